"""`--precision bf16`: the loss's forward and backward pass in bfloat16 (the matmuls and convolutions are bf16 in
the compiled program), float32 parameters, gradients, model state and metrics, and numbers close to float32's; a
loss that takes its gradients its own way is refused in one line."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _entry import run_entry

from research.data import Batch
from research.errors import ConfigError
from research.nn import build_model
from research.per_example import DPSGDLoss
from research.train import GlobalBatch, SupervisedStep, TrainState, classification_loss, take_step
from research.train.precision import InPrecision


def _signals(rows: int = 32) -> Batch:
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.normal(size=(rows, 40)), jnp.float32)
    return Batch(inputs, jnp.asarray(rng.integers(0, 10, rows), jnp.int32))


MODELS = {  # MNIST-1D's models: a plain MLP, a CNN, and a ResNet with BatchNorm's running statistics as state
    "mlp": {"in_size": 40, "out_size": 10, "hidden": (32,)},
    "cnn": {"channels": 8},
    "resnet": {"widths": (8, 8)},
}
# How far bf16's gradient may be from float32's, relative to its norm (measured: mlp 0.004, cnn 0.021, resnet
# 0.102: BatchNorm's batch statistics in bf16 are the coarsest part)
GRADIENT_TOLERANCE = {"mlp": 0.03, "cnn": 0.05, "resnet": 0.15}


@eqx.filter_jit
def _value_and_grad(loss, model, model_state, batch, key):
    return GlobalBatch().value_and_grad(loss, model, model_state, batch, key)


@pytest.mark.parametrize("name", ["mlp", *(pytest.param(n, marks=pytest.mark.slow) for n in ("cnn", "resnet"))])
def test_bf16_computes_in_bfloat16_and_returns_float32_close_to_float32(name):
    model, state = build_model(name, key=jax.random.key(0), **MODELS[name])
    batch, key = _signals(), jax.random.key(1)
    low = InPrecision(classification_loss, "bf16")
    (loss, (metrics, new_state)), grads = _value_and_grad(low, model, state, batch, key)
    (loss32, (metrics32, state32)), grads32 = _value_and_grad(classification_loss, model, state, batch, key)
    assert loss.dtype == jnp.float32 and all(m.dtype == jnp.float32 for m in metrics.values())
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert jax.tree.structure(new_state) == jax.tree.structure(state32)
    assert all(x.dtype == y.dtype for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(state32), strict=True))
    np.testing.assert_allclose(loss, loss32, rtol=2e-2)
    # bf16 keeps 8 bits of mantissa: the whole gradient within a few percent of float32's, pointing the same way
    flat, flat32 = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads, grads32))
    assert float(jnp.linalg.norm(flat - flat32) / jnp.linalg.norm(flat32)) < GRADIENT_TOLERANCE[name]
    assert float(flat @ flat32 / (jnp.linalg.norm(flat) * jnp.linalg.norm(flat32))) > 0.99
    jaxpr = str(eqx.filter_make_jaxpr(lambda m: low(m, state, batch, key))(model)[0])
    products = [line for line in jaxpr.splitlines() if "dot_general" in line or "conv_general_dilated" in line]
    assert products and all("bf16" in line for line in products), products


@pytest.mark.slow
def test_the_image_resnet_computes_its_uint8_pixels_in_bf16():
    model, state = build_model("image_resnet", key=jax.random.key(0), height=8, width=8, channels=1, features=4)
    pixels = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1)), jnp.uint8)
    low = InPrecision(classification_loss, "bf16")
    jaxpr = str(
        eqx.filter_make_jaxpr(lambda m: low(m, state, Batch(pixels, jnp.zeros(4, jnp.int32)), jax.random.key(0)))(
            model
        )[0]
    )
    products = [line for line in jaxpr.splitlines() if "dot_general" in line or "conv_general_dilated" in line]
    assert products and all("bf16" in line for line in products), products


def test_an_adam_step_in_bf16_keeps_float32_parameters_and_optimizer_state():
    model, _ = build_model("mlp", key=jax.random.key(0), **MODELS["mlp"])
    state = TrainState.create(model, optax.adam(1e-3), key=jax.random.key(3))
    step = eqx.filter_jit(lambda s: take_step(SupervisedStep(precision="bf16"), s, _signals(), GlobalBatch()))
    new, metrics = step(state)
    leaves = jax.tree.leaves(eqx.filter(new, eqx.is_inexact_array))
    assert leaves and all(x.dtype == jnp.float32 for x in leaves)
    assert float(metrics["grad_norm"]) > 0 and np.isfinite(float(metrics["loss"]))


def test_a_loss_that_takes_its_gradients_its_own_way_is_refused():
    with pytest.raises(ConfigError, match="--precision bf16: the loss DPSGDLoss takes its gradients its own way"):
        SupervisedStep(DPSGDLoss(1.0, 1.0, 32), precision="bf16")


@pytest.mark.parametrize(
    "script, message",
    [("dp_sgd", "takes its gradients its own way"), ("metalearn_lr", "differentiates through its inner SGD run")],
)
def test_what_cannot_compute_in_bf16_is_refused_in_one_line(script, message, capsys, mnist1d_dir, tmp_path):
    argv = ["--precision", "bf16", "--data-dir", str(mnist1d_dir), "--run-dir", str(tmp_path / "run")]
    status = run_entry(argv, script)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_mnist1d_trains_in_bf16_to_the_accuracy_of_float32(mnist1d_dir, tmp_path):
    """200 steps of the CNN: the test accuracy of bf16 compute within 3 points of float32's, on the same data."""
    import json

    accuracy = {}
    for precision in ("float32", "bf16"):
        run = tmp_path / precision
        argv = ["--model", "cnn", "--steps", "200", "--precision", precision, "--no-progress"]
        assert run_entry([*argv, "--data-dir", str(mnist1d_dir), "--run-dir", str(run)], "mnist1d") == 0
        accuracy[precision] = json.loads((run / "summary.json").read_text())["test_accuracy"]
    assert accuracy["float32"] > 0.3, accuracy  # it learned (chance is 0.1)
    assert abs(accuracy["bf16"] - accuracy["float32"]) < 0.03, accuracy
