"""Trackers: fit's records reach metrics.jsonl, TensorBoard event files, W&B and MLflow with the same names and
values, read back through each library's own reader."""

import json
import os
import shutil
import signal
import sys

import jax
import numpy as np
import optax
import pytest

from research.cli import TrainConfig, parse_config
from research.data import DeviceLoader, XORDataset
from research.nn import MLP
from research.services import (
    JsonlTracker,
    MlflowTracker,
    MultiTracker,
    RunDir,
    TensorBoardTracker,
    parse_trackers,
    read_tensorboard_scalars,
    read_wandb_runs,
    scalars,
    summary_metrics,
)
from research.train import TrainState, fit


def test_fit_logs_the_same_records_to_jsonl_and_tensorboard_with_lr_from_the_schedule(tmp_path):
    schedule = optax.linear_schedule(0.5, 0.1, transition_steps=40)
    model_key, train_key = jax.random.split(jax.random.key(0))
    state = TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(schedule), key=train_key)
    train = DeviceLoader.from_dataset(XORDataset(256, seed=1), 64, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(100, seed=2), 50, shuffle=False)
    run = RunDir(tmp_path / "run").create()
    tensorboard = TensorBoardTracker(tmp_path / "tb")
    fit(
        state,
        train,
        num_steps=40,
        log_every=10,
        eval_every=20,
        eval_data=test,
        run=run,
        tracker=tensorboard,
        lr_schedule=schedule,
        steps_per_call=5,
        progress=False,
    )
    tensorboard.finish()

    records = run.read_metrics()
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert set(records[1]) == {
        "step",
        "train/loss",
        "train/accuracy",
        "train/grad_norm",
        "lr",
        "steps_per_s",
        "test/loss",
        "test/accuracy",
    }
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
        events.append(event_pb2.Event.FromString(data[12 : 12 + length]))
        data = data[12 + length + 4 :]
    # TensorBoard drops earlier points at step >= 11 when it meets this SessionLog.START at step 11.
    assert any(
        e.HasField("session_log") and e.session_log.status == e.session_log.START and e.step == 11 for e in events
    )


def test_tensorboard_flag_without_the_package_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes `import tensorboardX` fail
    with pytest.raises(SystemExit) as info:
        parse_config(TrainConfig, ["--tensorboard"], prog="xor.py")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("xor.py: error: --tensorboard needs the tensorboardX package, which is not installed")
    assert "pip install" in err and ".[tensorboard]" in err
    assert parse_config(TrainConfig, []).tracking.tensorboard is False  # without the flag nothing is needed


# -- the run's trackers: W&B and MLflow, read back through their own readers ----------------------------
XOR = [
    "--no-progress",
    "--train-size",
    "256",
    "--test-size",
    "64",
    "--batch-size",
    "32",
    "--log-every",
    "4",
    "--eval-every",
    "8",
    "--steps-per-call",
    "4",
    "--checkpoint-every",
    "8",
    "--checkpoint-minutes",
    "0",
]


def run_xor(argv):
    """xor.py in this process; its exit status (0 when it returned)."""
    from research.cli import main_entry
    from research.experiment import load_experiment

    xor = load_experiment("xor")
    try:
        main_entry(xor.main, xor.Config, argv)
    except SystemExit as e:
        return e.code
    return 0


