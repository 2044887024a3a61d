from collections.abc import Hashable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck
from ._batch_norm import BatchNorm

AxisName = Hashable | Sequence[Hashable]


def _batch_norm(channels: int, axis_name: AxisName, momentum: float) -> BatchNorm:
    return BatchNorm(channels, axis_name=axis_name, momentum=momentum)


class ResidualBlock(eqx.Module):
    """`relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`, kernel 3; the shortcut is a strided 1x1
    convolution with batch norm when the stride or the width changes, else the identity."""

    conv1: eqx.nn.Conv1d
    norm1: BatchNorm
    conv2: eqx.nn.Conv1d
    norm2: BatchNorm
    shortcut: eqx.nn.Conv1d | None
    shortcut_norm: BatchNorm | None

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        axis_name: AxisName,
        momentum: float,
        *,
        key: PRNGKeyArray,
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        # No conv biases: the batch norm right after each convolution has its own.
        self.conv1 = eqx.nn.Conv1d(in_channels, out_channels, 3, stride=stride, padding=1, use_bias=False, key=k1)
        self.norm1 = _batch_norm(out_channels, axis_name, momentum)
        self.conv2 = eqx.nn.Conv1d(out_channels, out_channels, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = _batch_norm(out_channels, axis_name, momentum)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = eqx.nn.Conv1d(in_channels, out_channels, 1, stride=stride, use_bias=False, key=k3)
            self.shortcut_norm = _batch_norm(out_channels, axis_name, momentum)
        else:
            self.shortcut = self.shortcut_norm = None

    @typecheck
    def __call__(
        self, x: Float[Array, "channels length"], state: eqx.nn.State
    ) -> tuple[Float[Array, "out_channels out_length"], eqx.nn.State]:
        h, state = self.norm1(self.conv1(x), state)
        h, state = self.norm2(self.conv2(jax.nn.relu(h)), state)
        skip = x
        if self.shortcut is not None and self.shortcut_norm is not None:  # both or neither
            skip, state = self.shortcut_norm(self.shortcut(x), state)
        return jax.nn.relu(h + skip), state


class ResNet1d(eqx.Module):
    """A small 1-D ResNet: a conv stem, one residual block per entry of `widths` (the first keeps the
    length, each later one halves it), global average pooling and a linear head.

    Batch norm uses the statistics of the batch it is vmapped over in training (`mode="batch"`,
    reduced over `axis_name`) and the running statistics in `eqx.nn.inference_mode`; those live in
    an `eqx.nn.State`, so build it with `eqx.nn.make_with_state` (`research.nn.build_model` does).

    **Arguments:**

    - `length`: length of the input signal.
    - `classes`: number of classes.
    - `widths`: channels of each residual block; the stem has `widths[0]`.
    - `axis_name`: the vmap/pmap axis name(s) batch statistics are reduced over; `"batch"` is the
      name `research.train.forward` vmaps with; pass e.g. `("devices", "batch")` across devices.
    - `momentum`: running-statistics momentum (0.9 is PyTorch's `momentum=0.1`).
    - `key`: initialisation key.
    """

    stateful = True  # a class attribute, not a field: `build_model` reads it

    stem: eqx.nn.Conv1d
    stem_norm: BatchNorm
    blocks: tuple[ResidualBlock, ...]
    head: eqx.nn.Linear
    length: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    widths: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        length: int = 40,
        classes: int = 10,
        widths: Sequence[int] = (32, 64, 64),
        axis_name: AxisName = "batch",
        momentum: float = 0.9,
        *,
        key: PRNGKeyArray,
    ):
        widths = tuple(widths)
        if not widths:
            raise ValueError("ResNet1d needs at least one residual block (widths is empty)")
        if isinstance(axis_name, list):
            axis_name = tuple(axis_name)  # a JSON header gives a list; vmap axis names must be hashable
        keys = jax.random.split(key, len(widths) + 2)
        self.stem = eqx.nn.Conv1d(1, widths[0], 3, padding=1, use_bias=False, key=keys[0])
        self.stem_norm = _batch_norm(widths[0], axis_name, momentum)
        ins = (widths[0], *widths[:-1])
        self.blocks = tuple(
            ResidualBlock(i, o, 1 if n == 0 else 2, axis_name, momentum, key=k)
            for n, (i, o, k) in enumerate(zip(ins, widths, keys[1:-1], strict=True))
        )
        self.head = eqx.nn.Linear(widths[-1], classes, key=keys[-1])
        self.length, self.classes, self.widths = length, classes, widths

    def __check_init__(self):
        if self.head.weight.shape != (self.classes, self.widths[-1]):
            raise ValueError(f"ResNet1d head should be {(self.classes, self.widths[-1])}, got {self.head.weight.shape}")
        if self.stem.weight.shape != (self.widths[0], 1, 3):
            raise ValueError(f"ResNet1d stem should be {(self.widths[0], 1, 3)}, got {self.stem.weight.shape}")

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.length}"], state: eqx.nn.State, *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, " {self.classes}"], eqx.nn.State]:
        h, state = self.stem_norm(self.stem(x[None, :]), state)
        h = jax.nn.relu(h)
        for block in self.blocks:
            h, state = block(h, state)
        return self.head(jnp.mean(h, axis=1)), state
