"""Explicit state for the state-in/state-out pattern: counters, running means, EMA of a pytree.

Each helper is an `eqx.Module` (a pytree of arrays), so it passes through `jax.jit`, `lax.scan`
and checkpoints like any other state, and `update` returns a new object instead of mutating.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from .typing import Array, Float, Int, PyTree, Scalar, typecheck


class Counter(eqx.Module):
    """Counts calls: `counter, previous = counter.update()` returns the count before the increment."""

    count: Int[Array, ""]

    @staticmethod
    def init() -> "Counter":
        return Counter(jnp.zeros((), jnp.int32))

    @typecheck
    def update(self) -> tuple["Counter", Int[Array, ""]]:
        return Counter(self.count + 1), self.count


class RunningMean(eqx.Module):
    """Weighted running mean of a pytree of values, kept as (sum, total weight) on the device.

    `mean, value = RunningMean.init(like), ...; mean, current = mean.update(value)`.
    """

    total: PyTree[Float[Array, "..."]]
    weight: Float[Array, ""]

    @staticmethod
    def init(like: PyTree) -> "RunningMean":
        zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), like)
        return RunningMean(zeros, jnp.zeros((), jnp.float32))

    @typecheck
    def update(self, value: PyTree, weight: Scalar | float = 1.0) -> tuple["RunningMean", PyTree]:
        new = RunningMean(
            jax.tree.map(lambda t, v: t + weight * v, self.total, value),
            self.weight + weight,
        )
        return new, new.mean()

    def mean(self) -> PyTree:
        return jax.tree.map(lambda t: t / jnp.maximum(self.weight, 1e-30), self.total)


@typecheck
def ema_update(average: PyTree, value: PyTree, decay: float | Float[Array, ""]) -> PyTree:
    """One step of an exponential moving average over the array leaves of two same-shaped pytrees:
    `decay * average + (1 - decay) * value`. Non-array leaves are taken from `value`."""
    average_arrays, _ = eqx.partition(average, eqx.is_inexact_array)
    value_arrays, static = eqx.partition(value, eqx.is_inexact_array)
    mixed = jax.tree.map(lambda a, v: decay * a + (1 - decay) * v, average_arrays, value_arrays)
    return eqx.combine(mixed, static)
