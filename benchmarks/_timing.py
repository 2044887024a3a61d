"""Robust timing on a shared, noisy machine: candidates are interleaved round-robin, repeated, and
summarised by median and spread, so a burst of load hits every candidate alike."""

import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class Timing:
    """Seconds per unit (one step, one run) of one candidate over the repeats."""

    name: str
    seconds: list[float]
    note: str = ""
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def quartiles(self) -> tuple[float, float]:
        q1, q3 = np.percentile(self.seconds, [25, 75])
        return float(q1), float(q3)

    def to_dict(self) -> dict:
        q1, q3 = self.quartiles
        return {
            "name": self.name,
            "median": self.median,
            "q1": q1,
            "q3": q3,
            "min": min(self.seconds),
            "max": max(self.seconds),
            "repeats": len(self.seconds),
            "seconds": list(self.seconds),
            "note": self.note,
            **self.extra,
        }


def timed(fn: Callable[[], object], units: int = 1) -> float:
    """Seconds per unit of one call of `fn` (which must block until its work is done)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / units


def interleave(candidates: dict[str, Callable[[], float]], repeats: int) -> dict[str, Timing]:
    """Call each candidate `repeats` times, round-robin with a rotating start; each call returns the
    seconds per unit it measured. Candidates must be warm (compiled) before they get here."""
    names = list(candidates)
    results = {name: Timing(name, []) for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            results[name].seconds.append(candidates[name]())
    return results


def block(tree) -> None:
    """Wait for every jax array in `tree`."""
    import jax

    jax.block_until_ready(tree)
