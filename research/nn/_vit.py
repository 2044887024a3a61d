"""A vision transformer image classifier (Dosovitskiy et al. 2021), laid out as Hugging Face's `ViTModel` is, so
that its checkpoints load into it (`research.nn.load_vit`): image patches embedded linearly, a class token and
learned positions, pre-norm encoder blocks stacked and run with `lax.scan`, a final norm, a linear head on the
class token."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, Integer, PRNGKeyArray, PyTree, typecheck


class EncoderBlock(eqx.Module):
    """Pre-norm block over every token: `x + attention(norm(x))`, then `x + mlp(norm(x))` (exact GELU)."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, mlp_dim: int, eps: float, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(dim, eps=eps)
        biases = dict.fromkeys(("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"), True)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, **biases, key=k1)
        self.mlp_norm = eqx.nn.LayerNorm(dim, eps=eps)
        self.mlp_in = eqx.nn.Linear(dim, mlp_dim, key=k2)
        self.mlp_out = eqx.nn.Linear(mlp_dim, dim, key=k3)

    @typecheck
    def __call__(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h)
        h = jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.mlp_norm)(x)), approximate=False)
        return x + jax.vmap(self.mlp_out)(h)


class VisionTransformer(eqx.Module):
    """ONE image in (`height x width x channels`), class logits out. A float image is taken as the checkpoint's
    image processor makes it (`transformers`' `pixel_values`, channels last); a `uint8` image (0-255, as
    `research.data` reads images) is preprocessed as that processor does: `(x / 255 - mean) / std` per channel.

    **Arguments:**

    - `image_size`: the height and width of the (square) images; `patch` must divide it.
    - `patch`: the side of the square patches, each one token.
    - `channels`: colour channels of the images.
    - `classes`: the number of classes.
    - `dim`, `depth`, `heads`, `mlp_dim`: token width, number of blocks, attention heads (dividing `dim`),
      hidden width of each block's MLP (default `4 * dim`).
    - `eps`: the layer norms' epsilon (1e-12 in Hugging Face's ViT configs).
    - `mean`, `std`: per-channel statistics (0-1 units) a `uint8` image is normalised by (default 0.5 and 0.5,
      `ViTImageProcessor`'s).
    - `key`: initialisation key.
    """

    patch_embedding: eqx.nn.Linear  # a convolution of kernel and stride `patch`, over flattened (channel, row, col)
    class_token: Float[Array, " dim"]
    positions: Float[Array, "tokens dim"]  # the class token's, then the patches' row by row
    blocks: EncoderBlock  # every array has a leading `depth` axis
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    image_size: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    mean: tuple[float, ...] = eqx.field(static=True)
    std: tuple[float, ...] = eqx.field(static=True)

    def __init__(
        self,
        image_size: int = 32,
        patch: int = 4,
        channels: int = 3,
        classes: int = 10,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_dim: int | None = None,
        eps: float = 1e-12,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        *,
        key: PRNGKeyArray,
    ):
        if image_size % patch:
            raise ValueError(f"VisionTransformer patch {patch} must divide image_size {image_size}")
        if dim % heads:
            raise ValueError(f"VisionTransformer heads {heads} must divide dim {dim}")
        embed_key, class_key, position_key, block_key, head_key = jax.random.split(key, 5)
        tokens = 1 + (image_size // patch) ** 2
        self.patch_embedding = eqx.nn.Linear(channels * patch * patch, dim, key=embed_key)
        self.class_token = 0.02 * jax.random.normal(class_key, (dim,))
        self.positions = 0.02 * jax.random.normal(position_key, (tokens, dim))
        make_block = lambda k: EncoderBlock(dim, heads, mlp_dim or 4 * dim, eps, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(block_key, depth))
        self.norm = eqx.nn.LayerNorm(dim, eps=eps)
        self.head = eqx.nn.Linear(dim, classes, key=head_key)
        self.image_size, self.patch, self.channels, self.classes = image_size, patch, channels, classes
        self.mean = tuple(float(m) for m in (mean if mean is not None else (0.5,) * channels))
        self.std = tuple(float(s) for s in (std if std is not None else (0.5,) * channels))

    def __check_init__(self):
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(
                f"VisionTransformer takes one mean and one std a channel ({self.channels}); got "
                f"{len(self.mean)} and {len(self.std)}"
            )
        if min(self.std) <= 0:
            raise ValueError(f"VisionTransformer std must be positive, got {self.std}")

    @typecheck
    def __call__(
        self,
        x: Integer[Array, "{self.image_size} {self.image_size} {self.channels}"]
        | Float[Array, "{self.image_size} {self.image_size} {self.channels}"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " {self.classes}"]:
        if jnp.issubdtype(x.dtype, jnp.integer):
            mean, std = (jnp.asarray(s, jnp.float32).reshape(1, 1, -1) for s in (self.mean, self.std))
            x = (x.astype(jnp.float32) / 255 - mean) / std
        x = x.astype(self.patch_embedding.weight.dtype)  # computing in bf16 (research.train.precision.LowPrecision)
        side, p = self.image_size // self.patch, self.patch
        patches = x.reshape(side, p, side, p, self.channels).transpose(0, 2, 4, 1, 3).reshape(side * side, -1)
        tokens = jnp.concatenate([self.class_token[None], jax.vmap(self.patch_embedding)(patches)]) + self.positions
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: Array, block_params: PyTree) -> tuple[Array, None]:
            return eqx.combine(block_params, static)(x), None

        tokens, _ = jax.lax.scan(layer, tokens, params)
        return self.head(self.norm(tokens[0]))
