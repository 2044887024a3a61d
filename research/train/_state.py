"""Supervised training as one `Step`: `TrainState` (one model, its optimizer state, an EMA) and
`SupervisedStep` (a loss over a batch, one optax optimizer), with the loss and forward pass of a classifier."""

import dataclasses
import inspect
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..data import Batch
from ..errors import ConfigError
from ..state import EMA
from ..typing import Array, Bool, Float, Int, Integer, KeyData, PRNGKeyArray, PyTree, RowKeys, typecheck
from ._global_batch import GlobalBatch
from ._networks import Network, apply_gradient
from ._precision import InPrecision, Precision
from ._rows import LossFn, Metrics, are_row_keys, example_keys
from ._step import AbstractTrainState, Step, take_step


class TrainState(AbstractTrainState):
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
        """A fresh state at step 0: the one network of an `AbstractNetworksState` (`Network.create`: the
        optimizer initialised on the model's floating-point arrays, every array strongly typed) in the flat
        fields every supervised run's checkpoints hold. `ema_decay > 0` also keeps a debiased EMA of the
        model (see `with_ema`)."""
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        network = Network.create(model, optimizer, model_state=model_state)
        state = cls(
            step=jnp.zeros((), jnp.int32),
            model=network.model,
            model_state=network.model_state,
            opt_state=network.opt_state,
            key=jnp.asarray(key, jnp.uint32),
            optimizer=optimizer,
        )
        return state.with_ema(ema_decay) if ema_decay else state

    def networks(self) -> dict[str, eqx.Module]:
        return {"model": self.model}


@typecheck
def forward(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    inputs: Float[Array, " batch *example"] | Integer[Array, " batch *example"],
    *,
    key: RowKeys | PRNGKeyArray | None,
    axis_name: str = "batch",
) -> tuple[Float[Array, "batch ..."], eqx.nn.State | None]:
    """Apply a single-example model to a batch with `jax.vmap`; inputs are signals (floats), tokens (ints)
    or images (uint8).

    Each example gets its own key (dropout masks differ across the batch) when the model's `__call__`
    takes a `key` (any Equinox model: one without is called as `model(x)`): `key` is one key a row (a loss's
    `keys`), or one key, split into the rows' (`example_keys`), or `None` (inference). A stateful model is
    called as `model(x, state[, key=...])` with the state shared (not mapped) and batch statistics reduced
    over `axis_name`.
    """
    takes_key = _takes_key(model)
    if key is None or not takes_key:
        keys = None
    else:
        keys = key if are_row_keys(key, inputs.shape[0]) else example_keys(key, inputs.shape[0])

    # (A concrete eqx.Module has a __call__; the base class, which pyright reads, does not declare one.)
    def call(x: Any, k: Any, *state: Any) -> Any:
        return model(x, *state, key=k) if takes_key else model(x, *state)  # pyright: ignore[reportCallIssue]

    if model_state is None:
        return jax.vmap(call)(inputs, keys), None
    # The state goes in as an argument (not closed over) so that the model works on a copy: an
    # `eqx.nn.State` invalidates itself once `set` is called on it, which would break the caller's.
    return jax.vmap(call, in_axes=(0, 0, None), out_axes=(0, None), axis_name=axis_name)(inputs, keys, model_state)


def _takes_key(model: Any) -> bool:
    """Whether `model(...)` takes a `key` keyword (a parameter named `key`, or `**kwargs`)."""
    try:
        parameters = inspect.signature(model).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the convention of this codebase
        return True
    return any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


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
    model: eqx.Module, model_state: eqx.nn.State | None, batch: Batch, keys: RowKeys | PRNGKeyArray
) -> tuple[Float[Array, ""], tuple[Metrics, eqx.nn.State | None]]:
    """Mean cross-entropy of a classifier over a batch (its rows' `keys`, or one key split into them, reach
    the model's dropout: `forward`); aux is ({loss, accuracy}, new model state)."""
    logits, model_state = forward(model, model_state, batch.inputs, key=keys)
    losses, correct = classification_metrics(logits, batch.labels)
    loss = jnp.mean(losses)
    return loss, ({"loss": loss, "accuracy": jnp.mean(correct.astype(jnp.float32))}, model_state)