def mlflow_runs(uri, experiment="xor"):
    """The MLflow runs of `experiment` in the store `uri` (through the client: `mlflow.set_tracking_uri`
    would set $MLFLOW_TRACKING_URI for every later run of this process)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def mlflow_history(uri, run_id):
    """{step: {name: value}} of every metric of an MLflow run, each (step, name) once or it fails."""
    from mlflow.tracking import MlflowClient

    client, history = MlflowClient(uri), {}
    for name in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, name):
            assert name not in history.setdefault(metric.step, {}), f"{name} logged twice at step {metric.step}"
            history[metric.step][name] = metric.value
    return history


def jsonl_history(run):
    """{step: {name: value}} of metrics.jsonl, as the scalar trackers take it (a list is one value a member)."""
    return {r["step"]: scalars({k: v for k, v in r.items() if k != "step"}) for r in run.read_metrics()}


def tensorboard_history(run):
    """{step: {name: value}} of a run's event files: a resumed run's file takes over from the resume on."""
    history = {}
    for name, points in read_tensorboard_scalars(run.path).items():
        for step, value in points:
            history.setdefault(step, {})[name] = value
    return history


def wandb_history(runs):
    """{step: {name: value}} over W&B runs (a resumed run is several), each step logged by one of them."""
    history = {}
    for run in runs:
        for row in run["history"]:
            assert row["step"] not in history, f"step {row['step']} logged twice"
            history[row["step"]] = {k: v for k, v in row.items() if k != "step"}
    return history


def assert_one_name_a_metric(names):
    """No metric under both its record's name and summary.json's (`test/accuracy` and `test_accuracy`)."""
    summary_names = {name.replace("_", "/", 1) for name in names if "/" not in name}  # test_accuracy: test/accuracy
    assert not {name for name in names if "/" in name} & summary_names
    assert not [name for name in names if name.startswith(("test_", "val_", "train_"))], sorted(names)


def assert_same_history(got, expected):
    assert sorted(got) == sorted(expected)
    for step, values in expected.items():
        assert sorted(got[step]) == sorted(values), step
        np.testing.assert_allclose(
            [got[step][k] for k in sorted(values)], [values[k] for k in sorted(values)], rtol=1e-6
        )


@pytest.mark.slow
def test_wandb_mlflow_and_tensorboard_hold_every_record_the_summary_and_files_through_sigterm_and_resume(
    tmp_path, monkeypatch, capsys
):
    """A run stopped by SIGTERM after step 12's record and resumed with --resume auto alone (its options,
    trackers among them, from its config.json): one W&B run (two offline files of one id), one MLflow
    run (in its SQLite store) and the TensorBoard events in the run directory hold exactly
    metrics.jsonl's records, the config, the summary and the files; config.json says which runs they
    are, and keeps every option the run was started with."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = JsonlTracker.log

    def stop_after_12(self, step, metrics):
        log(self, step, metrics)
        if step == 12 and not (tmp_path / "stopped").exists():
            (tmp_path / "stopped").touch()
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(JsonlTracker, "log", stop_after_12)
    args = [*XOR, "--epochs", "4", "--run-dir", "r", "--tracker", "wandb,mlflow", "--tensorboard"]
    assert run_xor([*args, "--resume", "auto"]) == 143
    first = RunDir(tmp_path / "r").read_config()
    assert run_xor(["--run-dir", "r", "--resume", "auto"]) == 0  # no flag repeated
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("xor: MLP"))
    assert start.endswith("; W&B offline, in the run directory (`wandb sync` it, or set WANDB_MODE=online)")

    run = RunDir(tmp_path / "r")
    expected, summary, saved = jsonl_history(run), run.read_summary(), run.read_config()
    assert saved["trackers"] == first["trackers"] and saved["trackers"]["wandb"]["mode"] == "offline"
    assert saved["config"] == first["config"]  # tracker, tensorboard, the data's sizes, ...: as the run began
    assert sorted(expected) == list(range(4, 33, 4)) and "test/accuracy" in expected[16]
    wandb_runs = read_wandb_runs(run.path)
    assert [w["run_id"] for w in wandb_runs] == [saved["trackers"]["wandb"]["run_id"]] * 2
    assert [w["exit_code"] for w in wandb_runs] == [143, 0]
    assert_same_history(wandb_history(wandb_runs), expected)
    assert wandb_runs[0]["config"]["lr"] == 0.1 and wandb_runs[0]["config"]["epochs"] == 4
    assert {k: wandb_runs[-1]["summary"][k] for k in ("test/accuracy", "step", "wall_seconds")} == {
        "test/accuracy": pytest.approx(summary["test_accuracy"]),
        "step": 32,
        "wall_seconds": pytest.approx(summary["wall_seconds"]),
    }
    assert_one_name_a_metric(wandb_runs[-1]["summary"])
    assert {"config.json", "summary.json", "curves.png"} <= set(wandb_runs[-1]["files"])

    uri = saved["trackers"]["mlflow"]["uri"]
    assert uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"  # the default: in the runs folder
    [found] = mlflow_runs(uri)
    assert found.info.run_id == saved["trackers"]["mlflow"]["run_id"] and found.info.status == "FINISHED"
    assert found.info.run_name == "r" and found.data.params["lr"] == "0.1" and found.data.params["epochs"] == "4"
    history = mlflow_history(uri, found.info.run_id)
    assert history[32]["test/accuracy"] == pytest.approx(summary["test_accuracy"])  # logged once, by the record
    assert history[32]["wall_seconds"] == pytest.approx(summary["wall_seconds"])  # the summary's other facts
    assert_one_name_a_metric(history[32])
    assert_same_history({s: {k: v for k, v in h.items() if k in expected[s]} for s, h in history.items()}, expected)
    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(found.info.run_id)}
    assert {"config.json", "summary.json", "curves.png"} <= artifacts

    assert_same_history(tensorboard_history(run), expected)


