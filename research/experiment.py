"""What every experiment script does around the engine: the run directory, resume, the standard hooks,
the summary; `load_run`, which rebuilds a run's trained model from its directory; and `initial_model`, the
model `--init-from` starts a run from (a pretrained checkpoint, or another run's)."""

import dataclasses
import importlib.util
import json
import logging
import sys
import time
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from . import population
from .config import (
    EMA,
    ConfigError,
    RunConfig,
    Tracking,
    Training,
    check_combination,
    devices_of,
    ema_of,
    flat_options,
    headline_of,
    micro_batches,
    option_fields,
    profile_window,
    tracking_of,
)
from .curves import CurvePool
from .data import DeviceLoader, GrainLoader, HostLoader, TokenWindows, TorchLoader
from .errors import CheckpointError, Preempted
from .nn import LoRA
from .parallel import Placement, bytes_on_first_device, check_device_count, make_placement, population_placement
from .population import evaluate_population
from .progress import Progress
from .provenance import git_state, machine, parameter_counts, peak_memory, versions
from .report import plot_curves, run_summary, start_line, summary_line
from .run_plan import EvaluateOnly, Finished, Fresh, Resume, plan_run
from .services import (
    RUNS_ROOT,
    Ending,
    Headline,
    JsonlTracker,
    RunDir,
    load_checkpoint,
    tensorboard_problem,
    trackers_problem,
)
from .tracking import RunTrackers, open_trackers, run_files
from .train import (
    AbstractTrainState,
    Checkpoint,
    EarlyStopping,
    Engine,
    Evaluator,
    FitResult,
    Profile,
    ShowProgress,
    Step,
    SupervisedStep,
    add_standard_hooks,
)
from .train.evaluation import averaged_and_raw, check_labelled, evaluate_state
from .train.reduction import check_micro_batch_loss

logger = logging.getLogger(__name__)  # research.messages: what shows them, and where


def experiments_dir() -> Path:
    """Where the experiment scripts are: `research/experiments/` of an installed package (pyproject.toml
    ships `experiments/` there), else `experiments/` beside the source tree."""
    installed = Path(__file__).resolve().parent / "experiments"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "experiments"


EXPERIMENTS_DIR = experiments_dir()


def experiment_names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.py") if not p.stem.startswith("_"))


def experiment_script(name: str) -> Path:
    """The script of an experiment named `name` (`xor` is `experiments/xor.py`), or of a path to one."""
    path = Path(name) if name.endswith(".py") or "/" in name else EXPERIMENTS_DIR / f"{name}.py"
    if not path.is_file():
        raise ConfigError(f"no experiment {name!r} ({path} does not exist); available: {' '.join(experiment_names())}")
    return path


