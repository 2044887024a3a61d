"""`fit`: the engine with the standard hooks, in one call, for library users (an experiment script's
run adds the same hooks from its config: `research.experiment.add_default_hooks`).

**Arguments of `fit`** (besides `Engine`'s `step`, `placement`, `log_every`, `steps_per_call`,
`skip_nonfinite`, `debug_nans`, `population`, and `Engine.fit`'s `resume_window`, `resume_data`):

- `state`: the starting train state (step 0, or a restored checkpoint); left untouched.
- `train_data`: a `DeviceLoader` (batches gathered on the device; `steps_per_call` steps run in
  one compiled call), a `TorchLoader` (host batches from a torch DataLoader, one call a step), a
  `GrainLoader` (host batches through Grain) or a `TokenWindows` (random windows of a memory-mapped token file).
  Batch order is a pure function of the seed and the step, so a resumed run sees the same data.
- `num_steps`: the total number of steps (not the number still to take).
- `eval_data`, `eval_every`, `evaluator`: evaluate every `eval_every` steps (`None`: only at the
  end) and at the end (`Evaluate`); `val_data` likewise, logged as `val/...`.
- `run`: where to log (`metrics.jsonl`) and checkpoint; nothing is written when `None`. With
  several processes pass it on every process: each saves its shards of the checkpoints (in the
  background), process 0 commits them and logs.
- `early_stopping`: an `EarlyStopping` hook (`EarlyStopping("test/loss", patience=5)`), after the
  evaluation; its count is checkpointed with the state (restore it from the header's `hooks` to resume).
- `checkpoint_every`, `keep_checkpoints`, `checkpoint_header`: `Checkpoint`'s cadence, how many
  to keep and the JSON header written with each (`None`: only the final step, which is always
  checkpointed); `checkpoint_seconds`: also checkpoint at the first stop after so many seconds.
- `stop_signals`: on SIGTERM/SIGINT stop after the compiled call in flight, checkpoint there
  (with `run`) and raise `Preempted` (see `Engine`).
- `progress`: show a progress bar (or log lines when not on a terminal).
- `tracker`: another destination for the logged records (say a `TensorBoardTracker`); the
  caller owns it and calls its `finish()`.
- `lr_schedule`: the optimizer's schedule (`step -> lr`), logged as `lr`.
- `profile`: a `Profile` hook tracing its window of steps.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..data import DeviceLoader, GrainLoader, HostLoader, TokenWindows, TorchLoader
from ..parallel import Placement, one_device
from ..progress import Progress
from ..services import JsonlTracker, RunDir, Tracker
from ._engine import Engine, FitResult, Hook
from ._evaluate import evaluate_state
from ._hooks import (
    Checkpoint,
    EarlyStopping,
    Evaluate,
    Evaluator,
    NonFiniteGuard,
    Profile,
    ShowProgress,
    Track,
)
from ._step import AbstractTrainState, Step


def fit(
    state: AbstractTrainState,
    train_data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows,
    *,
    num_steps: int,
    step: Step | None = None,
    placement: Placement = one_device(),
    eval_data: DeviceLoader | HostLoader | None = None,
    val_data: DeviceLoader | HostLoader | None = None,
    eval_every: int | None = None,
    log_every: int = 100,
    steps_per_call: int = 1,
    run: RunDir | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    checkpoint_header: dict[str, Any] | None = None,
    checkpoint_seconds: float | None = None,
    resume_window: dict[str, Any] | None = None,
    resume_data: Any = None,
    skip_nonfinite: bool = False,
    progress: bool = True,
    tracker: Tracker | None = None,
    lr_schedule: Callable[[int], Any] | None = None,
    debug_nans: bool = False,
    population: bool = False,
    evaluator: Evaluator = evaluate_state,
    stop_signals: bool = False,
    profile: Profile | None = None,
    early_stopping: EarlyStopping | None = None,
) -> FitResult:
    """Train `state` until `state.step == num_steps`: an `Engine` with the standard hooks. The arguments
    are described in this module's docstring (`help(research.train._fit)`)."""
    engine = Engine(
        step,
        placement=placement,
        log_every=log_every,
        steps_per_call=steps_per_call,
        skip_nonfinite=skip_nonfinite,
        debug_nans=debug_nans,
        population=population,
        stop_signals=stop_signals,
    )
    resumable = {} if early_stopping is None else {"early_stopping": early_stopping}
    checkpoint = (
        None
        if run is None
        else Checkpoint(run, keep_checkpoints, checkpoint_header or {}, checkpoint_seconds, resumable=resumable)
    )
    start = int(np.max(np.asarray(state.step)))  # a population steps its members together
    add_standard_hooks(
        engine,
        num_steps=num_steps,
        start=start,
        run=run,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        skip_nonfinite=skip_nonfinite,
        val_data=val_data,
        eval_data=eval_data,
        evaluator=evaluator,
        eval_every=eval_every,
        show_progress=progress,
        acting=list(resumable.values()),
        trackers=_trackers(run, tracker),
        lr_schedule=lr_schedule,
        progress=ShowProgress(Progress(num_steps, initial=start, enabled=progress), start),
        profile=profile,
    )
    return engine.fit(state, train_data, num_steps, resume_window=resume_window, resume_data=resume_data)


