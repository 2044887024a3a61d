"""The engine's standard hooks: what happens at a stop of the loop, each with its own cadence.

Add them in this order (`fit` and `research.experiment.add_default_hooks` do): the non-finite
guard, evaluation, early stopping, tracking (metrics.jsonl and other trackers), progress, checkpoints,
the profile; a later hook sees what an earlier one put in `StepInfo.record`, and that an earlier one
ended the run (`StepInfo.final`).
"""

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..data import DeviceLoader, HostLoader
from ..errors import ConfigError, NonFiniteError
from ..progress import Progress
from ..services import CheckpointWriter, Headline, RunDir, Tracker
from ._engine import StepInfo
from ._evaluate import Evaluator, averaged_and_raw, evaluate_state


@dataclasses.dataclass
class NonFiniteGuard:
    """Stop with `NonFiniteError` naming the first step one of whose `finite_metrics` (the loss, the
    gradient's norm) was NaN/Inf, and the last good checkpoint (which stays untouched; `saving`: the
    checkpoint hook whose save in flight is committed first). Runs at every stop: a bad run stops early."""

    run: RunDir | None = None
    saving: "Checkpoint | None" = None

    def __call__(self, info: StepInfo) -> None:
        bad_step, metric = info.first_bad_step()
        if bad_step < 0:
            return
        if self.saving is not None:
            self.saving.wait()
        kept = self.run.checkpoint_paths()[-1] if self.run is not None and self.run.checkpoint_paths() else None
        where = f"; the last good checkpoint is {kept}" if kept else "; no checkpoint was written"
        raise NonFiniteError(
            f"non-finite {'gradient' if metric == 'grad_norm' else metric} at step {bad_step + 1}"
            f"{where}. Lower the learning rate, check the data, pass --skip-nonfinite to skip such steps, "
            "or rerun with --debug-nans to find the operation that made it"
        )


@dataclasses.dataclass
class Evaluate:
    """Evaluate the state on `data` in inference mode into `test/...` (the EMA model's when the state
    keeps one, and the trained model's as `test_raw/...`); `name="val"` for a validation set.
    `evaluator` replaces `evaluate_state` (a population evaluates each member and their ensemble)."""

    data: DeviceLoader | HostLoader
    progress: bool = False
    evaluator: Evaluator = evaluate_state
    name: str = "test"

    def __call__(self, info: StepInfo) -> None:
        metrics, raw = averaged_and_raw(self.evaluator, info.state, self.data, progress=self.progress)
        info.record.update({f"{self.name}/{k}": v for k, v in metrics.items()})
        info.record.update({f"{self.name}_raw/{k}": v for k, v in (raw or {}).items()})


@dataclasses.dataclass
class EarlyStopping:
    """End the run as finished (`StepInfo.finish`) once `metric` (a record's key: `test/loss`,
    `val/accuracy`) has not bettered its best for `patience` evaluations in a row; `goal` says which
    way is better. Add it after the evaluation, at every stop (it acts where the record has `metric`).

    Its count is part of the run: the checkpoint stores `state_dict()` (the `Checkpoint`'s `resumable`)
    and a resumed run `load_state_dict`s it, so it stops where the uninterrupted run stops."""

    metric: str
    patience: int
    goal: Literal["max", "min"] = "min"
    best: float | None = None  # the best value so far, and the step that reached it
    best_step: int = 0
    evaluations_since_best: int = 0

    def __call__(self, info: StepInfo) -> None:
        value = info.record.get(self.metric)
        if value is None:
            reported = sorted(k for k in info.record if k.startswith(self.metric.split("/")[0] + "/"))
            if reported:  # an evaluation that does not report the metric would never stop the run
                raise ConfigError(
                    f"--early-stopping watches {self.metric}, which this run's evaluation does not report "
                    f"(it reports {', '.join(reported)})"
                )
            return
        judge = Headline(self.metric, self.goal)
        if judge.better(value, judge.worst if self.best is None else self.best):
            self.best, self.best_step, self.evaluations_since_best = float(value), info.step, 0
            return
        self.evaluations_since_best += 1
        if self.evaluations_since_best >= self.patience and not info.final:
            best = "no finite value" if self.best is None else f"its best, {self.best:.6g} at step {self.best_step}"
            info.finish(f"{self.metric} has not bettered {best}, in {self.patience} evaluations")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "evaluations_since_best": self.evaluations_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.evaluations_since_best = state["evaluations_since_best"]


@dataclasses.dataclass
class Track:
    """Hand each non-empty record to the trackers (metrics.jsonl, TensorBoard), with `lr`, the rate
    of the last step taken, when the optimizer has a schedule and train metrics were fetched."""

    trackers: list[Tracker]
    lr_schedule: Callable[[int], Any] | None = None

    def __call__(self, info: StepInfo) -> None:
        if self.lr_schedule is not None and "steps_per_s" in info.record:
            info.record["lr"] = float(self.lr_schedule(info.step - 1))
        if info.record:
            for tracker in self.trackers:
                tracker.log(info.step, info.record)


