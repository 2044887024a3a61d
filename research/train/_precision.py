"""Mixed precision (`--precision bf16`): the parameters stay float32 (what the optimizer updates, the EMA
averages and checkpoints hold); the forward and backward pass of the loss run in bfloat16; what the model
returns is float32 again, so the loss and its metrics are float32.

bfloat16 has float32's exponent range, so gradients neither underflow nor overflow where float32's do not: it
needs no loss scaling (float16, which would, is not offered). Evaluation uses the float32 parameters.
"""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..nn import cast_floating
from ..typing import Array, Float, PRNGKeyArray, PyTree, RowKeys
from ._batch_loss import AbstractBatchLoss
from ._rows import AbstractLossWrapper, LossFn, Metrics

Precision = Literal["float32", "bf16"]
COMPUTE_DTYPES = {"float32": jnp.dtype("float32"), "bf16": jnp.dtype("bfloat16")}
FLOAT32 = jnp.dtype("float32")


class LowPrecision(eqx.Module):
    """`model` computing in `dtype`: called with its floating parameters and floating inputs cast to `dtype`
    (its `eqx.nn.State` is not: running statistics stay float32), it returns its floating outputs cast to
    float32. A module with a precision policy of its own (a `with_compute_dtype` method, as
    `research.nn.LanguageModel` has: float32 residual stream, norms and logits) is asked for `dtype`
    instead. `inspect.signature` sees `model`'s own arguments (`__wrapped__`), so `forward` passes a key or a
    state only where `model` takes one."""

    model: Any
    dtype: str = eqx.field(static=True)

    @property
    def __wrapped__(self) -> Any:
        return self.model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dtype = jnp.dtype(self.dtype)
        low, args, kwargs = _cast_parameters(self.model, dtype), *_cast_inputs((args, kwargs), dtype)
        return cast_floating(low(*args, **kwargs), FLOAT32)


def _cast_parameters(model: Any, dtype: Any) -> Any:
    has_policy = lambda x: hasattr(x, "with_compute_dtype")  # noqa: E731
    cast = lambda x: x.with_compute_dtype(dtype.name) if has_policy(x) else cast_floating(x, dtype)  # noqa: E731
    return jax.tree.map(cast, model, is_leaf=has_policy)


def _cast_inputs(tree: PyTree, dtype: Any) -> PyTree:
    """`cast_floating(tree, dtype)` but for the model states in it: running statistics stay float32 (a statistic
    computed in bf16 and moved towards them comes out float32, as `research.nn.BatchNorm` does)."""
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    return jax.tree.map(lambda x: x if is_state(x) else cast_floating(x, dtype), tree, is_leaf=is_state)


class InPrecision(AbstractLossWrapper):
    """`loss_fn` computed with the model in `precision` (`LowPrecision`): a loss of the same signature,
    `(model, model_state, batch, keys) -> (loss, (metrics, new model state))`, float32 in and out."""

    loss_fn: LossFn
    precision: Precision = eqx.field(static=True)

    def __check_init__(self) -> None:
        own_way = isinstance(self.loss_fn, AbstractBatchLoss)
        if own_way or any(hasattr(self.loss_fn, name) for name in ("value_and_grad", "micro_batch_sums")):
            raise ConfigError(
                f"--precision {self.precision}: the loss {type(self.loss_fn).__name__} takes its gradients its own "
                "way; train it in float32"
            )

    def __call__(
        self, model: eqx.Module, model_state: Any, batch: PyTree, keys: RowKeys | PRNGKeyArray
    ) -> tuple[Float[Array, ""], tuple[Metrics, Any]]:
        dtype = COMPUTE_DTYPES[self.precision]
        low = LowPrecision(model, dtype.name)
        loss, (metrics, model_state) = self.loss_fn(low, model_state, cast_floating(batch, dtype), keys)
        return loss.astype(FLOAT32), (cast_floating(metrics, FLOAT32), cast_floating(model_state, FLOAT32))