@pytest.mark.slow
def test_a_resume_after_a_kill_logs_each_step_once_and_a_tracker_added_then_gets_the_records_before(
    tmp_path, monkeypatch
):
    """A run killed after logging steps past its last checkpoint (as SIGKILL leaves it): its resume
    redoes those steps, and MLflow keeps one value a step; W&B, added at the resume, gets every record."""
    monkeypatch.chdir(tmp_path)
    args = [*XOR, "--epochs", "3", "--run-dir", "r"]
    assert run_xor([*args, "--tracker", "mlflow"]) == 0
    run = RunDir(tmp_path / "r")
    for path in run.checkpoint_paths()[-1:]:  # as if killed after logging step 24, checkpointed at 16
        shutil.rmtree(path)
    run.summary_file.unlink()
    run.truncate_metrics(after_step=20)
    assert run_xor([*args, "--tracker", "mlflow,wandb", "--resume", "auto"]) == 0
    expected = jsonl_history(run)
    saved = run.read_config()["trackers"]
    history = mlflow_history(saved["mlflow"]["uri"], saved["mlflow"]["run_id"])
    untimed = {s: {k: v for k, v in h.items() if k != "steps_per_s"} for s, h in expected.items()}  # redone: its rate
    assert_same_history({s: {k: v for k, v in h.items() if k in untimed[s]} for s, h in history.items()}, untimed)
    assert_same_history(wandb_history(read_wandb_runs(run.path)), expected)


@pytest.mark.parametrize("tracker, module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("jsonl,wandb", "wandb")])
def test_a_tracker_without_its_library_is_refused_in_one_line_naming_the_install(tracker, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as info:
        parse_config(TrainConfig, ["--tracker", tracker], prog="xor.py")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"xor.py: error: --tracker {module} needs the {module} package, which is not installed")
    assert f"pip install -c requirements/constraints.txt -e '.[{module}]'" in err  # a checkout's install


@pytest.mark.parametrize(
    "module, flag, instead",
    [
        ("wandb", "--tracker wandb", "give --tracker another value"),
        ("mlflow", "--tracker mlflow", "give --tracker another value"),
        ("tensorboardX", "--tensorboard", "pass --no-tensorboard"),
    ],
)
def test_a_tracker_of_the_run_missing_at_resume_is_refused_in_one_line_before_any_work(
    module, flag, instead, tmp_path, monkeypatch, capsys
):
    """A run tracked with W&B (or TensorBoard) resumed where that library is missing: one line, exit 2,
    nothing written; given the option again without it, the resume goes on without it, as asked."""
    from research.experiment import load_experiment

    xor = load_experiment("xor")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()
    record = {"experiment": "xor", "config": {"tracker": "wandb,mlflow", "tensorboard": True}}
    (tmp_path / "r/config.json").write_text(json.dumps(record))
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as info:
        parse_config(xor.Config, ["--run-dir", "r", "--resume"], prog="xor.py")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"xor.py: error: --resume r: the run's {flag} needs the {module} package, which is not installed"
    )
    assert err.endswith(f"; to resume without it, {instead}\n")
    assert os.listdir(tmp_path / "r") == ["config.json"]
    without = {
        "wandb": ["--tracker", "mlflow"],
        "mlflow": ["--tracker", "wandb"],
        "tensorboardX": ["--no-tensorboard"],
    }[module]
    tracking = parse_config(xor.Config, ["--run-dir", "r", "--resume", *without], prog="xor.py").tracking
    assert (tracking.tracker, tracking.tensorboard) == {
        "wandb": ("mlflow", True),
        "mlflow": ("wandb", True),
        "tensorboardX": ("wandb,mlflow", False),
    }[module]


