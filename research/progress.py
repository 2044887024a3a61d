"""Progress reporting for every long loop (training, evaluation, data generation).

On a terminal: a tqdm bar with the rate and the time left; in a Jupyter notebook, tqdm's notebook bar.
Elsewhere (`CI=true`, output piped to a file): no bar, but one plain line per `report` call with the
same facts, so a log shows how fast a run goes and when it will end. This module sits below everything
else, so `research.data` may use it as well as `research.train`.
"""

import importlib.util
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def interactive() -> bool:
    """Progress bars on a terminal and in a Jupyter notebook (tqdm's widget, with ipywidgets installed);
    `CI=true` or piped output gets plain log lines instead."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return False
    return sys.stderr.isatty() or in_notebook()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel that can draw tqdm's notebook bar (an ipywidgets widget)."""
    shell = sys.modules.get("IPython")
    if shell is None or importlib.util.find_spec("ipywidgets") is None:
        return False
    ipython = shell.get_ipython()
    return ipython is not None and "IPKernelApp" in ipython.config


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def format_duration(seconds: float | int) -> str:
    """`0:00:07`, `1:02:03`: hours:minutes:seconds, `?` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_rate(rate: float) -> str:
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"


class Progress:
    """A tqdm bar over `total` units on a terminal; otherwise one line per `report` call on stderr.

    A plain line reads `[train] step 380/1900 (20%) train/loss=0.35 | 5123 steps/s, ETA 0:00:01,
    elapsed 0:00:02`; the rate is that of the last interval (so compilation, which happens in the
    first, only slows the first estimate).

    **Arguments:**

    - `total`: the number of units (steps, batches, examples) the loop will do.
    - `initial`: units already done (a resumed run starts its bar there).
    - `desc`, `unit`: the label and the unit's name.
    - `enabled`: `False` silences everything.
    - `delay`: show the bar only once the loop has run this many seconds (short loops stay quiet).
    - `leave`: keep the finished bar on screen.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "train",
        enabled: bool = True,
        *,
        unit: str = "step",
        delay: float = 0.0,
        leave: bool = True,
    ):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self._bar = (
            tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=leave, delay=delay)
            if enabled and interactive()
            else None
        )
        self._start = self._last_time = time.perf_counter()
        self._done = self._last_done = initial

    def update(self, n: int) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.update(n)

    def report(self, step: int, metrics: dict[str, float], rate: float | None = None) -> None:
        """Show `metrics` as of `step`: on the bar, or as one line. `rate` (units per second) is
        measured here since the previous report unless the caller measured it better (`fit` passes
        its `steps_per_s`, which leaves out evaluation and checkpoints)."""
        now = time.perf_counter()
        if rate is None:
            rate = (self._done - self._last_done) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_done = now, self._done
        if self._bar is not None:
            self._bar.set_postfix_str(format_metrics(metrics), refresh=False)
        elif self.enabled:
            eta = (self.total - self._done) / rate if rate > 0 else math.inf
            percent = f" ({100 * step / self.total:.0f}%)" if self.total else ""
            text = format_metrics(metrics)
            print(
                f"[{self.desc}] {self.unit} {step}/{self.total}{percent} {text}{' | ' if text else ''}"
                f"{format_rate(rate)} {self.unit}s/s, ETA {format_duration(eta)}, "
                f"elapsed {format_duration(now - self._start)}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress_iter(
    items: Iterable[T],
    total: int,
    desc: str,
    *,
    unit: str = "it",
    enabled: bool = True,
    delay: float = 1.0,
    report_every: int = 0,
) -> Iterator[T]:
    """Iterate over `items` with a progress bar that appears only if the loop takes over `delay` s.

    Off a terminal it prints a line every `report_every` items (never when 0), e.g. for a data
    generator that takes minutes.
    """
    bar = Progress(total, desc=desc, enabled=enabled, unit=unit, delay=delay, leave=False)
    try:
        for i, item in enumerate(items, 1):
            yield item
            bar.update(1)
            if report_every and i % report_every == 0:
                bar.report(i, {})
    finally:
        bar.close()
