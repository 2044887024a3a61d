"""Low-rank adaptation (Hu et al. 2021): a model whose chosen linear layers compute with `W + (alpha / rank) B A`
in place of `W`, `A` and `B` the only parameters that train. The adapted model is merged into plain weights at
each call, so it is the base model's own class that computes (its shape checks, sampling and export unchanged)."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray
from ._weights import path_name


class Adapter(eqx.Module):
    """The low-rank update of one linear layer (of every block, for stacked blocks): `scale * b @ a`."""

    a: Float[Array, "*stack rank fan_in"]
    b: Float[Array, "*stack fan_out rank"]
    scale: float = eqx.field(static=True)

    def delta(self) -> Array:
        return self.scale * jnp.matmul(self.b, self.a)


def linear_layers(model: Any) -> dict[str, eqx.nn.Linear]:
    """Every `eqx.nn.Linear` of `model` by its name (`blocks.mlp_in`, ...)."""
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    return {path_name(path): x for path, x in leaves if is_linear(x)}


def _at(model: Any, name: str) -> Any:
    for part in name.split("."):
        model = model[int(part)] if isinstance(model, list | tuple) else getattr(model, part)
    return model


class LoRA(eqx.Module):
    """`model` with low-rank adapters on the linear layers whose names `targets` finds (`re.search`; see
    `linear_layers`): called like `model`, it computes `merged()`'s output. At initialisation `b` is zero, so
    the adapted model computes exactly what `model` does; `a` is drawn like a linear layer's weight.

    **Arguments:**

    - `model`: the base model (train its adapters alone: `research.train.fine_tuning.Frozen` with the pattern
      `^adapters\\.`).
    - `rank`: the rank of each update.
    - `targets`: a regular expression searched in the linear layers' names.
    - `alpha`: the update is scaled by `alpha / rank`.
    - `key`: initialisation key.
    """

    model: Any
    adapters: dict[str, Adapter]

    def __init__(self, model: Any, rank: int, targets: str, alpha: float = 16.0, *, key: PRNGKeyArray):
        chosen = {name: linear for name, linear in linear_layers(model).items() if re.search(targets, name)}
        if not chosen:
            names = ", ".join(linear_layers(model))
            raise ValueError(f"LoRA targets {targets!r} find no linear layer (they are: {names})")
        self.model, self.adapters = model, {}
        for (name, linear), k in zip(chosen.items(), jax.random.split(key, len(chosen)), strict=True):
            *stack, fan_out, fan_in = linear.weight.shape
            bound = 1 / fan_in**0.5
            a = jax.random.uniform(k, (*stack, rank, fan_in), linear.weight.dtype, -bound, bound)
            self.adapters[name] = Adapter(a, jnp.zeros((*stack, fan_out, rank), linear.weight.dtype), alpha / rank)

    def merged(self) -> Any:
        """The base model with each adapted layer's weight `W + scale * b @ a`: a model of the base's class."""
        names = list(self.adapters)
        weights = [_at(self.model, name).weight + self.adapters[name].delta() for name in names]
        return eqx.tree_at(lambda m: [_at(m, name).weight for name in names], self.model, weights)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.merged()(*args, **kwargs)
