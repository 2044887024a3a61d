"""The engine: place the state, then repeat { the next steps' batches from the loader, compiled calls
of train steps up to the next stop, a `StepInfo` for the hooks that are due }.

Everything around the compiled steps is a hook with a cadence (`Engine.add_hook(hook, every=N)`):
evaluation, logging and trackers, checkpoints, progress, the non-finite guard (`_hooks.py`). The
engine itself only fetches the running train metrics every `log_every` steps (the one regular host
synchronisation) and times the steps.
"""

import collections
import contextlib
import dataclasses
import functools
import math
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import TypeCheckError

from ..data import DeviceLoader, GrainLoader, TokenWindows, TorchLoader, take_rows
from ..debug import describe_nan_error
from ..errors import DataError, NonFiniteError, Preempted
from ..parallel import Leaves, Placement, bytes_on_first_device, one_device
from ..provenance import CompileTimer
from ..services import StopSignals
from ._compiled import CompiledTrainer, compiled_trainer
from ._state import SupervisedStep
from ._stats import HostStats, Layout, StepStats
from ._step import AbstractTrainState, Step

Hook = Callable[["StepInfo"], None]


@dataclasses.dataclass
class StepInfo:
    """What a hook sees at a stop of the loop.

    - `step`, `num_steps`: steps taken so far, and in all; `final`: whether this is the last stop.
    - `record`: the numbers of this stop, logged by the tracking hook: `train/...` and `steps_per_s`
      when the train metrics were fetched here (in a population, `train/loss` is the members' mean
      and `train/member_loss` their values), and whatever earlier hooks added (`test/...`).
    - `state`: the train state on the host (built on first use; with several processes, every process
      must ask for it at the same stops: it may gather shards across them).
    - `saved_state`: fresh copies of the state's arrays where the placement keeps them, for a
      checkpoint (built on first use; every process asks for it at the same stops).
    - `stats`: the step statistics since the train metrics were last fetched, up to here (on the
      devices); `host_stats`: the same on the host (fetched on first use, once a stop); `logged`:
      whether `record` took their metrics here (a `log_every` stop: the next steps start afresh).
    - `first_bad_step()`: `(step, metric)` of the first non-finite step since the last fetch.
    - `window()`: the running metrics not yet logged, as a checkpoint header stores them.
    - `data_state()`: the host loader's own state at this step (a Grain iterator's), or None.
    - `finish(reason)`: end the run here as finished (early stopping): the later hooks of this stop
      see it `final` (the checkpoint saves it, marked finished), and fit returns.
    - `replace_state(state)`: go on from `state` instead, a state of the same structure (pruned
      weights, a synced target network, a new learning rate in `optax.inject_hyperparams`'s state):
      the later hooks of this stop (the checkpoint) and the next steps take it.
    """

    step: int
    num_steps: int
    record: dict[str, Any]
    trainer: CompiledTrainer
    leaves: Leaves
    stats: StepStats
    logged: bool = False
    data_state: Callable[[], Any] = lambda: None
    finished_early: str | None = None  # why a hook ended the run before `num_steps` (`finish`)

    @property
    def final(self) -> bool:
        return self.step == self.num_steps or self.finished_early is not None

    def replace_state(self, state: Any) -> None:
        """Train on from `state` (the structure of `self.state`), placed as the run places its state."""
        self.leaves = self.trainer.place(state)
        for built in ("state", "saved_state"):  # the cached copies are of the state replaced
            self.__dict__.pop(built, None)

    def finish(self, reason: str) -> None:
        """End the run at this stop as finished, for `reason` (say, no improvement for 5 evaluations)."""
        self.finished_early = reason

    @functools.cached_property
    def state(self) -> Any:
        return self.trainer.state(self.leaves)

    @functools.cached_property
    def saved_state(self) -> Any:
        return self.trainer.saved_state(self.leaves)

    @functools.cached_property
    def host_stats(self) -> HostStats:
        return self.trainer.host(self.stats).fetch()

    def first_bad_step(self) -> tuple[int, str | None]:
        return self.host_stats.first_bad_step, self.host_stats.bad_metric

    def window(self) -> dict[str, Any]:
        # After a log stop nothing is left unlogged: an empty window, made on the host.
        return (StepStats.init(self.stats.layout).fetch() if self.logged else self.host_stats).window()


