import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Key

from ..data import Batch
from ..state import EMA
from ..typing import Array, Bool, Float, Int, Integer, KeyData, PRNGKeyArray, PyTree, typecheck
from ._keys import split_key_data

Metrics = dict[str, Float[Array, ""]]
# loss_fn(model, model_state, batch, key) -> (loss, (metrics, new_model_state)): a mean over its batch.
# A loss object may also define `value_and_grad(model, model_state, batch, key, *, axis_name)` with the
# output of `eqx.filter_value_and_grad(loss_fn, has_aux=True)`; it then owns how its gradient combines
# across the devices of `axis_name` (see `loss_value_and_grad`).
LossFn = Callable[[eqx.Module, Any, Batch, PRNGKeyArray], tuple[Float[Array, ""], tuple[Metrics, Any]]]


class TrainState(eqx.Module):
    """Everything that changes during training, and nothing else: the single source of truth for resume.

    **Fields:**

    - `step`: number of optimizer steps taken.
    - `model`: the `eqx.Module` being trained.
    - `model_state`: its `eqx.nn.State` (BatchNorm statistics, ...), or `None` for stateless models.
    - `opt_state`: the Optax optimizer state.
    - `key`: raw PRNG key data (`jax.random.key_data`), split once per step.
    - `optimizer`: the Optax `GradientTransformation` (static: not a leaf).
    - `ema`: `None`, or an `EMA` of `(model, model_state)` updated after every step (Polyak
      averaging; BatchNorm statistics are averaged along with the weights). `None` adds no leaves,
      so a state without EMA has exactly the leaves it had before this field existed.
    """

    step: Int[Array, ""]
    model: eqx.Module
    model_state: eqx.nn.State | None
    opt_state: PyTree
    key: KeyData
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    ema: EMA | None = None

    @classmethod
    def create(
        cls,
        model: eqx.Module,
        optimizer: optax.GradientTransformation,
        *,
        key: PRNGKeyArray,
        model_state: eqx.nn.State | None = None,
        ema_decay: float = 0.0,
    ) -> "TrainState":
        """A fresh state at step 0; the optimizer is initialised on the model's floating-point arrays.
        `ema_decay > 0` also keeps a debiased EMA of the model (see `with_ema`)."""
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        state = cls(
            step=jnp.zeros((), jnp.int32),
            model=model,
            model_state=_strong(model_state),
            opt_state=optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
            key=jnp.asarray(key, jnp.uint32),
            optimizer=optimizer,
        )
        return state.with_ema(ema_decay) if ema_decay else state

    def with_ema(self, decay: float, *, debias: bool = True) -> "TrainState":
        """This state with an EMA of `(model, model_state)` starting here (`decay` in [0, 1)).

        Debiased (the default), the average after `n` more steps is a weighted mean of those `n`
        models only, so it does not matter where it starts.
        """
        return dataclasses.replace(self, ema=EMA.init((self.model, self.model_state), decay, debias=debias))

    def averaged_model(self) -> tuple[eqx.Module, eqx.nn.State | None]:
        """`(model, model_state)` of the EMA; what evaluation uses when the EMA is on."""
        if self.ema is None:
            raise ValueError("this TrainState keeps no EMA of the model; build it with ema_decay > 0 or with_ema(...)")
        return self.ema.average


