"""Learning-curve plots (`curves.png`): every logged metric against the step (the loss and the accuracy
first, then the others: `grad_norm`, a GAN's `d_loss`, its `fid`, ...), training solid, test dashed.

`draw_curves(runs, out, title=...)` draws one plot. `CurveFigure` is the same figure kept for drawing
again: its axes, tick objects and the canvas's text and math layouts are made once, which makes each
further plot cheaper (`scripts/bench` case (f)). `CurvePool` draws many plots (a vmapped sweep's
members) in worker processes while the caller writes everything else.

This module imports matplotlib and the standard library only: a `CurvePool` worker runs this file
as a script (`python -P research/curves.py`), without importing `research` and JAX, so it starts in
the time of a matplotlib import. Keep it that way.
"""

import collections
import io
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Records = Sequence[dict[str, Any]]
CURVE_PANELS = ("loss", "accuracy")  # the panels of a classifier's runs, first in every plot that has them
COLUMNS = 3  # panels a row


def panels_of(runs: Sequence[tuple[Records, str]]) -> tuple[str, ...]:
    """The metrics the records of `runs` log as numbers, under `train/` or `test/`: the loss and the accuracy
    first, the others in name order (`CURVE_PANELS` when nothing is logged yet)."""
    names = {
        key.split("/", 1)[1]
        for records, _ in runs
        for record in records
        for key, value in record.items()
        if key.startswith(("train/", "test/")) and isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    if not names:
        return CURVE_PANELS
    return (*(name for name in CURVE_PANELS if name in names), *sorted(names - set(CURVE_PANELS)))


def curve(records: Records, name: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of metric `name` in logged `records`, leaving out records without a finite value."""
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [s for s, _ in points], [v for _, v in points]


class CurveFigure:
    """The learning-curve figure of `runs` runs, one colour each, one panel a metric of `panels`
    (`COLUMNS` a row), drawn with `draw` as often as needed.

    A plot drawn by a figure used before is pixel for pixel the plot a fresh figure draws (tested).
    """

    def __init__(self, runs: int, panels: tuple[str, ...] = CURVE_PANELS):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.panels = panels
        columns, rows = min(len(panels), COLUMNS), math.ceil(len(panels) / COLUMNS)
        self.figure = Figure(figsize=(5.5 * columns, 4.2 + 3.6 * (rows - 1)), dpi=110)
        # A canvas of its own: `savefig` would otherwise make one (and a renderer, whose caches of text
        # and math layouts start empty) for every plot.
        FigureCanvasAgg(self.figure)
        # Fixed margins: the constrained layout engine measured as half of the time of every run's plot.
        inch = 1 / self.figure.get_figheight()  # the one-row margins (0.12, 0.13 of 4.2 inches) in inches
        self.figure.subplots_adjust(
            left=0.06 * 2 / columns,
            right=0.99,
            bottom=0.5 * inch,
            top=1 - (0.55 if rows == 1 else 0.8) * inch,
            wspace=0.2,
            hspace=0.45,
        )
        grid = self.figure.subplots(rows, columns, squeeze=False).flatten()
        for unused in grid[len(panels) :]:
            unused.remove()
        self.axes = grid[: len(panels)]
        self.lines = [[self._run_lines(ax, i) for i in range(runs)] for ax in self.axes]
        for ax, metric in zip(self.axes, panels, strict=True):
            ax.set_xlabel("step")
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} (solid: train, dashed: test)", fontsize=10, y=1.0)  # y: no auto-placement (slow)
            ax.grid(True, alpha=0.3)
        self.title = self.figure.suptitle("")

    @staticmethod
    def _run_lines(ax: Any, i: int) -> tuple[Any, Any]:
        (train,) = ax.plot([], [], color=f"C{i}", linewidth=1.6)
        (test,) = ax.plot([], [], color=f"C{i}", linestyle="--", marker="o", markersize=4, linewidth=1.2)
        return train, test

    def draw(self, runs: Sequence[tuple[Records, str]], out: str | Path | io.BytesIO, *, title: str) -> None:
        """Plot `runs` (each its logged records and its label in the legend) into the PNG file `out`."""
        for ax, metric, lines in zip(self.axes, self.panels, self.lines, strict=True):
            for (records, label), (train, test) in zip(runs, lines, strict=True):
                train.set_data(*curve(records, f"train/{metric}"))
                train.set_label(label)
                test.set_data(*curve(records, f"test/{metric}"))
            self._scale(ax, metric)
        self.axes[0].legend(title="run", fontsize=9)
        self.title.set_text(title)
        if isinstance(out, io.BytesIO):
            self.figure.savefig(out, format="png")
            return
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        self.figure.savefig(out)  # in the format its name says (PNG for curves.png)

    @staticmethod
    def _scale(ax: Any, metric: str) -> None:
        from matplotlib.ticker import PercentFormatter

        values = [y for line in ax.get_lines() for y in line.get_ydata()]
        falls_far = metric.endswith("loss") and values and min(values) > 0 and max(values) / min(values) > 20
        ax.set_yscale("log" if falls_far else "linear")  # losses fall over orders of magnitude
        if metric == "accuracy":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.relim()
        ax.autoscale_view()


def draw_curves(runs: Sequence[tuple[Records, str]], out: str | Path, *, title: str) -> Path:
    """Plot `runs` (each its logged records and its label) into the PNG file `out`; returns its path."""
    CurveFigure(len(runs), panels_of(runs)).draw(runs, out, title=title)
    return Path(out)


Job = dict[str, Any]  # {"runs": [[records, label], ...], "out": path, "title": title}


class _Worker:
    """One worker process: this file run as a script, jobs in on stdin, a line out on stdout per plot drawn."""

    AHEAD = 2  # jobs handed to a worker at once: one it draws, one it reads next

    def __init__(self) -> None:
        self.errors = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-P", __file__],  # -P: this file's directory (research/) is not put on sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
        )
        self.in_flight = 0

    def take(self, queue: "collections.deque[Job]") -> None:
        """Count the plots drawn since last asked (without blocking), then hand over jobs from the front of `queue`."""
        out = self.process.stdout
        assert out is not None and self.process.stdin is not None
        while self.in_flight and select.select([out], [], [], 0)[0]:
            done = os.read(out.fileno(), 4096)
            if not done:  # the worker ended: `finish` says why
                return
            self.in_flight -= done.count(b"\n")
        while queue and self.in_flight < self.AHEAD:
            try:
                self.process.stdin.write((json.dumps(queue.popleft()) + "\n").encode())
                self.process.stdin.flush()
            except BrokenPipeError:
                return
            self.in_flight += 1

    def finish(self) -> str | None:
        """Wait until the worker has drawn what it was given; its error, if it failed."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the worker ends once it has drawn what it was sent
        except BrokenPipeError:
            pass
        assert self.process.stdout is not None
        self.process.stdout.read()  # its "drawn" lines, until it ends (its errors go to a file: no pipe to fill)
        self.process.stdout.close()
        self.process.wait()
        self.errors.seek(0)
        lines = self.errors.read().decode(errors="replace").strip().splitlines() or ["(no message)"]
        self.errors.close()
        return f"exit status {self.process.returncode}: {lines[-1]}" if self.process.returncode else None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout, self.errors):
            if pipe is not None:
                pipe.close()


class CurvePool:
    """Draws `curves.png` files in `processes` worker processes and here, one reused `CurveFigure` each.

    `draw` queues a plot and hands the workers what they can take; the caller goes on with its own
    work meanwhile. `close()` (or leaving the `with` block) draws here the plots no worker has taken
    yet, from the back of the queue while the workers take from the front, waits for the workers, and
    raises `RuntimeError` with a worker's error if one failed. Start it early: a worker takes the time
    of a matplotlib import to start.
    """

    def __init__(self, processes: int):
        self._here: dict[tuple[int, tuple[str, ...]], CurveFigure] = {}
        self._queue: collections.deque[Job] = collections.deque()
        self._workers = [_Worker() for _ in range(processes)]

    def draw(self, runs: Sequence[tuple[Records, str]], out: str | Path, *, title: str) -> None:
        """Queue a plot of `runs` into `out` (drawn at once when there are no workers)."""
        self._queue.append(
            {"runs": [[list(records), label] for records, label in runs], "out": str(out), "title": title}
        )
        self._hand_out()
        if not self._workers:
            self._draw_here(self._queue.pop())

    def _hand_out(self) -> None:
        for worker in self._workers:
            worker.take(self._queue)

    def _draw_here(self, job: Job) -> None:
        runs = [(records, label) for records, label in job["runs"]]
        _figure_for(self._here, runs).draw(runs, job["out"], title=job["title"])

    def close(self) -> None:
        while self._queue:
            self._draw_here(self._queue.pop())
            self._hand_out()
        failures = [problem for worker in self._workers if (problem := worker.finish())]
        self._workers = []
        if failures:
            raise RuntimeError(f"a process drawing curves.png failed ({'; '.join(failures)})")

    def terminate(self) -> None:
        """Stop the workers without waiting for their plots (the caller failed)."""
        for worker in self._workers:
            worker.kill()
        self._workers, self._queue = [], collections.deque()

    def __enter__(self) -> "CurvePool":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.terminate()


def plot_processes(plots: int) -> int:
    """How many `CurvePool` workers suit `plots` plots on this machine (which draws some itself): one
    per eight plots, at most one per core besides this process's and four in all; none for fewer than
    eight plots, which take about what a worker's start takes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(plots // 8, cores - 1, 4))


def _serve() -> None:
    """A `CurvePool` worker: draw each job read from stdin (one JSON object a line) until stdin closes."""
    # Ready before the first job comes: matplotlib imported, a one-run figure drawn once (fonts loaded).
    figures: dict[tuple[int, tuple[str, ...]], CurveFigure] = {}
    _figure_for(figures, [([], "")]).draw([([], "")], io.BytesIO(), title="")
    for line in sys.stdin:
        job = json.loads(line)
        runs = [(records, label) for records, label in job["runs"]]
        _figure_for(figures, runs).draw(runs, job["out"], title=job["title"])
        print("drawn", flush=True)


def _figure_for(figures: dict[tuple[int, tuple[str, ...]], CurveFigure], runs: Sequence[tuple[Records, str]]):
    """The figure of `runs` (their number and their metrics) in `figures`, made on first use."""
    key = (len(runs), panels_of(runs))
    if key not in figures:
        figures[key] = CurveFigure(*key)
    return figures[key]


if __name__ == "__main__":
    try:
        _serve()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