class SupervisedStep(Step):
    """Supervised training, today's step: the gradient of `loss_fn` on the state's model for the global
    batch and one update of the state's optax optimizer (the engine moves the EMA); metrics are the loss's
    and `grad_norm`, the global norm of the gradient.

    **Fields:**

    - `loss_fn`: `(model, model_state, batch, keys) -> (loss, (metrics, new model state))`, a mean over
      its batch given one key a row (`classification_loss` by default; see `GlobalBatch.value_and_grad`), or a
      loss object with its own `value_and_grad` (DP-SGD's, which decides how its gradient combines across
      devices and micro-batches: `GlobalBatch`).
    - `grad_accum`: take the gradient in this many parts of the batch, one after another
      (`GlobalBatch.value_and_grad`): the whole batch's step with the activation memory of one part
      (`--grad-accum`).
    - `precision`: `"bf16"` computes the loss's forward and backward pass in bfloat16 with float32
      parameters (`InPrecision`, `--precision`).

    The state is a `TrainState`. The step has two halves, `gradient` and `apply`: a population under
    `--deterministic-reduction` takes its members' gradients vmapped and applies each member's update on
    its own (`CompiledTrainer`), which keeps its bits the same on every layout.
    """

    loss_fn: LossFn = dataclasses.field(default_factory=lambda: classification_loss)
    grad_accum: int = eqx.field(default=1, static=True)
    precision: Precision = eqx.field(default="float32", static=True)
    finite_metrics: ClassVar[tuple[str, ...]] = ("loss", "grad_norm")

    def __check_init__(self) -> None:
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be at least 1, got {self.grad_accum}")

        if self.precision != "float32":
            InPrecision(self.loss_fn, self.precision)  # refuses a loss that takes its gradients its own way

    def with_grad_accum(self, grad_accum: int) -> "SupervisedStep":
        return dataclasses.replace(self, grad_accum=grad_accum)

    def with_precision(self, precision: Precision) -> "SupervisedStep":
        return dataclasses.replace(self, precision=precision)

    def __call__(
        self, state: "TrainState", batch: PyTree, key: PRNGKeyArray, global_batch: GlobalBatch
    ) -> tuple["TrainState", Metrics]:
        gradient, metrics = self.gradient(state, batch, key, global_batch)
        return self.apply(state, gradient, metrics)

    def gradient(
        self, state: "TrainState", batch: PyTree, key: PRNGKeyArray, global_batch: GlobalBatch
    ) -> tuple[tuple[PyTree, Any], Metrics]:
        """The first half: `(the gradient, the new model state)` and the loss's metrics."""
        loss_fn = self.loss_fn if self.precision == "float32" else InPrecision(self.loss_fn, self.precision)
        (_, (metrics, model_state)), grads = global_batch.value_and_grad(
            loss_fn, state.model, state.model_state, batch, key, grad_accum=self.grad_accum
        )
        return (grads, model_state), metrics

    def apply(
        self, state: "TrainState", gradient: tuple[PyTree, Any], metrics: Metrics
    ) -> tuple["TrainState", Metrics]:
        """The second half: the optimizer's update, and the metrics with `grad_norm`."""
        grads, model_state = gradient
        model, opt_state = apply_gradient(state.optimizer, state.model, grads, state.opt_state)
        new_state = dataclasses.replace(state, model=model, model_state=model_state, opt_state=opt_state)
        return new_state, {**metrics, "grad_norm": optax.tree.norm(grads)}


def train_step(
    state: TrainState,
    batch: PyTree,
    loss_fn: LossFn = classification_loss,
    *,
    axis_name: str | None = None,
    micro_batches: int | None = None,
) -> tuple[TrainState, Metrics]:
    """One optimizer step: a pure function `TrainState, batch -> TrainState, Metrics` (the engine's
    `SupervisedStep(loss_fn)` taken once, for a loop of your own).

    The gradient is taken directly on the model object with `eqx.filter_value_and_grad` (or by the
    loss's own `value_and_grad`, when it has one, as DP-SGD's does); metrics gain `grad_norm`, the
    global norm of the gradient. The step's key is split from `state.key` (so no two steps share
    dropout masks) and the new model state (BatchNorm statistics) comes out of the loss. When
    `state.ema` is set, `take_step` moves it to the new `(model, model_state)`.

    `axis_name` names a device axis (`jax.pmap`) over which `batch` is split: the gradient and the
    metrics are combined over it as the loss says (`loss_value_and_grad`), and each example keeps the
    key it has in the whole batch. (BatchNorm layers must reduce over that axis too: build them with
    `axis_name=(device_axis, "batch")`.)

    `micro_batches`: the global batch is that many micro-batches whose gradients are summed in one
    fixed order, so the step's bits do not depend on the device count (`_micro.py`; BatchNorm layers
    then reduce over `"batch"` alone: each micro-batch is normalised on its own).
    """
    return take_step(SupervisedStep(loss_fn), state, batch, GlobalBatch(axis_name, micro_batches))
