"""Explicit state for the state-in/state-out pattern: counters, running means, EMA of a pytree.

JAX functions are pure, so anything that changes over time travels as a value: each helper here is
an `eqx.Module` (a pytree of arrays, its settings static), and `update` is a pure function
`(state, value) -> (new_state, output)` that returns a new object instead of mutating. That is the
shape `jax.lax.scan` expects of its body, so these pass through `jax.jit`, `lax.scan`, `vmap` and
checkpoints like any other state:

    mean = RunningMean.init(0.0)
    mean, means = jax.lax.scan(RunningMean.update, mean, jnp.array([2.0, 4.0, 6.0]))  # 2, 3, 4

- `Counter`: how many updates so far.
- `RunningMean`: the (weighted) mean of every value seen, kept as a sum and a total weight.
- `EMA`: an exponential moving average of a pytree (Polyak averaging of model weights), optionally
  debiased; `ema_update` is its one-step rule on bare pytrees.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .typing import Array, Float, Int, PyTree, Scalar, typecheck

__all__ = ["EMA", "Counter", "RunningMean", "ema_update"]


class Counter(eqx.Module):
    """Counts updates: `counter, before = counter.update()` returns the new counter and the count
    *before* this update (0, 1, 2, ... on successive calls; the new counter holds 1, 2, 3, ...)."""

    count: Int[Array, ""]

    @staticmethod
    def init(start: int = 0) -> "Counter":
        return Counter(jnp.asarray(start, jnp.int32))

    @typecheck
    def update(self, increment: int | Int[Array, ""] = 1) -> tuple["Counter", Int[Array, ""]]:
        return Counter(self.count + jnp.asarray(increment, jnp.int32)), self.count


class RunningMean(eqx.Module):
    """Weighted running mean of a pytree of values, kept as (sum, total weight) on the device.

    `update(value, weight)` adds `weight * value` to the sum and `weight` to the total and returns the
    new state with the current mean, so accumulating metrics costs no host synchronisation: read
    `mean()` only when you need the number. Sums are float32 whatever the values' dtype.

    **Fields:**

    - `total`: the weighted sum of the values, a pytree shaped like them.
    - `weight`: the sum of the weights (the number of updates when every weight is 1).
    """

    total: PyTree[Float[Array, "..."]]
    weight: Float[Array, ""]

    @staticmethod
    def init(like: PyTree) -> "RunningMean":
        """Zero sums shaped like `like` (values, or `jax.ShapeDtypeStruct`s from `jax.eval_shape`)."""
        zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), like)
        return RunningMean(zeros, jnp.zeros((), jnp.float32))

    @typecheck
    def update(self, value: PyTree, weight: Scalar | float = 1.0) -> tuple["RunningMean", PyTree]:
        """Add one (weighted) value; returns the new state and the mean including it."""
        weight = jnp.asarray(weight, jnp.float32)
        new = RunningMean(jax.tree.map(lambda t, v: t + weight * v, self.total, value), self.weight + weight)
        return new, new.mean()

    @typecheck
    def mean(self) -> PyTree[Float[Array, "..."]]:
        """The mean so far (zeros before the first update, rather than 0 / 0)."""
        return jax.tree.map(lambda t: t / jnp.maximum(self.weight, 1e-30), self.total)


@typecheck
def ema_update(average: PyTree, value: PyTree, decay: float | Float[Array, ""]) -> PyTree:
    """One step of an exponential moving average over the floating-point array leaves of two
    same-shaped pytrees: `decay * average + (1 - decay) * value`, in each leaf's own dtype.

    Other leaves (integer counters, booleans, static fields) are taken from `value`: they are not
    averaged but follow the current value.
    """
    average_arrays, _ = eqx.partition(average, eqx.is_inexact_array)
    value_arrays, rest = eqx.partition(value, eqx.is_inexact_array)

    def mix(a: Array, v: Array) -> Array:
        d = jnp.asarray(decay, a.dtype)  # keep the leaf's dtype: a dtype change would recompile the step
        return d * a + (1 - d) * v

    return eqx.combine(jax.tree.map(mix, average_arrays, value_arrays), rest)


def _copy_leaf(x: Any) -> Any:
    # A copy, so the average never aliases buffers that a compiled step donates. A float leaf loses
    # any weak type, as `ema_update` will return it, and other leaves keep theirs, as they follow
    # the value: either way the first update does not change a type (which would recompile a step).
    if eqx.is_inexact_array(x):
        return jnp.array(x, dtype=x.dtype, copy=True)
    return jnp.array(x, copy=True) if eqx.is_array(x) else x


class EMA(eqx.Module):
    """Exponential moving average of a pytree: Polyak averaging of model weights.

    `ema = EMA.init(model, decay=0.999)`; after each optimizer step `ema, averaged = ema.update(model)`.

    With `debias=True` (the default, as in `optax.ema`) the average is the one a zero-initialised EMA
    would have after dividing by `1 - decay**count`: a weighted mean of the values seen so far, with
    weights proportional to `decay**age`. Early on it averages over the `count` values seen rather
    than being pulled towards the initial value, and the stored `average` is always that debiased
    mean (ready to evaluate; no separate correction step). With `debias=False` it is the textbook
    `average <- decay * average + (1 - decay) * value` starting from the value given to `init`.

    **Fields:**

    - `average`: the averaged pytree (floating-point leaves averaged; others follow the latest value).
    - `count`: number of updates so far.
    - `decay`: the decay in [0, 1) (static: changing it recompiles).
    - `debias`: whether to correct the zero-initialisation bias (static).
    """

    average: PyTree
    count: Int[Array, ""]
    decay: float = eqx.field(static=True)
    debias: bool = eqx.field(static=True, default=True)

    def __check_init__(self) -> None:
        if not 0 <= self.decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1), got {self.decay}; 0.99 to 0.9999 are usual values")

    @staticmethod
    def init(value: PyTree, decay: float, *, debias: bool = True) -> "EMA":
        """An average that starts at (a copy of) `value`, before any update."""
        copy = jax.tree.map(_copy_leaf, value)
        return EMA(copy, jnp.zeros((), jnp.int32), float(decay), debias)

    @typecheck
    def current_decay(self, count: Int[Array, ""]) -> Float[Array, ""]:
        """The decay applied at update number `count` (1 for the first update).

        Debiased, it is `decay * (1 - decay**(count-1)) / (1 - decay**count)`: 0 at the first update
        (the average becomes the value) and tending to `decay`. Computed as a ratio of `expm1`s so it
        stays accurate in float32 when `decay` is close to 1.
        """
        if not self.debias:
            return jnp.asarray(self.decay, jnp.float32)
        if self.decay == 0:
            return jnp.zeros((), jnp.float32)
        log_decay = math.log(self.decay)
        steps = count.astype(jnp.float32)
        return self.decay * jnp.expm1((steps - 1) * log_decay) / jnp.expm1(steps * log_decay)

    @typecheck
    def update(self, value: PyTree) -> tuple["EMA", PyTree]:
        """Fold in one more value; returns the new EMA and the new average."""
        count = self.count + 1
        average = ema_update(self.average, value, self.current_decay(count))
        return EMA(average, count, self.decay, self.debias), average
