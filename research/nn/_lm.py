"""A decoder-only transformer language model over bytes, its layers stacked and run with `lax.scan`; and a
classifier of token sequences read at the last token of one."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Bool, Float, Int, PRNGKeyArray, PyTree, typecheck

ComputeDtype = Literal["float32", "bfloat16"]


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    """`tree` with every floating-point array cast to `dtype` (integer arrays and non-arrays untouched).
    Under `jax.grad` the cast is differentiable: the gradient reaches the float32 originals."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)


class DecoderBlock(eqx.Module):
    """Pre-norm causal block: `x + attention(norm(x), mask)`, then `x + mlp(norm(x))`."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, mlp_dim: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.mlp_in = eqx.nn.Linear(dim, mlp_dim, key=k2)
        self.mlp_out = eqx.nn.Linear(mlp_dim, dim, key=k3)

    @typecheck
    def __call__(self, x: Float[Array, "tokens dim"], mask: Bool[Array, "tokens tokens"]) -> Float[Array, "tokens dim"]:
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.mlp_norm)(x)))
        return x + jax.vmap(self.mlp_out)(h)


class LanguageModel(eqx.Module):
    """A GPT-style decoder over a byte vocabulary: ONE sequence of tokens in, next-token logits out.

    Token embedding plus learned positions, `depth` pre-norm causal self-attention blocks whose
    parameters are stacked on a leading axis (built with `eqx.filter_vmap`) and applied with
    `jax.lax.scan`, so the traced program (and its compile time) does not grow with depth; then a
    final layer norm and an output head, tied to the embedding or its own.

    **Arguments:**

    - `context`: the longest sequence (number of learned positions).
    - `vocab`: vocabulary size (256: bytes).
    - `dim`: token width; `heads` must divide it.
    - `depth`: number of blocks.
    - `heads`: attention heads.
    - `mlp_dim`: hidden width of each block's MLP (default `4 * dim`).
    - `tied`: the head is the transposed token embedding (no parameters of its own).
    - `remat`: rematerialise each block in the backward pass (`jax.checkpoint`): less memory, more compute.
    - `compute_dtype`: `"bfloat16"` casts the parameters to bf16 inside the call (the float32 ones
      stay the master copy that the optimizer updates); logits are float32 either way.
    - `key`: initialisation key.
    """

    token_embedding: eqx.nn.Embedding
    positions: Float[Array, "context dim"]
    blocks: DecoderBlock  # every array has a leading `depth` axis
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear | None
    context: int = eqx.field(static=True)
    vocab: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)
    compute_dtype: ComputeDtype = eqx.field(static=True)

    def __init__(
        self,
        context: int = 128,
        vocab: int = 256,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_dim: int | None = None,
        tied: bool = True,
        remat: bool = False,
        compute_dtype: ComputeDtype = "float32",
        *,
        key: PRNGKeyArray,
    ):
        if dim % heads:
            raise ValueError(f"LanguageModel heads {heads} must divide dim {dim}")
        embed_key, position_key, block_key, head_key = jax.random.split(key, 4)
        self.token_embedding = eqx.nn.Embedding(weight=0.02 * jax.random.normal(embed_key, (vocab, dim)))
        self.positions = 0.02 * jax.random.normal(position_key, (context, dim))
        make_block = lambda k: DecoderBlock(dim, heads, mlp_dim or 4 * dim, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(block_key, depth))
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = None if tied else eqx.nn.Linear(dim, vocab, use_bias=False, key=head_key)
        self.context, self.vocab, self.depth = context, vocab, depth
        self.remat, self.compute_dtype = remat, compute_dtype

    def __check_init__(self):
        if self.positions.shape[0] != self.context:
            raise ValueError(f"positions should have {self.context} rows, got {self.positions.shape}")
        if self.token_embedding.weight.shape[0] != self.vocab:
            raise ValueError(f"token_embedding should have {self.vocab} rows, got {self.token_embedding.weight.shape}")

    @typecheck
    def __call__(
        self, tokens: Int[Array, " tokens"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "tokens vocab"]:
        length = tokens.shape[0]
        if length > self.context:
            raise ValueError(f"LanguageModel takes at most {self.context} tokens (its context), got {length}")
        model = cast_floating(self, jnp.dtype(self.compute_dtype))
        x = model.token_embedding.weight[tokens] + model.positions[:length]
        mask = jnp.tril(jnp.ones((length, length), bool))
        params, static = eqx.partition(model.blocks, eqx.is_array)

        def layer(x: Array, block_params: PyTree) -> tuple[Array, None]:
            return eqx.combine(block_params, static)(x, mask), None

        x, _ = jax.lax.scan(jax.checkpoint(layer) if self.remat else layer, x, params)
        x = jax.vmap(model.norm)(x)
        logits = x @ model.token_embedding.weight.T if model.head is None else jax.vmap(model.head)(x)
        return logits.astype(jnp.float32)


class LastTokenClassifier(eqx.Module):
    """A class out of a token sequence: a `LanguageModel` (untied head) read at its last position.

    The logits are the first `classes` of the next-token logits after the last token: for `[a, b, =]`
    of modular addition (Nanda et al. 2023), the answer's. The head's rows for the other tokens get
    no gradient (weight decay shrinks them to zero).

    **Arguments:**

    - `context`, `vocab`, `dim`, `depth`, `heads`, `mlp_dim`: the `LanguageModel`'s.
    - `classes`: the number of classes, at most `vocab`.
    - `key`: initialisation key.
    """

    model: LanguageModel
    classes: int = eqx.field(static=True)

    def __init__(
        self,
        context: int,
        vocab: int,
        classes: int,
        dim: int = 128,
        depth: int = 1,
        heads: int = 4,
        mlp_dim: int | None = None,
        *,
        key: PRNGKeyArray,
    ):
        if not 0 < classes <= vocab:
            raise ValueError(f"LastTokenClassifier classes must be in 1..vocab ({vocab}), got {classes}")
        self.model = LanguageModel(context, vocab, dim, depth, heads, mlp_dim, tied=False, key=key)
        self.classes = classes

    @typecheck
    def __call__(
        self, tokens: Int[Array, " tokens"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.classes}"]:
        return self.model(tokens)[-1, : self.classes]
