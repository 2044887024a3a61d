"""`research.train_experiment` and `research.sweep_experiment`: an experiment and a sweep called from Python
(a notebook cell) with its options as keyword arguments, checked as the command line checks them, giving the
numbers the command line gives."""

import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

import research
from research.cli import main_entry
from research.errors import ConfigError, DeviceError, Preempted
from research.experiment import LoadedRun, load_experiment
from research.services import tree_digest

xor = load_experiment("xor")
SHORT = {"epochs": 2, "progress": False}


def records(run_dir) -> list[dict]:
    """metrics.jsonl without its timings."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if "second" not in k and "per_s" not in k} for line in lines]


def test_a_call_trains_the_run_the_command_line_trains_and_returns_it_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = research.train_experiment("xor", lr=0.3, hidden=4, **SHORT)
    assert isinstance(run, LoadedRun) and run.path.parent == tmp_path / "runs/xor"  # a new runs/xor/<time>
    main_entry(
        xor.main, xor.Config, ["--lr", "0.3", "--hidden", "4", "--epochs", "2", "--no-progress", "--run-dir", "cli"]
    )
    assert records(run.path) == records(tmp_path / "cli")
    assert run.summary is not None and run.summary["step"] == run.step == 38
    assert run.config.training.lr == 0.3 and run.model.layers[0].weight.shape == (4, 2)
    cli_summary = json.loads((tmp_path / "cli/summary.json").read_text())
    assert run.summary["test_accuracy"] == cli_summary["test_accuracy"]
    assert tree_digest(run.state) == tree_digest(research.load_run(tmp_path / "cli").state)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epochs": 0}, "--epochs must be positive (got 0)"),
        ({"epoch": 2}, "epoch is not an option of xor (did you mean epochs?)"),
        ({"loader": "grain"}, "--loader must be one of device, torch (got 'grain')"),
        ({"hidden": "8"}, "--hidden must be int (got '8')"),
    ],
)
def test_a_bad_option_is_refused_naming_it_before_any_work(tmp_path, monkeypatch, options, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        research.train_experiment("xor", **options)
    assert str(refused.value) == message
    assert not (tmp_path / "runs").exists()


def test_more_devices_after_jax_started_are_refused_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jax.devices()  # JAX has started (in a notebook: any cell that touched it), whatever ran before this test
    with pytest.raises(DeviceError, match="to research.train_experiment as the first thing a fresh Python"):
        research.train_experiment("xor", devices=64, batch_size=64, **SHORT)


@pytest.mark.slow
def test_the_stop_button_checkpoints_and_says_which_call_continues_the_run(tmp_path, monkeypatch):
    """A notebook's stop button is SIGINT in the kernel: the run stops after a checkpoint, the error names the
    call that continues it, and that call ends where an uninterrupted run ends."""
    monkeypatch.chdir(tmp_path)
    options = {"epochs": 40, "steps_per_call": 19, "log_every": 19, "progress": False, "run_dir": "stopped"}

    def stop_once_training() -> None:
        metrics = tmp_path / "stopped/metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    stopper = threading.Thread(target=stop_once_training, daemon=True)
    stopper.start()
    with pytest.raises(Preempted) as stopped:
        research.train_experiment("xor", **options)
    stopper.join()
    call = f"research.train_experiment('xor', {', '.join(f'{k}={v!r}' for k, v in options.items())}, resume='auto')"
    assert str(stopped.value).startswith("stopped by SIGINT at step ")
    assert str(stopped.value).endswith(f"its checkpoint is saved: {call} to continue")
    assert stopped.value.status == 130 and 0 < stopped.value.step < 760
    resumed = research.train_experiment("xor", run_dir="stopped", resume="auto")  # the other options: the run's
    whole = research.train_experiment("xor", **{**options, "run_dir": "whole"})
    assert resumed.summary is not None and whole.summary is not None
    assert resumed.summary["test_loss"] == whole.summary["test_loss"]
    assert tree_digest(resumed.state) == tree_digest(whole.state)


@pytest.mark.slow
def test_a_vmapped_sweep_returns_each_run_equal_to_its_call_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = research.sweep_experiment("xor", {"lr": [0.1, 0.3], "seed": [1]}, vmapped=True, epochs=2)
    assert list(runs) == ["lr=0.1,seed=1", "lr=0.3,seed=1"]
    assert runs["lr=0.3,seed=1"].path == tmp_path / "runs/xor/grid-lr-seed/lr=0.3,seed=1"
    assert (tmp_path / "runs/xor/grid-lr-seed/results.md").read_text().startswith("| run | lr |")
    alone = research.train_experiment("xor", lr=0.3, seed=1, **SHORT)
    together, expected = records(runs["lr=0.3,seed=1"].path), records(alone.path)
    assert len(together) == len(expected)
    for got, want in zip(together, expected, strict=True):  # tests/test_vmapped_sweep.py's tolerance
        assert got == pytest.approx(want, rel=1e-5)
    for x, y in zip(jax.tree.leaves(runs["lr=0.3,seed=1"].model), jax.tree.leaves(alone.model), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("axes", "options", "message"),
    [
        ({"lr": [0.1]}, {"progress": False}, "progress: set by the sweep for each run"),
        ({"lr": "0.1,0.3"}, {}, "axis lr: give its values as a non-empty list, say {'lr': [0.1, 0.3]}"),
        ({"hidden": [2, 3]}, {}, "--vmapped: hidden cannot vary inside one program"),
        ({"lr": [0.1]}, {"epochs": -1}, "--epochs must be positive (got -1)"),
    ],
)
def test_a_bad_sweep_is_refused_in_one_line_before_any_run(tmp_path, monkeypatch, axes, options, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        research.sweep_experiment("xor", axes, vmapped=True, **options)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()
