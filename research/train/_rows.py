"""Where the rows of the batch a step sees sit in the global batch (`rows_of_global_batch`, `example_keys`,
`across_global_batch`), the keys a loss gets (`loss_keys`: one a row, or the batch's one key where the loss asks
for it), and the gradient of a mean loss over the global batch, of which the step sees one device's slice
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

from ..errors import ConfigError
from ..typing import Array, Float, PRNGKeyArray, PyTree, RowKeys, UInt32

Metrics = dict[str, Float[Array, ""]]
# loss_fn(model, model_state, batch, keys) -> (loss, (metrics, new_model_state)): a mean over its batch, given
# one key per row of it (`keys[i]` is row i's key in the global batch, whatever the split), or, if it declares
# `takes_batch_key`, the step's one key (`loss_keys`).
# A loss object may also define `value_and_grad(model, model_state, batch, key, *, axis_name)` with the
# output of `eqx.filter_value_and_grad(loss_fn, has_aux=True)`; it then owns how its gradient combines
# across the devices of `axis_name` (see `loss_value_and_grad`) and gets the step's one key.
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


def example_keys(key: PRNGKeyArray, count: int) -> Key[Array, " {count}"] | UInt32[Array, "{count} _"]:
    """One key per example of a batch of `count`: `jax.random.split(key, count)`, or, inside a train
    step whose batch is part of a global batch (split over devices, micro-batches or accumulated parts),
    those examples' keys among the whole batch's (so per-example randomness does not depend on the
    split). What a loss gets as its `keys` (`loss_keys`)."""
    # split(key, n)[i] does not depend on n (partitionable threefry), so this is the global batch's keys.
    return across_global_batch(jax.random.split, key, count)


def across_global_batch(draw: Callable[[PRNGKeyArray, int], PyTree], key: PRNGKeyArray, count: int) -> PyTree:
    """`draw(key, rows)` (a pytree whose leaves have a leading axis of `rows`) for the GLOBAL batch, and of it
    the rows of the batch of `count` being traced: a draw coupled across the batch (stratified or
    low-discrepancy times, a permutation) that does not depend on how the batch is split. A loss that draws
    this way from its batch's key declares `takes_batch_key = True` and `layout_free = True`."""
    rows = _rows_in_batch.get()
    if rows is None:
        return draw(key, count)
    total, first, stride = rows
    whole = draw(key, total)
    if isinstance(stride, int) and stride == 1:
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, count), whole)
    return jax.tree.map(lambda x: x[first + stride * jnp.arange(count)], whole)


def are_row_keys(key: Any, rows: int) -> bool:
    """Whether `key` is one key for each of `rows` rows (`RowKeys`), not one key (raw key data has a trailing axis)."""
    raw = not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return jnp.ndim(key) == 1 + raw and jnp.shape(key)[0] == rows


def takes_batch_key(loss_fn: Any) -> bool:
    """Whether `loss_fn` asks for its batch's one key rather than one key per row (`takes_batch_key = True`)."""
    return bool(getattr(loss_fn, "takes_batch_key", False))


def layout_free(loss_fn: Any) -> bool:
    """Whether `loss_fn`, given its batch's one key, draws the same whatever the split (`layout_free = True`)."""
    return bool(getattr(loss_fn, "layout_free", False))


class AbstractLossWrapper(eqx.Module):
    """A loss made of another (`loss_fn`, a field), which asks for the keys the loss it wraps asks for."""

    loss_fn: eqx.AbstractVar[Any]

    @property
    def takes_batch_key(self) -> bool:
        return takes_batch_key(self.loss_fn)

    @property
    def layout_free(self) -> bool:
        return layout_free(self.loss_fn)


def loss_keys(loss_fn: Any, key: PRNGKeyArray, rows: int) -> RowKeys | PRNGKeyArray:
    """The keys `loss_fn` gets for a batch of `rows`: one a row (`example_keys`, each row's key in the global
    batch), or, for a loss that declares `takes_batch_key`, the step's key itself. Such a loss's draws depend
    on how the batch is split unless it declares `layout_free` (it splits the key with `example_keys` or
    draws with `across_global_batch`); one that does not is refused where its batch is part of the global one."""
    if not takes_batch_key(loss_fn):
        return example_keys(key, rows)
    if _rows_in_batch.get() is not None and not layout_free(loss_fn):
        raise ConfigError(
            f"the loss {_name(loss_fn)} draws from its batch's key (takes_batch_key) but sees part of the "
            "global batch here (a device's slice, a --deterministic-reduction micro-batch or a --grad-accum "
            "part), so its draws would change with the split: draw per row from its keys (drop "
            "takes_batch_key), or draw for the global batch with across_global_batch and set layout_free = True"
        )
    return key


@contextlib.contextmanager
def one_key_a_row(loss_fn: Any) -> Iterator[None]:
    """Inside it, `loss_fn` (given one key a row) drawing from its keys as from one key is told so in a line
    naming it, rather than JAX's "accepts a single key" from deep in its trace."""
    try:
        yield
    except ValueError as e:
        if "accepts a single key" not in str(e) or takes_batch_key(loss_fn):
            raise
        raise ConfigError(
            f"the loss {_name(loss_fn)} drew from its keys as from one key ({e}): a loss gets one key per row "
            "of its batch (`keys[i]`, vmap over them), or declares takes_batch_key = True for the batch's one key"
        ) from None


def _name(loss_fn: Any) -> str:
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


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
        keys = loss_keys(loss_fn, key, batch_rows(batch))
        with one_key_a_row(loss_fn):
            (loss, (metrics, model_state)), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
                model, model_state, batch, keys
            )
    if axis_name is not None:
        loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), axis_name)
    return (loss, (metrics, model_state)), grads
