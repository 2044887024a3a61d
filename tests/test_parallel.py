"""Data parallelism gives the numbers of one device: pmap, sharded jit, several processes.

Simulated CPU devices must be requested before JAX starts, and this pytest process has started it
with one device, so the multi-device runs happen in subprocesses of `tests/_parallel_worker.py`
(a small experiment script); the one-device checks of each strategy run here, under the suite's
shape checks.
"""

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
import pytest
from test_tracking import assert_same_history, jsonl_history, mlflow_history, mlflow_runs, wandb_history

from research.cli import ConfigError
from research.data import DeviceLoader, XORDataset
from research.parallel import (
    DeviceError,
    Pmap,
    batch_axis_name,
    check_split,
    make_placement,
    one_device,
    process_group,
    process_rows,
    sharded,
    simulate_cpu_devices,
)
from research.services import RunDir, checkpoint_digest, load_checkpoint, read_wandb_runs
from research.tools.launch import launch
from research.train import fit

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "_parallel_worker.py"
spec = importlib.util.spec_from_file_location("parallel_worker", WORKER)
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)

TOLERANCE = 1e-5
LAUNCH_TWO = [sys.executable, "-m", "research.tools.launch", "--num-processes", "2", "--", str(WORKER)]  # + worker args


def worker_args(*groups: list[str]) -> list[str]:
    return [a for i, g in enumerate(groups) for a in ([] if i == 0 else ["+"]) + g]


def run_worker(cwd: Path, *groups: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(WORKER), *worker_args(*groups)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # one writer, one record a step
    return [r["train/loss"] for r in records]


def final_state(run: Path, model: str, step: int = 20):
    skeleton = worker.build_state(worker.Config.from_options(model=model))
    state, _ = load_checkpoint(run / "checkpoints" / f"step_{step:09d}", skeleton)
    return state


def assert_same_run(run: Path, reference: Path, model: str) -> None:
    np.testing.assert_allclose(losses(run), losses(reference), rtol=0, atol=TOLERANCE)
    a, b = final_state(run, model), final_state(reference, model)
    assert int(a.step) == int(b.step) == 20
    for x, y in zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=TOLERANCE)


def group(model: str, parallel: str, devices: int, run_dir: Path, *extra: str, loader: str | None = None) -> list[str]:
    loader = loader or ("torch" if model in ("mlp", "wide") else "device")  # host batches and device-resident data
    return [
        "--model",
        model,
        "--loader",
        loader,
        "--parallel",
        parallel,
        "--devices",
        str(devices),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """In one process with 8 simulated devices: each model on 1 device, with pmap and sharded on 4,
    a BatchNorm run moved between 4 devices and 1 device at step 10 through its checkpoint, and an
    FSDP run saved in 8 shards at step 8, resumed on 4 devices (resharded on load) to step 14, saved
    in 4 shards, and finished on 1 device."""
    root = tmp_path_factory.mktemp("parallel")
    groups = []
    for model in ("mlp", "batchnorm", "dpsgd"):
        for parallel, devices in (("none", 1), ("pmap", 4), ("sharded", 4)):
            groups.append(group(model, parallel, devices, root / f"{model}-{parallel}"))
    groups += [
        group("batchnorm", "sharded", 4, root / "4-then-1", "--steps", "10"),
        group("batchnorm", "none", 1, root / "4-then-1", "--resume"),
        group("batchnorm", "none", 1, root / "1-then-4", "--steps", "10"),
        group("batchnorm", "pmap", 4, root / "1-then-4", "--resume"),
        group("wide", "none", 1, root / "wide-none"),
        group("wide", "fsdp", 8, root / "8-4-1", "--steps", "8"),
        group("wide", "fsdp", 4, root / "8-4-1", "--steps", "14", "--resume"),
        group("wide", "none", 1, root / "8-4-1", "--resume"),
    ]
    run_worker(root, *groups)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "batchnorm", "dpsgd"])
