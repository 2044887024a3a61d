"""Typed experiment configs: option groups held as fields.

An option group (`Training`, `Checkpointing`, `Devices`, `EMA`, `Tracking`, `FineTuning`) is a frozen
dataclass of options, each declared with `option(...)`. An experiment's config holds the groups it can
honour as fields and adds its own options: `RunConfig` holds the two every run takes (`training`,
`checkpointing`), `WithDevices`, `WithEMA` and `WithTracking` add one group each, and `TrainConfig`
holds those five; an experiment that fine-tunes a pretrained model holds `FineTuning` itself
(`fine_tuning: FineTuning = group(FineTuning)`; `research.train.fine_tuning.check_fine_tuning` and its neighbours
read it). To change a group's defaults, an experiment subclasses the group and holds that:

    @dataclasses.dataclass(frozen=True)
    class XorTraining(Training):
        lr: float = option(0.1, "SGD learning rate", check=positive, vmappable=True)

    @dataclasses.dataclass(frozen=True)
    class Config(TrainConfig):
        training: XorTraining = group(XorTraining)
        epochs: int = option(10, "passes over the training set", check=positive, resumable=True)

Code reads an option through its group (`config.training.lr`, `config.devices.parallel`), and a
function that reads one group takes that group. A config lacks the groups it does not take (there is
no fallback): `devices_of`, `ema_of` and `tracking_of` say what a config without one means (one
device in one process; no EMA; metrics.jsonl alone). Option names are unique across a config's
groups, so a config also has a flat view: the command line (`--lr`), `--config` files, config.json
and the trackers name every option by its name alone (`option_fields`, `to_dict`, `from_dict`,
`from_options`, `replace`), as they did before the groups were nested.

Every option is checked when its group is built (`ConfigError`, naming the flag), and every check
that spans several options lives in one place, `check_combination`, run when a whole config is
built. An experiment whose unset options take values that depend on others (mnist1d's per-model
recipe) gives its config a `resolved()` method (`Recipes`); `from_dict`, which every way of building
a config from its options goes through (the command line, `--config`, `load_run`, `from_options`),
calls it, so nothing downstream sees an unset recipe option. The command line is generated from
these classes by `research.cli`.
"""

import dataclasses
import difflib
import functools
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from .errors import ConfigError
from .services import Headline, tensorboard_problem, trackers_problem

Resume = Literal["auto", "must"] | None


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def open_unit_interval(value: Any) -> str | None:
    return None if 0 < value < 1 else "must be in (0, 1)"


def closed_unit_interval(value: Any) -> str | None:
    return None if 0 <= value <= 1 else "must be in [0, 1]"


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


def config_name(config_class: type) -> str:
    """What messages call a config class: its experiment's name for an experiment's `Config` (`xor`), else
    the class's name (`TrainConfig`)."""
    if config_class.__name__ != "Config":
        return config_class.__qualname__
    script = getattr(sys.modules.get(config_class.__module__), "__file__", None)  # the experiment's script
    return Path(script).stem if script else config_class.__module__.rpartition(".")[2]


def unknown_options(unknown: Sequence[str], known: Iterable[str], owner: str, spell: Callable[[str], str] = str) -> str:
    """The one message for options that `owner` (an experiment) does not have, wherever they were given,
    each spelled as it was (`spell`: `flag_name` for flags): `--epoch is not an option of xor (did you mean
    --epochs?)` on the command line, `epoch is not an option of xor (did you mean epochs?)` from Python or
    a config file; with no close name, the options instead."""
    known = sorted(known)
    close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
    several = len(unknown) > 1
    meant = [spell(match[0]) + (f" for {spell(name)}" if several else "") for name, match in close.items() if match]
    tail = f" (did you mean {', '.join(meant)}?)" if meant else f"; its options: {', '.join(map(spell, known))}"
    return f"{', '.join(map(spell, unknown))} {'are not options' if several else 'is not an option'} of {owner}{tail}"


def group(group_class: type) -> Any:
    """A config field holding an option group, built with its defaults unless given."""
    return dataclasses.field(default_factory=group_class, metadata={"group": True})


def is_group(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("group"))


OptionsT = TypeVar("OptionsT", bound="Options")


