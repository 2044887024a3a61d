"""Per-example losses, gradients, gradient norms and clipping.

Write the loss of ONE example; `eqx.filter_vmap` over `eqx.filter_value_and_grad` gives every
example's gradient at once, with the model shared (not mapped) and the examples mapped. Each
example gets the key `jax.random.split(key, batch)[i]`, the same key `research.train.forward` gives
it, so the mean of the per-example gradients is exactly the gradient of the mean loss, dropout
included.

`chunk_size` bounds memory for large batches: the batch is processed `chunk_size` examples at a
time (`jax.lax.map` over micro-batches, or a `jax.lax.scan` accumulating the clipped sum), with the
same result as the direct computation up to float rounding.

`method` picks how norms and clipped sums are taken: `"vmap"` materialises every example's gradient
(memory batch x parameters); `"ghost"` takes the norms from each layer's inputs and output gradients
and then the clipped sum, in one backward pass with no per-example gradient (`_ghost.py`; for
models built from `eqx.nn.Linear` and `conv1d_as_matmul` convolutions); `"auto"` is ghost where it
covers the model, else vmap. Both give the same numbers up to float rounding.
"""

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ..data import Batch
from ..train import classification_metrics, example_keys
from ..typing import Array, Float, Int, PRNGKeyArray, PyTree, Shaped, typecheck
from ._ghost import GhostPlan, ghost_clipped_sum, ghost_norm_of_one, ghost_plan

# Metrics of one example (scalars) or of a batch of examples (one value per example).
ExampleMetrics = dict[str, Float[Array, ""]]
BatchMetrics = dict[str, Float[Array, " batch"]]
# loss_fn(model, model_state, inputs, label, key) -> (loss, metrics) for ONE example.
ExampleLossFn = Callable[
    [eqx.Module, eqx.nn.State | None, Array, Array, PRNGKeyArray | None], tuple[Float[Array, ""], ExampleMetrics]
]
# How per-example norms are taken: see the module docstring.
ClippingMethod = Literal["auto", "ghost", "vmap"]
CLIPPING_METHODS = ("auto", "ghost", "vmap")


@typecheck
def classification_example_loss(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    inputs: Shaped[Array, "..."],
    label: Int[Array, ""],
    key: PRNGKeyArray | None,
) -> tuple[Float[Array, ""], ExampleMetrics]:
    """Cross-entropy of a classifier on one example (the per-example term of
    `research.train.classification_loss`); metrics are its `loss` and `accuracy` (0 or 1)."""
    # (A concrete eqx.Module has a __call__; the base class, which pyright reads, does not declare one.)
    if model_state is None:
        logits = model(inputs, key=key)  # pyright: ignore[reportCallIssue]
    else:
        logits, _ = model(inputs, model_state, key=key)  # pyright: ignore[reportCallIssue]
    losses, correct = classification_metrics(logits[None], label[None])
    return losses[0], {"loss": losses[0], "accuracy": correct[0].astype(jnp.float32)}


def _uses_batch_statistics(module: object) -> bool:
    # eqx.nn.BatchNorm, or any layer shaped like it (reduces over a named vmap axis unless in inference).
    is_batch_norm = isinstance(module, eqx.nn.BatchNorm) or (
        isinstance(module, eqx.Module) and hasattr(module, "axis_name") and hasattr(module, "inference")
    )
    return is_batch_norm and not getattr(module, "inference")  # noqa: B009 (`module` is typed `object`)


def check_per_example_model(model: eqx.Module) -> None:
    """Refuse a model that normalises with batch statistics (BatchNorm in training mode).

    With batch statistics each example's output depends on the whole batch, so a per-example
    gradient is not defined (and DP-SGD's per-example sensitivity bound would not hold).
    """
    modules = jax.tree.leaves(model, is_leaf=_uses_batch_statistics)
    offending = [type(m).__name__ for m in modules if _uses_batch_statistics(m)]
    if offending:
        raise ValueError(
            f"per-example gradients are not defined for a model that normalises with batch statistics "
            f"(found {offending[0]} in training mode): each example's output depends on the rest of the batch. "
            "Use `eqx.nn.inference_mode(model)` (BatchNorm then uses its running statistics), or a model "
            "without BatchNorm (GroupNorm/LayerNorm)."
        )


