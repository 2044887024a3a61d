"""`scripts/sweep --vmapped`: a grid over seeds and learning rates trained as one population equals
its runs trained one by one, and leaves the run directories they would have left; refusals."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import optax
import pytest
from test_sweep import run_sweep
from test_tracking import assert_same_history, jsonl_history, mlflow_history, mlflow_runs, wandb_history

from research import load_run
from research.data import Batch, DeviceLoader, split_validation
from research.errors import ConfigError
from research.experiment import load_experiment, plot_curves
from research.nn import build_model
from research.population import member, stack_members
from research.services import RunDir, read_wandb_runs
from research.tools import sweep
from research.tools._vmapped import member_values
from research.train import TrainState

ROOT = Path(__file__).parent.parent
# 8 steps an epoch: 56 steps, evaluated at the end.
NAMES = ["lr=0.1,seed=0", "lr=0.1,seed=1", "lr=0.5,seed=0", "lr=0.5,seed=1"]
FLAGS = ["--epochs", "7", "--train-size", "256", "--test-size", "64", "--batch-size", "32", "--log-every", "8"]


def mtimes(path):
    return {p: p.stat().st_mtime_ns for p in [path, *path.rglob("*")]}


def metrics(path):
    return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(path).read_metrics()]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 2 x 2 grid of xor runs (lr x seed) as one population, and the same runs one by one."""
    root = tmp_path_factory.mktemp("vmapped")
    with pytest.MonkeyPatch.context() as patch:  # a worker process draws some of the plots (4 are drawn here otherwise)
        patch.setattr("research.tools._vmapped.plot_processes", lambda plots: 1)
        sweep.main(["xor", "lr=0.1,0.5", "seed=0,1", "--vmapped", "--sweep-dir", str(root / "v"), "--", *FLAGS])
    xor = load_experiment("xor")
    for lr in ("0.1", "0.5"):
        for seed in ("0", "1"):
            config = xor.Config.from_options(
                epochs=7,
                train_size=256,
                test_size=64,
                batch_size=32,
                log_every=8,
                lr=float(lr),
                seed=int(seed),
                run_dir=str(root / "alone" / f"lr={lr},seed={seed}"),
                progress=False,
            )
            xor.main(config)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_each_member_equals_its_run_trained_alone(swept, name):
    together, alone = swept / "v" / name, swept / "alone" / name
    logged, expected = metrics(together), metrics(alone)
    assert [sorted(r) for r in logged] == [sorted(r) for r in expected]
    for got, want in zip(logged, expected, strict=True):
        np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5)
    a, b = load_run(together), load_run(alone)
    assert a.step == b.step == 56
    for x, y in zip(jax.tree.leaves(a.model), jax.tree.leaves(b.model), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    assert float(a.state.opt_state.hyperparams["learning_rate"]) == pytest.approx(float(name.split(",")[0][3:]))
    inputs = a.setup.eval_data.host.inputs
    predict = lambda model: np.asarray(jax.vmap(model)(jnp.asarray(inputs))[:, 0] > 0)  # noqa: E731
    np.testing.assert_array_equal(predict(a.model), predict(b.model))
    summary = json.loads((together / "summary.json").read_text())
    assert summary["test_accuracy"] == pytest.approx(a.summary["test_accuracy"])
    assert json.loads((together / "config.json").read_text())["config"] == {
        **json.loads((alone / "config.json").read_text())["config"],
        "run_dir": str(together),
        "resume": "auto",
        "group": "v",
    }  # the sweep groups its runs in the trackers


def files(path):
    """The files of a run directory, relative, with the checkpoint's own (Orbax's) files left out."""
    return sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file() and "step_" not in str(p.parent.relative_to(path))
    )