def add_standard_hooks(
    engine: Engine,
    *,
    num_steps: int,
    start: int,
    run: RunDir | None,
    checkpoint: Checkpoint | None,
    checkpoint_every: int | None,
    skip_nonfinite: bool,
    val_data: DeviceLoader | HostLoader | None,
    eval_data: DeviceLoader | HostLoader | None,
    evaluator: Evaluator,
    eval_every: int | None,
    show_progress: bool,
    acting: Sequence[Hook],
    trackers: list[Tracker],
    lr_schedule: Callable[[int], Any] | None,
    progress: ShowProgress,
    profile: Profile | None,
    drawing: Hook | None = None,
    eval_at: tuple[int, ...] = (),
) -> None:
    """The standard hooks in the order they run (a later hook sees what an earlier one put in the record),
    for `fit` and an experiment's run (`research.experiment.add_default_hooks`): the non-finite guard, the
    evaluation of `val_data` then `eval_data` by `evaluator` (its bar shown with `show_progress`), and
    `drawing`, at their cadence (every `eval_every` steps, or at the end; at the steps `eval_at` and the
    end instead, when it names any), the `acting`
    hooks (early stopping), tracking, progress, the checkpoint (a step cadence, and a time cadence when it
    has one) and the profile of its window. `start` is the step the run starts from."""
    if not skip_nonfinite:  # a NaN state is not saved on preemption
        engine.add_hook(NonFiniteGuard(run, checkpoint), on_preemption=True)
    evaluations = [
        Evaluate(data, show_progress, evaluator, name)
        for data, name in ((val_data, "val"), (eval_data, "test"))
        if data is not None
    ]
    at = (*eval_at, num_steps) if eval_at else ()
    for hook in [*evaluations, *([drawing] if drawing is not None else [])]:
        engine.add_hook(hook, every=eval_every or num_steps, at=at)
    for hook in acting:
        engine.add_hook(hook)
    engine.add_hook(Track(trackers, lr_schedule))
    engine.add_hook(progress)
    if checkpoint is not None:
        engine.add_hook(checkpoint, every=checkpoint_every or num_steps, on_preemption=True)
        if checkpoint.every_seconds:
            engine.add_hook(checkpoint.when_due)
    if profile is not None:
        engine.add_hook(profile, at=(profile.start, profile.stop))
        profile.begin_if_due(start)


def _trackers(run: RunDir | None, tracker: Tracker | None) -> list[Tracker]:
    """`tracker`, after metrics.jsonl in `run` on process 0 (every process checkpoints, process 0 logs)."""
    logs = [JsonlTracker(run)] if run is not None and jax.process_index() == 0 else []
    return logs + ([tracker] if tracker is not None else [])