def _strong(tree: PyTree) -> PyTree:
    """`tree` with weakly typed arrays made strong (same values and dtypes). Equinox creates some
    state leaves (BatchNorm's counter) weakly typed, but a checkpoint restores them strong: without
    this, a resumed run would compile its step again."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype) if eqx.is_array(x) and x.weak_type else x, tree)


# Where the batch a loss sees sits in the global batch, `(global rows, first row)`, set while tracing
# a step whose batch is one device's slice (`jax.pmap`) or one micro-batch (`--deterministic-reduction`).
# `forward` then gives every example the key it would get in the whole batch, so dropout masks do not
# depend on the device count or on the micro-batches.
_rows_in_batch: contextvars.ContextVar[tuple[int, Any] | None] = contextvars.ContextVar("rows_in_batch", default=None)


@contextlib.contextmanager
def rows_of_global_batch(total: int, first: Any) -> Iterator[None]:
    """Inside it, a batch is rows `first, first + 1, ...` (a traced index may do) of a global batch of
    `total` rows: `example_keys` gives each example its key in the global batch."""
    token = _rows_in_batch.set((total, first))
    try:
        yield
    finally:
        _rows_in_batch.reset(token)


@contextlib.contextmanager
def _batch_split_over(axis_name: str | None, rows: int) -> Iterator[None]:
    if axis_name is None:
        yield
        return
    with rows_of_global_batch(rows * jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name) * rows):
        yield


def _example_keys(key: PRNGKeyArray, count: int) -> Key[Array, " {count}"]:
    rows = _rows_in_batch.get()
    if rows is None:
        return jax.random.split(key, count)
    # split(key, n)[i] does not depend on n (partitionable threefry), so this is the global batch's keys.
    total, first = rows
    return jax.lax.dynamic_slice_in_dim(jax.random.split(key, total), first, count)


@typecheck
def forward(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    inputs: Float[Array, " batch *example"] | Integer[Array, " batch *example"],
    *,
    key: PRNGKeyArray | None,
    axis_name: str = "batch",
) -> tuple[Float[Array, "batch ..."], eqx.nn.State | None]:
    """Apply a single-example model to a batch with `jax.vmap`; inputs are signals (floats), tokens (ints)
    or images (uint8).

    Each example gets its own key (dropout masks differ across the batch). A stateful model is called
    as `model(x, state, key=...)` with the state shared (not mapped) and batch statistics reduced
    over `axis_name`.
    """
    keys = None if key is None else _example_keys(key, inputs.shape[0])
    # (A concrete eqx.Module has a __call__; the base class, which pyright reads, does not declare one.)
    if model_state is None:
        outputs = jax.vmap(lambda x, k: model(x, key=k))(inputs, keys)  # pyright: ignore[reportCallIssue]
        return outputs, None
    # The state goes in as an argument (not closed over) so that the model works on a copy: an
    # `eqx.nn.State` invalidates itself once `set` is called on it, which would break the caller's.
    return jax.vmap(
        lambda x, k, s: model(x, s, key=k),  # pyright: ignore[reportCallIssue]
        in_axes=(0, 0, None),
        out_axes=(0, None),
        axis_name=axis_name,
    )(inputs, keys, model_state)


@typecheck
def classification_metrics(
    logits: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> tuple[Float[Array, " batch"], Bool[Array, " batch"]]:
    """Per-example cross-entropy and correctness.

    One logit means a binary classifier (sigmoid cross-entropy, predict 1 when the logit is > 0);
    more than one, a softmax over the classes.
    """
    if logits.shape[1] == 1:
        logit = logits[:, 0]
        losses = optax.sigmoid_binary_cross_entropy(logit, labels.astype(logit.dtype))
        correct = (logit > 0) == (labels == 1)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = jnp.argmax(logits, axis=1) == labels
    return losses, correct


def classification_loss(
    model: eqx.Module, model_state: eqx.nn.State | None, batch: Batch, key: PRNGKeyArray
) -> tuple[Float[Array, ""], tuple[Metrics, eqx.nn.State | None]]:
    """Mean cross-entropy of a classifier over a batch; aux is ({loss, accuracy}, new model state)."""
    logits, model_state = forward(model, model_state, batch.inputs, key=key)
    losses, correct = classification_metrics(logits, batch.labels)
    loss = jnp.mean(losses)
    return loss, ({"loss": loss, "accuracy": jnp.mean(correct.astype(jnp.float32))}, model_state)


def _split(key_data: KeyData) -> tuple[KeyData, PRNGKeyArray]:
    """`jax.random.split` of the state's key: (next state key data, this step's key)."""
    # (jax.config's options are attributes made at run time, which pyright cannot see.)
    impl = jax.config.jax_default_prng_impl  # pyright: ignore[reportAttributeAccessIssue]
    if key_data.shape == (2,) and impl == "threefry2x32":
        key, step_key = split_key_data(key_data)  # the same bits without XLA's CPU while loop
        return key, jax.random.wrap_key_data(step_key)
    key, step_key = jax.random.split(jax.random.wrap_key_data(key_data))
    return jax.random.key_data(key), step_key


def example_keys(key: PRNGKeyArray, count: int) -> Key[Array, " {count}"]:
    """One key per example of a batch of `count`: `jax.random.split(key, count)`, or, inside a train
    step whose batch is split over a device axis, this device's slice of the whole batch's keys (so
    per-example randomness does not depend on the device count)."""
    return _example_keys(key, count)


def loss_value_and_grad(
    loss_fn: LossFn,
    model: eqx.Module,
    model_state: Any,
    batch: Batch,
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
    with _batch_split_over(axis_name, batch_rows(batch)):
        own = getattr(loss_fn, "value_and_grad", None)
        if own is not None:
            return own(model, model_state, batch, key, axis_name=axis_name)
        (loss, (metrics, model_state)), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, model_state, batch, key
        )
    if axis_name is not None:
        loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), axis_name)
    return (loss, (metrics, model_state)), grads


def batch_rows(batch: Batch) -> int:
    """The rows of a batch (its leading axis)."""
    return jax.tree.leaves(batch)[0].shape[0]


def train_step(
    state: TrainState,
    batch: Batch,
    loss_fn: LossFn = classification_loss,
    *,
    axis_name: str | None = None,
    micro_batches: int | None = None,
) -> tuple[TrainState, Metrics]:
    """One optimizer step: a pure function `TrainState, Batch -> TrainState, Metrics`.

    The gradient is taken directly on the model object with `eqx.filter_value_and_grad` (or by the
    loss's own `value_and_grad`, when it has one, as DP-SGD's does); metrics gain `grad_norm`, the
    global norm of the gradient. The step's key is split from `state.key` (so no two steps share
    dropout masks) and the new model state (BatchNorm statistics) comes out of the loss. When
    `state.ema` is set, it is updated with the new `(model, model_state)`.

    `axis_name` names a device axis (`jax.pmap`) over which `batch` is split: the gradient and the
    metrics are combined over it as the loss says (`loss_value_and_grad`), and each example keeps the
    key it has in the whole batch. (BatchNorm layers must reduce over that axis too: build them with
    `axis_name=(device_axis, "batch")`.)

    `micro_batches`: the global batch is that many micro-batches whose gradients are summed in one
    fixed order, so the step's bits do not depend on the device count (`_micro.py`; BatchNorm layers
    then reduce over `"batch"` alone: each micro-batch is normalised on its own).
    """
    gradient, metrics = step_gradient(state, batch, loss_fn, axis_name=axis_name, micro_batches=micro_batches)
    return apply_gradient(state, gradient, metrics)


Gradient = tuple[PyTree, Any, KeyData]  # a step's (gradient, new model state, the state's next key)


def step_gradient(
    state: TrainState,
    batch: Batch,
    loss_fn: LossFn = classification_loss,
    *,
    axis_name: str | None = None,
    micro_batches: int | None = None,
) -> tuple[Gradient, Metrics]:
    """The first half of `train_step` (its arguments): the gradient, the new model state and key, and the
    loss's metrics; `apply_gradient` is the second."""
    key, step_key = _split(state.key)
    if micro_batches is None:
        (_, (metrics, model_state)), grads = loss_value_and_grad(
            loss_fn, state.model, state.model_state, batch, step_key, axis_name=axis_name
        )
    else:
        from ._micro import micro_batch_value_and_grad  # it builds on this module

        (_, (metrics, model_state)), grads = micro_batch_value_and_grad(
            loss_fn, state.model, state.model_state, batch, step_key, micro_batches=micro_batches, axis_name=axis_name
        )
    return (grads, model_state, key), metrics


def apply_gradient(state: TrainState, gradient: Gradient, metrics: Metrics) -> tuple[TrainState, Metrics]:
    """The second half of `train_step`: the optimizer's update, the EMA's, and the metrics with `grad_norm`."""
    grads, model_state, key = gradient
    params = eqx.filter(state.model, eqx.is_inexact_array)
    updates, opt_state = state.optimizer.update(grads, state.opt_state, params)
    model = eqx.apply_updates(state.model, updates)
    ema = None if state.ema is None else state.ema.update((model, model_state))[0]
    new_state = TrainState(
        step=state.step + 1,
        model=model,
        model_state=model_state,
        opt_state=opt_state,
        key=key,
        optimizer=state.optimizer,
        ema=ema,
    )
    return new_state, {**metrics, "grad_norm": optax.tree.norm(grads)}
