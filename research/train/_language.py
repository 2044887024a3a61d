"""Next-token cross-entropy for a language model: a loss with gradient accumulation, and its evaluator."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data import Batch, DeviceLoader, HostLoader
from ..typing import Array, Float, Int, PRNGKeyArray, PyTree, typecheck
from ._evaluate import padded_batches
from ._global_batch import Metrics
from ._state import TrainState

LN2 = math.log(2.0)


@typecheck
def next_token_sums(
    model: eqx.Module, tokens: Int[Array, "batch tokens"], targets: Int[Array, "batch tokens"]
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Per-sequence mean cross-entropy (nats) and accuracy of the next-token predictions of `model`
    (ONE sequence in, `[tokens, vocab]` logits out), vmapped over the batch."""
    # A concrete eqx.Module has a __call__; the base class, which pyright reads, does not declare one.
    logits = jax.vmap(model)(tokens)  # pyright: ignore[reportArgumentType]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.mean(losses, axis=1), jnp.mean(correct, axis=1)


@dataclasses.dataclass(frozen=True)
class NextTokenLoss:
    """Mean next-token cross-entropy of a `LanguageModel`: pass it as `loss_fn`. The batch is
    `(tokens, next tokens)`, both `[batch, tokens]`; metrics are `loss`, `accuracy` and `bits_per_byte`
    (`loss / ln 2`: bits per token, which is per byte for a byte vocabulary).

    **Arguments:**

    - `grad_accum`: split each (device's) batch into this many micro-batches, run one after the other
      with `jax.lax.scan`, and average their gradients: the step of the whole batch (for any
      optimizer, Adam included) with the activation memory of one micro-batch.
    """

    grad_accum: int = 1
    mean_over_batch = True  # its value_and_grad is a mean over the batch (`--deterministic-reduction` combines so)

    def __post_init__(self) -> None:
        if self.grad_accum < 1:
            raise ValueError(f"NextTokenLoss: grad_accum must be >= 1, got {self.grad_accum}")

    def __call__(
        self, model: eqx.Module, model_state: None, batch: Batch, key: PRNGKeyArray
    ) -> tuple[Float[Array, ""], tuple[Metrics, None]]:
        losses, correct = next_token_sums(model, batch.inputs, batch.labels)
        loss = jnp.mean(losses)
        return loss, ({"loss": loss, "accuracy": jnp.mean(correct), "bits_per_byte": loss / LN2}, model_state)

    def value_and_grad(
        self, model: eqx.Module, model_state: None, batch: Batch, key: PRNGKeyArray, *, axis_name: str | None = None
    ) -> tuple[tuple[Float[Array, ""], tuple[Metrics, None]], PyTree]:
        """The loss and gradient of the whole batch as the mean over `grad_accum` equal micro-batches
        (the mean of means is the mean: every micro-batch has as many tokens); with `axis_name`, also
        the mean over the devices (each holds an equal slice of the global batch)."""
        grad_fn = eqx.filter_value_and_grad(self, has_aux=True)
        rows = batch.inputs.shape[0]
        if rows % self.grad_accum:
            raise ValueError(f"--grad-accum {self.grad_accum} must divide the batch of {rows} rows (per device)")
        # Micro-batch k takes rows k, k + grad_accum, ...: split as [rows / grad_accum, grad_accum] and
        # moved to the front, the row axis stays sharded where the batch lives; a split as
        # [grad_accum, rows / grad_accum] would reshard it (XLA's "involuntary full rematerialization").
        micro = jax.tree.map(
            lambda x: jnp.swapaxes(x.reshape(rows // self.grad_accum, self.grad_accum, *x.shape[1:]), 0, 1), batch
        )

        def accumulate(total: PyTree, micro_batch: Batch) -> tuple[PyTree, None]:
            (_, (metrics, _)), grads = grad_fn(model, model_state, Batch(*micro_batch), key)
            return jax.tree.map(jnp.add, total, (metrics, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
        start = ({k: jnp.zeros((), jnp.float32) for k in ("loss", "accuracy", "bits_per_byte")}, zeros)
        summed, _ = jax.lax.scan(accumulate, start, micro)
        metrics, grads = jax.tree.map(lambda x: x / self.grad_accum, summed)
        if axis_name is not None:
            metrics, grads = jax.lax.pmean((metrics, grads), axis_name)
        return (metrics["loss"], (metrics, model_state)), grads


@eqx.filter_jit
def _masked_sums(model: eqx.Module, tokens: Array, targets: Array, mask: Array) -> Array:
    losses, correct = next_token_sums(model, tokens, targets)
    return jnp.stack([jnp.sum(losses * mask), jnp.sum(correct * mask)])


def evaluate_language_model(
    state: TrainState, data: DeviceLoader | HostLoader, *, progress: bool = False
) -> tuple[dict[str, float], dict[str, float] | None]:
    """The evaluator of a language model (`Setup.evaluator`, `fit(evaluator=...)`): mean next-token
    `loss`, `accuracy` and `bits_per_byte` over every window of `data`, `(metrics, raw_metrics)` as
    `evaluate_state` gives them (the EMA model's and the trained one's when the state keeps an EMA)."""

    def measure(model: eqx.Module) -> dict[str, float]:
        batches, size = padded_batches(data)
        sums = [
            _masked_sums(model, jnp.asarray(b.inputs), jnp.asarray(b.labels), jnp.asarray(mask)) for b, mask in batches
        ]
        loss, accuracy = np.sum(jax.device_get(sums), axis=0) / size
        return {"loss": float(loss), "accuracy": float(accuracy), "bits_per_byte": float(loss / LN2)}

    raw = measure(state.model)
    if state.ema is None:
        return raw, None
    return measure(state.averaged_model()[0]), raw
