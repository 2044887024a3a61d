"""Trackers: where logged metrics go (after Levanter's tracker interface).

A tracker has two methods, `log(step, metrics)` and `finish()`. `fit` sends every logged record to
the run directory's `metrics.jsonl` (`JsonlTracker`) and to any trackers it is given;
`TensorBoardTracker` writes TensorBoard event files through tensorboardX (the `tensorboard` extra).
Metric names are the same everywhere: `train/loss`, `train/accuracy`, `train/grad_norm`,
`test/loss`, `test/accuracy`, `lr` (when a schedule is given) and `steps_per_s`.
"""

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._rundir import RunDir

TENSORBOARD_MISSING = (
    "needs the tensorboardX package, which is not installed; install it with "
    "`.venv/bin/pip install -c requirements/constraints.txt -e '.[tensorboard]'`"
)


@runtime_checkable
class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number) as of training step `step`."""

    def finish(self) -> None:
        """Flush and close; the tracker is not used afterwards."""


class JsonlTracker:
    """One JSON object per call, `{"step": step, **metrics}`, appended to the run's `metrics.jsonl`."""

    def __init__(self, run: RunDir):
        self.run = run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self) -> None:
        pass


def tensorboard_problem() -> str | None:
    """`None` when tensorboardX can be imported, else what to do about it."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return TENSORBOARD_MISSING
    return None


class TensorBoardTracker:
    """Scalars to TensorBoard event files in `logdir` (`tensorboard --logdir runs/` shows each run).

    **Arguments:**

    - `logdir`: the directory of the event files (a run directory keeps them beside its metrics).
    - `purge_step`: when resuming from step `s`, pass `s + 1`: TensorBoard then drops the points an
      interrupted run logged after its last checkpoint, as `metrics.jsonl` does.
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError(f"TensorBoardTracker {TENSORBOARD_MISSING}") from None
        self._writer = SummaryWriter(logdir=str(logdir), purge_step=purge_step)
        self.logdir = Path(logdir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self._writer.add_scalar(name, float(value), global_step=step)
        self._writer.flush()  # a killed run keeps what it logged

    def finish(self) -> None:
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
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") else math.nan
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars
