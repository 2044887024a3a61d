"""Typed experiment configs and the command line built from them.

An experiment's config is a frozen dataclass whose fields are declared with `option(...)`. The
command line is generated from it: `--batch-size` for `batch_size`, `--resume/--no-resume` for a
bool, choices for a `Literal`, `nargs` for a tuple. Every field is checked in `__post_init__`, so a
bad value is refused the same way from the shell (one line, exit status 2) and from Python
(`ConfigError`).
"""

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from .errors import ConfigError, ResearchInputError
from .train import tensorboard_problem

C = TypeVar("C", bound="TrainConfig")


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def _tensorboard_installed(value: bool) -> str | None:
    return tensorboard_problem() if value else None


def option(default: Any, help: str, *, check: Callable[[Any], str | None] | None = None) -> Any:
    """A config field: its default, its `--help` text, and an optional check returning an error."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Options shared by every experiment script."""

    seed: int = option(0, "root seed: model init, dropout and data order all derive from it")
    batch_size: int = option(128, "examples per training step", check=positive)
    lr: float = option(0.1, "learning rate", check=positive)
    run_dir: str | None = option(None, "run directory (default: runs/<experiment>/<UTC time>)")
    resume: bool = option(False, "continue from the latest valid checkpoint in --run-dir (default: the newest run)")
    log_every: int = option(100, "steps between logged training metrics", check=positive)
    eval_every: int = option(0, "steps between test evaluations (0: only at the end)", check=non_negative)
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)", check=non_negative)
    keep_checkpoints: int = option(3, "number of most recent checkpoints kept", check=positive)
    steps_per_call: int = option(1, "training steps per compiled call on device-resident data", check=positive)
    skip_nonfinite: bool = option(False, "skip steps with a NaN/Inf loss or gradient instead of stopping the run")
    ema_decay: float = option(0.0, "decay of an EMA of the weights (and BatchNorm statistics) that is evaluated as "
                                   "test/*, the trained model as test_raw/* (0: no EMA)", check=unit_interval)
    progress: bool = option(True, "show a progress bar (plain log lines when not on a terminal)")
    tensorboard: bool = option(False, "also write TensorBoard event files into the run directory",
                               check=_tensorboard_installed)
    debug_nans: bool = option(False, "turn on jax_debug_nans and stop at the first operation that makes a NaN "
                                     "(one step per compiled call: slow)")
    # -- devices and processes (research.parallel); none of them changes the numbers -------------
    devices: int = option(1, "devices per process; on the CPU, simulated host devices "
                             "(XLA_FLAGS=--xla_force_host_platform_device_count=N)", check=positive)
    parallel: Literal["auto", "none", "pmap", "sharded"] = option(
        "auto", "data parallelism: none (one device), pmap, sharded (jit over a device mesh); "
                "auto: none on one device, sharded otherwise")
    coordinator_address: str | None = option(
        None, "host:port of process 0 in a multi-process run; unset: $JAX_COORDINATOR_ADDRESS")
    num_processes: int | None = option(None, "processes in the run; unset: $JAX_NUM_PROCESSES, else 1",
                                       check=positive)
    process_id: int | None = option(None, "this process's index, 0 .. processes-1; unset: $JAX_PROCESS_ID",
                                    check=non_negative)
    distributed_timeout: int = option(
        60, "seconds to wait for all processes to start, and for a silent process before the others stop",
        check=positive)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = _field_type(type(self), field.name)
            _check_type(field.name, value, expected)
            check = field.metadata.get("check")
            problem = check(value) if check is not None and value is not None else None
            if problem:
                got = "" if isinstance(value, bool) else f" (got {value!r})"
                raise ConfigError(f"{flag_name(field.name)} {problem}{got}")
        devices = self.devices * (self.num_processes or 1)
        if self.parallel == "none" and devices > 1:
            raise ConfigError(f"--parallel none trains on one device, not {devices}; pass --parallel sharded or pmap")
        if self.batch_size is not None and self.batch_size % devices:  # None: an experiment's default, checked later
            raise ConfigError(
                f"--batch-size {self.batch_size} is not divisible by the {devices} devices; pick a multiple of {devices}"
            )
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ConfigError(f"--process-id must be below --num-processes {self.num_processes} (got {self.process_id})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _check_type(name: str, value: Any, tp: Any) -> None:
    tp, optional = _strip_optional(tp)
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


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: ...)` to each option's help, unless the help already says what the default is
    or the default is None (unset: the help says what happens then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default:" in text or action.default is None else super()._get_help_string(action)


def build_parser(config_class: type[TrainConfig], prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog, description=description or config_class.__doc__, formatter_class=_DefaultsHelpFormatter)
    for field in dataclasses.fields(config_class):
        tp, _ = _strip_optional(_field_type(config_class, field.name))
        kwargs: dict[str, Any] = {"default": field.default, "help": field.metadata.get("help", " "),
                                  "dest": field.name}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = typing.get_args(tp)
            kwargs["type"] = type(typing.get_args(tp)[0])
        elif typing.get_origin(tp) is tuple:
            kwargs["nargs"] = "*"
            kwargs["type"] = typing.get_args(tp)[0]
            kwargs["metavar"] = field.name.upper()
        else:
            kwargs["type"] = tp
        parser.add_argument(flag_name(field.name), **kwargs)
    return parser


def parse_config(config_class: type[C], argv: Sequence[str] | None = None, prog: str | None = None) -> C:
    """Parse the command line into `config_class`; on a bad value print one line and exit with 2."""
    parser = build_parser(config_class, prog=prog)
    namespace = vars(parser.parse_args(argv))
    for field in dataclasses.fields(config_class):
        if typing.get_origin(_strip_optional(_field_type(config_class, field.name))[0]) is tuple:
            namespace[field.name] = tuple(namespace[field.name])
    try:
        return config_class(**namespace)
    except ConfigError as e:
        parser.error(str(e))


def main_entry(main: Callable[[C], Any], config_class: type[C], argv: Sequence[str] | None = None) -> None:
    """Run `main(parse_config(...))` as a script. Bad input found inside `main` (`--resume` with no
    checkpoint, data that does not fit the model, a damaged or foreign checkpoint) exits with status 2,
    a non-finite loss with status 1, each with one line on stderr.

    Before `main`, `research.parallel.setup_devices` applies `--devices` (simulated CPU devices must be
    requested before JAX creates its first array) and joins the other processes of a multi-process
    run (`jax.distributed.initialize`)."""
    from .parallel import exit_together, setup_devices  # imports jax; its backends start after setup_devices

    config = parse_config(config_class, argv)
    prog = Path(sys.argv[0]).name
    with exit_together(prog):
        try:
            setup_devices(config)
            main(config)
        except ResearchInputError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except FloatingPointError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
