"""Next-token cross-entropy for a language model: the loss and its evaluator."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data import Batch, DeviceLoader, HostLoader
from ..typing import Array, Float, Int, PRNGKeyArray, RowKeys, typecheck
from ._evaluate import padded_batches
from ._rows import Metrics
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


@dataclasses.dataclass(frozen=True)  # equal instances: a sweep compares its members' steps
class NextTokenLoss:
    """Mean next-token cross-entropy of a `LanguageModel`: pass it as `loss_fn`. The batch is
    `(tokens, next tokens)`, both `[batch, tokens]`; metrics are `loss`, `accuracy` and `bits_per_byte`
    (`loss / ln 2` bits a token over `bytes_per_token`: 1 for a byte vocabulary, the text's mean for a
    tokenizer's). A plain mean over the batch: `--grad-accum` (`SupervisedStep(grad_accum=...)`) takes its
    gradient in parts."""

    bytes_per_token: float = 1.0

    def __call__(
        self, model: eqx.Module, model_state: None, batch: Batch, keys: RowKeys | PRNGKeyArray
    ) -> tuple[Float[Array, ""], tuple[Metrics, None]]:
        losses, correct = next_token_sums(model, batch.inputs, batch.labels)
        loss = jnp.mean(losses)
        bits_per_byte = loss / (LN2 * self.bytes_per_token)
        return loss, ({"loss": loss, "accuracy": jnp.mean(correct), "bits_per_byte": bits_per_byte}, model_state)


@eqx.filter_jit
def _masked_sums(model: eqx.Module, tokens: Array, targets: Array, mask: Array) -> Array:
    losses, correct = next_token_sums(model, tokens, targets)
    return jnp.stack([jnp.sum(losses * mask), jnp.sum(correct * mask)])


def evaluate_language_model(
    state: TrainState, data: DeviceLoader | HostLoader, *, progress: bool = False, bytes_per_token: float = 1.0
) -> dict[str, float]:
    """The evaluator of a language model (`Setup.evaluator`, `fit(evaluator=...)`): mean next-token
    `loss`, `accuracy` and `bits_per_byte` (as `NextTokenLoss` reckons it) of the state's model over every
    window of `data`."""
    batches, size = padded_batches(data)
    sums = [
        _masked_sums(state.model, jnp.asarray(b.inputs), jnp.asarray(b.labels), jnp.asarray(mask))
        for b, mask in batches
    ]
    loss, accuracy = np.sum(jax.device_get(sums), axis=0) / size
    bits_per_byte = float(loss / (LN2 * bytes_per_token))
    return {"loss": float(loss), "accuracy": float(accuracy), "bits_per_byte": bits_per_byte}
