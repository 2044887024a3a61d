"""A loss over the whole global batch, whose term for one example depends on every other example of it (a
contrastive loss: SimCLR's NT-Xent), and how its gradient is taken on any placement.

Every other reduction of the engine assumes a mean of per-example terms: the mean of the devices' means
(`jax.pmap`), of the micro-batches' (`--deterministic-reduction`), of the parts' (`--grad-accum`). A batch
loss is no such mean: computed on each device's slice, or each micro-batch, it would be another function
(fewer negatives, each device its own), which changes meaning silently with the device count. So a batch loss
declares two halves, and `GlobalBatch.value_and_grad` takes its gradient in three phases
(`batch_loss_value_and_grad`), the "gathered embeddings" of GradCache (Gao et al. 2021):

1. every device embeds its rows through the model (`embed`; each micro-batch or part on its own, in a
   `jax.lax.scan`), and the embeddings of the global batch are gathered on every device;
2. the loss and its gradient with respect to the embeddings are computed there, of the whole global batch
   (`loss`: no model in it, cheap next to the model);
3. every device pulls its rows' share of that gradient back through the model (a VJP, again a micro-batch or
   a part at a time: the activation memory of one), and the parameter gradients add up over the devices
   (`lax.psum`), or, under micro-batches, are gathered and added in one fixed order (`tree_sum`), so that the
   bits are the same on 1, 2, 4 or 8 devices.

The sum in phase 3 is exact calculus, not an approximation: the loss is `L(z_1, ..., z_B)` and its
gradient is the sum over rows of `dL/dz_i dz_i/dtheta`. What the placement splits is only who computes
which rows' terms. Rows depend on each other through the model only by batch statistics (BatchNorm), which
see what they see under any mean loss: the device's slice joined over the device axis (`jax.pmap`), or each
micro-batch on its own ("ghost" batch norm, under `--deterministic-reduction`).
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..typing import Array, Float, PRNGKeyArray, PyTree, RowKeys, typecheck
from ._micro import _mean_state, tree_sum
from ._rows import (
    Metrics,
    batch_rows,
    batch_split_over,
    loss_keys,
    one_key_a_row,
    rows_in_global_batch,
    rows_of_global_batch,
)


class AbstractBatchLoss(eqx.Module):
    """A loss of the whole global batch, in two halves (pass it wherever a `LossFn` goes: `SupervisedStep`,
    `GlobalBatch.value_and_grad`; its gradient is then taken as the module docstring says).

    **Methods to define:**

    - `embed(model, model_state, batch, keys) -> (embeddings, new model state)`: the model on the rows of
      `batch` (a pytree whose leaves have a leading row axis): one embedding a row (any pytree of arrays with
      a leading row axis). `keys` holds one key a row, its key in the global batch, so per-row randomness
      does not depend on the split (or the batch's one key, as for any loss declaring `takes_batch_key`).
    - `loss(embeddings) -> (loss, metrics)`: the loss of the global batch's embeddings and its float32
      scalar metrics (no model: everything that depends on parameters is in `embed`).

    Calling it, `loss_fn(model, model_state, batch, keys)`, is the loss of `batch` taken whole, as a `LossFn`.
    """

    @abc.abstractmethod
    def embed(
        self, model: Any, model_state: Any, batch: PyTree, keys: RowKeys | PRNGKeyArray
    ) -> tuple[PyTree, Any]: ...

    @abc.abstractmethod
    def loss(self, embeddings: PyTree) -> tuple[Float[Array, ""], Metrics]: ...

    def __call__(
        self, model: Any, model_state: Any, batch: PyTree, keys: RowKeys | PRNGKeyArray
    ) -> tuple[Float[Array, ""], tuple[Metrics, Any]]:
        embeddings, model_state = self.embed(model, model_state, batch, keys)
        loss, metrics = self.loss(embeddings)
        return loss, (metrics, model_state)


@typecheck
def nt_xent(embeddings: Float[Array, "batch views dim"], temperature: float) -> tuple[Float[Array, ""], Metrics]:
    """SimCLR's NT-Xent (Chen et al. 2020) over `views` views of each example: the embeddings normalised to
    unit length, each view's cosine similarity to every other view of the batch over `temperature` as logits,
    and the loss the mean over views of minus the log-softmax of the view's positives (the other views of its
    example; with 2 views, its pair) against all the others. Metrics: `loss`, and `pair_accuracy`, the
    fraction of views whose most similar other view is a positive.

    Written to round the same way in every program XLA compiles it into (`research.train._micro`): a multiply
    by `rsqrt` rather than a divide by the norm, multiplies by Python constants rather than divides."""
    examples, views, dim = embeddings.shape
    if views < 2:
        raise ValueError(f"nt_xent compares views of the same example: it needs at least 2 a row, got {views}")
    z = embeddings.reshape(examples * views, dim)
    z = z * jax.lax.rsqrt(jnp.maximum(jnp.sum(z * z, axis=1, keepdims=True), 1e-12))
    logits = (z @ z.T) * (1.0 / temperature)
    example = jnp.arange(examples * views) // views
    self_pair = jnp.eye(examples * views, dtype=bool)
    positive = (example[:, None] == example[None, :]) & ~self_pair
    log_probs = jax.nn.log_softmax(jnp.where(self_pair, -jnp.inf, logits), axis=1)
    per_view = jnp.sum(jnp.where(positive, log_probs, 0.0), axis=1) * (1.0 / (views - 1))
    loss = -jnp.sum(per_view) * (1.0 / (examples * views))
    nearest = jnp.argmax(jnp.where(self_pair, -jnp.inf, logits), axis=1)
    hits = jnp.take_along_axis(positive, nearest[:, None], axis=1)[:, 0]
    return loss, {"loss": loss, "pair_accuracy": jnp.sum(hits.astype(jnp.float32)) * (1.0 / (examples * views))}


# -- the gradient ---------------------------------------------------------------------------------------


class _Parts(eqx.Module):
    """How this device's rows are taken `count` at a time: `contiguous` blocks (micro-batches, each in its
    place of the global batch) or strided parts (`--grad-accum`: part `k` holds rows `k, k + count, ...`,
    which keeps the rows where a sharded batch has them), and where each part's rows sit in the global batch."""

    count: int = eqx.field(static=True)
    contiguous: bool = eqx.field(static=True)
    total: Any  # where this device's rows sit, as `rows_in_global_batch` gives them: the global rows,
    first: Any  # the first of this device's (traced under a device axis),
    stride: Any  # and the step between two of them

    def split(self, tree: PyTree) -> PyTree:
        """`[rows, ...]` -> `[count, rows / count, ...]`."""

        def one(x: Array) -> Array:
            if self.contiguous:
                return x.reshape(self.count, -1, *x.shape[1:])
            return jnp.swapaxes(x.reshape(-1, self.count, *x.shape[1:]), 0, 1)

        return jax.tree.map(one, tree)

    def merge(self, tree: PyTree) -> PyTree:
        """The inverse of `split`."""

        def one(x: Array) -> Array:
            if self.contiguous:
                return x.reshape(-1, *x.shape[2:])
            return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

        return jax.tree.map(one, tree)

    def rows_of(self, index: Array, rows: int) -> Any:
        """The context in which part `index` (of `rows` rows) gives each row its key in the global batch."""
        if self.contiguous:
            return rows_of_global_batch(self.total, self.first + index * rows * self.stride, self.stride)
        return rows_of_global_batch(self.total, self.first + index * self.stride, self.stride * self.count)