@pytest.mark.parametrize("parallel", ["pmap", "sharded"])
def test_four_devices_give_the_losses_and_parameters_of_one(one_process_runs, model, parallel):
    """`dpsgd`: 20 steps of SGD on a DP-SGD gradient with noise on; the loss owns how its gradient
    combines (clipped sums over devices, noise added once), so every placement takes the same step."""
    assert_same_run(one_process_runs / f"{model}-{parallel}", one_process_runs / f"{model}-none", model)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["4-then-1", "1-then-4", "8-4-1"])
def test_a_checkpoint_continues_on_another_number_of_devices(one_process_runs, run):
    model = "wide" if run == "8-4-1" else "batchnorm"
    assert_same_run(one_process_runs / run, one_process_runs / f"{model}-none", model)
    if run == "8-4-1":  # the 64x64 arrays were saved in 8 shards, then in 4 (Orbax's record of the shardings)
        for step, devices in ((8, 8), (14, 4)):
            shardings = json.loads((one_process_runs / run / f"checkpoints/step_{step:09d}/_sharding").read_text())
            split = [
                len(s["device_mesh"]["mesh"])
                for s in map(json.loads, shardings.values())
                if s["partition_spec"] == ["data"]
            ]
            assert split and set(split) == {devices}


@pytest.mark.slow
def test_two_processes_give_the_same_numbers_and_stop_together_when_one_dies(one_process_runs, tmp_path):
    """`scripts/launch` with 2 processes of 2 devices (each feeds its share of every batch): the runs
    match one device, only process 0 writes the run directory, each process saves its own shards of
    an FSDP state (resumed at step 10 from those shards); then an endless run loses process 1
    (SIGKILL) and process 0 exits at once with a clear error instead of waiting in a collective."""
    groups = [
        group("batchnorm", "sharded", 1, tmp_path / "batchnorm-sharded"),  # device-resident data
        group("mlp", "pmap", 2, tmp_path / "mlp-pmap"),  # host batches from a torch DataLoader
        group("mlp", "sharded", 2, tmp_path / "mlp-grain", loader="grain"),  # host batches through Grain
        group("dpsgd", "pmap", 2, tmp_path / "dpsgd-pmap"),  # noise drawn once for the global batch
        group("wide", "fsdp", 2, tmp_path / "wide-fsdp", "--steps", "10"),
        group("wide", "fsdp", 2, tmp_path / "wide-fsdp", "--resume"),
        group("mlp", "sharded", 1, tmp_path / "endless", "--steps", "10000000", "--log-every", "20"),
    ]
    launcher = subprocess.Popen(
        [*LAUNCH_TWO, *worker_args(*groups)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "endless" / "metrics.jsonl").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.5)
        process_1 = next(pid for pid in _children(launcher.pid) if b"JAX_PROCESS_ID=1\0" in _environ(pid))
        os.kill(process_1, signal.SIGKILL)
        killed = time.monotonic()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert time.monotonic() - killed < 60 and launcher.returncode == 137
    assert "launch: process 1 was killed by SIGKILL" in err
    assert "worker: error: process 0 of 2: lost contact with another process" in err
    assert "process 1 of 2: joined 127.0.0.1:" in err

    assert_same_run(tmp_path / "batchnorm-sharded", one_process_runs / "batchnorm-none", "batchnorm")
    assert_same_run(tmp_path / "mlp-pmap", one_process_runs / "mlp-none", "mlp")
    assert_same_run(tmp_path / "mlp-grain", one_process_runs / "mlp-none", "mlp")  # the torch loader's batches
    assert_same_run(tmp_path / "dpsgd-pmap", one_process_runs / "dpsgd-none", "dpsgd")
    assert_same_run(tmp_path / "wide-fsdp", one_process_runs / "wide-none", "wide")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "batchnorm-sharded",
        "dpsgd-pmap",
        "endless",
        "mlp-grain",
        "mlp-pmap",
        "wide-fsdp",
    ]
    assert out.count("test accuracy") == 6  # only process 0 reports


