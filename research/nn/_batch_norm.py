from collections.abc import Hashable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ..typing import Array, Float, PRNGKeyArray, typecheck


class BatchNorm(eqx.nn.BatchNorm):
    """`eqx.nn.BatchNorm(mode="batch")` (batch statistics over `axis_name`, running statistics in its
    `eqx.nn.State`, the same fields and state) written so that it rounds the same way in every program XLA
    compiles it into, which `--deterministic-reduction` needs for a BatchNorm model to give the same bits on
    every layout:

    - it normalises with a multiply by `rsqrt(var + eps)`, as PyTorch and Flax do, where Equinox divides by
      `sqrt(var + eps)`: XLA rewrites a divide by a broadcast value into a multiply by its reciprocal in
      some programs and not in others;
    - its running averages move by `(statistic - running) * (1 - momentum)`, one product, where Equinox
      adds `running * momentum` and `statistic * (1 - momentum)`: XLA's CPU backend always lets LLVM fuse
      a multiply and an add into one FMA, and with two products which one it fuses depended on the program
      (a one-device step hoists `running * momentum` out of its micro-batch loop, so only the other product
      could fuse there).
    """

    def __init__(self, input_size: int, axis_name: Hashable | Sequence[Hashable], momentum: float = 0.99, **kwargs):
        super().__init__(input_size, axis_name, momentum=momentum, mode="batch", **kwargs)

    @typecheck
    def __call__(
        self,
        x: Float[Array, " {self.input_size} *spatial"],
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> tuple[Float[Array, " {self.input_size} *spatial"], eqx.nn.State]:
        del key
        assert self.batch_counter is not None and self.batch_state_index is not None
        counter = state.get(self.batch_counter)
        hidden_mean, hidden_var = state.get(self.batch_state_index)
        if self.inference if inference is None else inference:
            debias = jnp.where(counter == 0, 1, 1 - self.momentum**counter)  # Equinox's zero-debiased averages
            mean, var = hidden_mean / debias, hidden_var / debias
        else:
            mean, var = jax.vmap(self._statistics)(x)
            state = state.set(self.batch_counter, counter + 1)
            state = state.set(
                self.batch_state_index, (self._towards(hidden_mean, mean), self._towards(hidden_var, var))
            )
        return jax.vmap(self._normalise)(x, mean, var, self.weight, self.bias), state

    def _towards(self, running: Array, statistic: Array) -> Array:
        return running + (statistic - running) * (1 - self.momentum)

    def _statistics(self, y: Array) -> tuple[Array, Array]:
        mean = lax.pmean(jnp.mean(y), self.axis_name)
        var = lax.pmean(jnp.mean((y - mean) * jnp.conj(y - mean)), self.axis_name)
        return mean, jnp.maximum(0.0, var)

    def _normalise(self, y: Array, mean: Array, var: Array, weight: Array | None, bias: Array | None) -> Array:
        out = (y - mean) * lax.rsqrt(var + self.eps)
        return out if weight is None or bias is None else out * weight + bias
