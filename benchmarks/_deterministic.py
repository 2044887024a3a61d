"""Case (j): what `--deterministic-reduction` costs (issue 29).

MNIST-1D's CNN (batch 128) and `experiments/lm.py`'s language model (32 windows of 128 bytes), each
trained warm by `fit` (the device loader, many steps a compiled call) with the ordinary step and with
the layout-invariant one (8 micro-batches, each computed in a `lax.scan` and summed in a fixed order),
on one device and on 4 simulated CPU devices (`--parallel sharded`). Each device count is its own
process (simulated devices must be set before JAX starts). Reported: seconds per step, interleaved
and repeated, and the temporary buffers XLA allocates for one compiled call of the step
(`memory_analysis().temp_size_in_bytes`, per device), which is where the micro-batches' stacked
gradients live.

Simulated devices share this machine's two cores, so on 4 devices the times say what the flag costs
in a program that also pays for partitioning and collectives, not what it would cost on accelerators.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._timing import Timing

ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCHES = 8


def _experiment(model: str, quick: bool):
    """`(state, train_data, step, steps_per_call)` of a warm-up-ready run of `model`."""
    from research.experiment import load_experiment

    if model == "cnn":
        module = load_experiment("mnist1d")
        config = module.Config.from_options(model="cnn", steps=1000, data_dir="data", progress=False)
        calls = 100
    else:
        module = load_experiment("lm")
        config = module.Config.from_options(steps=1000, text_bytes=400_000, progress=False)
        calls = 20
    setup = module.setup(config)
    return setup.build_state(), setup.train_data, setup.step, 10 if quick else calls


def _temp_bytes(trainer, state, data, steps: int) -> int | None:
    """XLA's temporary buffers for one compiled call of `steps` of `trainer`'s steps, on one device."""
    import numpy as np

    leaves = trainer.place(state)
    stats = trainer.init_stats(leaves, data.host.take(np.zeros(data.index_shape, np.int32)))
    indices = trainer.placement.put_indices(np.zeros((steps, *data.index_shape), np.int32))
    device_data = trainer.placement.put_data(data.host, data.arrays)
    lowered = trainer._run.lower(leaves, stats.words, device_data, indices, trainer.placement.put_count(steps))
    analysis = lowered.compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def _training(state, data, step, steps: int, placement) -> Callable[[], float]:
    """Seconds per step of `steps` warm steps of `fit` in one compiled call (compiled here)."""
    from research.train import fit

    def train() -> float:
        start = time.perf_counter()
        fit(
            state,
            data,
            num_steps=steps,
            step=step,
            placement=placement,
            steps_per_call=steps,
            log_every=steps,
            progress=False,
        )
        return (time.perf_counter() - start) / steps

    train()
    return train


def worker(devices: int, quick: bool) -> dict:
    from research.parallel import make_placement
    from research.train import compiled_trainer

    from ._timing import interleave

    results = {}
    for model in ("cnn", "lm"):
        state, data, step, steps = _experiment(model, quick)
        candidates, memory = {}, {}
        for name, micro in (("ordinary step", None), ("--deterministic-reduction", MICRO_BATCHES)):
            placement = make_placement("auto", devices, micro)
            candidates[name] = _training(state, data, step, steps, placement)
            memory[name] = _temp_bytes(compiled_trainer(step, state, placement=placement), state, data, steps)
        timings = interleave(candidates, 2 if quick else 7)
        results[model] = {"step": {t.name: t.seconds for t in timings.values()}, "temp_bytes": memory}
    return results


def run(quick: bool) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for devices in (1, 4):
            path = Path(scratch) / f"{devices}.json"
            env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            command = [sys.executable, "-m", "benchmarks._deterministic", str(devices), str(path), str(int(quick))]
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise RuntimeError(f"case (j) on {devices} device(s) failed: {done.stderr.strip()[-2000:]}")
            measured = json.loads(path.read_text())
            for row in measured.values():
                row["step"] = [Timing(name, seconds) for name, seconds in row["step"].items()]
            out[f"{devices} device{'s' if devices > 1 else ''}"] = measured
    return {"devices": out, "micro_batches": MICRO_BATCHES}


if __name__ == "__main__":
    count, target, quick_flag = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
    target.write_text(json.dumps(worker(count, quick_flag)))