@pytest.mark.slow
def test_two_processes_stop_together_on_sigterm_and_resume_to_the_same_bits(one_process_runs, tmp_path):
    """SIGTERM to `scripts/launch` reaches both processes; they agree on the step (at the next logging
    stop, where a checkpoint is saved every time: the signal comes while a save is in flight), the
    checkpoint there is committed, every process exits 143, and the same command with
    `--resume auto` ends where an uninterrupted two-process run ends, bit for bit. Its trackers are
    process 0's alone: one W&B run (started twice) and one MLflow run, holding metrics.jsonl's records."""
    args = [
        "--model",
        "mlp",
        "--loader",
        "device",
        "--parallel",
        "sharded",
        "--devices",
        "1",
        "--steps",
        "400",
        "--log-every",
        "20",
        "--checkpoint-every",
        "20",
        "--checkpoint-minutes",
        "0",
        "--no-progress",
    ]
    # No --run-dir: the processes must agree on the default one (named after the time) to save into it
    straight = subprocess.run([*LAUNCH_TWO, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    [straight_dir] = (tmp_path / "runs" / "worker").iterdir()
    tracked = [*args, "--run-dir", str(tmp_path / "stopped"), "--tracker", "wandb,mlflow"]
    launcher = subprocess.Popen(
        [*LAUNCH_TWO, *tracked], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 143, err[-3000:]
    steps = {int(line.split(" at step ")[1].split()[0]) for line in err.splitlines() if "stopped by SIGTERM" in line}
    assert len(steps) == 1 and "launch: every process stopped on a signal (status 143)" in err, err[-3000:]
    step = steps.pop()
    assert 0 < step < 400 and step % 20 == 0
    assert (tmp_path / "stopped" / "checkpoints" / f"step_{step:09d}" / "checkpoint.json").exists()
    resumed = subprocess.run(
        [*LAUNCH_TWO, *tracked, "--resume", "auto"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def records(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "steps_per_s"} for line in lines]

    assert records(tmp_path / "stopped") == records(straight_dir)
    final = "checkpoints/step_000000400"
    assert checkpoint_digest(tmp_path / "stopped" / final) == checkpoint_digest(straight_dir / final)

    run = RunDir(tmp_path / "stopped")
    expected, saved = jsonl_history(run), run.read_config()["trackers"]
    wandb_runs = read_wandb_runs(run.path)
    assert [w["run_id"] for w in wandb_runs] == [saved["wandb"]["run_id"]] * 2
    assert_same_history(wandb_history(wandb_runs), expected)
    [found] = mlflow_runs(saved["mlflow"]["uri"], experiment="worker")
    history = mlflow_history(saved["mlflow"]["uri"], found.info.run_id)
    assert_same_history({s: {k: v for k, v in h.items() if k in expected[s]} for s, h in history.items()}, expected)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes() + b"\0"


# -- in this process (one device) ----------------------------------------------------------------------


def test_each_strategy_on_one_device_matches_the_plain_fast_path():
    train = XORDataset(256, seed=42)
    results = {}
    for name, placement in (("none", one_device()), ("pmap", Pmap(1)), ("sharded", sharded(1))):
        config = worker.Config.from_options(model="batchnorm", parallel=name)
        results[name] = fit(
            worker.build_state(config),
            DeviceLoader.from_dataset(train, 32, seed=0),
            num_steps=4,
            log_every=2,
            steps_per_call=2,
            progress=False,
            placement=placement,
        )
    for result in results.values():
        assert result.train_metrics == pytest.approx(results["none"].train_metrics, abs=1e-6)
        assert int(result.state.step) == 4
        for x, y in zip(
            jax.tree.leaves(eqx.filter(result.state, eqx.is_array)),
            jax.tree.leaves(eqx.filter(results["none"].state, eqx.is_array)),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)


def test_batch_norm_layers_must_reduce_over_the_strategys_axes():
    state = worker.build_state(worker.Config.from_options(model="batchnorm", parallel="none"))  # axis "batch"
    with pytest.raises(ValueError, match=r"needs \('devices', 'batch'\)"):
        Pmap(1).check(state.model, 32)
    ema = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name=batch_axis_name("pmap"), mode="ema")[0]
    with pytest.raises(ValueError, match='mode="ema"'):
        Pmap(1).check(eqx.tree_at(lambda s: s.model, state, ema).model, 32)


def test_a_batch_the_devices_do_not_divide_is_refused():
    with pytest.raises(ConfigError, match="--batch-size 128 is not divisible by the 3 devices"):
        worker.TrainConfig.from_options(devices=3)
    with pytest.raises(ConfigError, match="not divisible by the 6 devices"):
        worker.TrainConfig.from_options(devices=3, num_processes=2, batch_size=9)
    with pytest.raises(ConfigError, match="--parallel none trains on one device"):
        worker.TrainConfig.from_options(devices=2, parallel="none")
    with pytest.raises(DeviceError, match="a training batch of 33 rows cannot be split evenly over 2 devices"):
        check_split(33, 2)


def test_more_devices_than_exist_are_refused_before_any_work(tmp_path):
    assert jax.device_count() == 1  # this pytest process
    config = worker.Config.from_options(devices=2, run_dir=str(tmp_path / "run"))
    with pytest.raises(DeviceError, match="--devices 2: only 1 cpu device"):
        worker.main(config)
    assert not (tmp_path / "run").exists()
    with pytest.raises(DeviceError, match="JAX already started with 1 CPU device"):
        simulate_cpu_devices(2)
    with pytest.raises(DeviceError, match="--parallel none trains on one device"):
        make_placement("none", 2)
    assert make_placement("auto", 1) == one_device() and make_placement("auto", 4) == sharded(4)


def test_the_script_refuses_an_indivisible_batch_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "xor.py"), "--devices", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "xor.py: error: --batch-size 128 is not divisible by the 3 devices; pick a multiple of 3"
    )
    assert not (tmp_path / "runs").exists()


def test_process_group_comes_from_flags_or_the_environment(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert process_group() is None
    assert process_group(num_processes=1) is None
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    group = process_group()
    assert (group.coordinator_address, group.num_processes, group.process_id) == ("10.0.0.1:1234", 4, 3)
    assert process_group(process_id=1).process_id == 1  # a flag wins over the environment
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(ConfigError, match=r"needs --process-id \(or \$JAX_PROCESS_ID\)"):
        process_group()
    with pytest.raises(ConfigError, match="must be in 0 .. 3"):
        process_group(process_id=4)


def test_a_slurm_job_step_of_several_tasks_is_found_by_jaxs_own_slurm_detection(monkeypatch):
    """Under `srun` (SLURM_STEP_NUM_TASKS > 1) with no flags or JAX variables, the processes join through
    `jax.distributed.initialize()`'s detection; a batch script (one process) stays one."""
    from jax._src.clusters import ClusterEnv

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "gpu[017-018]",
        "SLURM_STEP_NUM_NODES": "2",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert process_group() is None  # the batch script itself
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    group = process_group()
    assert (group.coordinator_address, group.num_processes, group.process_id) == ("", 2, 1)
    address, processes, index, _ = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 60)
    assert (address.split(":")[0], processes, index) == ("gpu017", 2, 1)  # what initialize() then uses
    assert process_group(num_processes=1) is None  # flags still win


def test_process_rows_split_a_batch_into_contiguous_shares():
    batch = np.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(process_rows(batch), batch)  # one process: everything
    np.testing.assert_array_equal(process_rows(batch.T, axis=1), batch.T)


def test_the_launcher_stops_every_process_when_one_fails(tmp_path, capfd):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        # one write per line: under PYTHONUNBUFFERED, print writes each word apart and the processes'
        # words interleave
        "os.write(1, ' '.join(['started', os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'],"
        " os.environ['JAX_COORDINATOR_ADDRESS'].split(':')[0]]).encode() + b'\\n')\n"
        "if os.environ['JAX_PROCESS_ID'] == '2': sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    assert launch(3, [str(script)], settle_seconds=1.0) == 3
    assert time.monotonic() - start < 60
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == [f"started {i} 3 127.0.0.1" for i in range(3)]
    assert "launch: process 2 exited with status 3; stopping process(es) 0, 1" in err


def test_backends_started_probes_without_changing_the_device_count():
    script = (
        "import jax\n"
        "from research.parallel._devices import backends_started\n"
        "jax.config.update('jax_num_cpu_devices', 3)\n"
        "before = backends_started(), jax.config.jax_num_cpu_devices\n"
        "count = jax.local_device_count()\n"
        "print(before, count, backends_started(), jax.config.jax_num_cpu_devices)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "(False, 3) 3 True 3"


def test_gloo_binds_to_loopback_or_warns_and_keeps_jaxs_default(monkeypatch, caplog):
    from jax._src.lib import _jax

    from research.parallel import _distributed

    registered = []
    monkeypatch.setattr(
        "jax.extend.backend.register_backend_factory", lambda *args, **kwargs: registered.append((args, kwargs))
    )
    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", lambda **kwargs: ("gloo", kwargs))
    _distributed._gloo_on_loopback()
    [((platform, factory), options)] = registered
    assert (platform, options) == ("cpu", {"priority": 0, "fail_quietly": False})
    assert factory.keywords["collectives"][1]["hostname"] == "127.0.0.1"

    monkeypatch.delattr(_jax, "make_gloo_tcp_collectives")  # a JAX whose internals moved
    with caplog.at_level("WARNING", logger="research.parallel._distributed"):
        _distributed._gloo_on_loopback()
    assert len(registered) == 1
    assert f"gloo stays on the host name's address: JAX {jax.__version__} has no" in caplog.text


def test_local_processes_take_accelerators_of_their_own(monkeypatch):
    """On one machine with several GPUs, process i of a local run takes GPUs [i*D, (i+1)*D) (D: --devices)
    instead of every process taking them all; runs across machines and SLURM steps keep JAX's choice, and so
    does a process whose environment names its devices already."""
    from research.parallel import _distributed
    from research.parallel._distributed import ProcessGroup, local_device_ids

    for variable in ("JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    assert local_device_ids(ProcessGroup("127.0.0.1:1234", 4, 2), 2) == [4, 5]
    assert local_device_ids(ProcessGroup("localhost:1234", 2, 0), 1) == [0]
    assert local_device_ids(ProcessGroup("10.0.0.7:1234", 4, 2), 2) is None  # across machines
    assert local_device_ids(ProcessGroup("", 4, 2), 2) is None  # a SLURM step
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert local_device_ids(ProcessGroup("127.0.0.1:1234", 4, 2), 2) is None

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(_distributed, "_gloo_on_loopback", lambda: None)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # this process's collectives stay as they are
    _distributed.join(ProcessGroup("127.0.0.1:1234", 2, 1), 30, devices_per_process=3)
    assert calls[0]["local_device_ids"] == [3, 4, 5] and calls[0]["process_id"] == 1


def test_a_lost_peer_is_told_from_gloos_or_nccls_error_and_nothing_else():
    from research.parallel._distributed import _collective_failure

    nested = "Error dispatching computation: " * 2
    gloo = f"INTERNAL: {nested}Gloo all-reduce failed: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\nx"
    nccl = f"INTERNAL: {nested}NCCL operation ncclAllReduce(...) failed: remote process exited. Last NCCL warning\nx"
    assert _collective_failure(jax.errors.JaxRuntimeError(gloo)).startswith("Gloo all-reduce failed: [../gloo")
    assert _collective_failure(jax.errors.JaxRuntimeError(nccl)).startswith("NCCL operation ncclAllReduce(...)")
    assert _collective_failure(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")) is None
    assert _collective_failure(RuntimeError("Gloo")) is None  # not JAX's


def test_deterministic_reduction_asks_a_gpu_for_deterministic_ops_too(monkeypatch):
    from research.config import Devices
    from research.parallel import setup_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    setup_devices(Devices())
    assert "--xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]
    setup_devices(Devices(deterministic_reduction=True))
    setup_devices(Devices(deterministic_reduction=True))
    flags = os.environ["XLA_FLAGS"].split()
    assert flags.count("--xla_gpu_deterministic_ops=true") == 1 and "--xla_cpu_enable_fast_math=false" in flags
