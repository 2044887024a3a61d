"""FSDP (`--parallel fsdp`): the train state's large arrays are split over the devices, and training
gives the numbers of one device. Simulated devices must exist before JAX starts, so the runs happen
in a subprocess with 8 CPU devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent

SCRIPT = """
import json, sys
from research.parallel import simulate_cpu_devices
simulate_cpu_devices(8)
import equinox as eqx, jax, numpy as np, optax
from research.data import DeviceLoader, TorchLoader, XORDataset
from research.nn import MLP
from research.parallel import DATA_AXIS, bytes_on_first_device, fsdp, make_placement
from research.train import TrainState, fit

train = XORDataset(512, seed=42)
state = TrainState.create(MLP(2, 2, hidden=(256, 256), key=jax.random.key(0)), optax.adam(1e-3),
                          key=jax.random.key(1), ema_decay=0.9)
out = {}
for loader in ("device", "torch"):
    for name in ("none", "fsdp"):
        data = DeviceLoader.from_dataset(train, 32, seed=0) if loader == "device" else TorchLoader(train, 32, seed=0)
        result = fit(state, data, num_steps=20, log_every=1, steps_per_call=5, progress=False,
                     placement=make_placement(name, 1 if name == "none" else 8))
        leaves = jax.tree.leaves(eqx.filter(result.state, eqx.is_array))
        out[f"{loader}-{name}"] = {"loss": float(result.train_metrics["loss"]), "bytes": result.state_bytes_per_device,
                                   "leaves": [np.asarray(x).ravel()[:512].tolist() for x in leaves]}
eight = fsdp(8)
total = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
small = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)) if not any(eight.leaf_spec(x.shape)))
placed = eight.place([np.asarray(x) for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))])
out["shapes"] = {"total": total, "replicated": small, "placed_on_first": bytes_on_first_device(placed),
                 "weight_spec": str(eight.leaf_spec((256, 256))), "bias_spec": str(eight.leaf_spec((256,)))}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fsdp_on_8_devices_holds_an_eighth_of_the_state_and_trains_like_one_device(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    shapes = out["shapes"]
    # The 256x256 weights (and their Adam moments and EMA) are split 8 ways; the biases (256 < 1024
    # elements) and the small layers stay whole: at most 1/8 of the total plus that remainder.
    assert shapes["weight_spec"] == "P('data', None)" and shapes["bias_spec"] == "P()"
    assert shapes["placed_on_first"] <= shapes["total"] / 8 + shapes["replicated"]
    assert shapes["placed_on_first"] < shapes["total"] / 4
    for loader in ("device", "torch"):
        fsdp, one = out[f"{loader}-fsdp"], out[f"{loader}-none"]
        assert fsdp["bytes"] == shapes["placed_on_first"] and one["bytes"] == shapes["total"]
        np.testing.assert_allclose(fsdp["loss"], one["loss"], rtol=1e-5)
        for a, b in zip(fsdp["leaves"], one["leaves"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # parameters, Adam moments, EMA