@dataclasses.dataclass
class FitResult:
    state: Any  # the final train state (an `AbstractTrainState`)
    train_metrics: dict[str, Any]  # means over the last logging window (one value per member in a population)
    eval_metrics: dict[str, float] | None  # at the final step; of the EMA model when the state keeps one
    wall_seconds: float
    raw_eval_metrics: dict[str, float] | None = None  # of the trained (not averaged) model, when EMA is on
    state_bytes_per_device: int | None = None  # the train state's bytes on the first device (FSDP: ~1/N)
    steps_per_s: float | None = None  # over the last logging window (compile and hooks left out)
    val_metrics: dict[str, float] | None = None  # on the validation set, when the run has one
    compile_seconds: float | None = None  # JAX's tracing and compilation in the calls up to the first stop
    finished_early: str | None = None  # why a hook ended the run before its last step (`StepInfo.finish`)


class Engine:
    """The training loop. Build it with the step and where to train, add hooks, then `fit`.

    **Arguments:**

    - `step`: the `Step` it takes (`SupervisedStep(loss_fn)`, the default with the classification loss;
      a GAN's alternating updates, ...).
    - `placement`: where the state and batches live (`one_device()`, or `research.parallel`'s
      `make_placement`); the train data always yields global batches and results do not depend on it.
    - `log_every`: fetch the running means of the train metrics every so many steps (into
      `StepInfo.record` as `train/...`).
    - `steps_per_call`: steps per compiled call on device-resident data (`DeviceLoader`).
    - `skip_nonfinite`: skip steps one of whose `finite_metrics` is NaN/Inf (counted as `train/skipped`).
    - `debug_nans`: one step per call with `jax_debug_nans`, replaying a bad step op by op to name the
      operation that made the NaN (`NonFiniteError`); slow, one device only.
    - `population`: the state is a population (a leading member axis on every array).
    - `stop_signals`: while training, SIGTERM and SIGINT stop the run after the compiled call in
      flight: the hooks added with `on_preemption=True` run there (the checkpoint), then `Preempted`.
      The processes of a multi-process run stop together at the next stop (after its hooks), having
      agreed through one small all-gather per stop.
    """

    def __init__(
        self,
        step: Step | None = None,
        *,
        placement: Placement = one_device(),
        log_every: int = 100,
        steps_per_call: int = 1,
        skip_nonfinite: bool = False,
        debug_nans: bool = False,
        population: bool = False,
        stop_signals: bool = False,
    ):
        if debug_nans and not placement.on_one_device:
            raise ValueError("debug_nans replays steps op by op on one device; train without a parallel placement")
        self.step = SupervisedStep() if step is None else step
        self.placement, self.population = placement, population
        self.log_every, self.steps_per_call = log_every, steps_per_call
        self.skip_nonfinite, self.debug_nans, self.stop_signals = skip_nonfinite, debug_nans, stop_signals
        self.hooks: list[tuple[Hook, int | None, tuple[int, ...]]] = []
        self.preemption_hooks: list[Hook] = []

    def add_hook(
        self, hook: Hook, *, every: int | None = None, at: tuple[int, ...] = (), on_preemption: bool = False
    ) -> "Engine":
        """Call `hook(info)` every `every` steps and at the end (`every=None`: at every stop), or only
        at the steps `at` (say a profile's first and last), and, with `on_preemption`, where a signal
        stopped the run. A hook with a `close()` method (the checkpoint, the progress bar, the
        profile) is closed when fit ends, normally or not."""
        self.hooks.append((hook, every, tuple(at)))
        if on_preemption:
            self.preemption_hooks.append(hook)
        return self

    def fit(
        self,
        state: AbstractTrainState,
        train_data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows,
        num_steps: int,
        *,
        resume_window: dict[str, Any] | None = None,
        resume_data: Any = None,
    ) -> FitResult:
        """Train `state` (left untouched) until its step is `num_steps`; `resume_window` is the
        `window` of the checkpoint it came from, so a resumed run logs what an uninterrupted one would,
        and `resume_data` its host loader's state (`StepInfo.data_state`)."""
        start_time = time.perf_counter()
        with self._closing_hooks():  # also when placing the state or laying out the statistics fails
            trainer = self._trainer(state, train_data)
            traces_before = dict(trainer.num_traces)
            leaves, final, state_bytes, compile_seconds, finished_early = self._train(
                trainer, state, train_data, num_steps, resume_window, resume_data
            )
        _warn_on_retrace(trainer, traces_before)
        result = _result(trainer.state(leaves), final, time.perf_counter() - start_time, state_bytes)
        return dataclasses.replace(result, compile_seconds=compile_seconds, finished_early=finished_early)

    def _trainer(
        self, state: AbstractTrainState, train_data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows
    ) -> CompiledTrainer:
        member_batches = getattr(train_data, "members", None) is not None
        if member_batches and not self.population:
            raise ValueError("train_data has batches per member (DeviceLoader.for_members): train a population")
        return compiled_trainer(
            self.step,
            state,
            skip_nonfinite=self.skip_nonfinite,
            placement=self.placement,
            population=self.population,
            member_batches=member_batches,
        )

    def _train(
        self,
        trainer: CompiledTrainer,
        state: AbstractTrainState,
        train_data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows,
        num_steps: int,
        resume_window: dict[str, Any] | None,
        resume_data: Any,
    ) -> tuple[Leaves, dict[str, Any], int, float | None, str | None]:
        """The loop: the final leaves, the last record, the state's bytes a device, the compile seconds,
        and why a hook ended the run early (`StepInfo.finish`), if one did."""
        step = int(np.max(np.asarray(state.step)))
        leaves = trainer.place(state)  # fresh copies: the compiled steps donate them
        state_bytes = bytes_on_first_device(leaves)
        feed = _Feed(trainer, train_data, step, self.steps_per_call, self.debug_nans, resume_data)
        stats = feed.init_stats(leaves, resume_window)
        clock, final = _Clock(step, self.skip_nonfinite), {}
        with _nan_checks(self.debug_nans), _signals(self.stop_signals) as signals, CompileTimer() as compiling:
            alone = jax.process_count() == 1  # several processes may only stop where all of them stop
            while step < num_steps:
                until = self._next_stop(step, num_steps)
                leaves, stats, step = feed.advance(leaves, stats, step, until, signals if alone else None)
                compiling.freeze()  # the first stop's calls compiled the step: later ones reuse it
                logs = step % self.log_every == 0 or step == num_steps  # (never where a signal stopped early)
                info = StepInfo(step, num_steps, {}, trainer, leaves, stats, logs, feed.data_state)
                if step < until:  # `advance` stops early only when a signal came
                    assert signals is not None and signals.received is not None
                    self._preempted(info, signals.received)
                if logs:
                    info.record.update(clock.window_record(step, info.host_stats))
                    stats = feed.init_stats(leaves)
                with clock.paused():
                    self._run_hooks(info)
                    leaves = info.leaves  # (a hook may have replaced the state)
                    if signals is not None and not alone and step < num_steps:
                        received = _agreed_signal(signals)
                        if received:
                            self._preempted(info, received)
                final.update(info.record)
                if info.finished_early is not None:
                    return leaves, final, state_bytes, compiling.seconds, info.finished_early
        return leaves, final, state_bytes, compiling.seconds, None

    @contextlib.contextmanager
    def _closing_hooks(self) -> Iterator[None]:
        """When fit ends, normally or not, close the hooks that finish work in the background (the
        checkpoint's save in flight is committed before fit returns or raises)."""
        try:
            yield
        finally:
            closed = set()
            for hook, *_ in self.hooks:
                close = getattr(hook, "close", None)
                if close is not None and id(hook) not in closed:
                    closed.add(id(hook))
                    close()

    def _preempted(self, info: StepInfo, received: int) -> None:
        for hook in self.preemption_hooks:
            hook(info)
        saves = any(getattr(hook, "saves_state", False) for hook in self.preemption_hooks)
        saved = "; its checkpoint is saved" if saves else "; nothing was saved (no run directory)"
        name = signal.Signals(received).name
        raise Preempted(
            f"stopped by {name} at step {info.step} of {info.num_steps}{saved}: rerun the same "
            "command with --resume auto to continue",
            step=info.step,
            status=128 + received,
        )

    def _next_stop(self, step: int, num_steps: int) -> int:
        cadences = [self.log_every, *(every for _, every, _ in self.hooks)]
        points = [s for *_, at in self.hooks for s in at if s > step]
        return int(min(num_steps, *points, *(_next_multiple(step, every) for every in cadences)))

    def _run_hooks(self, info: StepInfo) -> None:
        for hook, every, at in self.hooks:
            if info.step in at if at else (every is None or info.final or info.step % every == 0):
                hook(info)


