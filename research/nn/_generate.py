"""Sampling tokens from a `LanguageModel` with a key-value cache: one pass over the prompt fills every
block's keys and values, then one compiled loop (`lax.scan`) computes each new token from the cache."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..typing import Array, Float, Int, Integer, PRNGKeyArray, PyTree, Shaped, typecheck
from ._lm import DecoderBlock, LanguageModel, attention

START_TOKEN = 10  # b"\n": what an empty prompt starts from, as if the text began after a line break


class KeyValueCache(eqx.Module):
    """The keys and values of every block at every position of the window (those past its end unused)."""

    keys: Float[Array, "depth context heads qk_size"]
    values: Float[Array, "depth context heads vo_size"]


def _empty_cache(model: LanguageModel) -> KeyValueCache:
    attention = model.blocks.attention  # static fields: the same in every (stacked) block
    dtype = attention.key_proj.weight.dtype  # the compute dtype (`model` is `LanguageModel.computing()`)
    shape = (model.depth, model.context, attention.num_heads)
    return KeyValueCache(jnp.zeros((*shape, attention.qk_size), dtype), jnp.zeros((*shape, attention.vo_size), dtype))


@typecheck
def _block(
    block: DecoderBlock,
    x: Float[Array, "tokens dim"],
    keys: Float[Array, "context heads qk_size"],
    values: Float[Array, "context heads vo_size"],
    start: Int[Array, ""],
) -> tuple[Float[Array, "tokens dim"], Float[Array, "tokens heads qk_size"], Float[Array, "tokens heads vo_size"]]:
    """`DecoderBlock.__call__` for tokens at positions `start, start + 1, ...` that see the cached
    positions before them; also their own keys and values (for the cache)."""
    h = jax.vmap(block.attention_norm)(x).astype(keys.dtype)
    query, new_keys, new_values = block.queries_keys_values(h)
    keys = jax.lax.dynamic_update_slice_in_dim(keys, new_keys, start, axis=0)
    values = jax.lax.dynamic_update_slice_in_dim(values, new_values, start, axis=0)
    positions = start + jnp.arange(x.shape[0])
    mask = jnp.arange(keys.shape[0])[None, :] <= positions[:, None]
    attended = attention(query, keys, values, mask)
    x = x + jax.vmap(block.attention.output_proj)(attended.reshape(x.shape[0], -1)).astype(x.dtype)
    return x + block.mlp(x), new_keys, new_values


@typecheck
def _extend(
    model: LanguageModel, cache: KeyValueCache, tokens: Int[Array, " tokens"], start: Int[Array, ""]
) -> tuple[Float[Array, "tokens dim"], KeyValueCache]:
    """The final hidden states of `tokens` placed at positions `start, ...`, attending to the cache
    before them, and the cache with their keys and values written in. `model` is
    `LanguageModel.computing()`."""
    x = model.token_embedding.weight[tokens] + jax.lax.dynamic_slice_in_dim(model.positions, start, len(tokens))
    params, static = eqx.partition(model.blocks, eqx.is_array)

    def layer(x: Array, inputs: PyTree) -> tuple[Array, tuple[Array, Array]]:
        block_params, keys, values = inputs
        x, new_keys, new_values = _block(eqx.combine(block_params, static), x, keys, values, start)
        return x, (new_keys, new_values)

    x, (new_keys, new_values) = jax.lax.scan(layer, x, (params, cache.keys, cache.values))
    write = lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new, start, axis=1)  # noqa: E731
    return x, KeyValueCache(write(cache.keys, new_keys), write(cache.values, new_values))


@typecheck
def _logits(model: LanguageModel, hidden: Float[Array, " dim"]) -> Float[Array, " vocab"]:
    return model.logits(hidden[None])[0]


@typecheck
def _prefill(
    model: LanguageModel, window: Int[Array, " context"], count: Int[Array, ""]
) -> tuple[KeyValueCache, Float[Array, " vocab"]]:
    """The cache of the first `count` tokens of `window` (the rest is padding, never attended to and
    overwritten as tokens come), and the logits of the token after them: one pass over the window."""
    hidden, cache = _extend(model, _empty_cache(model), window, jnp.int32(0))
    return cache, _logits(model, hidden[count - 1])


def _pick(
    logits: Float[Array, " vocab"], key: PRNGKeyArray, temperature: Float[Array, ""], top_k: Int[Array, ""]
) -> Int[Array, ""]:
    """A token from `logits`: the likeliest at temperature 0, else sampled among the `top_k` likeliest
    (and those tied with the k-th). Both are traced: one compiled loop serves every setting."""
    kth_largest = jnp.sort(logits)[logits.shape[0] - top_k]
    kept = jnp.where(logits < kth_largest, -jnp.inf, logits)
    sampled = jax.random.categorical(key, kept / jnp.where(temperature > 0, temperature, 1.0))
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)


@eqx.filter_jit
def _sample_loop(
    model: LanguageModel,
    window: Int[Array, " context"],
    count: Int[Array, ""],
    keys: Shaped[Array, "length ..."],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    with_logits: bool,
) -> tuple[Int[Array, " length"], Float[Array, "length vocab"] | None]:
    """The compiled loop. Each step brings the cache up to date with the window (the whole window
    after a re-fill, else its last token), picks a token from the logits, and appends it; a full
    window is cut to its last `context // 2` tokens (the new one included), to be re-filled next step.
    `with_logits`: also return each step's logits (`length x vocab` floats: only when asked)."""
    model = model.computing()
    context, keep = model.context, max(model.context // 2, 1)

    def fill(cache: KeyValueCache, window: Array, count: Array) -> tuple[KeyValueCache, Array]:
        return _prefill(model, window, count)

    def extend(cache: KeyValueCache, window: Array, count: Array) -> tuple[KeyValueCache, Array]:
        hidden, cache = _extend(model, cache, window[count - 1][None], count - 1)
        return cache, _logits(model, hidden[0])

    def step(carry: tuple, key: PRNGKeyArray) -> tuple[tuple, tuple[Array, Array | None]]:
        cache, window, count, fresh = carry  # fresh: nothing of this window is in the cache yet
        cache, logits = jax.lax.cond(fresh, fill, extend, cache, window, count)
        token = _pick(logits, key, temperature, top_k)
        full = count == context
        kept = jnp.concatenate([window[context - keep + 1 :], token[None], jnp.zeros(context - keep, window.dtype)])
        window = jnp.where(full, kept, window.at[count].set(token, mode="drop"))
        return (cache, window, jnp.where(full, keep, count + 1), full), (token, logits if with_logits else None)

    carry = (_empty_cache(model), window, count, jnp.bool_(True))
    _, (tokens, logits) = jax.lax.scan(step, carry, keys)
    return tokens, logits


def _window(model: LanguageModel, prompt: Integer[Array, " prompt"]) -> tuple[Array, Array]:
    """The prompt's last `context` tokens (an empty prompt: START_TOKEN), padded to the context, and their count."""
    tokens = np.asarray(prompt)
    if tokens.size == 0:
        if model.vocab <= START_TOKEN:
            raise ValueError(
                f"generate: an empty prompt starts from token {START_TOKEN} (newline), outside the "
                f"model's vocabulary 0..{model.vocab - 1}: give a prompt"
            )
        tokens = np.array([START_TOKEN])
    outside = np.flatnonzero((tokens < 0) | (tokens >= model.vocab))
    if outside.size:
        raise ValueError(
            f"generate: prompt token {tokens[outside[0]]} at position {outside[0]} is outside the "
            f"model's vocabulary 0..{model.vocab - 1} ({outside.size} such token(s))"
        )
    tokens = tokens[-model.context :].astype(np.int32)
    window = np.zeros(model.context, np.int32)
    window[: len(tokens)] = tokens
    return jnp.asarray(window), jnp.int32(len(tokens))


def _check_arguments(model: LanguageModel, length: int, temperature: float | int, top_k: int | None) -> None:
    if length < 1:
        raise ValueError(f"generate: length must be at least 1 (tokens to generate), got {length}")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0 (0: always the most likely token), got {temperature}")
    if top_k is not None and not 1 <= top_k <= model.vocab:
        raise ValueError(f"generate: top_k must be in 1..{model.vocab} (the vocabulary) or None, got {top_k}")


def _generate(
    model: LanguageModel,
    prompt: Integer[Array, " prompt"],
    length: int,
    key: PRNGKeyArray,
    temperature: float | int,
    top_k: int | None,
    with_logits: bool,
) -> tuple[Array, Array | None]:
    _check_arguments(model, length, temperature, top_k)
    window, count = _window(model, prompt)
    return _sample_loop(
        model,
        window,
        count,
        jax.random.split(key, length),
        jnp.float32(temperature),
        jnp.int32(model.vocab if top_k is None else top_k),
        with_logits,
    )


@typecheck
def generate_with_logits(
    model: LanguageModel,
    prompt: Integer[Array, " prompt"],
    length: int,
    *,
    key: PRNGKeyArray,
    temperature: float | int = 1.0,
    top_k: int | None = None,
) -> tuple[Int[Array, " {length}"], Float[Array, "{length} vocab"]]:
    """`generate`'s tokens, and the logits each was picked from (row `i`: the logits of token `i`)."""
    tokens, logits = _generate(model, prompt, length, key, temperature, top_k, with_logits=True)
    assert logits is not None
    return tokens, logits


@typecheck
def generate(
    model: LanguageModel,
    prompt: Integer[Array, " prompt"],
    length: int,
    *,
    key: PRNGKeyArray,
    temperature: float | int = 1.0,
    top_k: int | None = None,
) -> Int[Array, " {length}"]:
    """`length` tokens that follow `prompt`, sampled from `model` one at a time.

    One pass over the prompt fills every block's key-value cache, then one compiled loop
    (`lax.scan`) computes each new token's logits from the cache alone: the logits the uncached
    `model(tokens)[-1]` gives, to float rounding.

    **The context.** The model has `context` learned positions, so it sees a window of at most
    `context` tokens: a longer prompt is cut to its last `context`. Whenever a new token would not
    fit, the window restarts from its last `context // 2` tokens (the new one included; one more
    pass re-fills the cache, inside the compiled loop), so any `length` works, and once the text is
    that long each token is picked after at least `context // 2` tokens.

    **Arguments:**

    - `model`: a `LanguageModel` (its `compute_dtype`: bf16 computes in bfloat16).
    - `prompt`: the tokens to continue (bytes, for a byte model). An empty prompt starts from a
      newline (`b"\\n"`, token 10), which is not returned. Its values are checked, so it must be
      concrete (not traced): `generate` compiles its own loop.
    - `length`: how many tokens to generate.
    - `key`: the key of the sampling; the same key gives the same tokens.
    - `temperature`: logits are divided by it before sampling (`jax.random.categorical`); 0 picks the
      most likely token every time (greedy).
    - `top_k`: sample among the `top_k` most likely tokens only (tokens tied with the k-th are kept).

    **Returns:** the generated tokens (without the prompt), int32.

    **Raises:** `ValueError` for `length < 1`, a negative temperature, a `top_k` outside
    1..vocab, or a prompt token outside the vocabulary.
    """
    return _generate(model, prompt, length, key, temperature, top_k, with_logits=False)[0]