@pytest.mark.parametrize("name", NAMES[::3])
def test_each_member_directory_holds_what_its_run_alone_holds(swept, name):
    together, alone = swept / "v" / name, swept / "alone" / name
    assert files(together) == files(alone) == ["config.json", "curves.png", "metrics.jsonl", "summary.json"]
    assert [p.name for p in (together / "checkpoints").iterdir()] == ["step_000000056"]
    assert (together / "checkpoints" / "step_000000056" / "checkpoint.json").exists()  # committed
    saved, own = json.loads((together / "config.json").read_text()), json.loads((alone / "config.json").read_text())
    # Its population's name instead of the identities of the trackers it was not tracked by (none for either).
    assert sorted(saved) == sorted({*own, "vmapped"} - {"trackers"}) and own["trackers"] == {}
    assert saved["parameters"] == own["parameters"]
    assert saved["resolved"] == own["resolved"] and saved["machine"] == own["machine"]
    # curves.png, drawn (by a worker process, or here) from the records in memory, is the plot of metrics.jsonl.
    again = plot_curves([RunDir(together)], [name], swept / f"{name}.png", title=f"xor {name} (vmapped)")
    np.testing.assert_array_equal(matplotlib.image.imread(together / "curves.png"), matplotlib.image.imread(again))


def test_the_populations_own_plot_is_drawn_by_the_pool_as_a_run_draws_it(swept):
    population = next((swept / "v").glob("population-*"))
    again = plot_curves([RunDir(population)], [population.name], swept / "population.png")
    np.testing.assert_array_equal(matplotlib.image.imread(population / "curves.png"), matplotlib.image.imread(again))


def sweep_on_devices(sweep_dir, devices, *flags):
    """The sweep of `swept`, as a process whose JAX has `devices` simulated CPU devices."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the sweep simulates its own devices
    command = ["xor", "lr=0.1,0.5", "seed=0,1", "--vmapped", "--sweep-dir", str(sweep_dir)]
    result = subprocess.run(
        [sys.executable, "-m", "research.tools.sweep", *command, "--", *FLAGS, *flags, "--devices", str(devices)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(next(sweep_dir.glob("population-*/summary.json")).read_text())


def assert_same_members(together, reference):
    """Each member's records and final state in sweep directory `together` equal those in `reference`."""
    for name in NAMES:
        logged, expected = metrics(together / name), metrics(reference / name)
        assert [sorted(r) for r in logged] == [sorted(r) for r in expected]
        for got, want in zip(logged, expected, strict=True):
            np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)], rtol=1e-5)
        a, b = load_run(together / name), load_run(reference / name)
        assert a.step == b.step == 56
        for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("devices, split", [(2, "members"), (8, "batch")])
def test_a_population_on_several_devices_equals_it_on_one(swept, tmp_path, capsys, devices, split):
    """2 devices split the 4 members (2 each, whole); 8 do not divide them and split each batch of 32 rows
    (4 each, the state replicated). Member by member, the runs equal the one-device population's to the
    tolerance of tests/test_parallel.py. Not bitwise in general: XLA vectorises the members' arithmetic
    over the member axis, and that axis's length on a device (or the split rows) can move the last bits
    (measured on a 2-core x86 CPU: bitwise on 2 devices here, but 14 of 16 members of a K=16 grid on 2
    devices differ, by at most 2.4e-7 in any parameter; 2.4e-7 here on 8). A checkpoint of the population
    split over its members resumes on one device."""
    every = ["--checkpoint-every", "24", "--keep-checkpoints", "3"]
    summary = sweep_on_devices(tmp_path / "v", devices, *every)
    alone = load_run(swept / "v" / NAMES[0]).state  # the whole population's state: 4 of these
    state_bytes = len(NAMES) * sum(x.nbytes for x in jax.tree.leaves(eqx.filter(alone, eqx.is_array)))
    assert summary["state_bytes_per_device"] == (state_bytes // devices if split == "members" else state_bytes)
    assert_same_members(tmp_path / "v", swept / "v")
    # Not vacuous: the members are far apart, each close only to itself.
    first, other = (jax.tree.leaves(load_run(swept / "v" / name).model) for name in NAMES[:2])
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(first, other, strict=True)) > 0.1
    if split == "members":  # killed after step 48's checkpoint, rerun on this process's one device
        population = next((tmp_path / "v").glob("population-*"))
        shutil.rmtree(population / "checkpoints" / "step_000000056")
        (population / "summary.json").unlink()
        for name in NAMES:
            shutil.rmtree(tmp_path / "v" / name)
        command = ["xor", "lr=0.1,0.5", "seed=0,1", "--vmapped", "--sweep-dir", str(tmp_path / "v")]
        code, _, err = run_sweep([*command, "--", *FLAGS, *every], capsys)
        assert code == 0 and "from step 48" in err, err
        assert_same_members(tmp_path / "v", swept / "v")