# Several devices: wait for the calls in flight after this many. XLA's CPU client starts each
# device's share of a call on a pool of max(cores, devices) threads, and a start blocks its thread
# while its device has 32 calls queued; a host far ahead then starves an all-reduce of the threads
# it needs, which deadlocks ("Expected 4 threads to join the rendezvous"). See test_parallel_deadlock.
MAX_CALLS_IN_FLIGHT = 16
BATCHES_AHEAD = 2  # host batches copied to the devices before the step that takes them


class _Feed:
    """Batches from the loader into compiled calls: device-resident data runs `steps_per_call` steps
    a call; host batches (a torch DataLoader, Grain, a token file's windows: this process's rows of each
    global batch), and every step under `debug_nans`, one step a call."""

    def __init__(
        self,
        trainer: CompiledTrainer,
        data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows,
        step: int,
        steps_per_call: int,
        debug_nans: bool,
        data_state: Any = None,
    ):
        self.trainer, self.data, self.debug_nans = trainer, data, debug_nans
        self.steps_per_call = 1 if debug_nans else steps_per_call
        self.calls = 0
        self.layout: Layout | None = None
        self.several_devices = not trainer.placement.on_one_device
        if isinstance(data, DeviceLoader):
            self.example = take_rows(data.host, np.zeros(data.index_shape, np.int32))  # shaped like a step's batch
            self.device_data = trainer.placement.put_data(data.host, data.arrays)
            self.ahead = None
        else:
            host_batches = _peeked(data.batches(step, data_state))
            self.example = next(host_batches)
            state = getattr(data, "state", lambda: None)
            self.ahead = _put_ahead(host_batches, trainer.placement.put_batch, state, BATCHES_AHEAD)
        self.taken_state = data_state

    def data_state(self) -> Any:
        """The host loader's state after the batches trained on so far (a Grain iterator's), else None."""
        return self.taken_state

    def stats_layout(self, leaves: Leaves) -> Layout:
        """The layout of the step statistics; every batch has the example's shapes, so it is worked
        out once (a few hundred microseconds a logging stop otherwise)."""
        if self.layout is None:
            try:
                self.layout = self.trainer.stats_layout(leaves, self.example)
            except TypeCheckError as e:
                raise DataError(_summarise_type_error(e)) from None
        return self.layout

    def init_stats(self, leaves: Leaves, window: dict[str, Any] | None = None) -> StepStats:
        """Zeroed statistics for the next steps (holding `window`, a checkpoint's unlogged one), placed."""
        layout = self.stats_layout(leaves)
        stats = StepStats.init(layout) if window is None else StepStats.from_window(window, layout)
        return self.trainer.placement.put_stats(stats)

    def advance(
        self, leaves: Leaves, stats: StepStats, step: int, until: int, signals: StopSignals | None = None
    ) -> tuple[Leaves, StepStats, int]:
        """Steps `step .. until` in compiled calls; stops early (returning the step reached) after the
        call in flight when `signals` caught a stop signal."""
        stopped = lambda: signals is not None and signals.received is not None  # noqa: E731
        if isinstance(self.data, DeviceLoader) and not self.debug_nans:  # (no host batches then)
            while step < until and not stopped():
                n = min(self.steps_per_call, until - step)
                indices = np.zeros((self.steps_per_call, *self.data.index_shape), np.int32)
                indices[:n] = self.data.step_indices(step, n)
                leaves, stats = self.trainer.run(
                    leaves, stats, self.device_data, self.trainer.placement.put_indices(indices), n
                )
                self._called(stats)
                step += n
            return leaves, stats, step
        while step < until and not stopped():
            leaves, stats = self._one_step(leaves, stats, step)
            self._called(stats)
            step += 1
        return leaves, stats, step

    def _called(self, stats: StepStats) -> None:
        self.calls += 1
        if self.several_devices and self.calls % MAX_CALLS_IN_FLIGHT == 0:
            jax.block_until_ready(stats)

    def _one_step(self, leaves: Leaves, stats: StepStats, position: int) -> tuple[Leaves, StepStats]:
        if isinstance(self.data, DeviceLoader):
            batch = self.data.step_batch(position)
            placed = self.trainer.placement.put_batch(batch)
        else:
            assert self.ahead is not None  # made for every host loader
            batch, placed, self.taken_state = next(self.ahead)
        before = self.trainer.placement.place(leaves) if self.debug_nans else None  # the step donates its inputs
        try:
            leaves, stats = self.trainer.step(leaves, stats, placed)
            if before is not None and stats.fetch().first_bad_step >= 0:
                # The statistics hold only finite values, so a NaN loss need not reach any output JAX
                # checks: replay the step op by op to find where it came from.
                self.trainer.replay_eagerly(before, batch)
        except FloatingPointError as error:
            if isinstance(error, NonFiniteError):
                raise
            raise NonFiniteError(describe_nan_error(error, f"training step {position + 1}")) from error
        return leaves, stats


