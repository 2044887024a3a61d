"""The step statistics: what the compiled steps accumulate on the device between two host
synchronisations (`StepStats`, one packed vector), and the same numbers read on the host by name
(`HostStats`). This module is the one place that knows where each number sits in the vector.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..typing import Array, Float, Int, UInt32
from ._packing import Packing

# A step's metrics: scalars, or one value per member of a population.
StepMetrics = dict[str, Float[Array, "*members"]]

NO_BAD_STEP = int(np.iinfo(np.int32).max)  # the first non-finite step's code while every step was finite


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the statistics hold: `metrics`, the names and shapes of the metrics whose sums they keep, in
    order (sorted by name); `finite`, the step's `finite_metrics` (which must all be finite on a good step)."""

    metrics: tuple[tuple[str, tuple[int, ...]], ...]
    finite: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.metrics]


def layout_of(shapes: dict[str, Any], finite: tuple[str, ...]) -> Layout:
    """The `StepStats` layout of a step's metrics (arrays or `jax.ShapeDtypeStruct`s) and its `finite_metrics`."""
    return Layout(tuple((name, tuple(value.shape)) for name, value in sorted(shapes.items())), tuple(finite))


@functools.cache
def _packing(layout: Layout) -> Packing:
    """The parts of the packed vector, in `_in_order`'s order: each metric's weighted sum (float32, in
    `layout` order), the total weight (float32), the first non-finite step's code and the number of
    skipped steps (int32: no float operation touches their bits)."""
    floats = tuple((shape, np.dtype(np.float32)) for _, shape in layout.metrics)
    scalar = lambda dtype: ((), np.dtype(dtype))  # noqa: E731
    return Packing((*floats, scalar(np.float32), scalar(np.int32), scalar(np.int32)))


def _in_order(layout: Layout, total: dict[str, Any], weight: Any, first_bad: Any, skipped: Any) -> list:
    """The parts of the packed vector in their order (see `_packing`)."""
    return [*(total[name] for name in layout.names), weight, first_bad, skipped]


def _by_name(parts: list, layout: Layout) -> tuple[dict[str, Any], Any, Any, Any]:
    """`(total, weight, first_bad, skipped)` of the parts `_in_order` put in order."""
    *sums, weight, first_bad, skipped = parts
    return dict(zip(layout.names, sums, strict=True)), weight, first_bad, skipped


def _decode_first_bad(code: int, finite: tuple[str, ...]) -> tuple[int, str | None]:
    """`(step, metric)` of the first non-finite step's code; `(-1, None)`: none."""
    if code == NO_BAD_STEP:
        return -1, None
    return code // len(finite), finite[code % len(finite)]


@dataclasses.dataclass(frozen=True)
class HostStats:
    """Step statistics on the host, by name (`StepStats.fetch()`).

    - `total`: each metric's weighted sum over the finite steps (float32; one value per member in a
      population, whose non-finite members are left out).
    - `weight`: their total weight (the number of finite steps).
    - `skipped`: the steps whose update was skipped because it was not finite (`skip_nonfinite`).
    - `first_bad_step`: the first step one of whose `finite_metrics` was not finite (-1: none), and
      `bad_metric`: the first of them that was not (`None`: none).
    """

    total: dict[str, np.ndarray]
    weight: float
    skipped: int
    first_bad_step: int
    bad_metric: str | None

    def means(self) -> dict[str, np.ndarray]:
        """The running mean of each metric (numpy: no device op per metric; zeros before any step)."""
        return {name: np.asarray(total / max(self.weight, 1e-30)) for name, total in self.total.items()}

    def window(self) -> dict[str, Any]:
        """The statistics of an unfinished logging window as a checkpoint header keeps them, exactly, as
        JSON (float32 -> float is exact); `StepStats.from_window` reads them back."""
        return {
            "total": {name: total.tolist() for name, total in self.total.items()},
            "weight": self.weight,
            "skipped": self.skipped,
        }