def test_rerunning_skips_the_finished_runs_with_or_without_vmapped(swept, capsys):
    for extra in (["--vmapped"], []):
        code, out, err = run_sweep(
            ["xor", "lr=0.1,0.5", "seed=0,1", *extra, "--sweep-dir", str(swept / "v"), "--", *FLAGS], capsys
        )
        assert code == 0
        assert err.count("already finished") == 4 and "population" not in err
        assert "| 2 | 0.5 |" in out


@pytest.mark.slow
def test_a_population_killed_before_its_members_were_written_is_completed(swept, tmp_path, capsys):
    copy = shutil.copytree(swept / "v", tmp_path / "v")
    population = next(copy.glob("population-*"))
    (population / "summary.json").unlink()  # stopped after its last checkpoint, before its members were written
    for name in NAMES:
        shutil.rmtree(copy / name)
    code, _, err = run_sweep(
        ["xor", "lr=0.1,0.5", "seed=0,1", "--vmapped", "--sweep-dir", str(copy), "--", *FLAGS], capsys
    )
    assert code == 0 and "already finished" not in err and "nothing to train" not in err
    # The members end together: no line promises a wait for the others.
    assert [line.rsplit("ETA ", 1)[1] for line in err.splitlines() if " done: " in line] == ["0:00:00"] * 4
    for name in NAMES:
        assert metrics(copy / name) == metrics(swept / "v" / name)
        assert load_run(copy / name).step == 56
    # Stopped while it wrote its members: the same population (trained) writes the missing ones.
    shutil.rmtree(copy / NAMES[1])
    before = mtimes(copy / NAMES[0])
    code, _, err = run_sweep(
        ["xor", "lr=0.1,0.5", "seed=0,1", "--vmapped", "--sweep-dir", str(copy), "--", *FLAGS], capsys
    )
    assert code == 0 and err.count("already finished") == 3 and "nothing to train" in err
    assert metrics(copy / NAMES[1]) == metrics(swept / "v" / NAMES[1])
    assert mtimes(copy / NAMES[0]) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["hidden=4,8"],
            "sweep: error: --vmapped: hidden cannot vary inside one program (this experiment's vmappable "
            "options: lr, seed); sweep it without --vmapped",
        ),
        (
            ["lr=0.1", "--", "--devices", "2", "--parallel", "pmap"],
            "sweep: error: --vmapped splits its population's members (or its batches) over --devices with "
            "--parallel auto or sharded, not pmap",
        ),
        (
            ["lr=0.1", "--", "--num-processes", "2", "--process-id", "0", "--coordinator-address", "localhost:1"],
            "sweep: error: --vmapped trains its population in one process",
        ),
        (["lr=0.1", "--", "--loader", "torch"], "sweep: error: --vmapped gathers each member's batches on the device"),
        (["lr=0.1,1", "--search", "random"], "sweep: error: --vmapped trains a grid's runs as one population"),
        (
            ["lr=0.1", "--", "--early-stopping", "2", "--eval-every", "19"],
            "sweep: error: --vmapped trains its members for the same steps, and --early-stopping",
        ),
    ],
)
def test_what_one_program_cannot_train_is_refused_in_one_line(args, message, tmp_path, capsys):
    own, rest = (args[: args.index("--")], args[args.index("--") :]) if "--" in args else (args, [])
    code, out, err = run_sweep(["xor", *own, "--vmapped", "--sweep-dir", str(tmp_path / "s"), *rest], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "s").exists()


def test_member_values_takes_one_members_numbers_out():
    record = {
        "step": 8,
        "train/loss": 0.5,
        "train/member_loss": [0.4, 0.6],
        "test/ensemble_accuracy": 0.9,
        "test_raw/member_accuracy": [0.7, 0.8],
        "test_raw/accuracy": 0.75,
        "val/member_loss": [1.0, 2.0],
    }
    assert member_values(record, 1) == {"step": 8, "train/loss": 0.6, "test_raw/accuracy": 0.8, "val/loss": 2.0}


