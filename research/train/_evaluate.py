import math
from collections.abc import Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import Batch, DeviceLoader, HostLoader
from ..progress import Progress
from ..typing import Array, Float, typecheck
from ._state import TrainState, classification_metrics, forward


@eqx.filter_jit
@typecheck
def _eval_sums(
    model: eqx.Module, model_state: eqx.nn.State | None, batch: Batch, mask: Float[Array, " batch"]
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    logits, _ = forward(model, model_state, batch.inputs, key=None)
    losses, correct = classification_metrics(logits, batch.labels)
    return jnp.sum(losses * mask), jnp.sum(correct * mask)


def _padded(batches: Iterable[Batch], batch_size: int) -> Iterable[tuple[Batch, np.ndarray]]:
    for inputs, labels in batches:
        count = len(labels)
        mask = np.zeros(batch_size, np.float32)
        mask[:count] = 1
        if count < batch_size:
            index = np.arange(batch_size) % count
            inputs, labels = inputs[index], labels[index]
        yield Batch(inputs, labels), mask


def padded_batches(data: DeviceLoader | HostLoader) -> tuple[Iterable[tuple[Batch, np.ndarray]], int]:
    """`(batches, size)`: every example of `data` once, in batches of one size (a smaller last batch is
    padded and its padding masked out by the 0/1 mask given with each batch), and the example count."""
    if isinstance(data, DeviceLoader):
        return data.padded_batches(), data.size
    # A HostLoader is a torch DataLoader, annotated as an Iterable so that this module need not import torch.
    return _padded(data, data.batch_size), len(data.dataset)  # pyright: ignore[reportAttributeAccessIssue]


def evaluate(
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    data: DeviceLoader | HostLoader,
    *,
    progress: bool = False,
) -> dict[str, float]:
    """Mean loss and accuracy of a classifier over every example of `data`, in inference mode.

    Batches are weighted by their number of examples: a smaller last batch is padded to the full
    batch size and masked, so the average is exact and the evaluation compiles once. With
    `progress`, an evaluation that takes over a second shows a bar (batches/s and ETA).
    """
    model = eqx.nn.inference_mode(model)
    batches, size = padded_batches(data)
    batch_size = data.batch_size  # pyright: ignore[reportAttributeAccessIssue]  (a HostLoader's: DataLoader's)
    bar = Progress(math.ceil(size / batch_size), desc="eval", unit="batch", enabled=progress, delay=1.0, leave=False)
    totals = []
    try:
        for b, mask in batches:
            totals.append(
                _eval_sums(model, model_state, Batch(jnp.asarray(b.inputs), jnp.asarray(b.labels)), jnp.asarray(mask))
            )
            if len(totals) > 1:  # keep one batch in flight; the bar then counts finished batches
                jax.block_until_ready(totals[-2])
                bar.update(1)
    finally:
        bar.close()
    loss, correct = np.sum(jax.device_get(totals), axis=0)
    return {"loss": float(loss / size), "accuracy": float(correct / size)}


def evaluate_state(
    state: TrainState, data: DeviceLoader | HostLoader, *, progress: bool = False
) -> tuple[dict[str, float], dict[str, float] | None]:
    """`(metrics, raw_metrics)` of a TrainState: `metrics` of the model it stands for (the EMA
    `(model, model_state)` when `state.ema` is set, else the trained model) and `raw_metrics` of the
    trained model when there is an EMA (else `None`). `fit` logs them as `test/...` and `test_raw/...`."""
    raw = evaluate(state.model, state.model_state, data, progress=progress)
    if state.ema is None:
        return raw, None
    return evaluate(*state.averaged_model(), data, progress=progress), raw
