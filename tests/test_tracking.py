"""Trackers: fit's records reach metrics.jsonl and TensorBoard event files with the same names and values."""

import sys

import jax
import numpy as np
import optax
import pytest

from research.cli import TrainConfig, parse_config
from research.data import DeviceLoader, XORDataset
from research.nn import MLP
from research.train import (
    JsonlTracker,
    MultiTracker,
    RunDir,
    TensorBoardTracker,
    TrainState,
    fit,
    read_tensorboard_scalars,
)


def test_fit_logs_the_same_records_to_jsonl_and_tensorboard_with_lr_from_the_schedule(tmp_path):
    schedule = optax.linear_schedule(0.5, 0.1, transition_steps=40)
    model_key, train_key = jax.random.split(jax.random.key(0))
    state = TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(schedule), key=train_key)
    train = DeviceLoader.from_dataset(XORDataset(256, seed=1), 64, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(100, seed=2), 50, shuffle=False)
    run = RunDir(tmp_path / "run").create()
    tensorboard = TensorBoardTracker(tmp_path / "tb")
    fit(state, train, num_steps=40, log_every=10, eval_every=20, eval_data=test, run=run, tracker=tensorboard,
        lr_schedule=schedule, steps_per_call=5, progress=False)
    tensorboard.finish()

    records = run.read_metrics()
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert set(records[1]) == {"step", "train/loss", "train/accuracy", "train/grad_norm", "lr", "steps_per_s",
                               "test/loss", "test/accuracy"}
    assert "test/loss" not in records[0]
    np.testing.assert_allclose([r["lr"] for r in records], [float(schedule(s - 1)) for s in (10, 20, 30, 40)])

    scalars = read_tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == set(records[1]) - {"step"}
    for name, points in scalars.items():
        expected = [(r["step"], r[name]) for r in records if name in r]
        assert [s for s, _ in points] == [s for s, _ in expected]
        np.testing.assert_allclose([v for _, v in points], [v for _, v in expected], rtol=1e-6)  # float32 in the file


def test_multi_tracker_forwards_every_call_and_jsonl_tracker_writes_one_line_per_log(tmp_path):
    class Recorder:
        def __init__(self):
            self.calls = []

        def log(self, step, metrics):
            self.calls.append((step, dict(metrics)))

        def finish(self):
            self.calls.append("finished")

    run = RunDir(tmp_path).create()
    recorder = Recorder()
    tracker = MultiTracker([JsonlTracker(run), recorder])
    tracker.log(3, {"train/loss": 0.5})
    tracker.log(6, {"train/loss": float("nan")})
    tracker.finish()
    assert recorder.calls[0] == (3, {"train/loss": 0.5}) and recorder.calls[2] == "finished"
    assert recorder.calls[1][0] == 6 and np.isnan(recorder.calls[1][1]["train/loss"])
    assert run.read_metrics() == [{"step": 3, "train/loss": 0.5}, {"step": 6, "train/loss": "nan"}]


def test_tensorboard_purge_step_is_written_for_a_resumed_run(tmp_path):
    first = TensorBoardTracker(tmp_path)
    first.log(10, {"train/loss": 1.0})
    first.log(20, {"train/loss": 0.5})  # logged after the checkpoint at 10: a resume redoes it
    first.finish()
    resumed = TensorBoardTracker(tmp_path, purge_step=11)
    resumed.log(20, {"train/loss": 0.25})
    resumed.finish()
    from tensorboardX.proto import event_pb2

    files = sorted(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    data = files[-1].read_bytes()
    events = []
    while data:
        length = int.from_bytes(data[:8], "little")
        events.append(event_pb2.Event.FromString(data[12:12 + length]))
        data = data[12 + length + 4:]
    # TensorBoard drops earlier points at step >= 11 when it meets this SessionLog.START at step 11.
    assert any(e.HasField("session_log") and e.session_log.status == e.session_log.START and e.step == 11
               for e in events)


def test_tensorboard_flag_without_the_package_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes `import tensorboardX` fail
    with pytest.raises(SystemExit) as info:
        parse_config(TrainConfig, ["--tensorboard"], prog="xor.py")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("xor.py: error: --tensorboard needs the tensorboardX package, which is not installed")
    assert "pip install" in err and ".[tensorboard]" in err
    assert parse_config(TrainConfig, []).tensorboard is False  # without the flag nothing is needed