class Options:
    """The base of every option group and config: checks each option when built, and a whole config's
    combination of options (`check_combination`)."""

    if typing.TYPE_CHECKING:  # each subclass is a dataclass (`dataclasses.fields`, `replace` take it)
        __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        if isinstance(self, Checkpointing):
            object.__setattr__(self, "resume", _resume_mode(self.resume))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if is_group(field):
                if not isinstance(value, hints[field.name]):
                    raise ConfigError(f"{field.name} must be a {hints[field.name].__name__} (got {value!r})")
            else:
                check_option(field, value, hints[field.name])
        if isinstance(self, RunConfig):
            check_combination(self)

    def to_dict(self) -> dict[str, Any]:
        """Every option by its name alone (`lr`, not `training.lr`), as the command line, `--config` files,
        config.json and the trackers name them, in `--help`'s order (`option_fields`)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if not is_group(field)}
        for field in dataclasses.fields(self):
            if is_group(field):
                values.update(getattr(self, field.name).to_dict())
        return {name: values[name] for name in option_fields(type(self))}

    @classmethod
    def from_dict(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
        """A config of this class from its options by name (`{"lr": 0.3}`), or nested by group (`{"training":
        {"lr": 0.3}}`); an option not given takes its default, a list an option of tuples holds (from
        JSON) becomes a tuple, and recipe options are resolved (`Recipes`). `ConfigError` names any key
        that is not an option."""
        flat = flat_options(cls, values)
        unknown = [name for name in flat if name not in option_fields(cls)]
        if unknown:
            raise ConfigError(unknown_options(unknown, option_fields(cls), config_name(cls)))
        config = _build(cls, flat)
        if isinstance(config, Recipes):
            return config.resolved()
        return config

    @classmethod
    def from_options(cls: type[OptionsT], **options: Any) -> OptionsT:
        """`from_dict(options)`: `xor.Config.from_options(lr=0.3, run_dir="r")`."""
        return cls.from_dict(options)

    def replace(self: OptionsT, **options: Any) -> OptionsT:
        """This config with some options (by name, whatever group holds them) changed; recipes are not
        resolved again (`dataclasses.replace` for a config of groups)."""
        unknown = [name for name in options if name not in option_fields(type(self))]
        if unknown:
            raise ConfigError(unknown_options(unknown, option_fields(type(self)), config_name(type(self))))
        return _build(type(self), {**self.to_dict(), **options})


@typing.runtime_checkable
class Recipes(Protocol):
    """A config whose unset (`None`) options take values that depend on other options (mnist1d's
    per-model recipe): `resolved()` returns it with each of them set. `Options.from_dict` resolves
    every config it builds, so code handed a parsed config never calls it."""

    def resolved(self) -> Any: ...


def _build(config_class: type[OptionsT], flat: Mapping[str, Any]) -> OptionsT:
    """`config_class` with the options in `flat` (by name) and defaults elsewhere, each group built and
    checked first."""
    hints = typing.get_type_hints(config_class)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_class):
        if is_group(field):
            values[field.name] = _build(hints[field.name], flat)
        elif field.name in flat:
            value = _resume_mode(flat[field.name]) if field.name == "resume" else flat[field.name]
            if isinstance(value, list) and typing.get_origin(strip_optional(hints[field.name])[0]) is tuple:
                value = tuple(value)
            values[field.name] = value
    return config_class(**values)


def _resume_mode(value: Any) -> Any:
    """`--resume` as Python may spell it: True is "must", False and "never" are None."""
    return ("must" if value is True else None) if value in (True, False, "never") else value


def flat_options(config_class: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` by option name: a group's mapping (`{"training": {"lr": 0.3}}`) spread into its options;
    a name that is not one of that group's stays dotted (`training.nope`), for the caller to refuse."""
    hints = typing.get_type_hints(config_class)
    groups = {f.name: hints[f.name] for f in dataclasses.fields(config_class) if is_group(f)}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in groups and isinstance(value, Options):
            value = value.to_dict()
        if key in groups and isinstance(value, Mapping):
            own = option_fields(groups[key])
            flat.update({name if name in own else f"{key}.{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return flat


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
    early_stopping: int = option(
        0,
        "end the run as finished once the experiment's headline metric (the validation set's when the run "
        "has one) has not bettered its best in this many evaluations in a row; needs --eval-every (0: off)",
        check=non_negative,
        resumable=True,
    )
    grad_accum: int = option(
        1,
        "take each step's gradient in this many parts of the batch, one after another: the same step with the "
        "activation memory of one part (parts of each device's rows, or of each --micro-batches micro-batch)",
        check=positive,
    )
    precision: Literal["float32", "bf16"] = option(
        "float32",
        "bf16: the loss's forward and backward pass in bfloat16, with float32 parameters, optimizer state and outputs",
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
        "micro-batch on its own); on a GPU it also sets XLA's --xla_gpu_deterministic_ops",
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
        "a group name for the trackers (W&B's group, an MLflow tag); a sweep gives its runs the sweep's name",
        resumable=True,
    )
    profile_steps: str | None = option(
        None,
        "A:B: write a jax.profiler trace of steps A..B (A steps taken to B) into the run directory's "
        "profile/ (TensorBoard's profile plugin, Perfetto)",
        check=_profile_steps,
        resumable=True,
    )


def _names_what_trains(value: str) -> str | None:
    return None if value else "must name what trains (all: everything)"


@dataclasses.dataclass(frozen=True)
class FineTuning(Options):
    """Where the model starts and what of it trains: a pretrained model, part of it, or low-rank adapters."""

    init_from: str | None = option(
        None, "start from a pretrained model: a Hugging Face save_pretrained directory, or a run of this experiment"
    )
    trainable: str = option(
        "all",
        "what trains: all, head (the output layer), or a regular expression searched in the parameters' names "
        "(norm, blocks.mlp_, ...); the rest keeps its weights and takes no optimizer state",
        check=_names_what_trains,
    )
    lora_rank: int = option(
        0,
        "adapt the blocks' linear layers with low-rank updates of this rank, which alone train (LoRA; 0: off); "
        "merged into the weights on export",
        check=non_negative,
    )
    lora_targets: str = option(
        "attention|mlp_", "a regular expression searched in the linear layers' names: those --lora-rank adapts"
    )
    lora_alpha: float = option(16.0, "LoRA's updates are scaled by --lora-alpha / --lora-rank", check=positive)


GROUPS: tuple[type[Options], ...] = (Training, Checkpointing, Devices, EMA, Tracking, FineTuning)


@dataclasses.dataclass(frozen=True)
class RunConfig(Options):
    """The option groups every run takes: how it trains, where it lives and saves. An experiment's config
    subclasses it with the optional groups it honours (`WithDevices`, `WithEMA`, `WithTracking`, or
    `TrainConfig` for all of them), replaces a group by its own subclass to change the group's
    defaults, and adds its own options.

    `headline` (a class variable, not an option) names the evaluation metric the experiment's runs are
    judged by and its direction (`Headline("accuracy")`, `Headline("fid", goal="min", percent=False)`): the
    summary line, the best checkpoint kept, `scripts/compare_runs` and `scripts/sweep`'s objective use it.
    Every experiment declares one (`headline_of`)."""

    headline: typing.ClassVar[Headline | None] = None
    # False for an experiment whose `--batch-size` is not the rows the devices split (metalearn_lr's is its
    # inner runs' batch; its population's members are what its devices take): the batch checks then skip it.
    batch_splits_over_devices: typing.ClassVar[bool] = True
    training: Training = group(Training)
    checkpointing: Checkpointing = group(Checkpointing)


@dataclasses.dataclass(frozen=True)
class WithDevices(RunConfig):
    """A config that takes the device and process options (data parallelism, several processes)."""

    devices: Devices = group(Devices)


@dataclasses.dataclass(frozen=True)
class WithEMA(RunConfig):
    """A config that takes `--ema-decay`."""

    ema: EMA = group(EMA)


@dataclasses.dataclass(frozen=True)
class WithTracking(RunConfig):
    """A config that takes the tracking options (`--tracker`, `--profile-steps`, ...)."""

    tracking: Tracking = group(Tracking)


@dataclasses.dataclass(frozen=True)
class TrainConfig(WithDevices, WithEMA, WithTracking):
    """Every option group: the config of an experiment that honours them all."""


def headline_of(config: type[RunConfig] | RunConfig) -> Headline:
    """The headline an experiment's config declares; refused, before any work, when it declares none."""
    config_class = config if isinstance(config, type) else type(config)
    if config_class.headline is None:
        raise ConfigError(
            f"{config_class.__module__}.{config_class.__name__} declares no headline, the number its runs are judged "
            'by: give it `headline: ClassVar[Headline] = Headline("accuracy")` (or the metric its evaluation reports)'
        )
    return config_class.headline


def devices_of(config: RunConfig) -> Devices:
    """The device options of `config`; an experiment that takes none runs on one device in one process."""
    return config.devices if isinstance(config, WithDevices) else Devices()


def ema_of(config: RunConfig) -> EMA:
    """The EMA options of `config`; an experiment that takes none keeps no EMA."""
    return config.ema if isinstance(config, WithEMA) else EMA()


def tracking_of(config: RunConfig) -> Tracking:
    """The tracking options of `config`; an experiment that takes none writes metrics.jsonl alone."""
    return config.tracking if isinstance(config, WithTracking) else Tracking()


def group_index(group_class: type) -> int:
    """Where a group (or a subclass of one) comes in `GROUPS`, an experiment's own group after them: the
    order of `--help` and of the flat view."""
    return next((i for i, standard in enumerate(GROUPS) if issubclass(group_class, standard)), len(GROUPS))


@functools.cache
def option_fields(config_class: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every option of a config class (or of a group) by name, with its type hint: the config's own
    options first, then its groups' in `GROUPS` order. A name two groups (or a group and the config)
    both declare is a `TypeError`: the command line and config.json name options by name alone."""
    hints = typing.get_type_hints(config_class)
    fields = sorted(dataclasses.fields(config_class), key=lambda f: group_index(hints[f.name]) if is_group(f) else -1)
    found: dict[str, tuple[dataclasses.Field, Any]] = {}
    for field in fields:
        inner = option_fields(hints[field.name]) if is_group(field) else {field.name: (field, hints[field.name])}
        for name in inner.keys() & found.keys():
            raise TypeError(f"{config_class.__qualname__} has two options named {name!r}; rename one")
        found.update(inner)
    return found


def check_combination(config: RunConfig, processes: int | None = None) -> None:
    """Every check that spans several options, in one place; raises `ConfigError`.

    Run when a config is built (with the processes it names) and again by `run_experiment` once JAX
    knows how many processes joined (`processes`, which may come from $JAX_NUM_PROCESSES):

    - `--parallel none` trains on one device, not several devices or processes;
    - the batch splits evenly over all devices of all processes;
    - `--process-id` is below `--num-processes`;
    - `--debug-nans` replays steps op by op on one device, so it takes no data parallelism;
    - `--resume auto` needs `--run-dir`: a restarted job must find its own run, not the newest one;
    - `--deterministic-reduction`'s micro-batches split the batch, and the devices split them;
    - `--early-stopping` counts evaluations, so it needs `--eval-every`;
    - `--grad-accum`'s parts split each device's rows (each micro-batch's).
    """
    training, checkpointing, devices = config.training, config.checkpointing, devices_of(config)
    processes = processes or devices.num_processes or 1
    count = devices.devices * processes
    batch_size = training.batch_size if config.batch_splits_over_devices else None
    if devices.parallel == "none" and count > 1:
        raise ConfigError(f"--parallel none trains on one device, not {count}; pass --parallel sharded or pmap")
    if batch_size is not None and batch_size % count:  # None: an experiment's default, checked later
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by the {count} devices; pick a multiple of {count}"
        )
    process_id, num_processes = devices.process_id, devices.num_processes
    if process_id is not None and num_processes is not None and process_id >= num_processes:
        raise ConfigError(f"--process-id must be below --num-processes {num_processes} (got {process_id})")
    if training.debug_nans and (count > 1 or devices.parallel in ("pmap", "sharded", "fsdp")):
        raise ConfigError("--debug-nans replays steps op by op on one device; drop --devices and --parallel")
    if checkpointing.resume == "auto" and checkpointing.run_dir is None:
        raise ConfigError("--resume auto needs --run-dir: the directory a restarted job finds its run in")
    if devices.deterministic_reduction and devices.micro_batches % count:
        raise ConfigError(
            f"--micro-batches {devices.micro_batches} is not divisible by the {count} devices; "
            "pick a multiple of the device count"
        )
    if devices.deterministic_reduction and batch_size is not None and batch_size % devices.micro_batches:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by --micro-batches {devices.micro_batches}")
    split, splitter = (
        (devices.micro_batches, "--micro-batches") if devices.deterministic_reduction else (count, "devices")
    )
    if batch_size is not None and batch_size % (training.grad_accum * split):
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by --grad-accum {training.grad_accum} x {split} {splitter}"
        )
    if training.early_stopping and not training.eval_every:
        raise ConfigError(
            f"--early-stopping {training.early_stopping} counts evaluations, and this run evaluates only at its end; "
            "pass --eval-every N too"
        )


def micro_batches(devices: Devices) -> int | None:
    """The fixed micro-batch count of a `--deterministic-reduction` run; `None` without it."""
    return devices.micro_batches if devices.deterministic_reduction else None


def check_option(field: dataclasses.Field, value: Any, hint: Any) -> None:
    """Refuse (`ConfigError`, naming the flag) a value of the wrong type, or one its `check` refuses."""
    _check_type(field.name, value, hint)
    check = field.metadata.get("check")
    problem = check(value) if check is not None and value is not None else None
    if problem:
        got = "" if isinstance(value, bool) else f" (got {value!r})"
        raise ConfigError(f"{flag_name(field.name)} {problem}{got}")


def vmappable_options(config: Any) -> set[str]:
    """The options of `config` (or of its class) a vmapped population may vary (`option(vmappable=True)`)."""
    config_class = config if isinstance(config, type) else type(config)
    return {name for name, (field, _) in option_fields(config_class).items() if field.metadata.get("vmappable")}


def resumable_options(config: Any) -> set[str]:
    """The options of `config` (or of its class) a run may be resumed with changed (`option(resumable=True)`);
    a standard group's resumable option stays so in an experiment's group that changes its default
    (xor's `log_every`): resuming with it changed is a matter of what it means, not of its default."""
    config_class = config if isinstance(config, type) else type(config)
    standard = {
        name for group in GROUPS for name, (field, _) in option_fields(group).items() if field.metadata.get("resumable")
    }
    options = option_fields(config_class).items()
    return {name for name, (field, _) in options if field.metadata.get("resumable") or name in standard}


def config_differences(saved: Mapping[str, Any], config: RunConfig) -> list[tuple[str, Any, Any]]:
    """`(name, saved value, value now)` of each option of `config` that differs from `saved` (the `config`
    of a run's config.json, by option name, as every run has written it), leaving out the `resumable`
    ones: what keeps `--resume` from continuing that run."""
    saved = flat_options(type(config), saved)  # one nested by group, as a hand-written file may be
    current = json.loads(json.dumps(config.to_dict()))  # as config.json holds it: a tuple option is a list there
    # An option added after the run was saved trained it at its default.
    saved = {**{k: v for k, v in _defaults(type(config)).items() if k not in saved}, **saved}
    keys = sorted((set(saved) | set(current)) - resumable_options(config))
    return [(k, saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)]


def _defaults(config_class: type) -> dict[str, Any]:
    """Every option's default (of a config or an option group), as config.json holds it."""
    defaults = {}
    for field in dataclasses.fields(config_class):
        if is_group(field):
            defaults.update(_defaults(field.type) if isinstance(field.type, type) else {})
        elif field.default is not dataclasses.MISSING:
            defaults[field.name] = json.loads(json.dumps(field.default))
    return defaults


def check_resumable(saved: Mapping[str, Any], config: RunConfig, run: Any) -> None:
    """Refuse in one line (`ConfigError`) a `config` that would continue the run in `run` (whose
    config.json holds `saved`) with other values of options that are not `resumable`, naming them."""
    differences = config_differences(saved, config)
    if differences:
        had = " ".join(_as_flags(name, value) for name, value, _ in differences)
        given = " ".join(_as_flags(name, value) for name, _, value in differences)
        raise ConfigError(
            f"--resume: the run in {run} was trained with {had}, which cannot change when it resumes "
            f"(given: {given}); leave out {' '.join(flag_name(name) for name, *_ in differences)} to continue it, "
            f"or start a new run with --config {run}/config.json"
        )


def _as_flags(name: str, value: Any) -> str:
    """An option's value as the command line spells it (`--lr 0.1`, `--no-ema`, `--sizes 8 16`)."""
    if isinstance(value, bool):
        return flag_name(name) if value else "--no-" + flag_name(name)[2:]
    if value is None:
        return f"{flag_name(name)} (unset)"
    return " ".join([flag_name(name), *map(str, value if isinstance(value, list) else [value])])


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