@functools.partial(jax.tree_util.register_dataclass, data_fields=("words",), meta_fields=("layout",))
@dataclasses.dataclass(frozen=True)
class StepStats:
    """What the compiled steps accumulate on the device between two host synchronisations, packed
    into one `uint32` vector. Every array in or out of a compiled call costs dispatch time, and so
    does a pytree node: the compiled functions take and return `words` alone (a plain array), and
    `CompiledTrainer.step`/`run` wrap it again.

    `words` is the buffer of a `Packing` (`_packing.py`) of: the weighted sums of the step metrics
    over the finite steps, the total weight, the first non-finite step's code (`2 * step + 1` when only
    `K * step + i`, where `K` is the number of `finite_metrics` and `i` the first of them that was
    not finite, `NO_BAD_STEP` while every step was finite; steps are counted in int32: codes hold steps
    below 2**31 / K) and the number of steps skipped
    because they were not finite. `layout` (static) names the metrics and their shapes.

    Read them on the host with `fetch()`: one transfer, then `HostStats`'s named fields.
    """

    # Fresh statistics hold numpy words: the compiled call they go into transfers them with its other
    # arguments (a separate `jnp.asarray` cost ~100 us a logging stop). A leading device axis under `jax.pmap`.
    words: UInt32[Array | np.ndarray, "*devices packed"]
    layout: Layout

    @staticmethod
    def init(layout: Layout) -> "StepStats":
        """Zeroed statistics for `layout`, on the host."""
        zeros = {name: np.zeros(shape, np.float32) for name, shape in layout.metrics}
        return StepStats._on_host(layout, zeros, np.float32(0), np.int32(NO_BAD_STEP), np.int32(0))

    @staticmethod
    def from_window(window: dict[str, Any], layout: Layout) -> "StepStats":
        """Statistics holding a saved logging window (`HostStats.window`; `fit`'s `resume_window`): its
        sums, its weight, its skipped steps, and no non-finite step yet."""
        total = {name: np.asarray(window["total"][name], np.float32) for name in layout.names}
        weight, skipped = np.float32(window["weight"]), np.int32(window["skipped"])
        return StepStats._on_host(layout, total, weight, np.int32(NO_BAD_STEP), skipped)

    @staticmethod
    def _on_host(layout: Layout, total: dict[str, np.ndarray], *counts: np.generic) -> "StepStats":
        # Packed in numpy: no transfer and no device op (the compiled call that takes them transfers them).
        return StepStats(_packing(layout).buffer_on_host(_in_order(layout, total, *counts)), layout)

    def fetch(self) -> HostStats:
        """The statistics on the host, by name, in one transfer (copied out of the fetched words, which
        the next step may donate)."""
        words = np.array(jax.device_get(self.words))
        total, weight, first_bad, skipped = _by_name(_packing(self.layout).views_on_host(words), self.layout)
        return HostStats(total, float(weight), int(skipped), *_decode_first_bad(int(first_bad), self.layout.finite))

    def record(self, step: Int[Array, ""], metrics: StepMetrics) -> "StepStats":
        """Add one step's metrics. A population's metrics have one value per member: its step counts
        as finite when every member's was (a member's non-finite metrics are left out of the sums)."""
        packing = _packing(self.layout)
        if self.layout.names != sorted(metrics) or self.words.shape[-1] != packing.size:
            raise ValueError(
                f"the step's metrics {sorted(metrics)} are not the ones these statistics were made for "
                f"{self.layout.names} ({self.words.shape[-1]} words); make them with the trainer's init_stats"
            )
        finite = [jnp.isfinite(metrics[name]) for name in self.layout.finite]
        member_ok = functools.reduce(jnp.logical_and, finite)
        clean = {name: jnp.where(member_ok, metrics[name], 0.0).astype(jnp.float32) for name in self.layout.names}
        ok = _all(member_ok)
        # Which metric came first among the non-finite ones: the number of leading finite ones.
        leading_ok = functools.reduce(jnp.logical_and, map(_all, finite[:1]))
        first = leading_ok.astype(jnp.int32)
        for flags in finite[1:-1]:
            leading_ok = leading_ok & _all(flags)
            first = first + leading_ok.astype(jnp.int32)
        code = jnp.where(ok, NO_BAD_STEP, len(finite) * step + first)
        # The sums add the step's clean metrics and weight; the counters add its skip and may not exceed
        # their ceiling (the first bad step's code only goes down). Each part updates elementwise over
        # the whole vector (an add, a minimum, a select on each word's dtype), so XLA writes the donated
        # buffer in place: one kernel and no copy a step.
        zeros = {name: jnp.zeros(shape, jnp.float32) for name, shape in self.layout.metrics}
        words_of = lambda *parts: packing.pack(_in_order(self.layout, *parts))[0]  # noqa: E731
        no, none = jnp.int32(0), jnp.float32(0)
        sums = _bitcast(self.words, jnp.float32) + _bitcast(
            words_of(clean, ok.astype(jnp.float32), no, no), jnp.float32
        )
        skipped = _bitcast(words_of(zeros, none, no, (~ok).astype(jnp.int32)), jnp.int32)
        ceiling = _bitcast(words_of(zeros, none, code, jnp.int32(NO_BAD_STEP)), jnp.int32)
        counters = jnp.minimum(_bitcast(self.words, jnp.int32) + skipped, ceiling)
        words = jnp.where(packing.holds(np.float32), _bitcast(sums, jnp.uint32), _bitcast(counters, jnp.uint32))
        return StepStats(words, self.layout)


def _bitcast(words: Any, dtype: Any) -> Array:
    return jax.lax.bitcast_convert_type(words, dtype)


def _all(flags: Array) -> Array:
    return flags if flags.ndim == 0 else jnp.all(flags)