def _example_keys(key: PRNGKeyArray | None, batch_size: int) -> Array | None:
    # Inside a train step split over devices, this device's share of the global batch's keys.
    return None if key is None else example_keys(key, batch_size)


def _examples(batch: Batch, key: PRNGKeyArray | None) -> tuple[int, tuple[Array, Array, Array | None]]:
    """`(batch size, (inputs, labels, one key per example or None))`, the shapes checked."""
    batch_size = _check_batch(batch.inputs, batch.labels)
    return batch_size, (batch.inputs, batch.labels, _example_keys(key, batch_size))


def _value_and_grad_of_one(loss_fn: ExampleLossFn, model: eqx.Module, model_state: eqx.nn.State | None):
    def one(example: tuple[Array, Array, PRNGKeyArray | None]) -> tuple[PyTree, ExampleMetrics]:
        inputs, label, key = example
        value_and_grad = eqx.filter_value_and_grad(loss_fn, has_aux=True)
        (loss, metrics), grads = value_and_grad(model, model_state, inputs, label, key)
        return grads, {**metrics, "loss": loss}

    return one


def _map_examples(fn, examples, chunk_size: int | None):
    """`fn` over the leading axis of `examples`: one vmap, or vmaps of `chunk_size` inside a lax.map."""
    if chunk_size is None:
        return eqx.filter_vmap(fn, axis_name="batch")(examples)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of examples or None, got {chunk_size}")
    return jax.lax.map(fn, examples, batch_size=chunk_size)


@typecheck
def _check_batch(inputs: Shaped[Array, " batch *example"], labels: Shaped[Array, " batch"]) -> int:
    return inputs.shape[0]


def _first_example(examples: tuple) -> tuple:
    return jax.tree.map(lambda x: x[0], examples)


def _ghost_plan_for(
    method: str, model: eqx.Module, model_state: eqx.nn.State | None, loss_fn: ExampleLossFn, examples: tuple
) -> GhostPlan | None:
    """The ghost plan to use, or None for the vmap path; `method="ghost"` on a model it does not cover raises."""
    if method not in CLIPPING_METHODS:
        raise ValueError(f"method must be one of {', '.join(CLIPPING_METHODS)}, got {method!r}")
    if method == "vmap":
        return None
    plan = ghost_plan(model, model_state, loss_fn, _first_example(examples))
    if isinstance(plan, str):
        if method == "ghost":
            raise ValueError(
                f"method='ghost' cannot take this model's per-example gradient norms: {plan}. "
                "Use method='vmap' (or 'auto', which falls back to it)."
            )
        return None
    return plan


@typecheck
def ghost_problem(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    batch: Batch,
    key: PRNGKeyArray | None = None,
    *,
    loss_fn: ExampleLossFn = classification_example_loss,
) -> str | None:
    """Why ghost clipping cannot take this model's per-example norms (None: it can, and
    `method="auto"` uses it). Traces the model on the batch's first example; runs nothing."""
    _, examples = _examples(batch, key)
    plan = ghost_plan(model, model_state, loss_fn, _first_example(examples))
    return plan if isinstance(plan, str) else None


