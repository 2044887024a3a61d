"""What a sweep varies: `key=v1,v2` (a list of values) or `key=low:high[:log]` (a numeric range),
checked against the fields of an experiment's config, and turned into command-line flags."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..config import flag_name, option_fields, strip_optional, unknown_options
from ._runs import UsageError

# Options the sweep sets for every run itself: they cannot be swept or passed after `--`.
SET_BY_SWEEP = ("run_dir", "resume", "progress")


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric range `low:high[:log]` for a random or TPE search (of ints when `integer`)."""

    low: float
    high: float
    log: bool
    integer: bool


@dataclasses.dataclass(frozen=True)
class Axis:
    """One swept option: `values` (a grid's list, a search's categorical choices) or a `range`."""

    key: str
    hint: Any
    values: tuple[str, ...] = ()
    range: Range | None = None

    @property
    def points(self) -> tuple[str, ...]:
        """The values to check before starting: the list, or the range's two ends."""
        if self.range is None:
            return self.values
        kind = int if self.range.integer else float
        return (format_value(kind(self.range.low)), format_value(kind(self.range.high)))


def sweepable_fields(config_class: type) -> dict[str, Any]:
    """The config's option names (all but those the sweep sets) and their type hints, in `--help`'s
    order: the experiment's own options first, then its groups'."""
    return {name: hint for name, (_, hint) in option_fields(config_class).items() if name not in SET_BY_SWEEP}


def parse_axis(text: str, fields: dict[str, Any], experiment: str) -> Axis:
    """`lr=0.1,0.3` or `lr=1e-3:1e-1:log` as an `Axis` of one of `fields` (the options of `experiment` a
    sweep may vary); a bad key is a `UsageError`, said as a flag or a `--config` key would be."""
    key, sep, spec = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not spec:
        raise UsageError(f"{text!r} is not KEY=VALUES (like lr=0.1,0.3 or lr=1e-3:1e-1:log)")
    if key in SET_BY_SWEEP:
        raise UsageError(f"{key} is set by the sweep; the keys it varies: {', '.join(sorted(fields))}")
    if key not in fields:
        raise UsageError(unknown_options([key], fields, experiment))
    hint = fields[key]
    inner, _ = strip_optional(hint)
    if ":" in spec and inner in (int, float):
        return Axis(key, hint, range=_parse_range(key, spec, integer=inner is int))
    values = tuple(v.strip() for v in spec.split(","))
    if "" in values:
        raise UsageError(f"{key}={spec}: an empty value")
    return Axis(key, hint, values=tuple(dict.fromkeys(values)))


def _parse_range(key: str, spec: str, *, integer: bool) -> Range:
    parts = spec.split(":")
    log = parts[-1] == "log"
    if len(parts) - log != 2:
        raise UsageError(f"{key}={spec}: a range is LOW:HIGH or LOW:HIGH:log")
    try:
        low, high = (int(p) if integer else float(p) for p in parts[:2])
    except ValueError:
        raise UsageError(f"{key}={spec}: the ends of a range of {'int' if integer else 'float'}s are numbers") from None
    if not low < high:
        raise UsageError(f"{key}={spec}: LOW must be below HIGH")
    if log and low <= 0:
        raise UsageError(f"{key}={spec}: a log range needs LOW > 0")
    return Range(float(low), float(high), log, integer)


def format_value(value: Any) -> str:
    """A sampled value as it goes on the command line and into the run directory's name."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def flag_words(axis: Axis, value: str) -> list[str]:
    """`--lr 0.1`; `--tensorboard` / `--no-tensorboard` for a bool; a tuple's items split on spaces."""
    if strip_optional(axis.hint)[0] is bool:
        truth = value.lower()
        if truth not in ("true", "false", "1", "0", "yes", "no"):
            raise UsageError(f"{axis.key}={value}: {flag_name(axis.key)} takes true or false")
        prefix = "--" if truth in ("true", "1", "yes") else "--no-"
        return [prefix + axis.key.replace("_", "-")]
    return [flag_name(axis.key), *value.split()]


def check_passed_flags(flags: Sequence[str], axes: Sequence[Axis]) -> None:
    """Refuse flags after `--` that the sweep sets itself or that name a swept option."""
    taken = {key: "is set by the sweep" for key in SET_BY_SWEEP}
    taken.update({axis.key: "is swept" for axis in axes})
    for word in flags:
        name = word.split("=", 1)[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
        if word.startswith("--") and name in taken:
            raise UsageError(f"{word} after '--': {name} {taken[name]}")


def run_name(values: Sequence[tuple[str, str]]) -> str:
    """`lr=0.1,seed=0`: the run directory's name (slashes and spaces replaced by `_`)."""
    text = ",".join(f"{key}={value}" for key, value in values)
    return text.replace("/", "_").replace(" ", "_")