def test_the_summary_reaches_a_tracker_under_its_records_names_and_mlflow_logs_each_once(tmp_path):
    """summary.json's `test_accuracy` is the records' `test/accuracy`: a tracker gets it under that name, and
    MLflow, which holds the final record's already, logs at the last step only what the record did not."""
    summary = {"test_accuracy": 0.75, "test_raw_loss": 0.5, "val_loss": 0.4, "train_loss": 0.25, "step": 8}
    summary |= {"wall_seconds": 3.0, "test_member_accuracy": [0.5, 1.0], "experiment": "xor"}
    assert summary_metrics(summary) == {
        "test/accuracy": 0.75,
        "test_raw/loss": 0.5,
        "val/loss": 0.4,
        "train/loss": 0.25,
        "step": 8,
        "wall_seconds": 3.0,
        "test/member_accuracy": [0.5, 1.0],
        "experiment": "xor",
    }
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, experiment="xor", name="r")
    tracker.log(4, {"train/loss": 1.0})
    tracker.log(8, {"train/loss": 0.25, "test/accuracy": 0.75, "test/member_accuracy": [0.5, 1.0]})
    tracker.log_summary(summary_metrics(summary))
    tracker.finish()
    history = mlflow_history(uri, tracker.run_id)  # each (step, name) once, or it fails
    assert history == {
        4: {"train/loss": 1.0},
        8: {
            "train/loss": 0.25,
            "test/accuracy": 0.75,
            "test/member_accuracy/0": 0.5,
            "test/member_accuracy/1": 1.0,
            "test_raw/loss": 0.5,
            "val/loss": pytest.approx(0.4),
            "wall_seconds": 3.0,
        },
    }


def test_tracker_names_are_checked_and_tensorboard_is_a_spelling_of_one(capsys):
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--tracker", "wandb,neptune"], prog="xor.py")
    assert "unknown tracker 'neptune'; choose from jsonl, tensorboard, wandb, mlflow" in capsys.readouterr().err
    from research.tracking import trackers_of

    assert trackers_of(parse_config(TrainConfig, []).tracking) == ("jsonl",)
    assert trackers_of(parse_config(TrainConfig, ["--tensorboard", "--tracker", "mlflow"]).tracking) == (
        "jsonl",
        "tensorboard",
        "mlflow",
    )
    assert parse_trackers(" mlflow , wandb,jsonl") == ("jsonl", "wandb", "mlflow")


def test_a_population_sends_one_scalar_a_member():
    assert scalars({"train/loss": 0.5, "train/member_loss": [0.25, 0.75], "note": "x", "ok": True}) == {
        "train/loss": 0.5,
        "train/member_loss/0": 0.25,
        "train/member_loss/1": 0.75,
    }


def test_a_tracker_that_cannot_start_is_refused_in_one_line_and_leaves_no_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")  # the store's directory is a file
    uri = f"sqlite:///{tmp_path}/file/mlflow.db"
    assert run_xor([*XOR, "--epochs", "1", "--run-dir", "r", "--tracker", "wandb,mlflow", "--mlflow-uri", uri]) == 2
    err = capsys.readouterr().err
    assert ": error: --tracker mlflow could not start: " in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
