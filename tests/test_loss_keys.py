"""The keys a loss gets: one a row by default (each row's key in the global batch), the batch's one key where the
loss asks for it, refused where that key would make its draws depend on the split, and `across_global_batch`
for a draw coupled across the batch that does not.

A device axis is simulated with `jax.vmap(..., axis_name=...)` over the devices' slices: the collectives
`GlobalBatch` uses (`axis_index`, `axis_size`, `all_gather`, `pmean`) mean the same under it as under `jax.pmap`.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.errors import ConfigError
from research.train import GlobalBatch, across_global_batch

ROWS, DEVICES = 16, 4


def stratified_times(key, rows):
    """Score-based diffusion's low-discrepancy times (Equinox's example): one uniform offset for the batch, then
    `rows` evenly spaced times, each row's in its own stratum. A draw coupled across the batch."""
    return (jax.random.uniform(key) + jnp.arange(rows) / rows) % 1.0


class Scale(eqx.Module):
    weight: jax.Array


def _regression(model, times, inputs):
    loss = jnp.mean((model.weight * inputs - times) ** 2)
    return loss, ({"loss": loss}, None)


class CoupledLoss(eqx.Module):
    """The port as written: the batch's key, the times drawn over the rows it sees."""

    takes_batch_key: ClassVar[bool] = True

    def __call__(self, model, _, inputs, key):
        return _regression(model, stratified_times(key, inputs.shape[0]), inputs)


class GlobalTimesLoss(eqx.Module):
    """The same times drawn for the global batch, this batch's rows of them taken: layout-free."""

    takes_batch_key: ClassVar[bool] = True
    layout_free: ClassVar[bool] = True

    def __call__(self, model, _, inputs, key):
        return _regression(model, across_global_batch(stratified_times, key, inputs.shape[0]), inputs)


def per_row_loss(model, _, inputs, keys):
    """The default: each row's time from its own key."""
    return _regression(model, jax.vmap(jax.random.uniform)(keys), inputs)


def one_key_loss(model, _, inputs, keys):
    """A batch-coupled draw written against one key a row."""
    return _regression(model, stratified_times(keys, inputs.shape[0]), inputs)


MODEL = Scale(jnp.asarray(0.5))
INPUTS = jnp.linspace(-1.0, 1.0, ROWS)
KEY = jax.random.key(3)


def whole(loss_fn, global_batch=None):
    global_batch = global_batch or GlobalBatch()
    (loss, _), grads = global_batch.value_and_grad(loss_fn, MODEL, None, INPUTS, KEY)
    return float(loss), float(grads.weight)


def on_devices(loss_fn, micro_batches=None):
    """`value_and_grad` on DEVICES simulated devices, each given its equal slice of the global batch."""

    def one(inputs):
        (loss, _), grads = GlobalBatch("devices", micro_batches).value_and_grad(loss_fn, MODEL, None, inputs, KEY)
        return loss, grads.weight

    loss, grad = jax.vmap(one, axis_name="devices")(INPUTS.reshape(DEVICES, -1))
    return float(loss[0]), float(grad[0])


def test_a_loss_gets_one_key_a_row_its_key_in_the_global_batch():
    times = jax.vmap(jax.random.uniform)(jax.random.split(KEY, ROWS))  # row i's key: split(key, rows)[i]
    expected = float(jnp.mean((MODEL.weight * INPUTS - times) ** 2))
    assert whole(per_row_loss)[0] == pytest.approx(expected, rel=1e-6)
    for split in (on_devices(per_row_loss), on_devices(per_row_loss, 4), whole(per_row_loss, GlobalBatch(None, 4))):
        np.testing.assert_allclose(split, whole(per_row_loss), rtol=1e-6)


def test_a_loss_that_draws_from_its_row_keys_as_one_key_is_told_so_naming_it():
    with pytest.raises(ConfigError, match=r"^the loss one_key_loss drew from its keys as from one key .*batch_key"):
        whole(one_key_loss)


def test_a_batch_coupled_draw_is_refused_where_its_batch_is_part_of_the_global_one():
    whole(CoupledLoss())  # the whole batch: the port's own meaning
    for split in (lambda: on_devices(CoupledLoss(), 4), lambda: on_devices(CoupledLoss())):
        with pytest.raises(ConfigError, match=r"^the loss CoupledLoss draws from its batch's key .*layout_free"):
            split()
    with pytest.raises(ConfigError, match="CoupledLoss"):
        whole(CoupledLoss(), GlobalBatch(None, 4))  # micro-batches on one device: each would draw the same times


def test_a_coupled_draw_across_the_global_batch_is_the_same_on_every_split():
    """The port's times drawn for the global batch: the loss and gradient of one device's whole batch on 4
    devices, under micro-batches on 1 and on 4. (The coupled draw over each part would give each part the same
    16 / 4 strata: another loss.)"""
    reference = whole(GlobalTimesLoss())
    assert reference == whole(CoupledLoss())  # without a split, the port's draw itself
    for split in (on_devices(GlobalTimesLoss()), on_devices(GlobalTimesLoss(), 4)):
        np.testing.assert_allclose(split, reference, rtol=1e-6)
    assert on_devices(GlobalTimesLoss(), 4) == whole(GlobalTimesLoss(), GlobalBatch(None, 4))