def _put_ahead(
    batches: Iterator[Any], put: Callable[[Any], Any], state: Callable[[], Any], ahead: int
) -> Iterator[tuple[Any, Any, Any]]:
    """`(batch, its copy on the devices, the loader's state after it)` for each of `batches`, the copies made
    `ahead` batches before the step that takes them (an accelerator copies them while it computes)."""
    queue: collections.deque = collections.deque()
    for batch in batches:
        queue.append((batch, put(batch), state()))
        if len(queue) > ahead:
            yield queue.popleft()
    yield from queue


def _peeked(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches` whose first batch can be read (as the example the statistics are laid out for) and
    is then trained on like the others."""
    first = next(batches)
    yield first
    yield first
    yield from batches


class _Clock:
    """Steps per second over each logging window, leaving out the time the hooks take."""

    def __init__(self, step: int, count_skipped: bool):
        self.start, self.step, self.count_skipped = time.perf_counter(), step, count_skipped

    def window_record(self, step: int, stats: HostStats) -> dict[str, Any]:
        means = stats.means()
        record: dict[str, Any] = {f"train/{k}": _scalar(v) for k, v in means.items()}
        record.update({f"train/member_{k}": v.tolist() for k, v in means.items() if v.ndim})
        if self.count_skipped:
            record["train/skipped"] = stats.skipped
        now = time.perf_counter()
        record["steps_per_s"] = (step - self.step) / max(now - self.start, 1e-9)
        self.start, self.step = now, step
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - begin


def _scalar(value: np.ndarray) -> float:
    """A metric as one number: its mean over a population's members."""
    return float(np.mean(value))


def _agreed_signal(signals: StopSignals) -> int:
    """The stop signal any process of the run has received (0: none): every process calls this at
    the same stops, so they all stop at the same step."""
    received = multihost_utils.process_allgather(np.int32(signals.received or 0))
    return int(np.max(received))


@contextlib.contextmanager
def _signals(on: bool) -> Iterator[StopSignals | None]:
    if not on:
        yield None
        return
    with StopSignals() as signals:
        yield signals


@contextlib.contextmanager
def _nan_checks(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with jax.debug_nans(True):
        yield


def _result(state: AbstractTrainState, record: dict[str, Any], seconds: float, state_bytes: int) -> FitResult:
    def prefixed(prefix: str) -> dict[str, float] | None:
        found = {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}
        return found or None

    return FitResult(
        state,
        prefixed("train/") or {},
        prefixed("test/"),
        seconds,
        prefixed("test_raw/"),
        state_bytes,
        record.get("steps_per_s"),
        prefixed("val/"),
    )


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
    # typecheck's note gives the sizes behind `{self.in_size}`; JAX adds notes of its own (multi-line).
    notes = "; ".join(note for note in getattr(error, "__notes__", []) if note.startswith("where "))
    where_sizes = f" ({notes})" if notes else ""
    return (
        f"the data does not fit the model: {function} parameter '{parameter}' got {got}, expected {expected}"
        f"{where_sizes}"
    )


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