@typecheck
def per_example_grads(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    batch: Batch,
    key: PRNGKeyArray | None = None,
    *,
    loss_fn: ExampleLossFn = classification_example_loss,
    chunk_size: int | None = None,
) -> tuple[PyTree, BatchMetrics]:
    """Every example's gradient of `loss_fn` with respect to the model's floating-point arrays.

    **Arguments:**

    - `model`, `model_state`: the model (shared by all examples) and its state (`None` if stateless).
      A model with BatchNorm must be in inference mode.
    - `batch`: `Batch(inputs, labels)` with the examples along the first axis.
    - `key`: split into one key per example (as `research.train.forward` does), or `None`.
    - `loss_fn`: the loss of one example, `(model, model_state, inputs, label, key) -> (loss, metrics)`.
    - `chunk_size`: process this many examples at a time (bounds activation memory); `None`: all at once.

    **Returns:** `(grads, metrics)`: `grads` has the model's structure (`None` where a leaf is not a
    float array) with a leading batch axis on every array; `metrics` maps names (including `loss`)
    to one value per example.
    """
    check_per_example_model(model)
    _, examples = _examples(batch, key)
    return _map_examples(_value_and_grad_of_one(loss_fn, model, model_state), examples, chunk_size)


@typecheck
def per_example_losses(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    batch: Batch,
    key: PRNGKeyArray | None = None,
    *,
    loss_fn: ExampleLossFn = classification_example_loss,
    chunk_size: int | None = None,
) -> Float[Array, " batch"]:
    """Every example's loss (arguments as in `per_example_grads`), without gradients."""
    check_per_example_model(model)
    _, examples = _examples(batch, key)

    def one(example):
        inputs, label, example_key = example
        return loss_fn(model, model_state, inputs, label, example_key)[0]

    return _map_examples(one, examples, chunk_size)


