"""Trackers: where logged metrics go (after Levanter's tracker interface).

A tracker has two methods, `log(step, metrics)` and `finish()`. `fit` sends every logged record to
the run directory's `metrics.jsonl` (`JsonlTracker`) and to any trackers it is given;
`TensorBoardTracker` writes TensorBoard event files through tensorboardX (the `tensorboard` extra),
`WandbTracker` a Weights & Biases run (`wandb`), `MlflowTracker` an MLflow run (`mlflow`). A tracker of
a whole run (a `RunTracker`) also takes the run's summary and files at its end, and finishes with how
the run ended. Metric names are the same everywhere: `train/loss`, `train/accuracy`,
`train/grad_norm`, `test/loss`, `test/accuracy`, `lr` (when a schedule is given) and `steps_per_s`;
a population's per-member values (`train/member_loss`, a list) go to the trackers other than
metrics.jsonl as one scalar per member, `train/member_loss/0`, `train/member_loss/1`, ...
"""

import math
import numbers
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from ..errors import ConfigError
from ..install import extra_problem, require_extra
from ._rundir import RunDir

Ending = Literal["finished", "failed", "killed"]  # how a run ended, as a RunTracker is told
LIBRARIES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}  # each tracker's package


def tracker_problem(name: str) -> str | None:
    """`None` when the library of the tracker `name` can be imported, else what to do about it."""
    return extra_problem(LIBRARIES[name]) if name in LIBRARIES else None


TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


def parse_trackers(text: str) -> tuple[str, ...]:
    """The trackers of a `--tracker` comma list, in their canonical order, `jsonl` always among them."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(TRACKERS))
    if unknown:
        raise ConfigError(
            f"--tracker: unknown tracker {', '.join(map(repr, unknown))}; choose from {', '.join(TRACKERS)}"
        )
    return tuple(name for name in TRACKERS if name in names | {"jsonl"})


def trackers_problem(text: str) -> str | None:
    """What is wrong with a `--tracker` value (an unknown name, a library that is not installed), or None."""
    try:
        names = parse_trackers(text)
    except ConfigError as e:
        return str(e).removeprefix("--tracker: ")
    for name in names:
        problem = tracker_problem(name)
        if problem:
            return f"{name} {problem}"
    return None


def tensorboard_problem() -> str | None:
    """`None` when tensorboardX can be imported, else what to do about it."""
    return tracker_problem("tensorboard")


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a record, as trackers of scalars take them: a list (a population's values, one a
    member) becomes `name/0`, `name/1`, ...; anything that is not a number is left out."""
    found = {}
    for name, value in metrics.items():
        if isinstance(value, (list, tuple)):
            found.update({f"{name}/{i}": float(v) for i, v in enumerate(value) if _is_number(v)})
        elif _is_number(value):
            found[name] = float(value)
    return found


# summary.json's names of what the records log as `PREFIX/metric`, longest first (`test_raw_loss` is `test_raw/loss`)
SUMMARY_PREFIXES = ("test_raw", "test", "val", "train")


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A run's summary as its trackers take it: each final number under the name its records log it by
    (summary.json's `test_accuracy` is `test/accuracy`, `train_loss` is `train/loss`), so that a metric has
    one name in a W&B or MLflow run; the summary's other facts (`step`, `wall_seconds`, ...) as they are."""
    renamed = {}
    for key, value in summary.items():
        prefix = next((p for p in SUMMARY_PREFIXES if key.startswith(f"{p}_")), None)
        renamed[f"{prefix}/{key.removeprefix(prefix + '_')}" if prefix else key] = value
    return renamed


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@runtime_checkable
class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number) as of training step `step`."""

    def finish(self) -> None:
        """Flush and close; the tracker is not used afterwards."""


@runtime_checkable
class RunTracker(Protocol):
    """A tracker of one whole run (what `--tracker` opens): its records, then its summary and files."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number) as of training step `step`."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Record the run's final numbers (its summary.json)."""

    def log_files(self, paths: Sequence[Path]) -> None:
        """Keep these files of the run (config.json, summary.json, curves.png) with it."""

    def finish(self, ending: Ending = "finished") -> None:
        """Close, saying how the run ended; the tracker is not used afterwards."""


class JsonlTracker:
    """One JSON object per call, `{"step": step, **metrics}`, appended to the run's `metrics.jsonl`."""

    def __init__(self, run: RunDir):
        self.run = run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self) -> None:
        pass


class TensorBoardTracker:
    """Scalars to TensorBoard event files in `logdir` (`tensorboard --logdir runs/` shows each run).

    **Arguments:**

    - `logdir`: the directory of the event files (a run directory keeps them beside its metrics).
    - `purge_step`: when resuming from step `s`, pass `s + 1`: TensorBoard then drops the points an
      interrupted run logged after its last checkpoint, as `metrics.jsonl` does.
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None):
        require_extra("TensorBoardTracker", "tensorboardX")
        from tensorboardX import SummaryWriter

        # tensorboardX names its file after the second: a run resumed within that second would write over it.
        self._writer = SummaryWriter(logdir=str(logdir), purge_step=purge_step, filename_suffix=f".{time.time_ns()}")
        self.logdir = Path(logdir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in scalars(metrics).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a killed run keeps what it logged

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Nothing to write: the final numbers are the last points of the curves."""

    def log_files(self, paths: Sequence[Path]) -> None:
        """Nothing to copy: the event files live in the run directory, beside the others."""

    def finish(self, ending: Ending = "finished") -> None:
        self._writer.close()


class MultiTracker:
    """Several trackers as one."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def read_tensorboard_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `path` (a file or a directory): name -> [(step, value)].

    Reads the TFRecord framing directly (8-byte length, 4-byte CRC, the `Event` proto, 4-byte CRC),
    so checking what was written needs no TensorFlow or TensorBoard install.
    """
    from tensorboardX.proto import event_pb2

    path = Path(path)
    files = sorted(path.glob("events.out.tfevents.*")) if path.is_dir() else [path]
    scalars: dict[str, list[tuple[int, float]]] = {}
    for file in files:
        data = file.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            length = int.from_bytes(data[offset : offset + 8], "little")
            # (event_pb2 is generated by protobuf at import: pyright cannot see its classes.)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])  # pyright: ignore[reportAttributeAccessIssue]
            offset += 12 + length + 4
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") else math.nan
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars
