"""Reading several run directories for the tools: checks, and short unique names for legends."""

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..services import RunDir


class UsageError(ValueError):
    """A bad argument to a tool; its `main` prints it on one line and exits with status 2."""


def open_runs(paths: Sequence[str | Path]) -> list[RunDir]:
    """`RunDir`s for `paths`, each of which must hold a run (a `config.json`)."""
    if not paths:
        raise UsageError("give at least one run directory")
    runs = []
    for path in map(Path, paths):
        if not (path / "config.json").exists():
            hint = " (a run directory holds config.json and metrics.jsonl)" if path.is_dir() else ""
            raise UsageError(f"{path} is not a run directory{hint}")
        runs.append(RunDir(path))
    return runs


def run_labels(runs: Sequence[RunDir]) -> list[str]:
    """Each run's directory name, with as many parent names as it takes to tell them apart."""
    parts = [run.path.resolve().parts for run in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(run.path) for run in runs]


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, error: Exception) -> NoReturn:
    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def within(low: int | float, high: int | float, kind: type) -> Callable[[str], Any]:
    """An argparse `type`: `kind(text)`, refused unless `low <= value <= high`."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value

    parse.__name__ = f"{kind.__name__} in {low}..{high}"  # argparse names the type in its message
    return parse
