"""Training part of a model (`--trainable`): the parameters whose names a pattern finds train, the rest stay as
they are. Their gradients are stopped inside the loss (`Frozen`: XLA then drops their weight-gradient products,
and `grad_norm` is the trained parameters'), and the optimizer keeps no state for them (`only_trainable`)."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..errors import ConfigError
from ..nn import path_name
from ..typing import PRNGKeyArray, PyTree, RowKeys
from ._precision import LowPrecision
from ._rows import AbstractLossWrapper, LossFn

TRAINABLE_PRESETS = {"all": "", "head": r"^head\."}  # "": every name


def trainable_pattern(trainable: str) -> str:
    """The regular expression `--trainable` stands for: a preset's (`all`, `head`), or itself."""
    pattern = TRAINABLE_PRESETS.get(trainable, trainable)
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"--trainable {trainable!r} is not a regular expression: {e}") from None
    return pattern


def check_trainable(model: Any, pattern: str, flag: str) -> None:
    """Refuse a pattern that finds no floating-point parameter of `model` (its arrays, or their shapes from
    `eqx.filter_eval_shape`), naming them."""
    floating = lambda x: isinstance(x, jax.ShapeDtypeStruct | jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]
    names = [path_name(path) for path, x in leaves if floating(x)]
    if not any(re.search(pattern, name) for name in names):
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ConfigError(f"--trainable {flag} finds no parameter of the model (its names: {shown})")


def _labelled(tree: PyTree, pattern: str, trained: Any, frozen: Any) -> PyTree:
    """`tree` with each array replaced by `trained(x)` where `pattern` finds its name, else `frozen(x)`."""

    def label(path: tuple, x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        return trained(x) if re.search(pattern, path_name(path)) else frozen(x)

    return jax.tree_util.tree_map_with_path(label, tree)


def only_trainable(optimizer: optax.GradientTransformation, pattern: str) -> optax.GradientTransformation:
    """`optimizer` on the parameters whose names `pattern` finds (`re.search` in `research.nn.array_names`'s
    names); the others get no update and no optimizer state (`optax.set_to_zero`)."""
    labels = lambda params: _labelled(params, pattern, lambda _: "trained", lambda _: "frozen")  # noqa: E731
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


class Frozen(AbstractLossWrapper):
    """`loss_fn` with the gradients of the parameters `pattern` does not find stopped: a loss of the same
    signature. Wraps the loss before `--precision` does (it sees the float32 model, or `LowPrecision`'s)."""

    loss_fn: LossFn
    pattern: str = eqx.field(static=True)

    def __check_init__(self) -> None:
        if any(hasattr(self.loss_fn, name) for name in ("value_and_grad", "micro_batch_sums")):
            raise ConfigError(
                f"--trainable: the loss {type(self.loss_fn).__name__} takes its gradients its own way; it trains all"
            )

    def __call__(self, model: Any, model_state: Any, batch: PyTree, keys: RowKeys | PRNGKeyArray) -> Any:
        if isinstance(model, LowPrecision):
            model = eqx.tree_at(lambda m: m.model, model, self._stopped(model.model))
        else:
            model = self._stopped(model)
        return self.loss_fn(model, model_state, batch, keys)

    def _stopped(self, model: Any) -> Any:
        return _labelled(model, self.pattern, lambda x: x, jax.lax.stop_gradient)
