"""Typed experiment configs, composed of option groups.

An experiment's config is a frozen dataclass that inherits the option groups it can honour and adds
its own fields, each declared with `option(...)`:

    @dataclasses.dataclass(frozen=True)
    class Config(Training, Checkpointing, Devices, EMA, Tracking):
        epochs: int = option(10, "passes over the training set", check=positive, resumable=True)

Attribute access stays flat (`config.batch_size`, `config.devices`). An option of a group the
experiment does not take is not on its command line, and reads as that group's default, so the
layers below (`research.experiment`, the engine) can read any option of any config.

Every field is checked when the config is built (`ConfigError`, naming the flag), and every check that
spans several options lives in one place, `check_combination`. The command line is generated from
these classes by `research.cli`.
"""

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from .errors import ConfigError
from .train import tensorboard_problem, trackers_problem

Resume = Literal["auto", "must"] | None


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def open_unit_interval(value: Any) -> str | None:
    return None if 0 < value < 1 else "must be in (0, 1)"


def _tensorboard_installed(value: bool) -> str | None:
    return tensorboard_problem() if value else None


def option(
    default: Any,
    help: str,
    *,
    check: Callable[[Any], str | None] | None = None,
    resumable: bool = False,
    vmappable: bool = False,
) -> Any:
    """A config field.

    **Arguments:**

    - `default`: its value when not given.
    - `help`: its `--help` text; a text that says `default: ...` itself gets no generated default.
    - `check`: returns what is wrong with a (non-None) value, or None.
    - `resumable`: a run may be resumed with another value (how long it trains, where it logs, which
      devices): `--resume` refuses a config that differs from the run's in any other option.
    - `vmappable`: runs that differ only in such options can train as one vmapped population
      (`scripts/sweep --vmapped`): the option changes array values of the step-0 state and the
      shuffling, never a shape or the compiled program (a hyperparameter the optimizer keeps in its
      state through `optax.inject_hyperparams`; the seed).
    """
    return dataclasses.field(
        default=default, metadata={"help": help, "check": check, "resumable": resumable, "vmappable": vmappable}
    )


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class Options:
    """The base of every option group and config: checks each field and then `check_combination`."""

    if typing.TYPE_CHECKING:  # each subclass is a dataclass (`dataclasses.fields`, `replace` take it)
        __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        if "resume" in hints and self.resume in (True, False, "never"):  # from Python: resume=True is "must"
            object.__setattr__(self, "resume", "must" if self.resume is True else None)
        for field in dataclasses.fields(self):
            check_option(field, getattr(self, field.name), hints[field.name])
        check_combination(self)

    def __getattr__(self, name: str) -> Any:
        # Only reached for a name the config lacks: an option of a group it does not take reads as
        # that group's default (the layers below read every option of every config).
        if name in _GROUP_DEFAULTS:
            return _GROUP_DEFAULTS[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Training(Options):
    """How the model is trained."""

    seed: int = option(0, "root seed: model init, dropout and data order all derive from it", vmappable=True)
    batch_size: int = option(128, "examples per training step", check=positive)
    lr: float = option(0.1, "learning rate", check=positive)
    log_every: int = option(100, "steps between logged training metrics", check=positive, resumable=True)
    eval_every: int = option(
        0, "steps between test evaluations (0: only at the end)", check=non_negative, resumable=True
    )
    steps_per_call: int = option(1, "training steps per compiled call on device-resident data", check=positive)
    skip_nonfinite: bool = option(
        False, "skip steps with a NaN/Inf loss or gradient instead of stopping the run", resumable=True
    )
    progress: bool = option(True, "show a progress bar (plain log lines when not on a terminal)", resumable=True)
    debug_nans: bool = option(
        False,
        "turn on jax_debug_nans and stop at the first operation that makes a NaN (one step per compiled call: slow)",
        resumable=True,
    )


@dataclasses.dataclass(frozen=True)
class Checkpointing(Options):
    """Where a run lives, how often it saves, and resuming it."""

    run_dir: str | None = option(None, "run directory (default: runs/<experiment>/<UTC time>)", resumable=True)
    resume: Resume = option(
        None,
        "continue from the latest valid checkpoint in --run-dir. auto: resume when --run-dir holds a "
        "checkpoint, else start there (for a scheduler that restarts jobs); must (bare --resume): refuse "
        "when there is nothing to resume, and without --run-dir take the newest run; --no-resume or "
        "absent: never (default: never)",
        resumable=True,
    )
    checkpoint_every: int = option(
        0, "steps between checkpoints (0: only at the end)", check=non_negative, resumable=True
    )
    keep_checkpoints: int = option(3, "number of most recent checkpoints kept", check=positive, resumable=True)
    checkpoint_minutes: float = option(
        10.0,
        "also checkpoint at the first logging stop this many minutes after the last checkpoint, so a "
        "killed run loses bounded work (0: off)",
        check=non_negative,
        resumable=True,
    )


@dataclasses.dataclass(frozen=True)
class Devices(Options):
    """Devices, processes and compilation (research.parallel); none of them changes the numbers."""

    devices: int = option(
        1,
        "devices per process; on the CPU, simulated host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)",
        check=positive,
        resumable=True,
    )
    parallel: Literal["auto", "none", "pmap", "sharded", "fsdp"] = option(
        "auto",
        "data parallelism: none (one device), pmap, sharded (jit over a device mesh), fsdp (sharded, "
        "with the train state's large arrays split over the devices too); "
        "auto: none on one device, sharded otherwise",
        resumable=True,
    )
    deterministic_reduction: bool = option(
        False,
        "layout-invariant training: split each global batch into --micro-batches micro-batches whose gradients "
        "are summed in one fixed order, so the run gives the same bits on any device count and placement, "
        "and a run resumed on other devices continues it exactly (BatchNorm then normalises each "
        "micro-batch on its own)",
    )
    micro_batches: int = option(
        8,
        "micro-batches per global batch under --deterministic-reduction: it must divide --batch-size, and every "
        "device count the run uses (processes x --devices) must divide it",
        check=positive,
    )
    coordinator_address: str | None = option(
        None, "host:port of process 0 in a multi-process run; unset: $JAX_COORDINATOR_ADDRESS", resumable=True
    )
    num_processes: int | None = option(
        None, "processes in the run; unset: $JAX_NUM_PROCESSES, else 1", check=positive, resumable=True
    )
    process_id: int | None = option(
        None, "this process's index, 0 .. processes-1; unset: $JAX_PROCESS_ID", check=non_negative, resumable=True
    )
    distributed_timeout: int = option(
        60,
        "seconds to wait for all processes to start, and for a silent process before the others stop",
        check=positive,
        resumable=True,
    )
    compilation_cache: bool = option(
        True,
        "keep compiled programs in JAX's persistent compilation cache, so that a run started again skips "
        "most compilation: $RESEARCH_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/research/jax, else "
        "~/.cache/research/jax ($RESEARCH_COMPILATION_CACHE=0 turns it off too)",
        resumable=True,
    )


@dataclasses.dataclass(frozen=True)
class EMA(Options):
    """An exponential moving average of the weights."""

    ema_decay: float = option(
        0.0,
        "decay of an EMA of the weights (and BatchNorm statistics) that is evaluated as "
        "test/*, the trained model as test_raw/* (0: no EMA)",
        check=unit_interval,
    )


def profile_window(text: str) -> tuple[int, int]:
    """`(A, B)` of a `--profile-steps A:B` value (`ValueError` when it is not `A:B` with 0 <= A < B)."""
    start, colon, stop = text.partition(":")
    if not colon or not start.strip().isdigit() or not stop.strip().isdigit() or int(start) >= int(stop):
        raise ValueError(text)
    return int(start), int(stop)


def _profile_steps(value: str) -> str | None:
    try:
        profile_window(value)
    except ValueError:
        return "must be A:B, two step counts with A < B (say 10:20)"
    return None


@dataclasses.dataclass(frozen=True)
class Tracking(Options):
    """What a run records besides metrics.jsonl: trackers, a profile."""

    tracker: str = option(
        "jsonl",
        "where metrics go, a comma list of: jsonl (metrics.jsonl, always), tensorboard (event files in the "
        "run directory), wandb (Weights & Biases, offline in the run directory unless $WANDB_MODE says "
        "otherwise), mlflow (to --mlflow-uri)",
        check=trackers_problem,
        resumable=True,
    )
    tensorboard: bool = option(
        False,
        "also write TensorBoard event files into the run directory (as --tracker tensorboard)",
        check=_tensorboard_installed,
        resumable=True,
    )
    mlflow_uri: str | None = option(
        None,
        "MLflow tracking URI of --tracker mlflow (default: $MLFLOW_TRACKING_URI, else a SQLite database "
        "runs/mlflow.db with its artifacts in runs/mlartifacts/)",
        resumable=True,
    )
    group: str | None = option(
        None,
        "a group name for the trackers (W&B's group, an MLflow tag); scripts/sweep gives its runs the sweep's name",
        resumable=True,
    )
    profile_steps: str | None = option(
        None,
        "A:B: write a jax.profiler trace of steps A..B (A steps taken to B) into the run directory's "
        "profile/ (TensorBoard's profile plugin, Perfetto)",
        check=_profile_steps,
        resumable=True,
    )


GROUPS: tuple[type[Options], ...] = (Training, Checkpointing, Devices, EMA, Tracking)
_GROUP_DEFAULTS = {f.name: f.default for group in GROUPS for f in dataclasses.fields(group)}


@dataclasses.dataclass(frozen=True)
class TrainConfig(Training, Checkpointing, Devices, EMA, Tracking):
    """Every option group: the config of an experiment that honours them all."""


def check_combination(config: Any, processes: int | None = None) -> None:
    """Every check that spans several options, in one place; raises `ConfigError`.

    Run when a config is built (with the processes it names) and again by `run_experiment` once JAX
    knows how many processes joined (`processes`, which may come from $JAX_NUM_PROCESSES):

    - `--parallel none` trains on one device, not several devices or processes;
    - the batch splits evenly over all devices of all processes;
    - `--process-id` is below `--num-processes`;
    - `--debug-nans` replays steps op by op on one device, so it takes no data parallelism;
    - `--resume auto` needs `--run-dir`: a restarted job must find its own run, not the newest one;
    - `--deterministic-reduction`'s micro-batches split the batch, and the devices split them.
    """
    processes = processes or config.num_processes or 1
    devices = config.devices * processes
    if config.parallel == "none" and devices > 1:
        raise ConfigError(f"--parallel none trains on one device, not {devices}; pass --parallel sharded or pmap")
    if config.batch_size is not None and config.batch_size % devices:  # None: an experiment's default, checked later
        raise ConfigError(
            f"--batch-size {config.batch_size} is not divisible by the {devices} devices; pick a multiple of {devices}"
        )
    if None not in (config.process_id, config.num_processes) and config.process_id >= config.num_processes:
        raise ConfigError(
            f"--process-id must be below --num-processes {config.num_processes} (got {config.process_id})"
        )
    if config.debug_nans and (devices > 1 or config.parallel in ("pmap", "sharded", "fsdp")):
        raise ConfigError("--debug-nans replays steps op by op on one device; drop --devices and --parallel")
    if config.resume == "auto" and config.run_dir is None:
        raise ConfigError("--resume auto needs --run-dir: the directory a restarted job finds its run in")
    if config.deterministic_reduction and config.micro_batches % devices:
        raise ConfigError(
            f"--micro-batches {config.micro_batches} is not divisible by the {devices} devices; "
            "pick a multiple of the device count"
        )
    if config.deterministic_reduction and config.batch_size is not None and config.batch_size % config.micro_batches:
        raise ConfigError(
            f"--batch-size {config.batch_size} is not divisible by --micro-batches {config.micro_batches}"
        )


def micro_batches(config: Any) -> int | None:
    """The fixed micro-batch count of a `--deterministic-reduction` run; `None` without it."""
    return config.micro_batches if config.deterministic_reduction else None


def check_option(field: dataclasses.Field, value: Any, hint: Any) -> None:
    """Refuse (`ConfigError`, naming the flag) a value of the wrong type, or one its `check` refuses."""
    _check_type(field.name, value, hint)
    check = field.metadata.get("check")
    problem = check(value) if check is not None and value is not None else None
    if problem:
        got = "" if isinstance(value, bool) else f" (got {value!r})"
        raise ConfigError(f"{flag_name(field.name)} {problem}{got}")


def vmappable_options(config: Any) -> set[str]:
    """The fields of `config` (or of its class) a vmapped population may vary (`option(vmappable=True)`)."""
    return {f.name for f in dataclasses.fields(config) if f.metadata.get("vmappable")}


def resumable_options(config: Any) -> set[str]:
    """The fields of `config` (or of its class) a run may be resumed with changed (`option(resumable=True)`)."""
    return {f.name for f in dataclasses.fields(config) if f.metadata.get("resumable")}


def strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _check_type(name: str, value: Any, tp: Any) -> None:
    tp, optional = strip_optional(tp)
    if value is None:
        if not optional:
            raise ConfigError(f"{flag_name(name)} must be set")
        return
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(map(str, typing.get_args(tp)))
            raise ConfigError(f"{flag_name(name)} must be one of {choices} (got {value!r})")
    elif origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(f"{flag_name(name)} must be a tuple (got {value!r})")
    elif tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{flag_name(name)} must be a number (got {value!r})")
    elif isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{flag_name(name)} must be {tp.__name__} (got {value!r})")
