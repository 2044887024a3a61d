import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jaxtyping import TypeCheckError

from ..errors import DataError, NonFiniteError
from ..data import Batch, DeviceLoader, HostLoader, TorchLoader
from ..debug import describe_nan_error
from ..progress import Progress
from ._checkpoint import save_checkpoint
from ._compiled import (NONFINITE_NAMES, CompiledTrainer, StepStats, _copy, compiled_trainer, decode_first_bad,
                        host_means, unpack_sums)
from ._evaluate import evaluate_state
from ._rundir import RunDir
from ._state import LossFn, TrainState, classification_loss
from ._tracking import JsonlTracker, MultiTracker, Tracker


@dataclasses.dataclass
class FitResult:
    state: TrainState
    train_metrics: dict[str, float]  # means over the last logging window
    eval_metrics: dict[str, float] | None  # at the final step; of the EMA model when the state keeps one
    wall_seconds: float
    raw_eval_metrics: dict[str, float] | None = None  # of the trained (not averaged) model, when EMA is on


def _next_multiple(step: int, every: int | None) -> int | float:
    return math.inf if not every else (step // every + 1) * every


def _summarise_type_error(error: TypeCheckError) -> str:
    """One line out of jaxtyping's multi-line report: the function, the parameter, got vs expected."""
    lines = [line.strip() for line in str(error).splitlines()]
    where = next((line for line in lines if line.startswith("Type-check error")), "")
    function = where.rsplit(" of ", 1)[-1].rstrip(".") if " of " in where else "the model"
    parameter = next((line.split("'")[1] for line in lines if "typechecking parameter" in line), "return value")
    got = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Actual value:")), "?")
    expected = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Expected type:")), "?")
    return f"the data does not fit the model: {function} parameter '{parameter}' got {got}, expected {expected}"


def window_to_header(stats: StepStats) -> dict[str, Any]:
    """The running metrics of an unfinished logging window, exactly, as JSON (float32 -> float is exact)."""
    sums, counters = jax.device_get((stats.sums, stats.counters))
    total = unpack_sums(sums, stats.layout)
    return {"total": {k: np.asarray(v).tolist() for k, v in total.items()}, "weight": float(sums[-1]),
            "skipped": int(counters[1])}


def _window_from_header(window: dict[str, Any], like: StepStats) -> StepStats:
    return StepStats.from_window(window["total"], window["weight"], window["skipped"], like)


def fit(
    state: TrainState,
    train_data: DeviceLoader | TorchLoader,
    *,
    num_steps: int,
    loss_fn: LossFn = classification_loss,
    eval_data: DeviceLoader | HostLoader | None = None,
    eval_every: int | None = None,
    log_every: int = 100,
    steps_per_call: int = 1,
    run: RunDir | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    checkpoint_header: dict[str, Any] | None = None,
    resume_window: dict[str, Any] | None = None,
    skip_nonfinite: bool = False,
    progress: bool = True,
    tracker: Tracker | None = None,
    lr_schedule: Callable[[int], Any] | None = None,
    debug_nans: bool = False,
    parallel: Any = None,
) -> FitResult:
    """Train `state` until `state.step == num_steps` on the fast path.

    **Arguments:**

    - `state`: the starting TrainState (step 0, or a restored checkpoint); left untouched.
    - `train_data`: a `DeviceLoader` (batches gathered on the device; `steps_per_call` steps run in
      one compiled call) or a `TorchLoader` (host batches from a torch DataLoader, one call a step).
      Batch order is a pure function of the seed and the step, so a resumed run sees the same data.
    - `num_steps`: the total number of steps (not the number still to take).
    - `loss_fn`: `(model, model_state, batch, key) -> (loss, (metrics, model_state))`.
    - `eval_data`, `eval_every`: evaluate every `eval_every` steps and at the end, in inference mode
      (BatchNorm uses its running statistics, dropout is off). When `state.ema` is set, `test/...`
      are the EMA model's metrics and `test_raw/...` the trained model's.
    - `log_every`: fetch the running means of the train metrics every so many steps; with the
      non-finite check at each cadence boundary, the only host synchronisation. Written to `run`'s
      `metrics.jsonl` and to `tracker`.
    - `run`: where to log and checkpoint (nothing is written when `None`).
    - `checkpoint_every`, `keep_checkpoints`, `checkpoint_header`: checkpoint cadence, how many
      recent ones to keep (the one with the best `test/accuracy` is kept as well), and the JSON
      header written with each (the final step is always checkpointed).
    - `resume_window`: the `window` entry of the header of the checkpoint `state` came from, so that
      a resumed run logs exactly the metrics an uninterrupted one would.
    - `skip_nonfinite`: skip steps whose loss or gradient is NaN/Inf (counted as `train/skipped`)
      instead of stopping with `NonFiniteError`, which names the first bad step and quantity and
      leaves the checkpoints written so far untouched.
    - `progress`: show a progress bar (or log lines when not on a terminal).
    - `tracker`: another destination for the logged records (say a `TensorBoardTracker`); the
      caller owns it and calls its `finish()`.
    - `lr_schedule`: the optimizer's learning-rate schedule (`step -> lr`); when given, each record
      has `lr`, the rate of the last step taken (`lr_schedule(step - 1)`).
    - `debug_nans`: run with `jax_debug_nans`, one step per call, so that a NaN stops training at
      the first operation that produced it (`NonFiniteError` names it and its source line); slow.
    - `parallel`: a data-parallel strategy from `research.parallel` (`Pmap`, `Sharded`, ...), whose
      `trainer(loss_fn, state)` places the state, batches and statistics on its devices; `None` trains
      on one device. `train_data` always yields global batches; results do not depend on it.
    """
    start_time = time.perf_counter()
    if parallel is None:
        trainer = compiled_trainer(loss_fn, state, skip_nonfinite=skip_nonfinite)
    else:
        trainer = parallel.trainer(loss_fn, state, skip_nonfinite=skip_nonfinite)
    if debug_nans and trainer.parallel:
        raise ValueError("debug_nans replays steps op by op on one device; train without a parallel strategy")
    traces_before = dict(trainer.num_traces)
    step = int(state.step)
    leaves = trainer.place(state)  # fresh copies: the compiled steps donate them
    if isinstance(train_data, DeviceLoader):
        example = Batch(*(a[: train_data.batch_size] for a in train_data.host))
        device_data = trainer.put_data(train_data.host, train_data.arrays)
        host_batches = None
    else:
        host_batches = train_data.batches(step)
        example = next(host_batches)
    try:
        fresh_stats = trainer.init_stats(leaves, example)
    except TypeCheckError as e:
        raise DataError(_summarise_type_error(e)) from None
    if resume_window is not None:
        fresh_stats = trainer.put_stats(_window_from_header(resume_window, trainer.host(fresh_stats)))
    stats = fresh_stats
    pending = example if host_batches is not None else None

    trackers = MultiTracker(([JsonlTracker(run)] if run is not None else []) + ([tracker] if tracker else []))
    bar = Progress(num_steps, initial=step, enabled=progress)
    train_metrics: dict[str, float] = {}
    eval_metrics = raw_eval_metrics = None
    window_start, window_step = time.perf_counter(), step
    during = f"training step {step + 1}"  # where a NaN found by debug_nans came from
    nan_checks = contextlib.ExitStack()
    if debug_nans:
        nan_checks.enter_context(jax.debug_nans(True))
    try:
        while step < num_steps:
            until = int(min(num_steps, _next_multiple(step, log_every), _next_multiple(step, eval_every),
                            _next_multiple(step, checkpoint_every)))
            if host_batches is None and not debug_nans:
                leaves, stats = _run_device(trainer, leaves, stats, train_data, device_data, step, until,
                                            steps_per_call)
            else:
                # One compiled step per call: with debug_nans a NaN is then traced back to one op
                # (inside a compiled loop it could only be blamed on the loop).
                for position in range(step, until):
                    during = f"training step {position + 1}"
                    if host_batches is None:
                        index = train_data.step_indices(position, 1)[0]
                        batch = Batch(train_data.arrays.inputs[index], train_data.arrays.labels[index])
                    else:
                        batch = pending if pending is not None else next(host_batches)
                        pending = None
                    before = _copy(leaves) if debug_nans else None  # the step donates its inputs
                    leaves, stats = trainer.step(leaves, stats, trainer.put_batch(batch))
                    if before is not None and stats.first_bad_step >= 0:
                        # The statistics hold only finite values, so a NaN loss need not reach any
                        # output JAX checks: replay the step op by op to find where it came from.
                        trainer.replay_eagerly(before, batch)
            bar.update(until - step)
            step = until
            if not skip_nonfinite:
                _raise_if_nonfinite(trainer.host(stats), run)
            record: dict[str, Any] = {}
            if step % log_every == 0 or step == num_steps:
                local = trainer.host(stats)
                sums, counters = jax.device_get((local.sums, local.counters))  # one transfer, then numpy
                train_metrics = {k: float(v) for k, v in host_means(sums, local.layout).items()}
                skipped = counters[1]
                now = time.perf_counter()
                record.update({f"train/{k}": v for k, v in train_metrics.items()})
                if skip_nonfinite:
                    record["train/skipped"] = int(skipped)
                if lr_schedule is not None:
                    record["lr"] = float(lr_schedule(step - 1))
                record["steps_per_s"] = (step - window_step) / max(now - window_start, 1e-9)
                window_start, window_step = now, step
                stats = trainer.init_stats(leaves, example)
            pause_start = time.perf_counter()
            if eval_data is not None and (step == num_steps or (eval_every and step % eval_every == 0)):
                during = f"the evaluation at step {step}"
                eval_metrics, raw_eval_metrics = evaluate_state(trainer.state(leaves), eval_data, progress=progress)
                record.update({f"test/{k}": v for k, v in eval_metrics.items()})
                record.update({f"test_raw/{k}": v for k, v in (raw_eval_metrics or {}).items()})
            if record:
                shown = ("train/loss", "train/accuracy", "test/accuracy")
                bar.report(step, {k: v for k, v in record.items() if k in shown}, rate=record.get("steps_per_s"))
                trackers.log(step, record)
            if run is not None and (step == num_steps or (checkpoint_every and step % checkpoint_every == 0)):
                header = {**(checkpoint_header or {}), "step": step, "window": window_to_header(trainer.host(stats)),
                          "eval": {k: v for k, v in record.items() if k.startswith("test/")}}
                save_checkpoint(run.checkpoint_path(step), trainer.state(leaves), header)
                run.prune_checkpoints(keep_checkpoints)
            window_start += time.perf_counter() - pause_start  # steps_per_s leaves out eval and checkpoints
    except FloatingPointError as error:
        if not debug_nans or isinstance(error, NonFiniteError):
            raise
        raise NonFiniteError(describe_nan_error(error, during)) from error
    finally:
        nan_checks.close()
        bar.close()
    _warn_on_retrace(trainer, traces_before)
    return FitResult(trainer.state(leaves), train_metrics, eval_metrics, time.perf_counter() - start_time,
                     raw_eval_metrics)


def _raise_if_nonfinite(stats: StepStats, run: RunDir | None) -> None:
    bad_step, quantity = decode_first_bad(int(jax.device_get(stats.counters)[0]))
    if bad_step < 0:
        return
    kept = run.checkpoint_paths()[-1] if run is not None and run.checkpoint_paths() else None
    where = f"; the last good checkpoint is {kept}" if kept else "; no checkpoint was written"
    raise NonFiniteError(
        f"non-finite {NONFINITE_NAMES[quantity]} at step {bad_step + 1}"
        f"{where}. Lower the learning rate, check the data, pass --skip-nonfinite to skip such steps, "
        "or rerun with --debug-nans to find the operation that made it"
    )


def _run_device(trainer: CompiledTrainer, leaves, stats, loader: DeviceLoader, data: Batch, step: int, until: int,
                steps_per_call: int):
    while step < until:
        n = min(steps_per_call, until - step)
        indices = np.zeros((steps_per_call, loader.batch_size), np.int32)
        indices[:n] = loader.step_indices(step, n)
        leaves, stats = trainer.run(leaves, stats, data, trainer.put_indices(indices), n)
        step += n
    return leaves, stats


def _warn_on_retrace(trainer: CompiledTrainer, before: dict[str, int]) -> None:
    for name, count in trainer.num_traces.items():
        if count - before[name] > 1:
            why = trainer.traces.explanations.get(f"train {name} function", "")
            warnings.warn(
                f"the train {name} function was traced {count - before[name]} times in one fit: "
                "an input changed shape, dtype or structure between steps, which recompiles"
                + (f" (first retrace: {why})" if why else ""),
                stacklevel=3,
            )
