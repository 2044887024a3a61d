"""Generative models for small images (28-32 px): a DCGAN generator and discriminator, and a DDPM U-Net.

Each takes ONE example; images are `[height, width, channels]` float32 in [-1, 1], as the data layer
stores them (rescaled). Inside, activations are `[channels, height, width]`, the layout of
`conv2d_as_matmul` and `eqx.nn.GroupNorm`. There is no batch norm: the models are stateless and treat
each example on its own, so a batch's results do not depend on how it is split into micro-batches or
over devices (a GAN's discriminator under batch norm sees the batch's statistics, which leak
information between real and fake examples). Upsampling is a nearest-neighbour resize followed by a
3x3 convolution, not a transposed convolution, whose uneven overlap paints checkerboard artefacts
(Odena et al., 2016, "Deconvolution and Checkerboard Artifacts").
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck
from ._conv import conv2d_as_matmul


def _groups(channels: int) -> int:
    """GroupNorm's group count for `channels`: the largest divisor not above 8 that leaves at least two
    channels a group. With one channel a group the norm would erase any per-channel constant added
    before it, such as the U-Net's time embedding (and a conv's bias)."""
    return max(g for g in range(1, min(8, max(channels // 2, 1)) + 1) if channels % g == 0)


def _group_norm(channels: int) -> eqx.nn.GroupNorm:
    return eqx.nn.GroupNorm(_groups(channels), channels)


def _upsample(x: Float[Array, "channels height width"]) -> Float[Array, "channels height2 width2"]:
    """Nearest-neighbour resize by 2 (a repeat: exact, and cheaper than `jax.image.resize`'s gather)."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def _check_sizes(model: str, height: int, width: int, factor: int, why: str) -> None:
    if height < factor or width < factor or height % factor or width % factor:
        raise ValueError(
            f"{model} needs a height and a width divisible by {factor} ({why}); got {height}x{width}: "
            f"resize or crop the images, or change the model's depth"
        )


def _check_positive(model: str, **sizes: int) -> None:
    bad = {name: size for name, size in sizes.items() if size < 1}
    if bad:
        raise ValueError(f"{model} sizes must be positive; got " + ", ".join(f"{k}={v}" for k, v in bad.items()))


class Generator(eqx.Module):
    """A DCGAN-style generator (Radford et al., 2016) with group norm: `z -> linear -> [4f, h/4, w/4]`,
    group norm and ReLU, then two stages of (nearest upsample x2, 3x3 conv, group norm, ReLU) to `2f`
    and `f` channels, and a 3x3 conv to `channels` with `tanh`: an image in [-1, 1].

    **Arguments:**

    - `latent`: size of the noise vector `z`.
    - `height`, `width`, `channels`: the images' size; height and width divisible by 4.
    - `features`: `f`, the channels of the last stage.
    - `key`: initialisation key.
    """

    project: eqx.nn.Linear
    project_norm: eqx.nn.GroupNorm
    convs: tuple[eqx.nn.Conv2d, ...]
    norms: tuple[eqx.nn.GroupNorm, ...]
    out: eqx.nn.Conv2d
    latent: int = eqx.field(static=True)
    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    features: int = eqx.field(static=True)

    def __init__(
        self,
        latent: int = 64,
        height: int = 32,
        width: int = 32,
        channels: int = 3,
        features: int = 32,
        *,
        key: PRNGKeyArray,
    ):
        _check_positive("Generator", latent=latent, channels=channels, features=features)
        _check_sizes("Generator", height, width, 4, "two upsampling stages from a quarter of the size")
        k_project, k1, k2, k_out = jax.random.split(key, 4)
        self.project = eqx.nn.Linear(latent, 4 * features * (height // 4) * (width // 4), key=k_project)
        self.project_norm = _group_norm(4 * features)
        # No conv bias before a group norm: the norm subtracts it again.
        self.convs = (
            eqx.nn.Conv2d(4 * features, 2 * features, 3, padding=1, use_bias=False, key=k1),
            eqx.nn.Conv2d(2 * features, features, 3, padding=1, use_bias=False, key=k2),
        )
        self.norms = (_group_norm(2 * features), _group_norm(features))
        self.out = eqx.nn.Conv2d(features, channels, 3, padding=1, key=k_out)
        self.latent, self.height, self.width, self.channels, self.features = latent, height, width, channels, features

    @typecheck
    def __call__(
        self, z: Float[Array, " {self.latent}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "{self.height} {self.width} {self.channels}"]:
        h = self.project(z).reshape(4 * self.features, self.height // 4, self.width // 4)
        h = jax.nn.relu(self.project_norm(h))
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h = jax.nn.relu(norm(conv2d_as_matmul(conv, _upsample(h))))
        return jnp.transpose(jnp.tanh(conv2d_as_matmul(self.out, h)), (1, 2, 0))


class Discriminator(eqx.Module):
    """A DCGAN-style discriminator with group norm in place of batch norm: a stride-2 4x4 conv to `f`
    channels and LeakyReLU(0.2), a stride-2 4x4 conv to `2f` channels, group norm and LeakyReLU(0.2),
    then a linear map of the flattened features to one logit (of "real").

    **Arguments:**

    - `height`, `width`, `channels`: the images' size (at least 4x4).
    - `features`: `f`, the channels of the first conv.
    - `key`: initialisation key.
    """

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    head: eqx.nn.Linear
    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    features: int = eqx.field(static=True)

    def __init__(self, height: int = 32, width: int = 32, channels: int = 3, features: int = 32, *, key: PRNGKeyArray):
        _check_positive("Discriminator", channels=channels, features=features)
        if height < 4 or width < 4:
            raise ValueError(f"Discriminator needs images of at least 4x4 (two stride-2 convs); got {height}x{width}")
        k1, k2, k_head = jax.random.split(key, 3)
        # A 4x4 kernel, stride 2, padding 1 halves a size exactly (rounding down): 32 -> 16 -> 8, 28 -> 14 -> 7.
        self.conv1 = eqx.nn.Conv2d(channels, features, 4, stride=2, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(features, 2 * features, 4, stride=2, padding=1, use_bias=False, key=k2)
        self.norm2 = _group_norm(2 * features)
        self.head = eqx.nn.Linear(2 * features * (height // 4) * (width // 4), "scalar", key=k_head)
        self.height, self.width, self.channels, self.features = height, width, channels, features

    @typecheck
    def __call__(
        self, x: Float[Array, "{self.height} {self.width} {self.channels}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, ""]:
        h = jax.nn.leaky_relu(conv2d_as_matmul(self.conv1, jnp.transpose(x, (2, 0, 1))), 0.2)
        h = jax.nn.leaky_relu(self.norm2(conv2d_as_matmul(self.conv2, h)), 0.2)
        return self.head(h.reshape(-1))


class TimeResidualBlock(eqx.Module):
    """DDPM's residual block: `GN, SiLU, conv3x3, + linear(SiLU(time)) per channel, GN, SiLU, conv3x3`,
    plus the input (through a 1x1 conv when the channel count changes)."""

    norm1: eqx.nn.GroupNorm
    conv1: eqx.nn.Conv2d
    time: eqx.nn.Linear
    norm2: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    skip: eqx.nn.Conv2d | None

    def __init__(self, in_channels: int, out_channels: int, time_features: int, *, key: PRNGKeyArray):
        k1, k_time, k2, k_skip = jax.random.split(key, 4)
        self.norm1 = _group_norm(in_channels)
        self.conv1 = eqx.nn.Conv2d(in_channels, out_channels, 3, padding=1, key=k1)
        self.time = eqx.nn.Linear(time_features, out_channels, key=k_time)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = eqx.nn.Conv2d(out_channels, out_channels, 3, padding=1, key=k2)
        self.skip = None if in_channels == out_channels else eqx.nn.Conv2d(in_channels, out_channels, 1, key=k_skip)

    @typecheck
    def __call__(
        self, x: Float[Array, "in_channels height width"], time: Float[Array, " time_features"]
    ) -> Float[Array, "out_channels height width"]:
        h = conv2d_as_matmul(self.conv1, jax.nn.silu(self.norm1(x)))
        h = h + self.time(jax.nn.silu(time))[:, None, None]
        h = conv2d_as_matmul(self.conv2, jax.nn.silu(self.norm2(h)))
        return h + (x if self.skip is None else conv2d_as_matmul(self.skip, x))


def _sinusoidal(t: Float[Array, ""], features: int) -> Float[Array, " {features}"]:
    """The transformer's sinusoidal position code of `1000 t` (DDPM's step count for t in [0, 1]):
    periods from 2 pi to 2 pi * 10^4, so both neighbouring steps and the whole range are told apart."""
    half = features // 2
    frequencies = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / max(half - 1, 1))
    angles = 1000.0 * t * frequencies
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])


class UNet(eqx.Module):
    """A small DDPM noise-prediction U-Net (Ho et al., 2020): predicts the noise in `x` at diffusion time
    `t` in [0, 1]. The time's sinusoidal code (of `1000 t`) goes through an MLP (Linear, SiLU, Linear)
    and into every residual block. A 3x3 conv to `features` channels; at each of `levels` levels a
    residual block, then a stride-2 3x3 conv halving the size and doubling the channels; a middle
    block; the mirror path (nearest upsample x2, a 3x3 conv halving the channels, the level's skip
    concatenated, a residual block); group norm, SiLU and a 3x3 conv to `channels`.

    **Arguments:**

    - `channels`: the images' channels.
    - `features`: channels of the first level (`features * 2**level` at each level).
    - `levels`: how many times the resolution halves; height and width must be divisible by `2**levels`.
    - `time_features`: size of the time code and of its MLP (even).
    - `height`, `width`: the images' size.
    - `key`: initialisation key.
    """

    time_in: eqx.nn.Linear
    time_out: eqx.nn.Linear
    stem: eqx.nn.Conv2d
    down_blocks: tuple[TimeResidualBlock, ...]
    downsamples: tuple[eqx.nn.Conv2d, ...]
    middle: TimeResidualBlock
    upsamples: tuple[eqx.nn.Conv2d, ...]  # deepest level first
    up_blocks: tuple[TimeResidualBlock, ...]  # deepest level first
    out_norm: eqx.nn.GroupNorm
    out: eqx.nn.Conv2d
    channels: int = eqx.field(static=True)
    features: int = eqx.field(static=True)
    levels: int = eqx.field(static=True)
    time_features: int = eqx.field(static=True)
    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)

    def __init__(
        self,
        channels: int = 3,
        features: int = 32,
        levels: int = 2,
        time_features: int = 64,
        height: int = 32,
        width: int = 32,
        *,
        key: PRNGKeyArray,
    ):
        _check_positive("UNet", channels=channels, features=features)
        if levels < 0:
            raise ValueError(f"UNet levels must be 0 or more; got {levels}")
        if time_features < 2 or time_features % 2:
            raise ValueError(f"UNet time_features must be even and at least 2 (sines and cosines); got {time_features}")
        _check_sizes("UNet", height, width, 2**levels, f"{levels} levels each halve it")
        keys = iter(jax.random.split(key, 5 + 4 * levels))
        self.time_in = eqx.nn.Linear(time_features, time_features, key=next(keys))
        self.time_out = eqx.nn.Linear(time_features, time_features, key=next(keys))
        self.stem = eqx.nn.Conv2d(channels, features, 3, padding=1, key=next(keys))
        widths = [features * 2**level for level in range(levels + 1)]
        self.down_blocks = tuple(TimeResidualBlock(w, w, time_features, key=next(keys)) for w in widths[:-1])
        self.downsamples = tuple(eqx.nn.Conv2d(w, 2 * w, 3, stride=2, padding=1, key=next(keys)) for w in widths[:-1])
        self.middle = TimeResidualBlock(widths[-1], widths[-1], time_features, key=next(keys))
        below = widths[:0:-1]  # the channels arriving at each level on the way up, deepest first
        self.upsamples = tuple(eqx.nn.Conv2d(w, w // 2, 3, padding=1, key=next(keys)) for w in below)
        self.up_blocks = tuple(TimeResidualBlock(w, w // 2, time_features, key=next(keys)) for w in below)
        self.out_norm = _group_norm(features)
        self.out = eqx.nn.Conv2d(features, channels, 3, padding=1, key=next(keys))
        self.channels, self.features, self.levels, self.time_features = channels, features, levels, time_features
        self.height, self.width = height, width

    @typecheck
    def __call__(
        self,
        x: Float[Array, "{self.height} {self.width} {self.channels}"],
        t: Float[Array, ""],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "{self.height} {self.width} {self.channels}"]:
        time = self.time_out(jax.nn.silu(self.time_in(_sinusoidal(t, self.time_features))))
        h = conv2d_as_matmul(self.stem, jnp.transpose(x, (2, 0, 1)))
        skips = []
        for block, downsample in zip(self.down_blocks, self.downsamples, strict=True):
            h = block(h, time)
            skips.append(h)
            h = conv2d_as_matmul(downsample, h)
        h = self.middle(h, time)
        for block, upsample, skip in zip(self.up_blocks, self.upsamples, reversed(skips), strict=True):
            h = conv2d_as_matmul(upsample, _upsample(h))
            h = block(jnp.concatenate([h, skip]), time)
        h = conv2d_as_matmul(self.out, jax.nn.silu(self.out_norm(h)))
        return jnp.transpose(h, (1, 2, 0))
