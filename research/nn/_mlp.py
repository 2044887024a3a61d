from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}


def activation_by_name(name: str) -> Callable[[Array], Array]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}") from None


class MLP(eqx.Module):
    """Fully connected network on one example: `in_size -> hidden... -> out_size`.

    The activation is named by a string so that a checkpoint header can rebuild the model.

    **Arguments:**

    - `in_size`, `out_size`: feature sizes of the input and output vectors.
    - `hidden`: the width of each hidden layer (empty for a linear model).
    - `activation`: one of `ACTIVATIONS`, applied after every hidden layer (not after the last).
    - `residual`: a hidden layer whose input and output widths agree adds its input to its
      activated output, `h + act(W h + b)` (the MNIST-1D lottery-ticket notebook's MLP).
    - `key`: initialisation key.
    """

    layers: tuple[eqx.nn.Linear, ...]
    activation: str = eqx.field(static=True)
    residual: bool = eqx.field(static=True)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        hidden: tuple[int, ...] = (),
        activation: str = "tanh",
        residual: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        activation_by_name(activation)  # fail early on a typo
        sizes = (in_size, *hidden, out_size)
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = tuple(eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True))
        self.activation = activation
        self.residual = residual

    # (eqx.nn.Linear's sizes may also be "scalar", which an MLP never builds: its sizes are ints.)
    @property
    def in_size(self) -> int:
        return self.layers[0].in_features  # pyright: ignore[reportReturnType]

    @property
    def out_size(self) -> int:
        return self.layers[-1].out_features  # pyright: ignore[reportReturnType]

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.in_size}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.out_size}"]:
        act = activation_by_name(self.activation)
        for layer in self.layers[:-1]:
            y = act(layer(x))
            x = x + y if self.residual and layer.in_features == layer.out_features else y
        return self.layers[-1](x)


class LinearSigmoid(eqx.Module):
    """The tutorial's first model, `Linear -> Sigmoid`: returns probabilities, not logits."""

    linear: eqx.nn.Linear

    def __init__(self, in_size: int, out_size: int, *, key: PRNGKeyArray):
        self.linear = eqx.nn.Linear(in_size, out_size, key=key)

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.linear.in_features}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.linear.out_features}"]:
        return jax.nn.sigmoid(self.linear(x))