def _parts(rows: int, count: int, contiguous: bool) -> _Parts:
    if rows % count:
        what = "--micro-batches" if contiguous else "--grad-accum"
        raise ConfigError(f"{what}: {count} parts do not divide the {rows} rows of the batch they split")
    return _Parts(count, contiguous, *rows_in_global_batch(rows))


def _scan_parts(fn: Callable, parts: _Parts, *trees: PyTree) -> PyTree:
    """`fn(*part_trees)` of every part, one after another (`jax.lax.scan`: the same program whatever the
    count), stacked along a leading part axis; each part's rows keep their keys in the global batch."""
    split = [parts.split(t) for t in trees]
    rows = jax.tree.leaves(split[0])[0].shape[1]

    def one(_: None, indexed: tuple) -> tuple[None, PyTree]:
        index, *part = indexed
        with parts.rows_of(index, rows):
            return None, fn(*part)

    return jax.lax.scan(one, None, (jnp.arange(parts.count), *split))[1]


def batch_loss_value_and_grad(
    loss_fn: AbstractBatchLoss,
    model: eqx.Module,
    model_state: Any,
    batch: PyTree,
    key: PRNGKeyArray,
    *,
    axis_name: str | None = None,
    micro_batches: int | None = None,
    grad_accum: int = 1,
) -> tuple[tuple[Float[Array, ""], tuple[Metrics, Any]], PyTree]:
    """`eqx.filter_value_and_grad(loss_fn, has_aux=True)` of the GLOBAL batch, of which `batch` is this
    device's equal slice along `axis_name` (all of it without), in the three phases of the module docstring.

    `micro_batches`: the global batch is that many micro-batches (times `grad_accum`), embedded and pulled
    back one at a time, their gradients added in one fixed order: the same bits on any layout.
    `grad_accum`: without micro-batches, this device's rows in that many strided parts, one at a time."""
    rows = batch_rows(batch)
    with batch_split_over(axis_name, rows):
        if micro_batches is not None:
            devices = 1 if axis_name is None else jax.lax.axis_size(axis_name)
            parts = _parts(rows, micro_batches * grad_accum // devices, contiguous=True)
        elif grad_accum > 1:
            parts = _parts(rows, grad_accum, contiguous=False)
        else:
            return _whole(loss_fn, model, model_state, batch, key, axis_name)
        embed = lambda m, b: _embed(loss_fn, m, model_state, b, key)  # noqa: E731
        embeddings, states = _scan_parts(lambda b: embed(model, b), parts, batch)
        (loss, metrics), cotangent = _loss_and_cotangent(loss_fn, parts.merge(embeddings), axis_name)
        pull_back = lambda b, c: eqx.filter_vjp(lambda m: embed(m, b), model, has_aux=True)[1](c)[0]  # noqa: E731
        grads = _scan_parts(pull_back, parts, batch, cotangent)
    if micro_batches is not None:  # every micro-batch's gradient and state, added in one fixed order
        if axis_name is not None:
            grads, states = jax.lax.all_gather((grads, states), axis_name, tiled=True)
        grads, count = tree_sum(grads), micro_batches * grad_accum
    else:
        grads, count = jax.tree.map(lambda g: jnp.sum(g, axis=0), grads), grad_accum
        if axis_name is not None:
            grads = jax.lax.psum(grads, axis_name)
    new_state = None if model_state is None else _mean_state(states, count)
    return (loss, (metrics, new_state)), grads


def _whole(
    loss_fn: AbstractBatchLoss, model: Any, model_state: Any, batch: PyTree, key: PRNGKeyArray, axis_name: str | None
) -> tuple[tuple[Any, tuple[Metrics, Any]], PyTree]:
    """The three phases on this device's rows at once: one forward pass, its VJP kept for phase 3."""
    embeddings, pull_back, model_state = eqx.filter_vjp(
        lambda m: _embed(loss_fn, m, model_state, batch, key), model, has_aux=True
    )
    (loss, metrics), cotangent = _loss_and_cotangent(loss_fn, embeddings, axis_name)
    (grads,) = pull_back(cotangent)
    if axis_name is not None:
        grads = jax.lax.psum(grads, axis_name)
    return (loss, (metrics, model_state)), grads


def _embed(loss_fn: AbstractBatchLoss, model: Any, model_state: Any, batch: PyTree, key: PRNGKeyArray) -> tuple:
    """`loss_fn.embed` of `batch` with its rows' keys (`loss_keys`)."""
    keys = loss_keys(loss_fn, key, batch_rows(batch))
    with one_key_a_row(loss_fn):
        return loss_fn.embed(model, model_state, batch, keys)


def _loss_and_cotangent(
    loss_fn: AbstractBatchLoss, embeddings: PyTree, axis_name: str | None
) -> tuple[tuple[Any, Metrics], PyTree]:
    """Phase 2: the loss of the global batch's embeddings (gathered from every device along `axis_name`),
    and its gradient with respect to this device's rows of them."""
    rows = batch_rows(embeddings)
    gathered = embeddings if axis_name is None else jax.lax.all_gather(embeddings, axis_name, tiled=True)
    # JAX's custom-JVP softmax: no divide by a broadcast sum in its gradient, which XLA rounds otherwise in
    # some programs (research.train._micro)
    with jax.softmax_custom_jvp(True):
        (loss, metrics), cotangent = jax.value_and_grad(loss_fn.loss, has_aux=True)(gathered)
    if axis_name is None:
        return (loss, metrics), cotangent
    first = jax.lax.axis_index(axis_name) * rows
    return (loss, metrics), jax.tree.map(lambda c: jax.lax.dynamic_slice_in_dim(c, first, rows), cotangent)
