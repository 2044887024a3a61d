"""Layout-invariant reduction (`--deterministic-reduction`): the gradient of a global batch as a fixed
number of micro-batches, each computed on its own and summed in one fixed order, whatever device
holds which, so that a run gives the same bits on 1, 2, 4 or 8 devices and across processes.

An ordinary data-parallel step lets XLA reduce the gradient: one device sums its batch in one order,
eight devices each sum an eighth and then all-reduce the eight partial sums, and float addition is
not associative, so the bits differ with the device count (and Adam amplifies the difference). Here
the global batch of `B` rows is `M` micro-batches of `B / M` contiguous rows; a device holding
`M / D` of them computes each one's gradient in a `jax.lax.scan` (the loop body is the same program
whatever the trip count, so the same bits; a `vmap` over `M / D` micro-batches is not: XLA picks
other matmul kernels for other batch shapes), gathers every device's micro-batch gradients, and
adds them with `tree_sum`: elementwise adds in an order that depends only on `M`.

How micro-batches combine is the loss's to say: a plain loss (and one whose `value_and_grad` is a
mean over its batch, `mean_over_batch = True`) is the mean of the micro-batch means; a loss that
sums and then finishes (DP-SGD: noise added once, to the global sum) defines `micro_batch_sums` and
`from_micro_batch_sums`. A model's state (BatchNorm's running statistics) is the `tree_sum` mean of
the micro-batches' new states; batch statistics normalise within each micro-batch ("ghost" batch
norm over `B / M` rows).

The micro-batch step must also round the same way in every program XLA compiles it into (one device,
each of several devices), which it does not do on its own: XLA's CPU backend picks another dot kernel
for some dots (`research.parallel.EXACT_COMPILER_OPTIONS` pins it) and turns a divide by a broadcast value
into a multiply by its reciprocal in some programs only, so the step uses JAX's custom-JVP softmax (no divide in its
gradient) and `research.nn.BatchNorm` multiplies by `rsqrt(var + eps)`; and it fuses a multiply and an add
into an FMA wherever both land in one kernel, so BatchNorm's running averages have one product, not two.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..typing import PRNGKeyArray, PyTree
from ._rows import (
    LossFn,
    batch_rows,
    batch_split_over,
    loss_value_and_grad,
    rows_in_global_batch,
    rows_of_global_batch,
)


def tree_sum(stacked: PyTree) -> PyTree:
    """Each leaf summed over its leading axis in a fixed pairwise order (`x[0] + x[1]`, `x[2] + x[3]`, ...,
    level by level; an odd last element waits for the next level): the same bits for the same inputs,
    whichever program or device computes it."""

    def one(x: jax.Array) -> jax.Array:
        while x.shape[0] > 1:
            pairs = x[0 : x.shape[0] // 2 * 2 : 2] + x[1 : x.shape[0] // 2 * 2 : 2]
            x = jnp.concatenate([pairs, x[-1:]]) if x.shape[0] % 2 else pairs
        return x[0]

    return jax.tree.map(one, stacked)


def check_micro_batch_loss(loss_fn: LossFn) -> None:
    """Refuse a loss whose micro-batches this module cannot combine: one with its own `value_and_grad`
    that neither is a mean over its batch nor says how its micro-batch sums finish."""
    own = getattr(loss_fn, "value_and_grad", None) is not None
    if own and not (getattr(loss_fn, "mean_over_batch", False) or hasattr(loss_fn, "micro_batch_sums")):
        raise ConfigError(
            f"--deterministic-reduction: the loss {type(loss_fn).__name__} has its own value_and_grad but does not "
            "say how micro-batches combine (set mean_over_batch = True, or define micro_batch_sums and "
            "from_micro_batch_sums)"
        )


def _sums(loss_fn: LossFn, model: eqx.Module, model_state: Any, batch: PyTree, key: PRNGKeyArray) -> tuple:
    """`(sums, new model state)` of one micro-batch: the loss's own sums, or the mean's `((loss, metrics), grads)`."""
    own = getattr(loss_fn, "micro_batch_sums", None)
    if own is not None:
        return own(model, model_state, batch, key)
    (loss, (metrics, model_state)), grads = loss_value_and_grad(loss_fn, model, model_state, batch, key)
    return ((loss, metrics), grads), model_state


def _accumulated_sums(
    loss_fn: LossFn, model: eqx.Module, model_state: Any, batch: PyTree, key: PRNGKeyArray, grad_accum: int
) -> tuple:
    """What `_sums` gives for `batch`, taken in `grad_accum` parts one after another (`jax.lax.scan`): part
    `k` holds rows `k, k + grad_accum, ...` (a split that keeps the rows where a sharded batch has them).
    A mean is the mean of the parts' means (every part has as many rows), a sum the sum of their sums; the
    new model state is the mean of the parts' (each part starts from `model_state`)."""
    if grad_accum == 1:
        return _sums(loss_fn, model, model_state, batch, key)
    rows = batch_rows(batch)
    if rows % grad_accum:
        raise ConfigError(f"--grad-accum {grad_accum} must divide the {rows} rows of the batch it splits")
    parts = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(rows // grad_accum, grad_accum, *x.shape[1:]), 0, 1), batch)
    total, first, stride = rows_in_global_batch(rows)

    def part_sums(index: Any, part: PyTree) -> tuple:
        with rows_of_global_batch(total, first + index * stride, stride * grad_accum):
            return _sums(loss_fn, model, model_state, part, key)

    def add(carry: tuple, indexed: tuple[Any, PyTree]) -> tuple[tuple, None]:
        (sums, states), (new_sums, new_state) = carry, part_sums(*indexed)
        states = jax.tree.map(lambda s, n: s + n if jnp.issubdtype(n.dtype, jnp.floating) else n, states, new_state)
        return (jax.tree.map(jnp.add, sums, new_sums), states), None

    shapes = jax.eval_shape(part_sums, 0, jax.tree.map(lambda x: x[0], parts))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (sums, states), _ = jax.lax.scan(add, zeros, (jnp.arange(grad_accum), parts))
    if not hasattr(loss_fn, "micro_batch_sums"):
        sums = jax.tree.map(lambda x: x / grad_accum, sums)
    states = jax.tree.map(lambda x: x / grad_accum if jnp.issubdtype(x.dtype, jnp.floating) else x, states)
    return sums, states


def accumulated_value_and_grad(
    loss_fn: LossFn,
    model: eqx.Module,
    model_state: Any,
    batch: PyTree,
    key: PRNGKeyArray,
    *,
    grad_accum: int,
    axis_name: str | None = None,
) -> tuple[tuple[Any, tuple[dict, Any]], PyTree]:
    """`loss_value_and_grad`'s result for the global batch, of which `batch` is this device's equal slice
    along `axis_name` (all of it without), taken in `grad_accum` parts one after another
    (`GlobalBatch.value_and_grad`). A loss that sums and then finishes (DP-SGD) finishes once, on the
    global batch's sums."""
    check_micro_batch_loss(loss_fn)
    with batch_split_over(axis_name, batch_rows(batch)):
        sums, model_state = _accumulated_sums(loss_fn, model, model_state, batch, key, grad_accum)
    finish = getattr(loss_fn, "from_micro_batch_sums", None)
    if finish is not None:
        loss, metrics, grads = finish(sums if axis_name is None else jax.lax.psum(sums, axis_name), key)
    else:
        (loss, metrics), grads = sums
        if axis_name is not None:
            loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), axis_name)
    return (loss, (metrics, model_state)), grads


