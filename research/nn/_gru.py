from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck


class GRUClassifier(eqx.Module):
    """A GRU cell scanned over the signal (`jax.lax.scan`), then a linear head.

    The signal is read `chunk` values per time step (`length / chunk` steps). `readout="last"` feeds
    the head the final hidden state; `readout="all"` the hidden states of every step, flattened.
    MNIST-1D's reference GRU is `hidden_size=6, bidirectional=True, readout="all"`.

    **Arguments:**

    - `length`: length of the input signal.
    - `classes`: number of classes.
    - `hidden_size`: size of the hidden state (per direction).
    - `chunk`: signal values read per time step; must divide `length`.
    - `bidirectional`: also run a second cell from the end of the signal to its start.
    - `readout`: `"last"` or `"all"` (see above).
    - `key`: initialisation key.
    """

    cells: tuple[eqx.nn.GRUCell, ...]
    head: eqx.nn.Linear
    length: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    readout: Literal["last", "all"] = eqx.field(static=True)

    def __init__(
        self,
        length: int = 40,
        classes: int = 10,
        hidden_size: int = 64,
        chunk: int = 1,
        bidirectional: bool = False,
        readout: Literal["last", "all"] = "last",
        *,
        key: PRNGKeyArray,
    ):
        if length % chunk:
            raise ValueError(f"GRUClassifier chunk {chunk} must divide the signal length {length}")
        if readout not in ("last", "all"):
            raise ValueError(f"GRUClassifier readout must be 'last' or 'all', got {readout!r}")
        directions = 2 if bidirectional else 1
        keys = jax.random.split(key, directions + 1)
        self.cells = tuple(eqx.nn.GRUCell(chunk, hidden_size, key=k) for k in keys[:-1])
        features = directions * hidden_size * (length // chunk if readout == "all" else 1)
        self.head = eqx.nn.Linear(features, classes, key=keys[-1])
        self.length, self.classes, self.hidden_size, self.chunk, self.readout = (
            length,
            classes,
            hidden_size,
            chunk,
            readout,
        )

    def __check_init__(self):
        steps = self.length // self.chunk if self.readout == "all" else 1
        expected = (self.classes, len(self.cells) * self.hidden_size * steps)
        if self.head.weight.shape != expected:
            raise ValueError(f"GRUClassifier head should be {expected}, got {self.head.weight.shape}")

    @property
    def bidirectional(self) -> bool:
        return len(self.cells) == 2

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.length}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.classes}"]:
        steps = x.reshape(self.length // self.chunk, self.chunk)
        features = []
        for cell, reverse in zip(self.cells, (False, True), strict=False):  # one cell, or a second reversed

            def step(hidden, inputs, cell=cell):
                hidden = cell(inputs, hidden)
                return hidden, hidden

            last, every = jax.lax.scan(step, jnp.zeros(self.hidden_size, x.dtype), steps, reverse=reverse)
            features.append(last if self.readout == "last" else jnp.ravel(every))
        return self.head(jnp.concatenate(features))
