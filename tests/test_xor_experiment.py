"""End to end: the XOR experiment trains to the tutorial's accuracy and leaves a usable run directory."""

import importlib.util
import json
from pathlib import Path

import pytest
from _entry import run_entry

from research.data import DeviceLoader, XORDataset
from research.services import checkpoint_digest, load_checkpoint
from research.train import evaluate

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("xor_experiment", ROOT / "experiments" / "xor.py")
xor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xor)


@pytest.mark.slow
def test_xor_reaches_99_percent_and_writes_a_complete_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = xor.Config.from_options(run_dir="runs/xor/test", progress=False)
    summary = xor.main(config)

    assert summary["test_accuracy"] >= 0.99
    run = tmp_path / "runs/xor/test"
    assert json.loads((run / "summary.json").read_text()) == summary
    assert set(summary) >= {"test_accuracy", "test_loss", "train_loss", "step", "wall_seconds"}
    assert summary["step"] == 100 * (2500 // 128)
    saved = json.loads((run / "config.json").read_text())
    assert saved["config"] == config.to_dict() and saved["resolved"]["num_steps"] == summary["step"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == summary["step"] and "test/accuracy" in metrics[-1]
    assert metrics[0]["train/loss"] > metrics[-1]["train/loss"]

    checkpoint = run / "checkpoints" / f"step_{summary['step']:09d}"
    restored, header = load_checkpoint(checkpoint, xor.build_state(config))
    assert header["config"] == config.to_dict()
    test = DeviceLoader.from_dataset(XORDataset(500, seed=123), 128, shuffle=False)
    again = evaluate(restored.model, None, test)
    assert again == {"loss": summary["test_loss"], "accuracy": summary["test_accuracy"]}


@pytest.mark.slow
def test_resuming_gives_the_same_model_as_an_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    straight = dict(epochs=20, progress=False)
    xor.main(xor.Config.from_options(run_dir="straight", **straight))
    xor.main(xor.Config.from_options(run_dir="resumed", epochs=10, progress=False))
    xor.main(xor.Config.from_options(run_dir="resumed", resume=True, **straight))
    a = checkpoint_digest(tmp_path / "straight/checkpoints/step_000000380")
    b = checkpoint_digest(tmp_path / "resumed/checkpoints/step_000000380")
    assert a == b  # identical states
    metrics = [json.loads(line)["step"] for line in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()]
    assert metrics == sorted(set(metrics))


def test_resume_without_a_run_and_reuse_of_a_run_dir_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def run(*args) -> tuple[int, str]:  # in this process (tests/test_cli.py runs the script's own entry)
        status = run_entry(["--no-progress", "--epochs", "1", *args], "xor")
        return status, capsys.readouterr().err

    status, err = run("--resume")
    assert status == 2 and "no run to resume" in err
    assert run("--run-dir", "r")[0] == 0
    before = (tmp_path / "r/summary.json").read_bytes()
    status, err = run("--run-dir", "r")
    assert status == 2 and "already holds a run" in err
    assert (tmp_path / "r/summary.json").read_bytes() == before
    status, err = run("--run-dir", "r", "--resume", "--lr", "0.5")
    assert status == 2 and "trained with --lr 0.1, which cannot change when it resumes (given: --lr 0.5)" in err
