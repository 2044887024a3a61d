"""`jax.random.split` of a threefry key into two, and `jax.random.normal`, written out without a loop.

On CPU, JAX lowers the threefry hash as a 5-iteration `while` loop (to keep compile times short).
Inside a tiny train step that loop costs more than the rest of the step (~40 us of ~100 us for the
XOR MLP: each iteration is a separate trip through XLA's CPU runtime). This is the same hash with
the rounds unrolled: bit-for-bit what `jax.random.split(key)` returns for a threefry key with
`jax_threefry_partitionable` on (JAX's default); anything else falls back to `jax.random.split`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..typing import Array, UInt32, typecheck

_ROTATIONS = (np.array([13, 15, 26, 6], np.uint32), np.array([17, 29, 16, 24], np.uint32))


def _rotate_left(x: jax.Array, d: int) -> jax.Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    ks = [k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA)]
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ _rotate_left(x[1], int(r))
        x = [x[0] + ks[(i + 1) % 3], x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)]
    return x[0], x[1]


@typecheck
def split_key_data(key: UInt32[Array, " 2"]) -> tuple[UInt32[Array, " 2"], UInt32[Array, " 2"]]:
    """The two halves of `jax.random.split(jax.random.wrap_key_data(key))`, as raw key data."""
    # (jax.config's options are attributes made at run time, which pyright cannot see.)
    if not jax.config.jax_threefry_partitionable:  # pyright: ignore[reportAttributeAccessIssue]
        first, second = jax.random.split(jax.random.wrap_key_data(key))
        return jax.random.key_data(first), jax.random.key_data(second)
    zeros = jnp.zeros((2,), jnp.uint32)
    bits1, bits2 = _threefry2x32(key[0], key[1], zeros, jnp.arange(2, dtype=jnp.uint32))
    return jnp.stack([bits1[0], bits2[0]]), jnp.stack([bits1[1], bits2[1]])


def random_normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """`jax.random.normal(key, shape, dtype)`, bit for bit, with the threefry rounds unrolled.

    For a large draw (DP-SGD's noise: one normal per parameter) JAX's rolled loop costs several times
    the unrolled hash on CPU. Any key other than a threefry key with `jax_threefry_partitionable`
    on, a dtype other than float32, or more than 2^32 values falls back to `jax.random.normal`."""
    size = int(np.prod(shape, dtype=np.int64))
    threefry = (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        and key.shape == ()
        and str(jax.random.key_impl(key)) == "threefry2x32"
    )
    partitionable = jax.config.jax_threefry_partitionable  # pyright: ignore[reportAttributeAccessIssue]
    if not (threefry and partitionable and jnp.dtype(dtype) == jnp.float32 and 0 < size < 2**32):
        return jax.random.normal(key, shape, dtype)
    data = jax.random.key_data(key)
    bits1, bits2 = _threefry2x32(data[0], data[1], jnp.zeros((size,), jnp.uint32), jnp.arange(size, dtype=jnp.uint32))
    bits = (bits1 ^ bits2).reshape(shape)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - 1
    low = np.nextafter(np.float32(-1), np.float32(0))
    uniform = jax.lax.max(low, floats * (np.float32(1) - low) + low)
    return np.float32(np.sqrt(2)) * jax.lax.erf_inv(uniform)
