"""Augmentation of image batches on the device, inside the compiled train step: each example gets its
own key (see `research.train.example_keys`), so a batch's augmentation does not depend on how many
devices share it."""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Key

from ..typing import Array, Float, Integer, typecheck


@typecheck
def random_crop_flip(
    images: Integer[Array, "batch height width channels"] | Float[Array, "batch height width channels"],
    keys: Key[Array, " batch"],
    *,
    padding: int,
    flip: bool,
) -> Integer[Array, "batch height width channels"] | Float[Array, "batch height width channels"]:
    """Each image zero-padded by `padding` pixels on every side and cropped back to its size at a random
    offset (no crop when 0), then, with `flip`, mirrored left to right with probability 1/2: the
    augmentation of He et al.'s CIFAR ResNets. `keys`: one key an image."""

    def one(image, key):
        crop_key, flip_key = jax.random.split(key)
        if padding:
            height, width, _ = image.shape
            padded = jnp.pad(image, ((padding, padding), (padding, padding), (0, 0)))
            top, left = jax.random.randint(crop_key, (2,), 0, 2 * padding + 1)
            image = jax.lax.dynamic_slice(padded, (top, left, 0), image.shape)
        if flip:
            image = jnp.where(jax.random.bernoulli(flip_key), image[:, ::-1], image)
        return image

    return jax.vmap(one)(images, keys)


@typecheck
def random_resized_crop(
    images: Float[Array, "batch height width channels"],
    keys: Key[Array, " batch"],
    *,
    scale: tuple[float, float] = (0.5, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> Float[Array, "batch height width channels"]:
    """Each image cropped to a random box and resized back to its size (bilinear): the box covers a fraction
    of the image's area drawn uniformly from `scale`, with an aspect ratio drawn log-uniformly from `ratio`
    (each side at most the image's), at a uniformly random place: SimCLR's (and Inception's) crop.
    `keys`: one key an image."""

    def one(image: Array, key: Array) -> Array:
        area_key, ratio_key, place_key = jax.random.split(key, 3)
        height, width, _ = image.shape
        area = jax.random.uniform(area_key, (), minval=scale[0], maxval=scale[1])
        log_ratio = jax.random.uniform(ratio_key, (), minval=math.log(ratio[0]), maxval=math.log(ratio[1]))
        aspect = jnp.exp(log_ratio)  # width / height of the box
        box = jnp.minimum(jnp.stack([jnp.sqrt(area / aspect), jnp.sqrt(area * aspect)]), 1.0)  # of each side
        corner = jax.random.uniform(place_key, (2,)) * (1.0 - box)  # top, left, as fractions of each side
        size = jnp.asarray([height, width], jnp.float32)
        zoom = 1.0 / box
        return jax.image.scale_and_translate(
            image, image.shape, (0, 1), zoom, -corner * size * zoom, method="linear", antialias=False
        )

    return jax.vmap(one)(images, keys)


GREY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as PIL and torchvision make an RGB image grey


@typecheck
def colour_jitter(
    images: Float[Array, "batch height width channels"],
    keys: Key[Array, " batch"],
    *,
    brightness: float,
    contrast: float,
    saturation: float = 0.0,
    grey_probability: float = 0.0,
) -> Float[Array, "batch height width channels"]:
    """Each image (0-1 values) with its brightness scaled by a factor drawn uniformly from `1 +- brightness`,
    its contrast (the distance of every pixel from the image's mean grey) by one from `1 +- contrast`, and, for
    colour images (3 channels), its saturation (the distance from its grey version) by one from
    `1 +- saturation`, then made grey with probability `grey_probability`; clipped to [0, 1] after each.
    Grey images (1 channel) get the intensity changes only. `keys`: one key an image."""
    channels = images.shape[-1]
    luma = GREY_WEIGHTS if channels == 3 else (1 / channels,) * channels  # (1 channel: the image itself)
    weights = jnp.asarray(luma, jnp.float32)[:, None]

    def factor(key: Array, strength: float) -> Array:
        return jax.random.uniform(key, (), minval=1.0 - strength, maxval=1.0 + strength)

    def one(image: Array, key: Array) -> Array:
        b_key, c_key, s_key, g_key = jax.random.split(key, 4)
        image = jnp.clip(image * factor(b_key, brightness), 0.0, 1.0)
        mean = jnp.mean(image @ weights)
        image = jnp.clip((image - mean) * factor(c_key, contrast) + mean, 0.0, 1.0)
        if channels != 3:
            return image
        image = jnp.clip((image - image @ weights) * factor(s_key, saturation) + image @ weights, 0.0, 1.0)
        grey = jnp.broadcast_to(image @ weights, image.shape)
        return jnp.where(jax.random.bernoulli(g_key, grey_probability), grey, image)

    return jax.vmap(one)(images, keys)
