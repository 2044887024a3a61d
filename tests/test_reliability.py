"""Reliability: bit-identical reruns, resume after SIGKILL, damaged checkpoints, NaNs, bad input."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from research.cli import main_entry
from research.data import DeviceLoader, XORDataset
from research.errors import NonFiniteError, Preempted
from research.nn import MLP
from research.services import CheckpointWriter, RunDir, checkpoint_digest, load_checkpoint, tree_digest
from research.train import TrainState, fit
from research.train.evaluation import evaluate_state

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("xor_experiment", ROOT / "experiments" / "xor.py")
xor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xor)

TIMING_KEYS = {"steps_per_s"}


def run_script(cwd, *args, name="xor", timeout=600):
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--no-progress", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def payload(path):
    """What a checkpoint holds, bit for bit (its arrays' digest)."""
    return checkpoint_digest(path)


def metrics_without_timing(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in RunDir(run_dir).read_metrics()]


def final_checkpoint(run_dir):
    return RunDir(run_dir).checkpoint_paths()[-1]


# -- determinism ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_runs_of_the_same_command_are_bit_identical(tmp_path):
    args = ["--epochs", "20", "--log-every", "19", "--eval-every", "95"]
    for name in ("a", "b"):
        assert run_script(tmp_path, *args, "--run-dir", name).returncode == 0
    assert metrics_without_timing(tmp_path / "a") == metrics_without_timing(tmp_path / "b")
    assert payload(final_checkpoint(tmp_path / "a")) == payload(final_checkpoint(tmp_path / "b"))


# -- kill and resume --------------------------------------------------------------------------------
def kill_when_checkpointed(cwd, run_dir, args, name="xor", min_checkpoints=2, timeout=300):
    """Start a run, SIGKILL it once it has written `min_checkpoints` checkpoints; return its run dir."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--no-progress", "--run-dir", run_dir, *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = RunDir(Path(cwd) / run_dir)
    deadline = time.monotonic() + timeout
    try:
        while len(run.checkpoint_paths()) < min_checkpoints:  # committed ones; more may be in flight
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "the run wrote no checkpoints in time"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    return Path(cwd) / run_dir


KILL_CASES = {
    # name: (experiment, args); MNIST-1D cases also get `--data-dir` of the session's generated data.
    "xor": (
        "xor",
        [
            "--epochs",
            "300",
            "--steps-per-call",
            "5",
            "--log-every",
            "50",
            "--eval-every",
            "570",
            "--checkpoint-every",
            "190",
            "--keep-checkpoints",
            "2",
        ],
    ),
    # the reference CNN, several steps per compiled call, checkpoints between evaluations
    "mnist1d-cnn": (
        "mnist1d",
        [
            "--model",
            "cnn",
            "--steps",
            "800",
            "--steps-per-call",
            "10",
            "--log-every",
            "50",
            "--eval-every",
            "400",
            "--checkpoint-every",
            "100",
            "--keep-checkpoints",
            "2",
        ],
    ),
    # BatchNorm running statistics (model state) and an EMA of the weights in the checkpoint
    "mnist1d-resnet-ema": (
        "mnist1d",
        [
            "--model",
            "resnet",
            "--ema-decay",
            "0.99",
            "--steps",
            "160",
            "--log-every",
            "20",
            "--eval-every",
            "80",
            "--checkpoint-every",
            "40",
            "--keep-checkpoints",
            "2",
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(KILL_CASES))
def test_a_run_killed_with_sigkill_resumes_to_bit_identical_results(tmp_path, case, request):
    experiment, args = KILL_CASES[case]
    if experiment == "mnist1d":
        args = [*args, "--data-dir", str(request.getfixturevalue("mnist1d_dir"))]
    assert run_script(tmp_path, *args, "--run-dir", "straight", name=experiment).returncode == 0
    killed = kill_when_checkpointed(tmp_path, "killed", args, name=experiment)
    assert not (killed / "summary.json").exists()
    result = run_script(tmp_path, *args, "--run-dir", "killed", "--resume", name=experiment)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stderr
    assert payload(final_checkpoint(killed)) == payload(final_checkpoint(tmp_path / "straight"))
    assert metrics_without_timing(killed) == metrics_without_timing(tmp_path / "straight")


def stop_with_signal_mid_run(cwd, run_dir, args, number, after_records=2, timeout=300):
    """Start a run, send it `number` (SIGTERM, SIGINT) once it has logged `after_records` records."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "xor.py"), "--no-progress", "--run-dir", run_dir, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(cwd) / run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not metrics.exists() or len(metrics.read_text().splitlines()) < after_records:
        assert process.poll() is None, "the run ended before it could be stopped"
        assert time.monotonic() < deadline, "the run logged nothing in time"
        time.sleep(0.005)
    process.send_signal(number)
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("number, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_run_after_a_checkpoint_and_it_resumes_bit_identical(tmp_path, number, status):
    """SIGTERM (a scheduler's preemption) or SIGINT mid-run: the compiled call in flight finishes, a
    checkpoint is written at that step (between two step cadences: its metric window is saved too), the
    script exits with 128 + the signal in one line, and rerunning with --resume auto continues to the
    same bits as a run never stopped."""
    args = [
        "--epochs",
        "400",
        "--train-size",
        "1024",
        "--batch-size",
        "32",
        "--steps-per-call",
        "7",
        "--log-every",
        "100",
        "--eval-every",
        "3200",
        "--checkpoint-minutes",
        "0",
    ]
    assert run_script(tmp_path, *args, "--run-dir", "straight").returncode == 0
    code, err = stop_with_signal_mid_run(tmp_path, "stopped", args, number)
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1, err
    step = int(lines[0].split(" at step ")[1].split()[0])
    assert f"stopped by {signal.Signals(number).name} at step {step} of 12800; its checkpoint is saved" in lines[0]
    assert 0 < step < 12800 and RunDir(tmp_path / "stopped").checkpoint_paths()[-1].name == f"step_{step:09d}"
    result = run_script(tmp_path, *args, "--run-dir", "stopped", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert f"resuming stopped from step {step}" in result.stderr
    assert payload(final_checkpoint(tmp_path / "stopped")) == payload(final_checkpoint(tmp_path / "straight"))
    assert metrics_without_timing(tmp_path / "stopped") == metrics_without_timing(tmp_path / "straight")


def test_a_time_cadence_checkpoints_at_the_first_stop_after_it(tmp_path, monkeypatch):
    """--checkpoint-minutes: a checkpoint at the first logging stop once that much time has passed since
    the last one (here 60 ns, so every stop), beside the step cadence and the final one."""
    monkeypatch.chdir(tmp_path)
    main_entry(
        xor.main,
        xor.Config,
        [
            "--epochs",
            "2",
            "--train-size",
            "256",
            "--batch-size",
            "32",
            "--log-every",
            "4",
            "--no-progress",
            "--run-dir",
            "r",
            "--checkpoint-minutes",
            "1e-9",
            "--keep-checkpoints",
            "10",
        ],
    )
    assert [p.name for p in RunDir(tmp_path / "r").checkpoint_paths()] == [f"step_{s:09d}" for s in (4, 8, 12, 16)]


@pytest.mark.slow
def test_resume_falls_back_past_a_corrupted_checkpoint(tmp_path):
    args = ["--epochs", "30", "--checkpoint-every", "95", "--keep-checkpoints", "10", "--log-every", "19"]
    assert run_script(tmp_path, *args, "--epochs", "10", "--run-dir", "r").returncode == 0  # steps 95, 190
    assert run_script(tmp_path, *args, "--run-dir", "straight").returncode == 0
    newest = RunDir(tmp_path / "r").checkpoint_path(190)
    files = json.loads((newest / "checkpoint.json").read_text())["files"]
    data = newest / max(files, key=lambda name: files[name][0])  # the array bytes
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x01
    data.write_bytes(bytes(raw))
    result = run_script(tmp_path, *args, "--run-dir", "r", "--resume")
    assert result.returncode == 0, result.stderr
    assert "skipping checkpoint r/checkpoints/step_000000190 is corrupted: checksum mismatch in" in result.stderr
    assert "from step 95" in result.stderr
    assert payload(final_checkpoint(tmp_path / "r")) == payload(final_checkpoint(tmp_path / "straight"))
    assert metrics_without_timing(tmp_path / "r") == metrics_without_timing(tmp_path / "straight")


def test_pruning_keeps_the_newest_and_the_best(tmp_path):
    train = DeviceLoader.from_dataset(XORDataset(256, seed=0), 32, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(128, seed=1), 64, shuffle=False)
    run = RunDir(tmp_path / "run").create()
    fit(
        make_state(),
        train,
        num_steps=64,
        eval_data=test,
        eval_every=8,
        checkpoint_every=8,
        keep_checkpoints=2,
        log_every=8,
        run=run,
        progress=False,
    )
    kept = run.checkpoint_paths()
    evals = {r["step"]: r["test/accuracy"] for r in run.read_metrics()}
    best_step = max(evals, key=lambda s: (evals[s], -s))
    assert [p.name for p in kept[-2:]] == ["step_000000056", "step_000000064"]
    assert run.checkpoint_path(best_step) in kept and len(kept) == (2 if best_step >= 56 else 3)


# -- asynchronous saves -----------------------------------------------------------------------------
def xor_fit(run, num_steps, state=None, window=None, **options):
    train = DeviceLoader.from_dataset(XORDataset(256, seed=0), 32, seed=0)
    return fit(
        state if state is not None else make_state(),
        train,
        num_steps=num_steps,
        log_every=8,
        checkpoint_every=16,
        checkpoint_seconds=None,
        run=run,
        progress=False,
        resume_window=window,
        **options,
    )


def test_sigterm_while_a_save_is_in_flight_commits_it_and_the_run_resumes_bit_identical(tmp_path, monkeypatch):
    """The signal arrives while the save of step 16 is still being written (its commit is held back
    half a second): the run stops after the compiled call in flight, the save in flight and the one
    of the stopping step are committed before `Preempted` leaves fit, and a resume from it ends where
    a run never stopped ends, bit for bit."""
    straight = xor_fit(RunDir(tmp_path / "straight").create(), 64)
    commit = CheckpointWriter._commit

    def slow_commit(self, path, header):
        if header["step"] == 16:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        commit(self, path, header)

    monkeypatch.setattr(CheckpointWriter, "_commit", slow_commit)
    run = RunDir(tmp_path / "stopped").create()
    with pytest.raises(Preempted) as info:
        xor_fit(run, 64, steps_per_call=1, stop_signals=True)
    step = info.value.step
    assert info.value.status == 143 and 16 <= step < 64
    assert [p.name for p in run.checkpoint_paths()] == [f"step_{s:09d}" for s in sorted({16, step})]
    state, header = load_checkpoint(run.checkpoint_path(step), make_state())
    resumed = xor_fit(run, 64, state=state, window=header["window"])
    assert checkpoint_digest(run.checkpoint_path(64)) == tree_digest(straight.state) == tree_digest(resumed.state)
    assert resumed.train_metrics == straight.train_metrics


@pytest.mark.slow
@pytest.mark.parametrize("when", ["compiling", "evaluating"])
def test_sigterm_while_compiling_or_evaluating_stops_at_a_checkpoint_and_resumes_bit_identical(tmp_path, when):
    """The signal arrives while XLA compiles the first step, or while the state of step 24 is being
    evaluated: the run stops at the end of that compiled call (step 1) or that stop (step 24) with a
    checkpoint there, and a resume from it ends where a run never stopped ends, bit for bit."""
    test = DeviceLoader.from_dataset(XORDataset(64, seed=1), 32, shuffle=False)
    options = {"eval_data": test, "eval_every": 24, "steps_per_call": 1}
    straight = xor_fit(RunDir(tmp_path / "straight").create(), 64, **options)
    sent = []

    def send_once(*args, **kwargs) -> None:  # once fit handles the signal (things compile before it too)
        if not sent and callable(signal.getsignal(signal.SIGTERM)):
            sent.append(os.kill(os.getpid(), signal.SIGTERM))

    def evaluate(state, data, progress=False):
        if int(state.step) == 24:
            send_once()
        return evaluate_state(state, data, progress=progress)

    jax.clear_caches()  # every step compiles again, under the listener
    if when == "compiling":
        jax.monitoring.register_event_duration_secs_listener(send_once)
    run = RunDir(tmp_path / "stopped").create()
    try:
        with pytest.raises(Preempted) as info:
            xor_fit(run, 64, stop_signals=True, evaluator=evaluate, **options)
    finally:
        if when == "compiling":
            jax.monitoring.unregister_event_duration_listener(send_once)
    step = info.value.step
    assert info.value.status == 143 and step == (1 if when == "compiling" else 24)
    assert run.checkpoint_paths()[-1] == run.checkpoint_path(step)
    state, header = load_checkpoint(run.checkpoint_path(step), make_state())
    resumed = xor_fit(run, 64, state=state, window=header["window"], **options)
    assert checkpoint_digest(run.checkpoint_path(64)) == tree_digest(straight.state) == tree_digest(resumed.state)
    assert resumed.train_metrics == straight.train_metrics and resumed.eval_metrics == straight.eval_metrics


KILLED_DURING_A_SAVE = """
import os, signal, sys, time
import jax, jax.numpy as jnp, equinox as eqx, optax
from research.nn import MLP
from research.services import CheckpointWriter, RunDir, save_checkpoint
from research.train import TrainState
model_key, train_key = jax.random.split(jax.random.key(0))  # this file's make_state()
state = TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(0.1), key=train_key)
run = RunDir(sys.argv[1]).create()
save_checkpoint(run.checkpoint_path(8), state, {"step": 8})
kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
def kill_once_writing(*args):  # Orbax makes the save's directory in the background too: wait for it
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("step_000000016") for p in run.checkpoints.iterdir()):
        if time.monotonic() > deadline:
            sys.exit("Orbax made no directory for step 16 within 60 s")
        time.sleep(0.001)
    kill()
if sys.argv[2] == "writing":  # once the save has returned and Orbax writes in the background
    CheckpointWriter._commit = kill_once_writing
else:  # after Orbax renamed its directory, before checkpoint.json
    import research.services._checkpoint as checkpoint
    checkpoint._file_digests = kill
writer = CheckpointWriter()
writer.save(run.checkpoint_path(16), eqx.tree_at(lambda s: s.step, state, jnp.int32(16)), {"step": 16})
writer.wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["writing", "committing"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path, when):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_A_SAVE, str(tmp_path / "r"), when],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    run = RunDir(tmp_path / "r")
    assert any(p.name.startswith("step_000000016") for p in run.checkpoints.iterdir())  # what the save left
    assert run.latest_valid_checkpoint() == (run.checkpoint_path(8), [])
    restored, header = load_checkpoint(run.checkpoint_path(8), make_state())
    assert header["step"] == 8 and tree_digest(restored) == tree_digest(make_state())
    run.remove_uncommitted()  # as a resumed run does; its own save of step 16 then commits
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_000000008"]


# -- non-finite numbers -----------------------------------------------------------------------------
def make_state():
    model_key, train_key = jax.random.split(jax.random.key(0))
    return TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(0.1), key=train_key)


def poisoned_loader(bad_index=100):
    data = XORDataset(512, seed=0)
    inputs = data.inputs.copy()
    inputs[bad_index] = np.nan
    return DeviceLoader(inputs, data.labels, 32, seed=0)


def first_step_using(loader, index, num_steps):
    rows = loader.step_indices(0, num_steps)
    return 1 + next(i for i, row in enumerate(rows) if index in row)


def test_a_nan_stops_the_run_naming_the_step_and_keeps_the_good_checkpoints(tmp_path):
    loader = poisoned_loader()
    bad_step = first_step_using(loader, 100, 64)
    run = RunDir(tmp_path / "run").create()
    with pytest.raises(NonFiniteError, match=f"non-finite loss at step {bad_step};") as info:
        fit(
            make_state(),
            loader,
            num_steps=64,
            checkpoint_every=2,
            log_every=2,
            steps_per_call=2,
            run=run,
            progress=False,
        )
    good = run.checkpoint_paths()
    assert good and int(good[-1].stem.split("_")[1]) < bad_step
    assert str(good[-1]) in str(info.value)
    restored, header = load_checkpoint(good[-1], make_state())
    assert header["step"] == int(restored.step) < bad_step
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.model))


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_skip_nonfinite_skips_the_bad_steps_and_finishes(tmp_path, ema_decay):
    loader = poisoned_loader()
    run = RunDir(tmp_path / "run").create()
    state = make_state().with_ema(ema_decay) if ema_decay else make_state()
    result = fit(state, loader, num_steps=64, log_every=64, run=run, skip_nonfinite=True, progress=False)
    expected = sum(100 in row for row in loader.step_indices(0, 64))
    assert run.read_metrics()[-1]["train/skipped"] == expected >= 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.model))
    if ema_decay:  # the skipped steps did not reach the EMA either
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.ema))
    assert np.isfinite(result.train_metrics["loss"])


class DropoutMLP(eqx.Module):
    mlp: MLP
    dropout: eqx.nn.Dropout  # a Python float (`p`) and bool (`inference`) among the model's leaves

    def __call__(self, x, *, key=None):
        return self.mlp(self.dropout(x, key=key, inference=key is None))


def test_skip_nonfinite_trains_a_model_with_python_leaves():
    """The skipped step keeps the old arrays; a model's other leaves (Dropout's `p`, as in the transformers'
    attention) pass through (they broke `--skip-nonfinite` on grokking with a traceback)."""
    model_key, train_key = jax.random.split(jax.random.key(0))
    model = DropoutMLP(MLP(2, 1, hidden=(8,), key=model_key), eqx.nn.Dropout(0.1))
    state = TrainState.create(model, optax.sgd(0.1), key=train_key)
    result = fit(state, poisoned_loader(), num_steps=64, log_every=64, skip_nonfinite=True, progress=False)
    assert result.train_metrics["skipped"] >= 1 and result.state.model.dropout.p == 0.1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(eqx.filter(result.state.model, eqx.is_array)))


def test_the_script_exits_nonzero_on_a_nan_with_one_line(tmp_path, monkeypatch, capsys):
    from research.cli import main_entry

    class NaNXOR(XORDataset):
        def __init__(self, size, seed, std=0.1):
            super().__init__(size, seed, std)
            self.inputs[::7] = np.nan

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(xor, "XORDataset", NaNXOR)
    with pytest.raises(SystemExit) as info:
        main_entry(xor.main, xor.Config, ["--epochs", "1", "--no-progress"])
    assert info.value.code == 1
    assert "error: non-finite loss at step 1; no checkpoint was written" in capsys.readouterr().err
