"""A decoder-only transformer language model over bytes, its layers stacked and run with `lax.scan`; and a
classifier of token sequences read at the last token of one."""

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive

from ..typing import Array, Bool, Float, Int, PRNGKeyArray, PyTree, typecheck

ComputeDtype = Literal["float32", "bfloat16"]

# What a block keeps for its backward pass unless `remat` recomputes it whole: the outputs of its products and the
# residual stream between its halves. The norms, casts and GELU are recomputed from them: cheap elementwise work
# whose float32 and per-operation copies would otherwise be most of what a block keeps (docs/benchmarks.md, the LM's
# anatomy).
SAVED_FOR_BACKWARD = ("qkv", "attended", "residual", "mlp_hidden")


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


def _is_fused_attention(primitive: Primitive, *_, **__) -> bool:
    """cuDNN's forward kernel, whose outputs (the attention and its softmax statistics) its backward reads."""
    return primitive.name == "dot_product_attention_fwd_wrapper"


def for_backward(layer: Callable, remat: bool) -> Callable:
    """`layer` (a block's forward) keeping for the backward pass only its input (`remat`: recompute the rest) or
    only `SAVED_FOR_BACKWARD` and the fused attention's outputs besides it (recompute the elementwise work)."""
    if remat:
        return jax.checkpoint(layer)
    names = jax.checkpoint_policies.save_only_these_names(*SAVED_FOR_BACKWARD)
    return jax.checkpoint(layer, policy=jax.checkpoint_policies.save_from_both_policies(names, _is_fused_attention))


def fused_attention_available() -> bool:
    """Whether `causal_attention` may take cuDNN's fused kernel: the computation runs on a GPU."""
    return jax.default_backend() == "gpu"


def causal_attention(
    query: Float[Array, "tokens heads qk_size"],
    keys: Float[Array, "tokens heads qk_size"],
    values: Float[Array, "tokens heads vo_size"],
) -> Float[Array, "tokens heads vo_size"]:
    """Each position attending to itself and those before it: on a GPU in 16-bit floats, cuDNN's fused
    kernel (`jax.nn.dot_product_attention`, which skips the masked half and keeps no [tokens, tokens]
    matrix); elsewhere, and where cuDNN refuses the head width or layout, `attention` under a causal mask.
    The two agree to float rounding (tests/test_lm.py)."""
    if fused_attention_available() and query.dtype in (jnp.bfloat16, jnp.float16):
        # No cuDNN, or a head width or layout it lacks: XLA's attention below computes the same.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            return jax.nn.dot_product_attention(query, keys, values, is_causal=True, implementation="cudnn")
    return checkpoint_name(blocked_causal_attention(query, keys, values), "attended")


def blocked_causal_attention(
    query: Float[Array, "tokens heads qk_size"],
    keys: Float[Array, "tokens heads qk_size"],
    values: Float[Array, "tokens heads vo_size"],
    blocks: int = 4,
    min_rows: int = 32,
) -> Float[Array, "tokens heads vo_size"]:
    """`attention` under a causal mask, the queries taken in up to `blocks` blocks of at least `min_rows` rows,
    each against the keys up to its last row only: the blocks above the diagonal, all masked, are neither
    computed nor differentiated (4 blocks: 10/16 of the work; docs/benchmarks.md, case (i)). A masked logit
    adds an exact zero to its row's sums, so each row's softmax is the same, to float rounding."""
    tokens = query.shape[0]
    rows = max(min_rows, -(-tokens // blocks))
    parts = []
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        mask = jnp.tril(jnp.ones((end - start, end), bool), k=start)
        parts.append(attention(query[start:end], keys[:end], values[:end], mask))
    return jnp.concatenate(parts)


def dense(
    x: Float[Array, "tokens fan_in"], weight: Float[Array, "fan_out fan_in"], bias: Float[Array, " fan_out"] | None
) -> Float[Array, "tokens fan_out"]:
    """An `eqx.nn.Linear`'s product for all tokens at once, `x @ weight.T + bias`: the activations keep their layout
    (a vmapped `Linear` computes `weight @ x`, whose activation-sized result is then transposed)."""
    y = x @ weight.T
    return y if bias is None else y + bias[None]


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
        h = jax.vmap(self.attention_norm)(x).astype(self.mlp_in.weight.dtype)
        attended = causal_attention(*self.queries_keys_values(h)).reshape(x.shape[0], -1)
        projected = dense(attended, self.attention.output_proj.weight, self.attention.output_proj.bias)
        x = checkpoint_name(x + projected.astype(x.dtype), "residual")
        return x + self.mlp(x)

    def queries_keys_values(self, h: Float[Array, "tokens dim"]) -> tuple[Array, Array, Array]:
        """The heads' queries, keys and values of normalised `h` (each `[tokens, heads, head width]`), from one
        product with the three projections' weights side by side: one large matmul rather than three."""
        projections = (self.attention.query_proj, self.attention.key_proj, self.attention.value_proj)
        weight = jnp.concatenate([p.weight for p in projections])
        biases = [p.bias for p in projections if p.bias is not None]
        qkv = checkpoint_name(dense(h, weight, jnp.concatenate(biases) if biases else None), "qkv")
        query, keys, values = (part.reshape(h.shape[0], self.attention.num_heads, -1) for part in jnp.split(qkv, 3, -1))
        return query, keys, values

    def mlp(self, x: Float[Array, "tokens dim"]) -> Float[Array, "tokens dim"]:
        h = jax.vmap(self.mlp_norm)(x).astype(self.mlp_in.weight.dtype)
        hidden = checkpoint_name(dense(h, self.mlp_in.weight, self.mlp_in.bias), "mlp_hidden")
        return dense(jax.nn.gelu(hidden), self.mlp_out.weight, self.mlp_out.bias).astype(x.dtype)


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
    - `remat`: recompute each block whole in the backward pass (`jax.checkpoint`): least memory, a third more
      compute. Otherwise each block keeps its input, its products' outputs and the residual stream between its
      halves (`SAVED_FOR_BACKWARD`) and recomputes its norms, casts and GELU from them.
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

        x, _ = jax.lax.scan(for_backward(layer, self.remat), x, params)
        # the head's input kept, the final norm recomputed from the last block's output (which is kept anyway)
        keep_head_input = jax.checkpoint_policies.save_only_these_names("head_input")
        return jax.checkpoint(LanguageModel.logits, policy=keep_head_input)(model, x)

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
        x = checkpoint_name(jax.vmap(self.norm)(x).astype(dtype), "head_input")
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
