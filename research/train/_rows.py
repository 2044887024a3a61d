"""Where the rows of the batch a step sees sit in the global batch (`rows_of_global_batch`, `example_keys`),
and the gradient of a mean loss over the global batch, of which the step sees one device's slice
(`loss_value_and_grad`).

The pieces below `GlobalBatch` (`_global_batch.py`): the micro-batches (`_micro.py`) and the batch losses
(`_batch_loss.py`) build on them, and `GlobalBatch` dispatches to all three.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Key

from ..typing import Array, Float, PRNGKeyArray, PyTree

Metrics = dict[str, Float[Array, ""]]
# loss_fn(model, model_state, batch, key) -> (loss, (metrics, new_model_state)): a mean over its batch.
# A loss object may also define `value_and_grad(model, model_state, batch, key, *, axis_name)` with the
# output of `eqx.filter_value_and_grad(loss_fn, has_aux=True)`; it then owns how its gradient combines
# across the devices of `axis_name` (see `loss_value_and_grad`).
LossFn = Callable[[eqx.Module, Any, Any, PRNGKeyArray], tuple[Float[Array, ""], tuple[Metrics, Any]]]

# Where the batch a loss sees sits in the global batch, `(global rows, first row, stride)`: its rows are
# `first, first + stride, ...` of the global batch. Set while tracing a step whose batch is one device's
# slice (`jax.pmap`), one micro-batch (`--deterministic-reduction`) or one part of an accumulated
# gradient (`--grad-accum`); `example_keys` then gives every example the key it would get in the whole
# batch, so dropout masks do not depend on the device count, the micro-batches or the parts.
_rows_in_batch: contextvars.ContextVar[tuple[int, Any, Any] | None] = contextvars.ContextVar(
    "rows_in_batch", default=None
)


@contextlib.contextmanager
def rows_of_global_batch(total: int, first: Any, stride: Any = 1) -> Iterator[None]:
    """Inside it, a batch is rows `first, first + stride, ...` (traced values may do) of a global batch of
    `total` rows: `example_keys` gives each example its key in the global batch."""
    token = _rows_in_batch.set((total, first, stride))
    try:
        yield
    finally:
        _rows_in_batch.reset(token)


def rows_in_global_batch(rows: int) -> tuple[int, Any, Any]:
    """`(global rows, first row, stride)` of the batch of `rows` rows being traced: `(rows, 0, 1)` outside
    `rows_of_global_batch`."""
    return _rows_in_batch.get() or (rows, 0, 1)


@contextlib.contextmanager
def batch_split_over(axis_name: str | None, rows: int) -> Iterator[None]:
    """Inside it, a batch of `rows` rows is this device's equal slice of the global batch split over the
    device axis `axis_name` (nothing changes with `None`: the batch is the global one)."""
    if axis_name is None:
        yield
        return
    with rows_of_global_batch(rows * jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name) * rows):
        yield


def example_keys(key: PRNGKeyArray, count: int) -> Key[Array, " {count}"]:
    """One key per example of a batch of `count`: `jax.random.split(key, count)`, or, inside a train
    step whose batch is part of a global batch (split over devices, micro-batches or accumulated parts),
    those examples' keys among the whole batch's (so per-example randomness does not depend on the
    split)."""
    rows = _rows_in_batch.get()
    if rows is None:
        return jax.random.split(key, count)
    # split(key, n)[i] does not depend on n (partitionable threefry), so this is the global batch's keys.
    total, first, stride = rows
    keys = jax.random.split(key, total)
    if isinstance(stride, int) and stride == 1:
        return jax.lax.dynamic_slice_in_dim(keys, first, count)
    return keys[first + stride * jnp.arange(count)]


def batch_rows(batch: PyTree) -> int:
    """The rows of a batch (the leading axis of its leaves)."""
    return jax.tree.leaves(batch)[0].shape[0]


def loss_value_and_grad(
    loss_fn: LossFn,
    model: eqx.Module,
    model_state: Any,
    batch: PyTree,
    key: PRNGKeyArray,
    *,
    axis_name: str | None = None,
) -> tuple[tuple[Float[Array, ""], tuple[Metrics, Any]], PyTree]:
    """The loss and its gradient on the model for the GLOBAL batch, of which `batch` is this device's
    equal slice when `axis_name` names a device axis.

    The loss decides how its gradient combines. A plain loss is a mean over its batch, so the mean of
    the devices' means (`lax.pmean`) is the global mean. A loss with its own `value_and_grad` gets
    `axis_name` and combines itself: DP-SGD sums the clipped per-example gradients over the devices
    and adds its noise once, to the global sum (a mean of per-device noisy means would shrink the
    signal by the device count and not the noise).
    """
    with batch_split_over(axis_name, batch_rows(batch)):
        own = getattr(loss_fn, "value_and_grad", None)
        if own is not None:
            return own(model, model_state, batch, key, axis_name=axis_name)
        (loss, (metrics, model_state)), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, model_state, batch, key
        )
    if axis_name is not None:
        loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), axis_name)
    return (loss, (metrics, model_state)), grads