@dataclasses.dataclass
class ShowProgress:
    """Advance the progress bar (or write a log line when not on a terminal) with the main numbers;
    the engine closes the bar when fit ends."""

    bar: Progress
    step: int = 0  # where the bar stands
    shown: tuple[str, ...] = ("train/loss", "train/accuracy", "test/accuracy")

    def __call__(self, info: StepInfo) -> None:
        self.bar.update(info.step - self.step)
        self.step = info.step
        if info.record:
            self.bar.report(
                info.step,
                {k: v for k, v in info.record.items() if k in self.shown},
                rate=info.record.get("steps_per_s"),
            )

    def close(self) -> None:
        self.bar.close()


@dataclasses.dataclass
class Checkpoint:
    """Save the state (with `header` and the unlogged metrics window) in the background, and keep the
    `keep` newest checkpoints plus the best by `headline` (`test/accuracy`, highest, by default).

    A save returns once the arrays are copied off the devices; training goes on while Orbax writes
    them, and the next save (or the end of fit: `close`) waits for the commit. With several
    processes, add this hook on every process: each saves the shards it holds, and process 0 commits
    the checkpoint and prunes the older ones.

    Add it with a step cadence (`every=N`) and, for a cadence in time, add `when_due` too (at every
    stop): it saves once `every_seconds` have passed since the last save, so a killed run loses
    bounded work whatever its step cadence.

    The header also holds `finished` where a hook ended the run early (`StepInfo.finish`: resuming it
    trains no further), and the `state_dict()` of each of the `resumable` hooks, by name (`hooks`)."""

    saves_state = True  # the engine tells a preempted run's user that its state was saved

    run: RunDir
    keep: int = 3
    header: dict[str, Any] = dataclasses.field(default_factory=dict)
    every_seconds: float | None = None
    headline: Headline = Headline()
    resumable: dict[str, Any] = dataclasses.field(default_factory=dict)
    _last: float = dataclasses.field(default_factory=time.monotonic, init=False)
    _saved_step: int = dataclasses.field(default=-1, init=False)
    _writer: CheckpointWriter = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self._writer = CheckpointWriter(on_commit=lambda _: self.run.prune_checkpoints(self.keep, self.headline))

    def __call__(self, info: StepInfo) -> None:
        if info.step == self._saved_step:
            return
        header = {
            **self.header,
            "step": info.step,
            "window": info.window(),
            "eval": {k: v for k, v in info.record.items() if k.startswith(("test/", "val/"))},
        }
        if info.finished_early is not None:
            header["finished"] = info.finished_early
        if self.resumable:
            header["hooks"] = {name: hook.state_dict() for name, hook in self.resumable.items()}
        data = info.data_state()
        if data is not None:  # a host loader's own position (Grain's iterator state), to resume it from
            header["data"] = data
        self._writer.save(self.run.checkpoint_path(info.step), info.saved_state, header)
        self._last, self._saved_step = time.monotonic(), info.step

    def when_due(self, info: StepInfo) -> None:
        if self.every_seconds is None:
            return
        due = time.monotonic() - self._last >= self.every_seconds
        if jax.process_count() > 1:  # every process saves, so all of them must agree that it is time
            due = bool(np.max(multihost_utils.process_allgather(np.int32(due))))
        if due:
            self(info)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed."""
        self._writer.wait()

    def close(self) -> None:
        self._writer.close()


@dataclasses.dataclass
class Profile:
    """A `jax.profiler` trace of the steps from `start` to `stop` (`start` steps taken, to `stop`) in
    `directory`: TensorBoard's profile plugin reads it (`tensorboard --logdir DIRECTORY`, the Profile
    tab), and `plugins/profile/*/perfetto_trace.json.gz` opens in https://ui.perfetto.dev.

    Add it with `at=(start, stop)` (the engine then stops there). A run that starts at or after
    `start` (resumed) traces from its first step, compilation included; a run that ends first stops
    the trace at its end (`close`). `done` is called with the directory once the trace is written."""

    directory: Path
    start: int
    stop: int
    done: Callable[[Path], None] = lambda directory: None
    _tracing: bool = dataclasses.field(default=False, init=False)

    def begin_if_due(self, step: int) -> None:
        """Start tracing now when the run starts at `step`, inside the window."""
        if self.start <= step < self.stop:
            self._begin()

    def _begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self._tracing = True

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.start and not self._tracing:
            self._begin()
        elif info.step >= self.stop and self._tracing:
            jax.block_until_ready(info.leaves)  # the steps' device work, inside the trace
            self.close()

    def close(self) -> None:
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False
            self.done(self.directory)
