"""Where the batch a step sees sits in the global batch, and how its values combine into the global batch's.

A step runs on the global batch (one device, or `jax.jit` over a mesh), on one device's equal slice of it
(`jax.pmap`, or a mesh under `--deterministic-reduction`), or on one micro-batch of it. `GlobalBatch` is
what the engine hands a `Step` to say which: its `value_and_grad` is the gradient of a loss over the
GLOBAL batch whatever the step sees, and `example_keys` gives each example the key it has in the global
batch, so a run's numbers do not depend on the devices it runs on.
"""

import contextlib
import contextvars
import dataclasses
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
    grad_accum: int = 1,
) -> tuple[tuple[Float[Array, ""], tuple[Metrics, Any]], PyTree]:
    """The loss and its gradient on the model for the GLOBAL batch, of which `batch` is this device's
    equal slice when `axis_name` names a device axis; with `grad_accum` above 1, taken in that many parts
    of the batch one after another (`accumulated_value_and_grad`).

    The loss decides how its gradient combines. A plain loss is a mean over its batch, so the mean of
    the devices' means (`lax.pmean`) is the global mean. A loss with its own `value_and_grad` gets
    `axis_name` and combines itself: DP-SGD sums the clipped per-example gradients over the devices
    and adds its noise once, to the global sum (a mean of per-device noisy means would shrink the
    signal by the device count and not the noise).
    """
    if grad_accum > 1:
        from ._micro import accumulated_value_and_grad  # it builds on this module

        return accumulated_value_and_grad(
            loss_fn, model, model_state, batch, key, grad_accum=grad_accum, axis_name=axis_name
        )
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


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """What a step's batch is of the global batch, handed to a `Step` by the engine: `axis_name` names the
    device axis the batch is split over (`None`: the step sees the whole global batch, or XLA splits it),
    `micro_batches` the fixed number of micro-batches of a layout-invariant step
    (`--deterministic-reduction`, `_micro.py`; `None`: none).

    A step takes every gradient and every metric of the global batch through `value_and_grad`, so that
    its numbers are the same on any placement (and, with micro-batches, the same bits)."""

    axis_name: str | None = None
    micro_batches: int | None = None

    def value_and_grad(
        self,
        loss_fn: LossFn,
        model: eqx.Module,
        model_state: Any,
        batch: PyTree,
        key: PRNGKeyArray,
        *,
        grad_accum: int = 1,
    ) -> tuple[tuple[Float[Array, ""], tuple[Metrics, Any]], PyTree]:
        """`eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, model_state, batch, key)` of the global
        batch: `loss_fn` is a mean over its batch (`(loss, (metrics, new model state))`), and the result is
        that of the global batch, its metrics included, however the batch is split.

        `grad_accum`: take it in that many parts of the batch this step sees (of each micro-batch, under
        micro-batches), one after another in a `jax.lax.scan`: the same gradient (to float rounding) with the
        activation memory of one part. Part `k` holds rows `k, k + grad_accum, ...`, which keeps the rows
        where a sharded batch has them; each example keeps its key in the global batch.

        A loss over the whole batch (`research.train.AbstractBatchLoss`: a contrastive loss, no mean of
        per-example terms) is the loss of the whole global batch too: its embeddings are gathered from every
        device (and micro-batch, and part) and its gradient pulled back through each one's rows (`_batch_loss.py`)."""
        from ._batch_loss import AbstractBatchLoss, batch_loss_value_and_grad  # it builds on this module

        if isinstance(loss_fn, AbstractBatchLoss):
            return batch_loss_value_and_grad(
                loss_fn,
                model,
                model_state,
                batch,
                key,
                axis_name=self.axis_name,
                micro_batches=self.micro_batches,
                grad_accum=grad_accum,
            )
        if self.micro_batches is None:
            return loss_value_and_grad(
                loss_fn, model, model_state, batch, key, axis_name=self.axis_name, grad_accum=grad_accum
            )
        from ._micro import micro_batch_value_and_grad  # it builds on this module

        return micro_batch_value_and_grad(
            loss_fn,
            model,
            model_state,
            batch,
            key,
            micro_batches=self.micro_batches,
            axis_name=self.axis_name,
            grad_accum=grad_accum,
        )