def test_stack_members_keeps_each_members_hyperparameters_and_refuses_another_shape(getkey):
    def state(lr, hidden):
        model, _ = build_model("mlp", in_size=2, out_size=1, hidden=(hidden,), activation="tanh", key=getkey())
        return TrainState.create(model, optax.inject_hyperparams(optax.sgd)(learning_rate=lr), key=getkey())

    states = [state(0.1, 4), state(0.3, 4)]
    stacked = stack_members(states)
    assert stacked.opt_state.hyperparams["learning_rate"].tolist() == pytest.approx([0.1, 0.3])
    for k in range(2):
        for x, y in zip(jax.tree.leaves(member(stacked, k)), jax.tree.leaves(states[k]), strict=True):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ConfigError, match="member 1's state has other arrays than member 0's"):
        stack_members([state(0.1, 4), state(0.1, 8)])


def test_for_members_gives_each_member_its_own_runs_order_and_refuses_other_data():
    inputs, labels = np.arange(20, dtype=np.float32)[:, None], np.arange(20) % 2
    loaders = [DeviceLoader(inputs, labels, 4, seed=s) for s in (0, 1, 2)]
    together = DeviceLoader.for_members(loaders)
    assert together.index_shape == (3, 4)
    indices = together.step_indices(3, 4)  # crosses an epoch: 5 steps an epoch
    for k, loader in enumerate(loaders):
        np.testing.assert_array_equal(indices[:, k], loader.step_indices(3, 4))
    with pytest.raises(Exception, match="member 1 trains on other examples than member 0"):
        DeviceLoader.for_members([loaders[0], DeviceLoader(inputs + 1, labels, 4)])


def test_the_validation_split_is_the_same_for_every_seed_and_disjoint_from_training():
    data = Batch(np.arange(100, dtype=np.float32)[:, None], np.arange(100))
    train, val = split_validation(data, 20)
    again, val_again = split_validation(data, 20)
    assert len(val.labels) == 20 and len(train.labels) == 80
    np.testing.assert_array_equal(val.labels, val_again.labels)
    assert sorted([*train.labels, *val.labels]) == list(range(100))
    assert list(train.labels) == sorted(train.labels)  # the examples kept keep their order


@pytest.mark.slow
def test_a_vmapped_sweep_tracks_each_member_as_its_own_run_grouped_by_the_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's default store: runs/mlflow.db here
    sweep.main(
        [
            "xor",
            "seed=0,1",
            "--vmapped",
            "--sweep-dir",
            "v",
            "--",
            "--epochs",
            "2",
            *FLAGS[2:],
            "--tracker",
            "mlflow,wandb",
        ]
    )
    runs = {run.info.run_name: run for run in mlflow_runs(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")}
    assert sorted(runs) == ["seed=0", "seed=1"]  # the members, not their population
    for name, found in runs.items():
        member = RunDir(tmp_path / "v" / name)
        expected, saved = jsonl_history(member), member.read_config()["trackers"]
        assert found.data.tags["group"] == "v" and found.info.run_id == saved["mlflow"]["run_id"]
        history = mlflow_history(saved["mlflow"]["uri"], found.info.run_id)
        assert_same_history({s: {k: v for k, v in h.items() if k in expected[s]} for s, h in history.items()}, expected)
        [wandb_run] = read_wandb_runs(member.path)
        assert wandb_run["group"] == "v" and wandb_run["run_id"] == saved["wandb"]["run_id"]
        assert_same_history(wandb_history([wandb_run]), expected)
    assert not list(tmp_path.glob("v/population-*/wandb"))


@pytest.mark.slow
def test_each_member_gets_the_experiments_own_summary_numbers_and_plot(tmp_path):
    """grokking's `Setup.summarize_run` runs on each member's directory, as on a run of its own."""
    flags = ["--modulus", "7", "--train-fraction", "0.5", "--dim", "16", "--heads", "2", "--lr", "1e-2"]
    flags += ["--steps", "60", "--eval-every", "20", "--log-every", "20", "--steps-per-call", "20"]
    sweep.main(["grokking", "seed=0,1", "--vmapped", "--sweep-dir", str(tmp_path), "--", *flags])
    grokking = load_experiment("grokking")
    for name in ("seed=0", "seed=1"):
        run = RunDir(tmp_path / name)
        summary = json.loads((run.path / "summary.json").read_text())
        steps = grokking.grokking_steps(run.read_metrics())
        assert steps["memorization_step"] is not None  # 24 pairs, memorized within 60 steps
        assert {key: summary[key] for key in steps} == steps
        assert (run.path / "grokking.png").stat().st_size > 0
