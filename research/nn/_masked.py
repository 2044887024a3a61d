import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, PyTree, typecheck


def _bool_arrays_like(params: PyTree) -> PyTree:
    return jax.tree.map(lambda w: jnp.ones(w.shape, bool), params)


class Masked(eqx.Module):
    """`model` with each of its floating-point arrays multiplied by a fixed boolean mask in every call:
    a pruned network (lottery tickets) without changing the model.

    A pruned weight (mask `False`) adds nothing to the output and its gradient is exactly zero (the
    gradient of `w * m` is `g * m`), so an optimizer that makes no update from a zero gradient (SGD,
    Adam; AdamW too once the weight is zero) never revives it. The masks are boolean arrays: saved in
    checkpoints with the model, never trained (optimizers see only floating-point arrays).

    **Arguments:**

    - `model`: any model; called as `model(x, key=key)`.
    - `masks`: boolean arrays shaped like `eqx.filter(model, eqx.is_inexact_array)` (`None` where
      that has `None`); default: all `True` (nothing pruned).
    """

    model: eqx.Module
    masks: PyTree

    def __init__(self, model: eqx.Module, masks: PyTree | None = None):
        self.model = model
        self.masks = _bool_arrays_like(eqx.filter(model, eqx.is_inexact_array)) if masks is None else masks

    def __check_init__(self) -> None:
        params = eqx.filter(self.model, eqx.is_inexact_array)
        if jax.tree.structure(params) != jax.tree.structure(self.masks):
            raise ValueError("Masked: the masks must have the structure of the model's floating-point arrays")
        for w, m in zip(jax.tree.leaves(params), jax.tree.leaves(self.masks), strict=True):
            if m.shape != w.shape or m.dtype != jnp.bool_:
                raise ValueError(
                    f"Masked: a mask must be a bool array of its weight's shape {w.shape}, got {m.dtype}{list(m.shape)}"
                )

    def masked_model(self) -> eqx.Module:
        """The model with every pruned weight replaced by zero."""
        params, static = eqx.partition(self.model, eqx.is_inexact_array)
        return eqx.combine(jax.tree.map(lambda w, m: w * m, params, self.masks), static)

    def zeroed(self) -> "Masked":
        """The same masks over `masked_model()`: every pruned weight stored as zero, not only read as zero
        (a rewound lottery ticket: the initial weights with the pruned ones zeroed)."""
        return Masked(self.masked_model(), self.masks)

    @typecheck
    def __call__(self, x: Float[Array, "*input"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*output"]:
        # A concrete eqx.Module has a __call__; the base class, which pyright reads, does not declare one.
        return self.masked_model()(x, key=key)  # pyright: ignore[reportCallIssue]
