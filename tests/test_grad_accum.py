"""`--grad-accum N`: a step's gradient taken in N parts of its batch, one after another, is the whole batch's
gradient (to float rounding) for every kind of loss (a plain mean, DP-SGD's sums with the noise added once), over
a device axis and inside micro-batches, with every example's dropout key the one it has in the whole batch; the
option refuses a batch it cannot split and a step that does not take its gradients in parts."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _entry import run_entry

from research.data import Batch
from research.per_example import DPSGDLoss
from research.train import GlobalBatch, SupervisedStep, TrainState, classification_loss, take_step


class DropoutMLP(eqx.Module):
    """One example in, logits out, with dropout: its gradient depends on every example's key."""

    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.hidden, self.dropout, self.out = (
            eqx.nn.Linear(4, 16, key=a),
            eqx.nn.Dropout(0.5),
            eqx.nn.Linear(16, 3, key=b),
        )

    def __call__(self, x, *, key):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def _batch(rows: int = 32) -> Batch:
    rng = np.random.default_rng(0)
    return Batch(jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32), jnp.asarray(rng.integers(0, 3, rows), jnp.int32))


LOSSES = {
    "mean": classification_loss,
    "dp-sgd": DPSGDLoss(clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=32),
}
SLOW_DP_SGD = pytest.param("dp-sgd", marks=pytest.mark.slow)  # the quick tier checks the plain mean


def _assert_close(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@eqx.filter_jit
def _value_and_grad(global_batch, loss, model, batch, key, grad_accum):
    return global_batch.value_and_grad(loss, model, None, batch, key, grad_accum=grad_accum)


@pytest.mark.parametrize("loss", ["mean", SLOW_DP_SGD])
def test_parts_give_the_whole_batch_gradient_and_metrics(loss):
    model, batch, key = DropoutMLP(jax.random.key(0)), _batch(), jax.random.key(1)
    (whole, (metrics, _)), grads = _value_and_grad(GlobalBatch(), LOSSES[loss], model, batch, key, 1)
    for grad_accum in (2, 4):
        (parts, (parts_metrics, _)), parts_grads = _value_and_grad(
            GlobalBatch(), LOSSES[loss], model, batch, key, grad_accum
        )
        np.testing.assert_allclose(parts, whole, rtol=1e-6)
        _assert_close(parts_metrics, metrics)
        _assert_close(parts_grads, grads)


def test_without_each_examples_key_the_parts_would_differ():
    """The check above has teeth: parts that drew their dropout masks on their own (`jax.random.split(key, 16)`
    for each, not each example's key in the whole batch) give another gradient, far beyond rounding."""
    model, batch, key = DropoutMLP(jax.random.key(0)), _batch(), jax.random.key(1)
    _, grads = _value_and_grad(GlobalBatch(), classification_loss, model, batch, key, 1)
    halves = [jax.tree.map(lambda x, k=k: x[k::2], batch) for k in range(2)]
    own_keys = [_value_and_grad(GlobalBatch(), classification_loss, model, half, key, 1)[1] for half in halves]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *own_keys)
    assert not np.allclose(jax.tree.leaves(mean)[0], jax.tree.leaves(grads)[0], rtol=1e-2)
    _, parts = _value_and_grad(GlobalBatch(), classification_loss, model, batch, key, 2)
    _assert_close(parts, grads)


@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
def test_parts_on_each_device_of_an_axis_give_the_whole_batch_gradient(loss):
    """Each of 2 devices (a vmapped axis, as pmap runs it) takes its 16 rows in 2 parts; combined over the
    devices as the loss says (a mean; DP-SGD's sums, with the noise once), the whole batch's gradient."""
    model, batch, key = DropoutMLP(jax.random.key(0)), _batch(), jax.random.key(1)
    (whole, _), grads = _value_and_grad(GlobalBatch(), LOSSES[loss], model, batch, key, 1)
    per_device = jax.tree.map(lambda x: x.reshape(2, 16, *x.shape[1:]), batch)
    on_devices = eqx.filter_vmap(
        lambda b: _value_and_grad(GlobalBatch("devices"), LOSSES[loss], model, Batch(*b), key, 2),
        axis_name="devices",
    )
    (mapped, _), device_grads = on_devices(per_device)
    np.testing.assert_allclose(mapped, jnp.stack([whole, whole]), rtol=1e-6)
    _assert_close(jax.tree.map(lambda g: g[1], device_grads), grads)


@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
def test_parts_inside_micro_batches_give_the_whole_batch_gradient(loss):
    model, batch, key = DropoutMLP(jax.random.key(0)), _batch(), jax.random.key(1)
    (whole, _), grads = _value_and_grad(GlobalBatch(), LOSSES[loss], model, batch, key, 1)
    (micro, _), micro_grads = _value_and_grad(GlobalBatch(micro_batches=4), LOSSES[loss], model, batch, key, 2)
    np.testing.assert_allclose(micro, whole, rtol=1e-6)
    _assert_close(micro_grads, grads)


@pytest.mark.slow
def test_an_adam_step_with_parts_is_the_whole_batch_step():
    model, batch = DropoutMLP(jax.random.key(0)), _batch()
    # Adam's eps raised from 1e-8: where a gradient is ~1e-8, a rounding difference would be a visible update.
    state = TrainState.create(model, optax.adam(1e-2, eps=1e-4), key=jax.random.key(3))

    @eqx.filter_jit
    def step(state, grad_accum):
        return take_step(SupervisedStep(grad_accum=grad_accum), state, batch, GlobalBatch())

    whole, whole_metrics = step(state, 1)
    parts, metrics = step(state, 4)
    _assert_close(eqx.filter(parts.model, eqx.is_array), eqx.filter(whole.model, eqx.is_array))
    _assert_close(metrics, whole_metrics)
    assert int(parts.step) == int(whole.step) == 1


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("mnist1d", ["--model", "mlp", "--batch-size", "32", "--grad-accum", "3"], "not divisible by --grad-accum 3"),
        (
            "mnist1d",
            [
                "--model",
                "mlp",
                "--batch-size",
                "32",
                "--grad-accum",
                "4",
                "--deterministic-reduction",
                "--micro-batches",
                "16",
            ],
            "--batch-size 32 is not divisible by --grad-accum 4 x 16 --micro-batches",
        ),
        ("mnist1d", ["--model", "mlp", "--grad-accum", "0"], "--grad-accum"),
        ("metalearn_lr", ["--grad-accum", "2"], "--grad-accum 2: metalearn_lr's step is one unrolled inner run"),
    ],
)
def test_what_the_parts_cannot_split_is_refused_in_one_line(script, argv, message, capsys, mnist1d_dir, tmp_path):
    status = run_entry([*argv, "--data-dir", str(mnist1d_dir), "--run-dir", str(tmp_path / "run")], script)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
