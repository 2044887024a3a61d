"""Hooks that act: one ends the run as finished (early stopping: resumed, it stops where an
uninterrupted run stops, and once finished `--resume` reports it and trains nothing); one replaces the
state between steps (the checkpoint keeps the replacement)."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _entry import run_entry

from research.data import DeviceLoader, XORDataset
from research.errors import ConfigError
from research.nn import MLP
from research.services import RunDir, checkpoint_digest, load_checkpoint, tree_digest
from research.train import Checkpoint, EarlyStopping, Engine, TrainState, fit

EVAL_EVERY = 8


def xor_state():
    model_key, train_key = jax.random.split(jax.random.key(0))
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optimizer, key=train_key)


def xor_loaders():
    data = XORDataset(256, seed=0)
    return DeviceLoader(data.inputs, data.labels, 32, seed=0), DeviceLoader(data.inputs, data.labels, 256)


def xor_fit(state, num_steps, early_stopping, run):
    train, test = xor_loaders()
    return fit(
        state,
        train,
        num_steps=num_steps,
        eval_data=test,
        eval_every=EVAL_EVERY,
        log_every=EVAL_EVERY,
        checkpoint_every=EVAL_EVERY,
        run=run,
        early_stopping=early_stopping,
        progress=False,
    )


def never_better():
    """The test loss falls as XOR trains, so asking for its maximum sees no improvement after the first
    evaluation: a stop after exactly `1 + patience` evaluations."""
    return EarlyStopping("test/loss", patience=2, goal="max")


def test_a_hook_ends_the_run_as_finished_with_the_state_it_reached(tmp_path):
    run = RunDir(tmp_path / "run").create()
    result = xor_fit(xor_state(), 100, never_better(), run)
    assert int(result.state.step) == 3 * EVAL_EVERY
    assert result.finished_early is not None and result.finished_early.startswith("test/loss has not bettered")
    assert [r["step"] for r in run.read_metrics()] == [8, 16, 24]
    _, header = load_checkpoint(run.checkpoint_paths()[-1], xor_state())
    assert header["step"] == 24 and header["finished"] == result.finished_early
    assert header["hooks"]["early_stopping"]["evaluations_since_best"] == 2
    plain = xor_fit(xor_state(), 3 * EVAL_EVERY, None, None)  # the same steps without the hook
    assert tree_digest(result.state) == tree_digest(plain.state)


def test_a_metric_the_evaluation_does_not_report_is_refused_at_the_first_evaluation(tmp_path):
    with pytest.raises(ConfigError, match=r"watches test/fid, which .* \(it reports test/accuracy, test/loss\)"):
        xor_fit(xor_state(), 100, EarlyStopping("test/fid", patience=2), None)


def test_the_count_is_checkpointed_so_a_resumed_run_stops_where_an_uninterrupted_one_does(tmp_path):
    straight = xor_fit(xor_state(), 100, never_better(), RunDir(tmp_path / "straight").create())
    run = RunDir(tmp_path / "resumed").create()
    xor_fit(xor_state(), 2 * EVAL_EVERY, never_better(), run)  # stopped one evaluation short
    state, header = load_checkpoint(run.checkpoint_paths()[-1], xor_state())
    assert "finished" not in header
    hook = never_better()
    hook.load_state_dict(header["hooks"]["early_stopping"])
    resumed = xor_fit(state, 100, hook, run)
    assert int(resumed.state.step) == int(straight.state.step) == 3 * EVAL_EVERY  # (a fresh count: step 32)
    assert checkpoint_digest(run.checkpoint_paths()[-1]) == checkpoint_digest(
        RunDir(tmp_path / "straight").checkpoint_paths()[-1]
    )


@pytest.mark.slow
def test_the_experiment_stops_on_its_headline_and_resume_reports_it_finished(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["--no-progress", "--epochs", "40", "--eval-every", "19", "--early-stopping", "3", "--run-dir", "r"]
    assert run_entry(args, "xor") == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    # The rule, worked out from the logged test accuracies: the first evaluation 3 past the best.
    evaluations = [
        (r["step"], r["test/accuracy"]) for r in RunDir(tmp_path / "r").read_metrics() if "test/accuracy" in r
    ]
    best, stop = -np.inf, None
    for i, (step, accuracy) in enumerate(evaluations):
        if accuracy > best:
            best, best_at = accuracy, i
        elif i - best_at >= 3:
            stop = step
            break
    assert stop is not None and summary["step"] == stop == evaluations[-1][0] < 40 * 19
    assert summary["finished_early"].startswith("test/accuracy has not bettered")
    assert f"at step {stop} (finished early: test/accuracy" in out
    before = (tmp_path / "r/summary.json").read_bytes()
    assert run_entry([*args, "--resume", "--epochs", "60"], "xor") == 0  # more steps: still finished
    assert f"finished at step {stop}: nothing to train" in capsys.readouterr().err
    assert (tmp_path / "r/summary.json").read_bytes() == before


def test_early_stopping_without_evaluations_to_count_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_entry(["--no-progress", "--early-stopping", "3", "--run-dir", "r"], "xor") == 2
    err = capsys.readouterr().err
    assert "--early-stopping 3 counts evaluations" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_a_hook_replaces_the_state_between_steps_and_the_checkpoint_keeps_it(tmp_path):
    """A learning-rate intervention at step 16 (the rate in `inject_hyperparams`' state set to 0): the
    model stays what it was at step 16, and the step-16 checkpoint holds the new rate."""

    def stop_learning(info):
        state = info.state
        rate = state.opt_state.hyperparams["learning_rate"]
        info.replace_state(eqx.tree_at(lambda s: s.opt_state.hyperparams["learning_rate"], state, jnp.zeros_like(rate)))

    run = RunDir(tmp_path / "run").create()
    engine = Engine(log_every=8).add_hook(stop_learning, at=(16,)).add_hook(Checkpoint(run), every=16)
    result = engine.fit(xor_state(), xor_loaders()[0], 32)
    at_16 = fit(xor_state(), xor_loaders()[0], num_steps=16, progress=False).state
    assert int(result.state.step) == 32
    assert tree_digest(result.state.model) == tree_digest(at_16.model)
    assert tree_digest(result.state.model) != tree_digest(
        fit(xor_state(), xor_loaders()[0], num_steps=32, progress=False).state.model
    )
    saved, _ = load_checkpoint(run.checkpoint_path(16), xor_state())
    assert float(saved.opt_state.hyperparams["learning_rate"]) == 0.0
    assert tree_digest(saved.model) == tree_digest(at_16.model)