def load_experiment(name: str) -> types.ModuleType:
    """Import an experiment script by name (`xor` is `experiments/xor.py`) or by path, without running it."""
    path = experiment_script(name)
    spec = importlib.util.spec_from_file_location(f"experiments.{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"experiment {name!r}: {path} is not a Python script (it should end in .py)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_record(experiment: str, config: RunConfig, setup: "Setup", state: AbstractTrainState) -> dict[str, Any]:
    """What a run's config.json holds: the config, the resolved step count, the parameter counts of its
    networks (of one member in a population), the headline metric, the machine, library versions, the git
    commit, the command."""
    members = population.num_members(state) or None
    headline = headline_of(config)
    return {
        "experiment": experiment,
        "config": config.to_dict(),
        "resolved": {"num_steps": setup.num_steps, "steps_per_epoch": setup.train_data.steps_per_epoch},
        "parameters": {**network_parameters(state, members), **({"members": members} if members else {})},
        **({"headline": dataclasses.asdict(headline)} if headline != Headline() else {}),
        "machine": machine(devices_of(config).devices * jax.process_count()),
        "versions": versions(),
        "git": git_state(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
    }


def network_parameters(state: AbstractTrainState, members: int | None = None) -> dict[str, Any]:
    """`parameter_counts` of a state's one network (`{"total", "by_field"}` of its fields), or of several
    (`{"total", "by_field": {network: count}}`: a GAN's generator and discriminator)."""
    networks = state.networks()
    if len(networks) == 1:
        return parameter_counts(next(iter(networks.values())), members)
    totals = {name: parameter_counts(network, members)["total"] for name, network in networks.items()}
    return {"total": sum(totals.values()), "by_field": totals}


@dataclasses.dataclass
class Setup:
    """What one run trains, built without training: an experiment script's `setup(config)` returns it,
    its `main` hands it to `run_experiment`, and `scripts/show_jaxpr` uses it to trace one step.

    **Fields:**

    - `build_state`: makes the step-0 train state (when resuming, the skeleton a checkpoint fills): a
      `TrainState` for a `SupervisedStep`, else the step's own `AbstractTrainState`.
    - `train_data`: a `DeviceLoader`, a `TorchLoader`, a `GrainLoader` (batches are any pytree) or a
      `TokenWindows` (a token file's windows).
    - `num_steps`: the total number of training steps.
    - `eval_data`: a `DeviceLoader` or a torch `DataLoader` of numpy batches: the test set (`None`: none;
      the run then reports its train metrics).
    - `val_data`: a validation set like `eval_data` (`None`: none), evaluated with it, as `val/...`.
    - `step`: the `Step` the engine takes (`SupervisedStep(loss_fn)`; the classification loss by default).
    - `lr_schedule`: the optimizer's learning-rate schedule, when it has one (logged as `lr`).
    - `evaluator`: `(state, eval_data, progress=...) -> metrics` of the state it is given, the EMA's weights
      in it and then the trained ones (`averaged_and_raw`) when the run keeps an EMA (say,
      `research.train.evaluation.evaluate_language_model`, or one made by `research.train.batch_evaluator`);
      `None`: `evaluate_state` (classification), or `evaluate_population` for a population.
    - `summarize_run`: `(run, summary) -> numbers or None`: once training ended (on process 0; not
      when a finished run is only reported), numbers read from the whole run's `metrics.jsonl` (say,
      the first step a metric crossed a threshold, counting the steps before a resume) for its
      summary, and the experiment's own figures drawn into the run directory. A `--vmapped` sweep
      applies it to each member's run directory.
    - `draw`: `(state, run_dir) -> None`: the experiment's pictures of a trained state (say a grid of
      samples, `samples.png`) drawn into the run directory at every evaluation and when training ends
      (process 0). A population's members are drawn by `scripts/sweep --vmapped` into their own runs.
    - `eval_at`: the steps to evaluate (and draw) at, instead of every `--eval-every` steps (say each
      phase's own multiples of it, and its last step); the last step is always one. `()`: the cadence.
    - `hooks`: hooks that act on the run (`StepInfo.replace_state`, `StepInfo.finish`): called at every
      stop after the evaluations (they see their numbers) and before tracking and the checkpoint (which
      saves the state they leave). Not resumable: what they do must follow from the train state (its
      step, its arrays), as a resumed run calls them only from its checkpoint's step on.
    """

    build_state: Callable[[], AbstractTrainState]
    train_data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows
    num_steps: int
    eval_data: DeviceLoader | HostLoader | None = None
    step: Step = dataclasses.field(default_factory=SupervisedStep)
    lr_schedule: Callable[[int], Any] | None = None
    population: bool = False
    evaluator: Evaluator | None = None
    val_data: DeviceLoader | HostLoader | None = None
    summarize_run: Callable[[RunDir, dict[str, Any]], dict[str, Any] | None] | None = None
    draw: Callable[[Any, Path], None] | None = None
    eval_at: tuple[int, ...] = ()
    hooks: Sequence[Callable[[Any], None]] = ()

    def evaluate_with(self) -> Evaluator:
        """The evaluator this run uses."""
        if self.evaluator is not None:
            return self.evaluator
        return evaluate_population if self.population else evaluate_state


def initial_state(setup: Setup, ema: EMA) -> AbstractTrainState:
    """The step-0 train state a run trains (and the skeleton its checkpoints restore into):
    `setup.build_state()`, with an EMA of the model when `ema.ema_decay > 0` (unless it has one;
    in a population, one EMA per member). `ema` is the config's (`research.config.ema_of(config)`)."""
    state = setup.build_state()
    decay = ema.ema_decay
    if decay and state.ema is None:
        state = population.with_ema(state, decay) if setup.population else state.with_ema(decay)
    return state


def first_batch(data: DeviceLoader | TorchLoader | GrainLoader | TokenWindows) -> Any:
    """The batch of training step 0, as the train loop would see it."""
    if isinstance(data, DeviceLoader):
        return data.step_batch(0)
    return next(data.batches(0))


def _checked_for(placement: Placement, setup: Setup, state: AbstractTrainState) -> Placement:
    """`placement` as the run uses it (a population's members or rows split over its devices), checked
    against the run's state, batch and loss."""
    placement = _population_placement(setup, state, placement) if setup.population else placement
    placement.check(state.networks(), setup.train_data.batch_size)
    if placement.micro_batches is not None and isinstance(setup.step, SupervisedStep):
        check_micro_batch_loss(setup.step.loss_fn)
    return placement


def run_experiment(
    experiment: str,
    config: RunConfig,
    setup: Setup,
    *,
    summary_extra: dict[str, Any] | Callable[[FitResult], dict[str, Any]] | None = None,
    curves: CurvePool | None = None,
) -> dict[str, Any]:
    """Train, evaluate and record one run; returns (and writes to `summary.json`) its final numbers,
    with `summary_extra` (say, the privacy spent) added: a dict, or a function of the run's
    `FitResult` (say, tokens/s from its `steps_per_s`), and those of `setup.summarize_run`.

    The run directory gets `config.json` (with the resolved step count and library versions),
    `metrics.jsonl`, `checkpoints/`, `summary.json` and `curves.png` (and TensorBoard event files
    with `--tensorboard`). The engine's hooks are the standard ones, chosen from the config by
    `add_default_hooks`. `curves.png` is drawn by `curves` when given (a `research.curves.CurvePool`
    the caller closes: a vmapped sweep's, whose worker is idle when its population finishes).

    With `--ema-decay` above 0 the state gets an EMA of the model (unless `build_state` gave it
    one): `test_accuracy`/`test_loss` are then the EMA model's, and `test_raw_accuracy`/
    `test_raw_loss` the trained model's.

    Training runs on `--devices` devices per process with the `--parallel` strategy (build BatchNorm
    layers with `research.parallel.batch_axis_name(config.devices.parallel)`); a config without
    device options (`devices_of`) on one. With several processes every process trains and
    evaluates, and only process 0 writes the run directory.
    """
    headline_of(config)  # every experiment declares the number its runs are judged by
    devices = devices_of(config)
    check_device_count(devices.devices)
    placement = make_placement(devices.parallel, devices.devices, micro_batches(devices))
    check_combination(config, processes=jax.process_count())
    _check_profile_window(tracking_of(config), setup.num_steps)
    if config.training.grad_accum > 1:
        setup = dataclasses.replace(setup, step=setup.step.with_grad_accum(config.training.grad_accum))
    if config.training.precision != "float32":
        setup = dataclasses.replace(setup, step=setup.step.with_precision(config.training.precision))
    state = initial_state(setup, ema_of(config))
    placement = _checked_for(placement, setup, state)
    _check_early_stopping(config.training, setup)
    if setup.evaluator is None:  # the default evaluators read labels
        check_labelled(setup.val_data, "the validation data")
        check_labelled(setup.eval_data, "the test data")
    writer = jax.process_index() == 0
    plan = plan_run(experiment, config, num_steps=setup.num_steps, writer=writer)
    if isinstance(plan, Finished):
        if writer:
            logger.info(plan.note())
            print(summary_line(experiment, plan.summary, plan.run, headline_of(config)))
        return plan.summary
    state, header = _starting_state(plan, state, placement, writer)
    trackers = _open_trackers(experiment, config, plan.run, header.get("step", 0)) if writer else RunTrackers({})
    run = Run(experiment, config, setup, placement, plan, writer, trackers, header)
    ending: Ending = "failed"
    summary = None
    try:
        if writer:
            _start_run(run, state)
        summary = _run_and_summarize(run, state, summary_extra, curves=curves)
        ending = "finished"
        return summary
    except Preempted:
        ending = "killed"
        raise
    finally:
        trackers.close(ending, summary, run_files(plan.run))


@dataclasses.dataclass(frozen=True)
class Run:
    """One run as `run_experiment` carries it out, built once and read by each of its stages: the
    experiment's name, its config, what it trains (`setup`, its step with the config's precision and
    gradient parts), where (`placement`, checked for the state), the plan (`plan.run`: the run directory),
    whether this process writes the directory (process 0), its open trackers, and the header of the
    checkpoint it starts from (`{}` when it starts afresh)."""

    experiment: str
    config: RunConfig
    setup: Setup
    placement: Placement
    plan: Fresh | Resume | EvaluateOnly
    writer: bool
    trackers: RunTrackers
    header: dict[str, Any]

    @property
    def dir(self) -> RunDir:
        return self.plan.run


def _open_trackers(experiment: str, config: RunConfig, run: RunDir, start_step: int) -> RunTrackers:
    """Process 0's trackers; a resumed run continues the remote runs its config.json names."""
    previous = run.read_config().get("trackers", {}) if run.config_file.exists() else {}
    return open_trackers(experiment, config, run, runs_root=RUNS_ROOT, start_step=start_step, previous=previous)


def _starting_state(
    plan: Fresh | Resume | EvaluateOnly, state: AbstractTrainState, placement: Placement, writer: bool
) -> tuple[AbstractTrainState, dict[str, Any]]:
    """The state the run starts from (the step-0 `state`, or the plan's checkpoint restored into it)
    and that checkpoint's header; the `writer` drops the metrics logged after that step."""
    if isinstance(plan, Fresh):
        if plan.restart and writer:
            plan.run.truncate_metrics(after_step=0)
        return state, {}
    # Restored straight onto this run's devices, whatever it was saved from.
    state, header = load_checkpoint(plan.checkpoint, state, sharding=placement.restore_sharding)
    if writer:
        plan.run.truncate_metrics(after_step=header["step"])
        logger.info("resuming %s from step %s (%s)", plan.run.path, header["step"], plan.checkpoint.name)
    return state, header


def _population_placement(setup: Setup, state: AbstractTrainState, placement: Placement) -> Placement:
    """A population's placement on several devices: its members, or each batch, split over them."""
    member_batches = getattr(setup.train_data, "members", None) is not None
    members, rows = population.num_members(state), setup.train_data.batch_size
    return population_placement(placement, members=members, rows=rows, member_batches=member_batches)


def _start_run(run: Run, state: AbstractTrainState) -> None:
    """Process 0's start: the run directory cleared of interrupted saves, config.json, the start line.
    config.json keeps the identity of every tracker run the run has had, those not continued too (a
    resume given `--tracker` without one): resumed with it again, the run continues that one."""
    run.dir.create()
    run.dir.remove_uncommitted()  # an interrupted save's files; the saves of this run replace them
    record = config_record(run.experiment, run.config, run.setup, state)
    trackers = run.trackers.identities()
    had = run.dir.read_config().get("trackers", {}) if run.dir.config_file.exists() else {}
    run.dir.write_config({**record, "trackers": {**had, **trackers}})
    print(start_line(run.experiment, record, state, run.dir, trackers), flush=True)


def _run_and_summarize(
    run: Run, state: AbstractTrainState, summary_extra: Any, *, curves: CurvePool | None = None
) -> dict[str, Any]:
    """Train (or, checkpointed at its last step, only evaluate) and write the summary and curves.png."""
    start, setup, placement = time.perf_counter(), run.setup, run.placement
    result = _evaluate_finished(run, state) if isinstance(run.plan, EvaluateOnly) else _train(run, state)
    losses = tuple(name for name in setup.step.finite_metrics if not name.endswith("grad_norm"))
    summary = {"experiment": run.experiment, **run_summary(result, losses), "wall_seconds": time.perf_counter() - start}
    if result.finished_early is not None:
        summary["finished_early"] = result.finished_early
    if result.compile_seconds is not None:
        summary["compile_seconds"] = result.compile_seconds
    summary.update(peak_memory())
    if placement.name != "none":  # how the state is spread: FSDP holds about 1/N of it a device
        summary["state_bytes_per_device"] = result.state_bytes_per_device
    extra: Any = summary_extra(result) if callable(summary_extra) else summary_extra
    summary.update(extra or {})
    if run.writer:
        summary.update((setup.summarize_run(run.dir, summary) if setup.summarize_run is not None else None) or {})
        run.dir.write_summary(summary)
        plot_curves([run.dir], [run.dir.path.resolve().name], run.dir.path / "curves.png", pool=curves)
        print(summary_line(run.experiment, summary, run.dir, headline_of(run.config)))
    return summary


def _check_profile_window(tracking: Tracking, num_steps: int) -> None:
    if tracking.profile_steps:
        start, stop = profile_window(tracking.profile_steps)
        if stop > num_steps:
            raise ConfigError(f"--profile-steps {tracking.profile_steps} ends past the run's {num_steps} steps")


def _train(run: Run, state: AbstractTrainState) -> FitResult:
    """Train `state` (step 0, or restored with the checkpoint `run.header`) to `setup.num_steps` with the
    engine and the standard hooks of the config."""
    training, setup = run.config.training, run.setup
    engine = Engine(
        setup.step,
        placement=run.placement,
        log_every=training.log_every,
        steps_per_call=training.steps_per_call,
        skip_nonfinite=training.skip_nonfinite,
        debug_nans=training.debug_nans,
        population=setup.population,
        stop_signals=True,
    )
    start = int(np.max(np.asarray(state.step)))  # a population steps its members together
    add_default_hooks(engine, run, start=start)
    header = run.header
    return engine.fit(
        state, setup.train_data, setup.num_steps, resume_window=header.get("window"), resume_data=header.get("data")
    )


def add_default_hooks(engine: Engine, run: Run, *, start: int) -> None:
    """Add a run's standard hooks, chosen from its config, in the order they run (a later hook sees what
    an earlier one put in the record): the non-finite guard, evaluation (validation, then test), early
    stopping, tracking (metrics.jsonl and the `trackers`), progress, checkpoints (a step and a time
    cadence), the profile. Every process checkpoints its shards; process 0 alone logs, tracks and shows
    progress. `start` is the step the run starts from; its checkpoint's header gives the hooks' states. The
    assembly is `research.train.add_standard_hooks`, which `fit` uses too."""
    config, setup, writer, trackers = run.config, run.setup, run.writer, run.trackers
    training, checkpointing = config.training, config.checkpointing
    hook_states = run.header.get("hooks")
    header = {"experiment": run.experiment, "config": config.to_dict()}
    headline = headline_of(config)
    minutes = checkpointing.checkpoint_minutes
    resumable = _resumable_hooks(training, setup, headline)
    for name, hook in resumable.items():
        if hook_states and name in hook_states:
            hook.load_state_dict(hook_states[name])
    checkpoint = Checkpoint(run.dir, checkpointing.keep_checkpoints, header, 60 * minutes or None, headline, resumable)
    progress = training.progress and writer
    add_standard_hooks(
        engine,
        num_steps=setup.num_steps,
        start=start,
        run=run.dir,
        checkpoint=checkpoint,
        checkpoint_every=checkpointing.checkpoint_every,
        skip_nonfinite=training.skip_nonfinite,
        val_data=setup.val_data,
        eval_data=setup.eval_data,
        evaluator=setup.evaluate_with(),
        eval_every=training.eval_every,
        eval_at=setup.eval_at,
        show_progress=progress,
        drawing=Draw(setup.draw, run.dir.path, writer) if setup.draw is not None and not setup.population else None,
        acting=[*resumable.values(), *setup.hooks],
        trackers=[*([JsonlTracker(run.dir)] if writer else []), *([trackers] if trackers.trackers else [])],
        lr_schedule=setup.lr_schedule,
        progress=ShowProgress(
            Progress(setup.num_steps, initial=start, enabled=progress), start, shown_metrics(setup.step, headline)
        ),
        profile=_profile(tracking_of(config), run.dir, writer),
    )


def _resumable_hooks(training: Training, setup: Setup, headline: Headline) -> dict[str, EarlyStopping]:
    """The hooks that count across stops, by the name their state has in a checkpoint's header."""
    if not training.early_stopping:
        return {}
    watched = f"{'val' if setup.val_data is not None else 'test'}/{headline.metric}"
    return {"early_stopping": EarlyStopping(watched, training.early_stopping, headline.goal)}


def _check_early_stopping(training: Training, setup: Setup) -> None:
    if not training.early_stopping:
        return
    if setup.population:
        raise ConfigError(
            "--early-stopping ends a run at one step, and a population's members would stop at different "
            "ones; train them as separate runs (a sweep without --vmapped)"
        )
    if setup.eval_data is None and setup.val_data is None:
        raise ConfigError("--early-stopping watches an evaluation, and this experiment evaluates on no data")


@dataclasses.dataclass
class Draw:
    """The hook of `Setup.draw`: the state's pictures drawn into the run directory (by process 0; every
    process builds the state, which may gather its shards)."""

    draw: Callable[[Any, Path], None]
    directory: Path
    writer: bool

    def __call__(self, info: Any) -> None:
        state = info.state
        if self.writer:
            self.draw(state, self.directory)


def shown_metrics(step: Step, headline: Headline) -> tuple[str, ...]:
    """What the progress bar shows: the step's finite metrics but gradient norms (a supervised step's
    `train/loss`), `train/accuracy`, and the headline metric of the evaluation."""
    losses = [f"train/{name}" for name in step.finite_metrics if "grad_norm" not in name]
    return (*losses, "train/accuracy", f"test/{headline.metric}")


def _profile(tracking: Tracking, run: RunDir, writer: bool) -> Profile | None:
    """The `--profile-steps` window's profiler hook: every process traces into the run directory's
    `profile/` (process i > 0 into `profile/process_i`); process 0 says where its trace is."""
    if not tracking.profile_steps:
        return None
    start, stop = profile_window(tracking.profile_steps)
    index = jax.process_index()
    directory = run.path / "profile" / (f"process_{index}" if index else "")
    return Profile(directory, start, stop, done=_profile_hint(start, stop) if writer else lambda _: None)


def _profile_hint(start: int, stop: int) -> Callable[[Path], None]:
    def hint(directory: Path) -> None:
        perfetto = next(directory.glob("plugins/profile/*/perfetto_trace.json.gz"), None)
        logger.info(
            "profile of steps %s-%s: `tensorboard --logdir %s` (the Profile tab), or open %s in https://ui.perfetto.dev",
            start,
            stop,
            directory,
            perfetto or directory,
        )

    return hint


def _evaluate_finished(run: Run, state: AbstractTrainState) -> FitResult:
    """The result of a run whose training ended (its last checkpoint is at its last step, or marked
    `finished_early`) but that was stopped before it wrote its summary: its final model evaluated again,
    its last logged train metrics."""
    setup, placement = run.setup, run.placement
    arrays, rest = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    placed = placement.place(leaves)
    state = eqx.combine(jax.tree.unflatten(treedef, placement.gather(placed)), rest)  # restored FSDP shards: whole
    evaluator = setup.evaluate_with()
    metrics, raw = (None, None) if setup.eval_data is None else averaged_and_raw(evaluator, state, setup.eval_data)
    val = None if setup.val_data is None else evaluator(state.averaged(), setup.val_data)
    records = run.dir.read_metrics()
    last = records[-1] if records else {}
    train = {k[len("train/") :]: v for k, v in last.items() if k.startswith("train/")}
    return FitResult(
        state,
        train,
        metrics,
        0.0,
        raw,
        bytes_on_first_device(placed),
        steps_per_s=last.get("steps_per_s"),
        val_metrics=val,
        finished_early=run.header.get("finished"),
    )


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A trained run rebuilt from its directory by `load_run`, without training.

    **Fields:**

    - `path`: the run directory.
    - `experiment`: the experiment's name (`xor` is `experiments/xor.py`).
    - `config`: that script's `Config`, rebuilt from `config.json`.
    - `setup`: what the script's `setup(config)` returns: `setup.eval_data` is the run's test set.
    - `state`: the train state restored from `checkpoint` (a population's: its members stacked on a
      leading axis, as `research.population.stack_states` makes them).
    - `step`: the step of that checkpoint.
    - `checkpoint`: the newest valid checkpoint of the run.
    - `summary`: `summary.json` when it describes this state (the run finished at `step`), else `None`.

    `model`, `model_state` are the trained model's; `ema_model`, `ema_model_state` the EMA's
    (`None` when the run kept no EMA).
    """

    path: Path
    experiment: str
    config: RunConfig
    setup: Setup
    state: AbstractTrainState
    step: int
    checkpoint: Path
    summary: dict[str, Any] | None

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def model_state(self) -> Any:
        return self.state.model_state

    @property
    def ema_model(self) -> Any:
        return None if self.state.ema is None else self.state.ema.average[0]

    @property
    def ema_model_state(self) -> Any:
        return None if self.state.ema is None else self.state.ema.average[1]


def _rebuild_config(
    config_class: type[RunConfig], saved: dict[str, Any], where: Path, overrides: dict[str, Any]
) -> RunConfig:
    """`config_class` from the `config` of a run's config.json (by option name, as every run has written
    it; JSON lists back to tuples)."""
    values = {**flat_options(config_class, saved), **overrides}
    unknown = sorted(set(values) - set(option_fields(config_class)))
    if unknown:
        raise ConfigError(
            f"{where} has options that {config_class.__module__}.Config does not: "
            f"{', '.join(unknown)} (the experiment script changed since the run)"
        )
    return config_class.from_dict(values)


def _untracked(config_class: type[RunConfig], saved: dict[str, Any]) -> dict[str, Any]:
    """The options that turn off a saved run's trackers whose libraries this machine lacks: a loaded run
    tracks nothing, so a run trained with `--tracker wandb` on a cluster loads on a laptop without wandb."""
    values = flat_options(config_class, saved)
    off: dict[str, Any] = {}
    if values.get("tracker") and trackers_problem(values["tracker"]):
        off["tracker"] = "jsonl"
    if values.get("tensorboard") and tensorboard_problem():
        off["tensorboard"] = False
    return off


def load_run(run_dir: str | Path, **overrides: Any) -> LoadedRun:
    """The trained model of a run directory, rebuilt in one call without training.

    The config comes from `config.json` through the experiment script's `Config`; the skeleton from
    its `setup(config)` and `initial_state` (with the EMA of `--ema-decay`), traced for its shapes
    (`eqx.filter_eval_shape`) rather than computed; the arrays from the newest
    valid checkpoint (a damaged newer one is skipped with a warning). `setup` builds the run's data
    too (MNIST-1D from its cache in `--data-dir`, relative to the current directory: generated again
    where it is missing). A tracker whose library is not installed here (`--tracker wandb` trained on a
    cluster, loaded on a laptop) is left out of the loaded config: loading tracks nothing.

    **Arguments:**

    - `run_dir`: the run directory (`runs/xor/lr0.1`).
    - `overrides`: options to change from the saved config, say `data_dir="/data"`; one that changes
      the model does not fit the checkpoint (`CheckpointError`).

    **Raises:** `CheckpointError` when the directory holds no run or no valid checkpoint;
    `ConfigError` when `config.json` no longer fits the experiment script.
    """
    run = RunDir(run_dir)
    if not run.config_file.exists():
        raise CheckpointError(f"no run to load in {run.path}: it has no config.json")
    saved = run.read_config()
    checkpoint, problems = run.latest_valid_checkpoint()
    for problem in problems:
        warnings.warn(f"skipping {problem}", stacklevel=2)
    if checkpoint is None:
        found = f"{len(problems)} damaged checkpoint(s)" if problems else "no checkpoint"
        raise CheckpointError(
            f"no checkpoint to load in {run.checkpoints}: the run has {found} (it stopped before its first one?)"
        )
    module = load_experiment(saved["experiment"])
    untracked = _untracked(module.Config, saved["config"])
    config = _rebuild_config(module.Config, saved["config"], run.config_file, {**untracked, **overrides})
    setup = module.setup(config)
    # The skeleton's shapes only: drawing the step-0 arrays that the checkpoint's replace costs compilations.
    skeleton = eqx.filter_eval_shape(lambda: initial_state(setup, ema_of(config)))
    state, header = load_checkpoint(checkpoint, skeleton)
    summary = run.read_summary()
    if summary is not None and summary.get("step") != header["step"]:
        summary = None  # the run ended at a later step whose checkpoint is damaged
    return LoadedRun(
        path=run.path,
        experiment=saved["experiment"],
        config=config,
        setup=setup,
        state=state,
        step=header["step"],
        checkpoint=checkpoint,
        summary=summary,
    )


def saved_run_config(path: str | Path, experiment: str) -> RunConfig | None:
    """The config a run directory of `experiment` was started with (rebuilt through the experiment script's
    `Config`, nothing loaded), or `None` where `path` holds no run of ours (a Hugging Face directory has a
    config.json of its own).

    **Raises:** `ConfigError` in one line when `path` is a run of another experiment.
    """
    try:
        saved = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or "experiment" not in saved:
        return None
    if saved["experiment"] != experiment:
        raise ConfigError(f"--init-from {path} is a run of {saved['experiment']}, not of {experiment}")
    config_class = load_experiment(experiment).Config
    untracked = _untracked(config_class, saved["config"])
    return _rebuild_config(config_class, saved["config"], Path(path) / "config.json", untracked)


def initial_model(init_from: str | Path, experiment: str, read_pretrained: Callable[[Path], Any]) -> tuple[Any, Any]:
    """The model and model state (`None` for a stateless model) that `--init-from PATH` starts a run of
    `experiment` from: a run directory of `experiment` (its trained model, from `load_run`, with any LoRA
    adapters merged into its weights; not its EMA's), else a pretrained checkpoint that `read_pretrained(PATH)`
    reads (a Hugging Face directory: `research.nn.load_vit`, `load_gpt2`; stateless).

    **Raises:** `ConfigError` in one line when PATH is no directory, a run of another experiment, or a
    population's; `CheckpointError` when it holds no checkpoint `load_run` or `read_pretrained` can read.
    """
    path = Path(init_from)
    if not path.is_dir():
        raise ConfigError(
            f"--init-from {path}: no such directory (a run started from one reads it again to resume or to load)"
        )
    if saved_run_config(path, experiment) is None:  # no run of ours: a Hugging Face directory
        return read_pretrained(path), None
    run = load_run(path)
    if run.setup.population:
        raise ConfigError(f"--init-from {path} is a population of models: start from one member's run")
    model = run.model.merged() if isinstance(run.model, LoRA) else run.model
    return model, run.model_state
