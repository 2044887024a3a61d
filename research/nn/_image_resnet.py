"""A ResNet for small images (28-32 px: MNIST, CIFAR), after He et al. (2016)'s CIFAR networks."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, Integer, PRNGKeyArray, typecheck
from ._batch_norm import BatchNorm
from ._conv import conv2d_as_matmul
from ._resnet import AxisName, _batch_norm


class ImageBlock(eqx.Module):
    """`relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))` with 3x3 kernels; the shortcut is a strided
    1x1 convolution with batch norm when the stride or the width changes, else the identity."""

    conv1: eqx.nn.Conv2d
    norm1: BatchNorm
    conv2: eqx.nn.Conv2d
    norm2: BatchNorm
    shortcut: eqx.nn.Conv2d | None
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
        self.conv1 = eqx.nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, use_bias=False, key=k1)
        self.norm1 = _batch_norm(out_channels, axis_name, momentum)
        self.conv2 = eqx.nn.Conv2d(out_channels, out_channels, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = _batch_norm(out_channels, axis_name, momentum)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = eqx.nn.Conv2d(in_channels, out_channels, 1, stride=stride, use_bias=False, key=k3)
            self.shortcut_norm = _batch_norm(out_channels, axis_name, momentum)
        else:
            self.shortcut = self.shortcut_norm = None

    @typecheck
    def __call__(
        self, x: Float[Array, "channels height width"], state: eqx.nn.State
    ) -> tuple[Float[Array, "out_channels out_height out_width"], eqx.nn.State]:
        h, state = self.norm1(conv2d_as_matmul(self.conv1, x), state)
        h, state = self.norm2(conv2d_as_matmul(self.conv2, jax.nn.relu(h)), state)
        skip = x
        if self.shortcut is not None and self.shortcut_norm is not None:  # both or neither
            skip, state = self.shortcut_norm(conv2d_as_matmul(self.shortcut, x), state)
        return jax.nn.relu(h + skip), state


class ImageResNet(eqx.Module):
    """A ResNet for 28-32 px images: a 3x3 conv stem of `width` channels, three stages of `blocks`
    residual blocks (`width`, `2 width`, `4 width` channels; the second and third halve the
    resolution), global average pooling and a linear head: ResNet-20 of He et al. (2016) with `blocks=3`,
    `width=16`. Convolutions run as patches @ weight (`research.nn.conv2d_as_matmul`).

    It takes ONE image as data stores it, `[height, width, channels]`, `uint8` (0-255) or float (0-1),
    and normalises it itself: `(x / 255 - mean) / std` per channel. Batch norm as in `ResNet1d`:
    batch statistics over `axis_name` in training, running ones in `eqx.nn.inference_mode`, held in
    an `eqx.nn.State` (build it with `eqx.nn.make_with_state`, as `research.nn.build_model` does).

    **Arguments:**

    - `height`, `width`, `channels`: the images' size.
    - `classes`: number of classes.
    - `features`: channels of the first stage; `blocks`: residual blocks a stage.
    - `mean`, `std`: per-channel statistics of the training images (in 0-1 units) to normalise by.
    - `axis_name`, `momentum`: as `ResNet1d`'s.
    - `key`: initialisation key.
    """

    stateful = True

    stem: eqx.nn.Conv2d
    stem_norm: BatchNorm
    blocks: tuple[ImageBlock, ...]
    head: eqx.nn.Linear
    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    mean: tuple[float, ...] = eqx.field(static=True)
    std: tuple[float, ...] = eqx.field(static=True)

    def __init__(
        self,
        height: int = 32,
        width: int = 32,
        channels: int = 3,
        classes: int = 10,
        features: int = 16,
        blocks: int = 3,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        axis_name: AxisName = "batch",
        momentum: float = 0.9,
        *,
        key: PRNGKeyArray,
    ):
        if blocks < 1 or features < 1:
            raise ValueError(
                f"ImageResNet needs at least one block a stage and one feature (got blocks={blocks}, "
                f"features={features})"
            )
        if isinstance(axis_name, list):
            axis_name = tuple(axis_name)  # a JSON header gives a list; vmap axis names must be hashable
        keys = jax.random.split(key, 3 * blocks + 2)
        self.stem = eqx.nn.Conv2d(channels, features, 3, padding=1, use_bias=False, key=keys[0])
        self.stem_norm = _batch_norm(features, axis_name, momentum)
        widths = [features * 2**stage for stage in range(3) for _ in range(blocks)]
        strides = [2 if stage and i == 0 else 1 for stage in range(3) for i in range(blocks)]
        ins = [features, *widths[:-1]]
        self.blocks = tuple(
            ImageBlock(i, o, s, axis_name, momentum, key=k)
            for i, o, s, k in zip(ins, widths, strides, keys[1:-1], strict=True)
        )
        self.head = eqx.nn.Linear(widths[-1], classes, key=keys[-1])
        self.height, self.width, self.channels, self.classes = height, width, channels, classes
        self.mean = tuple(float(m) for m in (mean if mean is not None else (0.5,) * channels))
        self.std = tuple(float(s) for s in (std if std is not None else (0.25,) * channels))

    def __check_init__(self):
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(
                f"ImageResNet takes one mean and one std a channel ({self.channels}); got "
                f"{len(self.mean)} and {len(self.std)}"
            )
        if min(self.std) <= 0:
            raise ValueError(f"ImageResNet std must be positive, got {self.std}")

    @typecheck
    def __call__(
        self,
        x: Integer[Array, "{self.height} {self.width} {self.channels}"]
        | Float[Array, "{self.height} {self.width} {self.channels}"],
        state: eqx.nn.State,
        *,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, " {self.classes}"], eqx.nn.State]:
        features, state = self.features(x, state)
        return self.head(features), state

    @typecheck
    def features(
        self,
        x: Integer[Array, "{self.height} {self.width} {self.channels}"]
        | Float[Array, "{self.height} {self.width} {self.channels}"],
        state: eqx.nn.State,
    ) -> tuple[Float[Array, " features"], eqx.nn.State]:
        """The globally pooled activations of the last stage, which the head reads (`4 * features` of them):
        the feature space a Fréchet distance between two sets of images is measured in."""
        scale = 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else 1.0
        mean, std = (jnp.asarray(s, jnp.float32).reshape(1, 1, -1) for s in (self.mean, self.std))
        x = (x.astype(jnp.float32) / scale - mean) / std
        x = x.astype(self.stem.weight.dtype)  # computing in bf16 (research.train.precision.LowPrecision): from here on
        h, state = self.stem_norm(conv2d_as_matmul(self.stem, jnp.transpose(x, (2, 0, 1))), state)
        h = jax.nn.relu(h)
        for block in self.blocks:
            h, state = block(h, state)
        return jnp.mean(h, axis=(1, 2)), state
