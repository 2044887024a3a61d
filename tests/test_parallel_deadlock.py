"""Issue 14, failure 5: one compiled call a step on 4 simulated CPU devices hung in an all-reduce.

XLA's CPU client launches each device's share of a multi-device call on a pool of `max(cores,
devices)` threads, and a launch blocks in its thread while its device has 32 computations queued.
When the host dispatches steps faster than the devices run them (a torch DataLoader, or a
`DeviceLoader` with `steps_per_call=1`, and a model heavier than the dispatch), the blocked
launches take the threads the next all-reduce needs: "Expected 4 threads to join the rendezvous,
but only 3 of them arrived on time", SIGABRT after 60 s. `simulate_cpu_devices` now gives the
client `2 * devices` threads. The runs take more than 32 steps in one logging window (each log
fetches the metrics, which drains the queue) with a model whose step outlasts its dispatch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
STEPS = 96

SCRIPT = f"""
import json
import numpy as np
import sys
from research.parallel import make_placement, simulate_cpu_devices

if sys.argv[1] == "script":
    simulate_cpu_devices(4)  # what every experiment script does (research.parallel.setup_devices)

import equinox as eqx
import jax
import optax

from research.data import DeviceLoader, TorchLoader, XORDataset
from research.nn import MLP
from research.train import TrainState, fit

assert jax.device_count() == 4
train = XORDataset(512, seed=42)
model = MLP(2, 2, hidden=(1024, 1024), key=jax.random.key(0))  # a step of ~10 ms on 4 devices, 2 cores
state = TrainState.create(model, optax.adam(1e-3), key=jax.random.key(1))
runs = {{}}
for loader, parallel in (("torch", "pmap"), ("device", "sharded"), ("torch", "none"), ("device", "none")):
    data = TorchLoader(train, 32, seed=0) if loader == "torch" else DeviceLoader.from_dataset(train, 32, seed=0)
    result = fit(state, data, num_steps={STEPS}, log_every={STEPS}, steps_per_call=1, progress=False,
                 placement=make_placement(parallel, 1 if parallel == "none" else 4))
    params = jax.tree.leaves(eqx.filter(result.state.model, eqx.is_array))
    runs[f"{{loader}}-{{parallel}}"] = {{"metrics": result.train_metrics,
                                        "params": [np.asarray(p).ravel()[:256].tolist() for p in params]}}
print(json.dumps(runs))
"""


@pytest.mark.slow
@pytest.mark.parametrize("started_by", ["script", "user"])
def test_one_step_per_call_on_four_cpu_devices_does_not_deadlock(tmp_path, started_by):
    """`script`: as an experiment script starts JAX (XLA's pool gets 2 * devices threads); `user`:
    as a notebook would, with only XLA_FLAGS, where the engine's cap on calls in flight is the guard."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before JAX starts, as in a real run
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, started_by], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    for loader, parallel in (("torch", "pmap"), ("device", "sharded")):
        run, reference = runs[f"{loader}-{parallel}"], runs[f"{loader}-none"]
        assert run["metrics"].keys() == reference["metrics"].keys()
        for name, value in run["metrics"].items():
            np.testing.assert_allclose(value, reference["metrics"][name], rtol=1e-5, err_msg=f"{parallel} {name}")
        for a, b in zip(run["params"], reference["params"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
