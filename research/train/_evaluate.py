"""Evaluation: every example of a data set once, in batches of one size (the last one padded and its
padding masked out), through a per-batch function; evaluators of a train state; and `averaged_and_raw`,
the one place that hands an evaluator the state with the EMA's weights and, beside it, the trained one."""

import math
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import Batch, DeviceLoader, HostLoader, as_batch, take_rows
from ..errors import DataError
from ..progress import Progress
from ..typing import Array, Float, PRNGKeyArray, PyTree, typecheck
from ._rows import batch_rows
from ._state import classification_metrics, forward

# per_batch(model, model_state, batch, mask, key) -> a pytree of arrays (say, sums over the batch's real rows)
PerBatch = Callable[[Any, Any, Any, Float[Array, " batch"], PRNGKeyArray], PyTree]
# evaluate(state, data, progress=...) -> metrics of that state (`averaged_and_raw` chooses which weights it holds).
Evaluator = Callable[..., dict[str, Any]]
EVAL_SEED = 0  # the root of the keys a per-batch function gets: the same at every evaluation


@eqx.filter_jit
@typecheck
def _eval_sums(
    model: eqx.Module, model_state: eqx.nn.State | None, batch: Any, mask: Float[Array, " batch"], key: PRNGKeyArray
) -> dict[str, Float[Array, ""]]:
    logits, _ = forward(model, model_state, batch.inputs, key=None)
    losses, correct = classification_metrics(logits, batch.labels)
    return {"loss": jnp.sum(losses * mask), "accuracy": jnp.sum(correct * mask)}


def _padded(batches: Iterable[Any], batch_size: int) -> Iterable[tuple[Any, np.ndarray]]:
    for batch in batches:
        batch = as_batch(batch)
        count = batch_rows(batch)
        mask = np.zeros(batch_size, np.float32)
        mask[:count] = 1
        if count < batch_size:
            batch = take_rows(batch, np.arange(batch_size) % count)
        yield batch, mask


def padded_batches(data: DeviceLoader | HostLoader) -> tuple[Iterable[tuple[Any, np.ndarray]], int]:
    """`(batches, size)`: every example of `data` once, in batches of one size (a smaller last batch is
    padded and its padding masked out by the 0/1 mask given with each batch), and the example count."""
    if isinstance(data, DeviceLoader):
        return data.padded_batches(), data.size
    # A HostLoader is a torch DataLoader, annotated as an Iterable so that this module need not import torch.
    return _padded(data, data.batch_size), len(data.dataset)  # pyright: ignore[reportAttributeAccessIssue]


def evaluate_batches(
    per_batch: PerBatch, model: Any, model_state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False
) -> tuple[list[Any], int]:
    """`(results, size)`: `per_batch(model, model_state, batch, mask, key)` of every padded batch of `data`
    (`padded_batches`), fetched to the host, and the example count. `per_batch` is compiled once
    (`eqx.filter_jit`: wrap it yourself to keep it compiled across calls); the key of batch `i` is
    `fold_in(key(EVAL_SEED), i)`, the same at every evaluation. With `progress`, an evaluation that
    takes over a second shows a bar (batches/s and ETA)."""
    batches, size = padded_batches(data)
    batch_size = data.batch_size  # pyright: ignore[reportAttributeAccessIssue]  (a HostLoader's: DataLoader's)
    bar = Progress(math.ceil(size / batch_size), desc="eval", unit="batch", enabled=progress, delay=1.0, leave=False)
    root = jax.random.key(EVAL_SEED)
    results = []
    try:
        for i, (batch, mask) in enumerate(batches):
            batch = jax.tree.map(jnp.asarray, batch)
            results.append(per_batch(model, model_state, batch, jax.device_put(mask), jax.random.fold_in(root, i)))
            if len(results) > 1:  # keep one batch in flight; the bar then counts finished batches
                jax.block_until_ready(results[-2])
                bar.update(1)
    finally:
        bar.close()
    return jax.device_get(results), size


def mean_of_sums(results: list[dict[str, Any]], size: int) -> dict[str, float]:
    """Each metric's sum over the batches (in float32, batch by batch) divided by the example count: what
    a per-batch function returning sums over the real rows of its batch means."""
    names = list(results[0])
    totals = np.sum(np.stack([np.stack([r[name] for name in names]) for r in results]), axis=0)
    return {name: float(total / size) for name, total in zip(names, totals, strict=True)}


def check_labelled(data: DeviceLoader | HostLoader | None, what: str) -> None:
    """Refuse, before any training, data the default evaluators (`evaluate_state`, a population's) cannot
    score: a `DeviceLoader` made with `labels=None` has no labels, and the evaluation would fail only once
    every step had trained, deep inside a trace. (A torch loader's batches are not looked into.)"""
    if isinstance(data, DeviceLoader) and not isinstance(data.host, Batch):
        raise DataError(
            f"{what} has no labels (a DeviceLoader made with labels=None), and the default evaluator scores "
            "a classifier's predictions against labels: give labelled data, or Setup(evaluator=...) (say, one "
            "made by research.train.batch_evaluator)"
        )


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
    results, size = evaluate_batches(_eval_sums, eqx.nn.inference_mode(model), model_state, data, progress=progress)
    return mean_of_sums(results, size)


def averaged_and_raw(
    evaluator: Evaluator, state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`(metrics, raw_metrics)`: `evaluator`'s metrics of the state as the run stands for it (`state.averaged()`:
    the EMA's weights in place of the trained ones, when it keeps an EMA) and, with an EMA, of the trained
    state (else `None`); logged as `test/...` and `test_raw/...`. Every evaluation goes through it, so no
    evaluator chooses between the two itself."""
    metrics = evaluator(state.averaged(), data, progress=progress)
    return metrics, None if state.ema is None else evaluator(state, data, progress=progress)


def model_evaluator(evaluate_model: Callable[..., dict[str, Any]]) -> Evaluator:
    """An evaluator of train states from `evaluate_model(model, model_state, data, progress=...) -> metrics`,
    of the state's `(model, model_state)` (the EMA's, when `averaged_and_raw` hands it the averaged state)."""

    def evaluator(state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False) -> dict[str, Any]:
        return evaluate_model(state.model, state.model_state, data, progress=progress)

    return evaluator


def batch_evaluator(
    per_batch: PerBatch, finish: Callable[[list[Any], int], dict[str, Any]] = mean_of_sums
) -> Evaluator:
    """An evaluator of train states (`model_evaluator`) from a function of one padded batch:
    `per_batch(model, model_state, batch, mask, key)` (compiled once; the model in inference mode; `mask`
    is 1 on the batch's real rows, 0 on its padding) gives each batch's results, and `finish(results,
    size)` the metrics (by default, sums over the real rows divided by the example count)."""
    compiled = eqx.filter_jit(per_batch)

    def evaluate_model(model: Any, model_state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False):
        return finish(*evaluate_batches(compiled, eqx.nn.inference_mode(model), model_state, data, progress=progress))

    return model_evaluator(evaluate_model)


def combined_evaluator(*evaluators: Evaluator) -> Evaluator:
    """One evaluator whose metrics are those of `evaluators` together (say a test loss and a Fréchet distance)."""

    def evaluate(state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False) -> dict[str, Any]:
        return {k: v for evaluator in evaluators for k, v in evaluator(state, data, progress=progress).items()}

    return evaluate


evaluate_state: Evaluator = model_evaluator(evaluate)
evaluate_state.__doc__ = """Mean loss and accuracy (`evaluate`) of a `TrainState` of a classifier."""