def _finish(loss_fn: LossFn, total: PyTree, micro_batches: int, key: PRNGKeyArray) -> tuple:
    own = getattr(loss_fn, "from_micro_batch_sums", None)
    if own is not None:
        return own(total, key)
    (loss, metrics), grads = jax.tree.map(lambda x: x / micro_batches, total)
    return loss, metrics, grads


def _mean_state(stacked: PyTree, micro_batches: int) -> PyTree:
    """The model state after the step: the fixed-order mean of the micro-batches' float leaves (running
    statistics); other leaves (counters) are the same in every micro-batch."""
    return jax.tree.map(
        lambda x: tree_sum(x) / micro_batches if jnp.issubdtype(x.dtype, jnp.floating) else x[0], stacked
    )


def micro_batch_value_and_grad(
    loss_fn: LossFn,
    model: eqx.Module,
    model_state: Any,
    batch: PyTree,
    key: PRNGKeyArray,
    *,
    micro_batches: int,
    axis_name: str | None = None,
    grad_accum: int = 1,
) -> tuple[tuple[Any, tuple[dict, Any]], PyTree]:
    """`loss_value_and_grad`'s result for the global batch, of which `batch` is this device's equal slice
    along `axis_name` (all of it without), as `micro_batches` micro-batches combined in a fixed order.

    `grad_accum` parts of each micro-batch are `grad_accum` times as many micro-batches: each device takes its
    micro-batches one after another already, and the layout-invariant sum of them all is the one place that
    combines (a scan of parts nested in the scan of micro-batches rounds differently in some programs)."""
    if grad_accum > 1:
        return micro_batch_value_and_grad(
            loss_fn, model, model_state, batch, key, micro_batches=micro_batches * grad_accum, axis_name=axis_name
        )
    check_micro_batch_loss(loss_fn)
    devices = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    local = micro_batches // devices
    rows = batch_rows(batch) // local
    first = 0 if axis_name is None else jax.lax.axis_index(axis_name) * local
    micro = jax.tree.map(lambda x: x.reshape(local, rows, *x.shape[1:]), batch)

    def one(_: None, indexed: tuple[Any, PyTree]) -> tuple[None, tuple]:
        index, micro_batch = indexed
        with rows_of_global_batch(micro_batches * rows, (first + index) * rows):
            return None, _sums(loss_fn, model, model_state, micro_batch, key)

    # JAX's custom-JVP softmax rule: its gradient has no divide by the broadcast sum, which XLA turns into a
    # multiply by the reciprocal in some programs and not others (the same bits on every layout need neither)
    with jax.softmax_custom_jvp(True):
        _, stacked = jax.lax.scan(one, None, (jnp.arange(local), micro))
    if axis_name is not None:
        stacked = jax.lax.all_gather(stacked, axis_name, tiled=True)
    sums, states = stacked
    loss, metrics, grads = _finish(loss_fn, tree_sum(sums), micro_batches, key)
    new_state = None if model_state is None else _mean_state(states, micro_batches)
    return (loss, (metrics, new_state)), grads
