"""Augmentation of image batches on the device, inside the compiled train step: each example gets its
own key (see `research.train.example_keys`), so a batch's augmentation does not depend on how many
devices share it."""

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
