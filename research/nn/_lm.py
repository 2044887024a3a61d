"""A decoder-only transformer language model over bytes, its layers stacked and run with `lax.scan`; and a
classifier of token sequences read at the last token of one."""

import copy
import math
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


def attention(
    query: Float[Array, "tokens heads qk_size"],
    keys: Float[Array, "context heads qk_size"],
    values: Float[Array, "context heads vo_size"],
    mask: Bool[Array, "tokens context"],
) -> Float[Array, "tokens heads vo_size"]:
    """Multi-head attention where `mask` allows, as `eqx.nn.MultiheadAttention` computes it: each head's
    query scaled by 1/sqrt(qk_size), masked logits at the dtype's minimum, the softmax in float32. On a
    CPU this is faster than `jax.nn.dot_product_attention`'s XLA path (docs/benchmarks.md, case (i))."""

    def head(q: Array, k: Array, v: Array) -> Array:
        logits = jnp.where(mask, (q / math.sqrt(q.shape[-1])) @ k.T, jnp.finfo(q.dtype).min)
        return jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32))).astype(q.dtype) @ v

    return jax.vmap(head, in_axes=1, out_axes=1)(query, keys, values)


def causal_attention(
    query: Float[Array, "tokens heads qk_size"],
    keys: Float[Array, "tokens heads qk_size"],
    values: Float[Array, "tokens heads vo_size"],
) -> Float[Array, "tokens heads vo_size"]:
    """Each position attending to itself and those before it: on a GPU in 16-bit floats, cuDNN's fused
    kernel (`jax.nn.dot_product_attention`, which skips the masked half and keeps no [tokens, tokens]
    matrix); elsewhere, and where cuDNN refuses the head width or layout, `attention` under a causal mask.
    The two agree to float rounding (tests/test_lm.py)."""
    tokens = query.shape[0]
    causal_mask = jnp.tril(jnp.ones((tokens, tokens), bool))
    if jax.default_backend() != "gpu" or query.dtype not in (jnp.bfloat16, jnp.float16):
        return attention(query, keys, values, causal_mask)
    try:
        return jax.nn.dot_product_attention(query, keys, values, is_causal=True, implementation="cudnn")
    except (NotImplementedError, RuntimeError, ValueError):  # no cuDNN, or a head width or layout it lacks
        return attention(query, keys, values, causal_mask)


def split_heads(linear: eqx.nn.Linear, h: Float[Array, "tokens dim"], heads: int) -> Float[Array, "tokens {heads} _"]:
    return jax.vmap(linear)(h).reshape(h.shape[0], heads, -1)


class DecoderBlock(eqx.Module):
    """Pre-norm causal block: `x + attention(norm(x))`, then `x + mlp(norm(x))`. The residual stream `x` and
    the norms stay in `x`'s dtype; the matrix products run in their weights' (bfloat16 under `compute_dtype`)."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention  # its projections and sizes; the attention is `causal_attention`
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, mlp_dim: int, attention_bias: bool = False, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(dim)
        biases = dict.fromkeys(("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"), attention_bias)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, **biases, key=k1)
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.mlp_in = eqx.nn.Linear(dim, mlp_dim, key=k2)
        self.mlp_out = eqx.nn.Linear(mlp_dim, dim, key=k3)

    @typecheck
    def __call__(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
        attention, dtype = self.attention, self.mlp_in.weight.dtype
        h = jax.vmap(self.attention_norm)(x).astype(dtype)
        query, keys, values = (split_heads(p, h, attention.num_heads) for p in self.projections())
        attended = causal_attention(query, keys, values).reshape(x.shape[0], -1)
        x = x + jax.vmap(attention.output_proj)(attended).astype(x.dtype)
        return x + self.mlp(x)

    def projections(self) -> tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]:
        return self.attention.query_proj, self.attention.key_proj, self.attention.value_proj

    def mlp(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
        h = jax.vmap(self.mlp_norm)(x).astype(self.mlp_in.weight.dtype)
        return jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h))).astype(x.dtype)


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
    - `attention_bias`: the attention's projections have biases (GPT-2's do: `research.nn.load_gpt2`).
    - `remat`: rematerialise each block in the backward pass (`jax.checkpoint`): less memory, more compute.
    - `compute_dtype`: `"bfloat16"` runs the matrix products in bf16 (their weights cast inside the call;
      the float32 ones stay the master copy that the optimizer updates); the residual stream, the
      embeddings, the norms and the logits stay float32 either way (`--precision bf16` sets it).
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
        attention_bias: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        if dim % heads:
            raise ValueError(f"LanguageModel heads {heads} must divide dim {dim}")
        embed_key, position_key, block_key, head_key = jax.random.split(key, 4)
        self.token_embedding = eqx.nn.Embedding(weight=0.02 * jax.random.normal(embed_key, (vocab, dim)))
        self.positions = 0.02 * jax.random.normal(position_key, (context, dim))
        make_block = lambda k: DecoderBlock(dim, heads, mlp_dim or 4 * dim, attention_bias, key=k)  # noqa: E731
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
        model = self.computing()
        x = model.token_embedding.weight[tokens] + model.positions[:length]
        params, static = eqx.partition(model.blocks, eqx.is_array)

        def layer(x: Array, block_params: PyTree) -> tuple[Array, None]:
            return eqx.combine(block_params, static)(x), None

        x, _ = jax.lax.scan(jax.checkpoint(layer) if self.remat else layer, x, params)
        return model.logits(x)

    def computing(self) -> "LanguageModel":
        """This model as its call computes: the weights of the blocks' matrix products and of an untied head
        in `compute_dtype`; the embeddings, positions and norms as they are (float32)."""
        dtype = jnp.dtype(self.compute_dtype)
        is_norm = lambda x: isinstance(x, eqx.nn.LayerNorm)  # noqa: E731
        blocks = jax.tree.map(lambda x: x if is_norm(x) else cast_floating(x, dtype), self.blocks, is_leaf=is_norm)
        model = eqx.tree_at(lambda m: m.blocks, self, blocks)
        return model if self.head is None else eqx.tree_at(lambda m: m.head, model, cast_floating(self.head, dtype))

    def logits(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens {self.vocab}"]:
        """The next-token logits of final hidden states `x`, float32: the final norm in float32, the head's
        product (the head has no bias) in `compute_dtype`, accumulated in float32."""
        dtype = jnp.dtype(self.compute_dtype)
        head = self.token_embedding.weight if self.head is None else self.head.weight
        x = jax.vmap(self.norm)(x).astype(dtype)
        return jnp.matmul(x, head.T.astype(dtype), preferred_element_type=jnp.float32)

    def with_compute_dtype(self, dtype: ComputeDtype) -> "LanguageModel":
        """This model computing its matrix products in `dtype` (what `--precision bf16` asks of it)."""
        return self._with_static("compute_dtype", dtype)

    def with_remat(self, remat: bool) -> "LanguageModel":
        """This model rematerialising its blocks in the backward pass, or not."""
        return self._with_static("remat", remat)

    def _with_static(self, name: str, value: object) -> "LanguageModel":
        changed = copy.copy(self)
        object.__setattr__(changed, name, value)  # a static field: not a leaf `eqx.tree_at` reaches
        return changed


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
