"""End to end: the DP-SGD and ensemble experiments run, report what they promise, and agree with the library."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from research.per_example import default_max_batch_size, dp_sgd_epsilon
from research.services import RunDir

ROOT = Path(__file__).parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_experiment", ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def data_dir(mnist1d_dir):
    return str(mnist1d_dir)


@pytest.mark.slow
def test_dp_sgd_reports_accuracy_and_the_accountants_epsilon(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    dp_sgd = load("dp_sgd")
    config = dp_sgd.Config.from_options(
        data_dir=data_dir,
        run_dir="run",
        epochs=2,
        batch_size=256,
        lr=1e-2,
        channels=8,
        noise_multiplier=2.0,
        chunk_size=128,
        progress=False,
    )
    summary = dp_sgd.main(config)
    steps = 2 * round(4000 / 256)
    assert summary["step"] == steps and summary["test_accuracy"] > 0.15  # 10 classes: chance is 0.1
    expected = dp_sgd_epsilon(
        noise_multiplier=2.0,
        dataset_size=4000,
        expected_batch_size=256,
        max_batch_size=default_max_batch_size(4000, 256),
        steps=steps,
        delta=1e-5,
    )
    assert summary["epsilon"] == pytest.approx(expected) and summary["delta"] == 1e-5
    assert json.loads((tmp_path / "run/summary.json").read_text()) == summary
    out = capsys.readouterr().out
    assert "test accuracy" in out and f"({expected:.2f}, 1e-05)-DP" in out
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert 200 < metrics[-1]["train/batch_size"] < 310  # Poisson batches of 256 on average


@pytest.mark.slow
def test_ensemble_members_match_sequential_runs_and_the_ensemble_is_reported(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ensemble = load("ensemble")
    config = ensemble.Config.from_options(
        data_dir=data_dir, run_dir="run", num_members=3, epochs=1, hidden=32, compare_sequential=True, progress=False
    )
    summary = ensemble.main(config)
    assert len(summary["test_member_accuracy"]) == 3 and summary["test_ensemble_accuracy"] > 0.15
    # The population's members == the members trained alone (tests/test_population.py compares parameters).
    np.testing.assert_allclose(summary["sequential_member_test_accuracy"], summary["test_member_accuracy"], atol=1e-6)
    assert summary["test_accuracy"] == pytest.approx(np.mean(summary["test_member_accuracy"]))
    assert summary["wall_seconds"] > 0 and summary["sequential_wall_seconds"] > 0
    saved = json.loads((tmp_path / "run/summary.json").read_text())
    assert saved == {k: v for k, v in summary.items() if not k.startswith("sequential_")}
    assert "mean member test accuracy" in capsys.readouterr().out
    assert RunDir(tmp_path / "run").checkpoint_paths()
    assert len(json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])["test/member_accuracy"]) == 3