@typecheck
def per_example_grad_norms(grads: PyTree) -> Float[Array, " batch"]:
    """The global L2 norm of each example's gradient (over all leaves), from stacked gradients."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        raise ValueError("per_example_grad_norms: the gradient tree has no arrays (does the model have parameters?)")
    squares = [jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1) for g in leaves]
    return jnp.sqrt(sum(squares[1:], squares[0]))


@typecheck
def per_example_norms(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    batch: Batch,
    key: PRNGKeyArray | None = None,
    *,
    loss_fn: ExampleLossFn = classification_example_loss,
    chunk_size: int | None = None,
    method: ClippingMethod = "auto",
) -> tuple[Float[Array, " batch"], BatchMetrics]:
    """Every example's gradient norm (over all parameters) and metrics, arguments as in
    `per_example_grads`; with `method="ghost"` (or `"auto"` on a covered model) no per-example
    gradient is formed."""
    check_per_example_model(model)
    _, examples = _examples(batch, key)
    plan = _ghost_plan_for(method, model, model_state, loss_fn, examples)
    if plan is not None:
        return _map_examples(ghost_norm_of_one(plan, loss_fn, model, model_state), examples, chunk_size)
    one = _value_and_grad_of_one(loss_fn, model, model_state)

    def norm_of_one(example):
        grads, metrics = one(example)
        return per_example_grad_norms(jax.tree.map(lambda g: g[None], grads))[0], metrics

    return _map_examples(norm_of_one, examples, chunk_size)


def _clip_factors(norms: Float[Array, " batch"], clip_norm: float | int | Float[Array, ""]) -> Float[Array, " batch"]:
    # min(1, C / norm), written so that a zero gradient gets factor 1 and no division by zero.
    return clip_norm / jnp.maximum(norms, clip_norm)


def _scale_examples(grads: PyTree, factors: Float[Array, " batch"]) -> PyTree:
    return jax.tree.map(lambda g: g * factors.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype), grads)


@typecheck
def clip_per_example(grads: PyTree, clip_norm: float | int | Float[Array, ""]) -> tuple[PyTree, Float[Array, " batch"]]:
    """Scale each example's gradient by `min(1, clip_norm / norm)` so its global norm is at most
    `clip_norm` (up to float rounding); gradients already inside the ball are unchanged.

    **Returns:** `(clipped, norms)`, with `norms` the norms *before* clipping.
    """
    norms = per_example_grad_norms(grads)
    return _scale_examples(grads, _clip_factors(norms, clip_norm)), norms


def _weighted_sum(grads: PyTree, weights: Float[Array, " batch"]) -> PyTree:
    return jax.tree.map(lambda g: jnp.tensordot(weights.astype(g.dtype), g, axes=1), grads)


@typecheck
def clipped_gradient_sum(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    batch: Batch,
    key: PRNGKeyArray | None,
    *,
    clip_norm: float | int,
    weights: Float[Array, " batch"] | None = None,
    loss_fn: ExampleLossFn = classification_example_loss,
    chunk_size: int | None = None,
    method: ClippingMethod = "auto",
) -> tuple[PyTree, Float[Array, " batch"], BatchMetrics]:
    """`sum_i weights_i * clip(grad_i, clip_norm)`, the aggregate DP-SGD adds noise to.

    With `chunk_size` the sum is accumulated `chunk_size` examples at a time in a `jax.lax.scan`, so
    memory holds one chunk of per-example gradients rather than the whole batch's; chunks whose
    weights are all zero (padding) are skipped. `weights` defaults to ones (0/1 masks padding).
    `method`: `"vmap"` (per-example gradients), `"ghost"` (norms from layer inputs and output
    gradients, one backward pass; no per-example gradients), `"auto"` (ghost where covered).

    **Returns:** `(summed, norms, metrics)`: the model-shaped sum, each example's gradient norm
    before clipping, and each example's metrics.
    """
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive, got {clip_norm}")
    check_per_example_model(model)
    batch_size, examples = _examples(batch, key)
    weights = jnp.ones(batch_size, jnp.float32) if weights is None else weights
    one = _value_and_grad_of_one(loss_fn, model, model_state)
    plan = _ghost_plan_for(method, model, model_state, loss_fn, examples)

    def chunk_sum(chunk, chunk_weights):
        if plan is not None:  # no per-example gradients: norms, then the gradient of the clipped, weighted loss
            return ghost_clipped_sum(
                plan, loss_fn, model, model_state, chunk, lambda norms: chunk_weights * _clip_factors(norms, clip_norm)
            )
        grads, metrics = eqx.filter_vmap(one, axis_name="batch")(chunk)
        clipped, norms = clip_per_example(grads, clip_norm)
        return _weighted_sum(clipped, chunk_weights), norms, metrics

    if chunk_size is None or chunk_size >= batch_size:
        return chunk_sum(examples, weights)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of examples or None, got {chunk_size}")

    # Pad to whole chunks with zero-weight copies of example 0, then scan over the chunks.
    num_chunks = -(-batch_size // chunk_size)
    index = jnp.arange(num_chunks * chunk_size)
    padded_weights = jnp.where(index < batch_size, jnp.pad(weights, (0, num_chunks * chunk_size - batch_size)), 0.0)
    rows = jnp.where(index < batch_size, index, 0)
    chunked = jax.tree.map(lambda x: x[rows].reshape(num_chunks, chunk_size, *x.shape[1:]), examples)
    chunk_weights = padded_weights.reshape(num_chunks, chunk_size)
    summed_like, norms_like, metrics_like = jax.eval_shape(
        chunk_sum, jax.tree.map(lambda x: x[0], chunked), chunk_weights[0]
    )
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731

    def body(total, chunk_and_weights):
        chunk, w = chunk_and_weights
        nothing = lambda *_: (zeros(summed_like), zeros(norms_like), zeros(metrics_like))  # noqa: E731
        summed, norms, metrics = jax.lax.cond(jnp.any(w != 0), chunk_sum, nothing, chunk, w)
        return jax.tree.map(jnp.add, total, summed), (norms, metrics)

    summed, (norms, metrics) = jax.lax.scan(body, zeros(summed_like), (chunked, chunk_weights))
    unchunk = lambda x: x.reshape(num_chunks * chunk_size, *x.shape[2:])[:batch_size]  # noqa: E731
    return summed, unchunk(norms), jax.tree.map(unchunk, metrics)
