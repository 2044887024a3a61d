import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck


def _split(key: PRNGKeyArray | None, count: int) -> list[PRNGKeyArray | None]:
    return [None] * count if key is None else list(jax.random.split(key, count))


class TransformerBlock(eqx.Module):
    """Pre-norm encoder block: `x + drop(attention(norm(x)))`, then `x + drop(mlp(norm(x)))`."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, dropout_p=dropout, key=k1)
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.mlp_in = eqx.nn.Linear(dim, mlp_dim, key=k2)
        self.mlp_out = eqx.nn.Linear(mlp_dim, dim, key=k3)
        self.dropout = eqx.nn.Dropout(dropout)

    @typecheck
    def __call__(self, x: Float[Array, "tokens dim"], *, key: PRNGKeyArray | None = None) -> Float[Array, "tokens dim"]:
        attention_key, drop1, drop2, drop3 = _split(key, 4)
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.dropout(self.attention(h, h, h, key=attention_key), key=drop1)
        h = jax.vmap(self.mlp_norm)(x)
        h = self.dropout(jax.nn.gelu(jax.vmap(self.mlp_in)(h)), key=drop2)
        return x + self.dropout(jax.vmap(self.mlp_out)(h), key=drop3)


class TransformerClassifier(eqx.Module):
    """A small vision-transformer-style classifier for a 1-D signal.

    The signal is cut into `length / patch` patches, each embedded linearly, plus a learned
    positional embedding; then `depth` pre-norm blocks of multi-head self-attention and MLP, a final
    layer norm, a mean over the tokens and a linear head. Dropout (on embeddings, attention weights,
    and residual branches) draws from the `key` passed to `__call__`; `eqx.nn.inference_mode` turns
    it off, and then no key is needed.

    **Arguments:**

    - `length`: length of the input signal.
    - `classes`: number of classes.
    - `patch`: signal values per token; must divide `length`.
    - `dim`: token width.
    - `depth`: number of blocks.
    - `heads`: attention heads; must divide `dim`.
    - `mlp_dim`: hidden width of each block's MLP.
    - `dropout`: dropout probability.
    - `key`: initialisation key.
    """

    embed: eqx.nn.Linear
    positions: Float[Array, "tokens dim"]
    embed_dropout: eqx.nn.Dropout
    blocks: tuple[TransformerBlock, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    length: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(
        self,
        length: int = 40,
        classes: int = 10,
        patch: int = 4,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        mlp_dim: int = 64,
        dropout: float = 0.1,
        *,
        key: PRNGKeyArray,
    ):
        if length % patch:
            raise ValueError(f"TransformerClassifier patch {patch} must divide the signal length {length}")
        if dim % heads:
            raise ValueError(f"TransformerClassifier heads {heads} must divide dim {dim}")
        keys = jax.random.split(key, depth + 3)
        self.embed = eqx.nn.Linear(patch, dim, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (length // patch, dim))
        self.embed_dropout = eqx.nn.Dropout(dropout)
        self.blocks = tuple(TransformerBlock(dim, heads, mlp_dim, dropout, key=k) for k in keys[2:-1])
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=keys[-1])
        self.length, self.classes, self.patch, self.dim = length, classes, patch, dim

    def __check_init__(self):
        tokens = self.length // self.patch
        if self.positions.shape != (tokens, self.dim):
            raise ValueError(f"positions should be {(tokens, self.dim)}, got {self.positions.shape}")
        if self.head.weight.shape != (self.classes, self.dim):
            raise ValueError(f"head should be {(self.classes, self.dim)}, got {self.head.weight.shape}")

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.length}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.classes}"]:
        embed_key, *block_keys = _split(key, len(self.blocks) + 1)
        tokens = jax.vmap(self.embed)(x.reshape(self.length // self.patch, self.patch)) + self.positions
        tokens = self.embed_dropout(tokens, key=embed_key)
        for block, block_key in zip(self.blocks, block_keys, strict=True):
            tokens = block(tokens, key=block_key)
        pooled = jnp.mean(jax.vmap(self.norm)(tokens), axis=0)
        return self.head(pooled)
