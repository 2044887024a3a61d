import dataclasses
import math
import time
import warnings
from typing import Any

import jax
import numpy as np
import torch.utils.data

from ..data import Batch, DeviceLoader, TorchLoader
from ._compiled import CompiledTrainer, compiled_trainer
from ._evaluate import evaluate
from ._progress import Progress
from ._rundir import RunDir
from ._checkpoint import save_checkpoint
from ._state import LossFn, TrainState, classification_loss


class NonFiniteError(FloatingPointError):
    """The training loss or gradient became NaN or infinite."""


@dataclasses.dataclass
class FitResult:
    state: TrainState
    train_metrics: dict[str, float]  # means over the last logging window
    eval_metrics: dict[str, float] | None  # at the final step
    wall_seconds: float


def _next_multiple(step: int, every: int | None) -> int | float:
    return math.inf if not every else (step // every + 1) * every


def _fetch(sums) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(sums.mean()).items()}


def fit(
    state: TrainState,
    train_data: DeviceLoader | TorchLoader,
    *,
    num_steps: int,
    loss_fn: LossFn = classification_loss,
    eval_data: DeviceLoader | torch.utils.data.DataLoader | None = None,
    eval_every: int | None = None,
    log_every: int = 100,
    steps_per_call: int = 1,
    run: RunDir | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    checkpoint_header: dict[str, Any] | None = None,
    progress: bool = True,
) -> FitResult:
    """Train `state` until `state.step == num_steps` on the fast path.

    **Arguments:**

    - `state`: the starting TrainState (step 0, or a restored checkpoint); left untouched.
    - `train_data`: a `DeviceLoader` (batches gathered on the device; `steps_per_call` steps run in
      one compiled call) or a `TorchLoader` (host batches from a torch DataLoader, one call a step).
      Batch order is a pure function of the seed and the step, so a resumed run sees the same data.
    - `num_steps`: the total number of steps (not the number still to take).
    - `loss_fn`: `(model, model_state, batch, key) -> (loss, (metrics, model_state))`.
    - `eval_data`, `eval_every`: evaluate every `eval_every` steps and at the end.
    - `log_every`: fetch the running means of the train metrics every so many steps; they are the
      only host synchronisation, and are written to `run`'s `metrics.jsonl`.
    - `run`: where to log and checkpoint (nothing is written when `None`).
    - `checkpoint_every`, `keep_checkpoints`, `checkpoint_header`: checkpoint cadence, how many to
      keep, and the JSON header written with each (the final step is always checkpointed).
    - `progress`: show a progress bar (or log lines when not on a terminal).
    """
    start_time = time.perf_counter()
    trainer = compiled_trainer(loss_fn, state)
    traces_before = dict(trainer.num_traces)
    step = int(state.step)
    # The compiled steps donate their inputs; copy once so the caller's state (and model) stay valid.
    leaves = _copy(trainer.leaves(state))
    if isinstance(train_data, DeviceLoader):
        example = Batch(train_data.arrays.inputs[: train_data.batch_size], train_data.arrays.labels[: train_data.batch_size])
        host_batches = None
    else:
        host_batches = train_data.batches(step)
        example = next(host_batches)
    sums = trainer.init_metrics(leaves, example)
    pending = example if host_batches is not None else None

    bar = Progress(num_steps, initial=step, enabled=progress)
    train_metrics: dict[str, float] = {}
    eval_metrics = None
    window_start, window_step = time.perf_counter(), step
    try:
        while step < num_steps:
            until = int(min(num_steps, _next_multiple(step, log_every), _next_multiple(step, eval_every),
                            _next_multiple(step, checkpoint_every)))
            if host_batches is None:
                leaves, sums = _run_device(trainer, leaves, sums, train_data, step, until, steps_per_call)
            else:
                for _ in range(until - step):
                    batch = pending if pending is not None else next(host_batches)
                    pending = None
                    leaves, sums = trainer.step(leaves, sums, batch)
            bar.update(until - step)
            step = until
            record: dict[str, Any] = {}
            if step % log_every == 0 or step == num_steps:
                train_metrics = _fetch(sums)
                now = time.perf_counter()
                record.update({f"train/{k}": v for k, v in train_metrics.items()})
                record["steps_per_s"] = (step - window_step) / max(now - window_start, 1e-9)
                window_start, window_step = now, step
                sums = trainer.init_metrics(leaves, example)
                if not math.isfinite(train_metrics.get("loss", 0.0)) or not math.isfinite(
                    train_metrics.get("grad_norm", 0.0)
                ):
                    raise NonFiniteError(
                        f"non-finite training loss or gradient by step {step} "
                        f"(loss={train_metrics.get('loss')}, grad_norm={train_metrics.get('grad_norm')})"
                    )
            if eval_data is not None and (step == num_steps or (eval_every and step % eval_every == 0)):
                current = trainer.state(leaves)
                eval_metrics = evaluate(current.model, current.model_state, eval_data)
                record.update({f"test/{k}": v for k, v in eval_metrics.items()})
            if record:
                bar.report(step, {k: v for k, v in record.items() if k in ("train/loss", "train/accuracy", "test/accuracy")})
                if run is not None:
                    run.log({"step": step, **record})
            if run is not None and (step == num_steps or (checkpoint_every and step % checkpoint_every == 0)):
                save_checkpoint(run.checkpoint_path(step), trainer.state(leaves),
                                {**(checkpoint_header or {}), "step": step})
                run.prune_checkpoints(keep_checkpoints)
    finally:
        bar.close()
    _warn_on_retrace(trainer, traces_before)
    return FitResult(trainer.state(leaves), train_metrics, eval_metrics, time.perf_counter() - start_time)


@jax.jit
def _copy(leaves):
    return [x.copy() for x in leaves]


def _run_device(trainer: CompiledTrainer, leaves, sums, data: DeviceLoader, step: int, until: int, steps_per_call: int):
    while step < until:
        n = min(steps_per_call, until - step)
        indices = np.zeros((steps_per_call, data.batch_size), np.int32)
        indices[:n] = data.step_indices(step, n)
        leaves, sums = trainer.run(leaves, sums, data.arrays, indices, n)
        step += n
    return leaves, sums


def _warn_on_retrace(trainer: CompiledTrainer, before: dict[str, int]) -> None:
    for name, count in trainer.num_traces.items():
        if count - before[name] > 1:
            warnings.warn(
                f"the train {name} function was traced {count - before[name]} times in one fit: "
                "an input changed shape, dtype or structure between steps, which recompiles",
                stacklevel=3,
            )
