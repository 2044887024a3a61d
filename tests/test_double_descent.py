"""Double descent's mechanism: the seeded label noise, the data a run trains and tests on, the peak of a
curve, and the curve assembled from the sweep's runs (the real curve is in docs/results.md)."""

import json

import numpy as np
import pytest

from research.data import corrupt_labels, load_mnist1d
from research.experiment import load_experiment
from research.services import RunDir

double_descent = load_experiment("double_descent")


def test_exactly_the_fraction_of_labels_changes_deterministically_by_seed():
    labels = np.random.default_rng(0).integers(0, 10, size=4000).astype(np.int32)
    noisy = corrupt_labels(labels, 0.15, 10, seed=3)
    assert np.sum(noisy != labels) == 600 and noisy.dtype == labels.dtype  # every chosen label moves
    assert noisy.min() >= 0 and noisy.max() <= 9
    np.testing.assert_array_equal(noisy, corrupt_labels(labels, 0.15, 10, seed=3))
    other = corrupt_labels(labels, 0.15, 10, seed=4)
    assert not np.array_equal(np.flatnonzero(other != labels), np.flatnonzero(noisy != labels))
    assert np.sum(corrupt_labels(labels, 0.0, 10, seed=3) != labels) == 0
    moved = (noisy - labels)[noisy != labels] % 10
    assert set(moved.tolist()) == set(range(1, 10))  # to any other class


def test_a_run_trains_on_noisy_labels_and_tests_on_clean_ones(mnist1d_dir):
    config = double_descent.Config.from_options(
        width=8, num_samples=5000, train_split=0.8, data_dir=str(mnist1d_dir), seed=1
    )
    run = double_descent.setup(config)
    train, test = load_mnist1d(mnist1d_dir)
    np.testing.assert_array_equal(run.train_data.host.inputs, train.inputs)
    assert np.sum(run.train_data.host.labels != train.labels) == 600
    np.testing.assert_array_equal(run.eval_data.host.labels, test.labels)
    assert run.num_steps == 500 * 40  # the notebook's 500 epochs of batches of 100
    model = run.build_state().model
    assert [layer.weight.shape for layer in model.layers] == [(8, 40), (8, 8), (10, 8)]


def test_the_peak_is_after_the_underfitting_side():
    notebook = double_descent.find_peak(
        double_descent.NOTEBOOK_WIDTHS, double_descent.PUBLISHED_TEST_ERROR, double_descent.PUBLISHED_TRAIN_ERROR, 15.0
    )
    assert notebook == {
        "peak_width": 47,
        "peak_test_error": 54.05,
        "interpolation_width": 61,
        "last_width": 300,
        "last_test_error": 45.47,
    }
    # A bump among the underfitting widths (4) is higher than the real peak (32) and must not count.
    widths, test, train = [2, 4, 8, 16, 32, 64], [60, 62, 40, 45, 50, 42], [60, 58, 30, 10, 0, 0]
    assert double_descent.find_peak(widths, test, train, 15.0)["peak_width"] == 32
    assert double_descent.find_peak(widths, test, train, 15.0)["interpolation_width"] == 32


def test_each_run_gets_the_options_that_differ_from_the_defaults():
    config = double_descent.Config.from_options(
        seed=2, epochs=10, widths=(4, 8), jobs=2, compilation_cache=False, run_dir="somewhere", progress=False
    )
    assert double_descent.forwarded_flags(config) == ["--epochs", "10", "--seed", "2", "--no-compilation-cache"]


def test_the_curve_comes_from_one_run_per_width(tmp_path, monkeypatch, capsys):
    errors = {4: (0.60, 0.50), 8: (0.55, 0.05), 16: (0.70, 0.0), 32: (0.62, 0.0)}  # width: test, train error

    def fake_sweep(argv):  # what scripts/sweep leaves behind: a finished run per width
        sweep_dir = tmp_path / "curve"
        assert argv[:4] == ["double_descent", "width=4,8,16,32", "--sweep-dir", str(sweep_dir)]
        assert argv[argv.index("--") + 1 :] == ["--epochs", "3"]
        for width, (test, train) in errors.items():
            RunDir(sweep_dir / f"width={width}").write_summary({"test_accuracy": 1 - test, "train_accuracy": 1 - train})

    monkeypatch.setattr(double_descent.sweep, "main", fake_sweep)
    config = double_descent.Config.from_options(widths=(16, 4, 32, 8), epochs=3, run_dir=str(tmp_path / "curve"))
    curve = double_descent.main(config)
    assert curve["widths"] == [4, 8, 16, 32] and curve["peak_width"] == 16 and curve["interpolation_width"] == 16
    assert json.loads((tmp_path / "curve/curve.json").read_text())["peak_test_error"] == curve["peak_test_error"]
    assert "| 47 |" not in (tmp_path / "curve/curve.md").read_text()
    assert (tmp_path / "curve/double_descent.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "test error peaks at 70.00% at width 16" in out and "the notebook: 54.05% at width 47" in out


def test_the_curve_across_several_processes_is_refused_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(double_descent.jax, "process_count", lambda: 2)  # as if started by scripts/launch
    monkeypatch.setattr(double_descent.sweep, "main", lambda argv: pytest.fail("a run was started"))
    with pytest.raises(double_descent.ConfigError, match="pass --width W to train one width over several processes"):
        double_descent.main(double_descent.Config.from_options(widths=(4, 8), run_dir=str(tmp_path / "curve")))
    assert not (tmp_path / "curve").exists()
