"""The pieces the fast path rewrote for speed compute exactly what the straightforward code does."""

import jax
import numpy as np
import pytest

from research.train._keys import split_key_data


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
def test_unrolled_key_split_gives_the_bits_of_jax_random_split(seed):
    key = jax.random.key(seed)
    for _ in range(3):
        first, second = jax.random.split(key)
        mine = jax.jit(split_key_data)(jax.random.key_data(key))
        np.testing.assert_array_equal(mine[0], jax.random.key_data(first))
        np.testing.assert_array_equal(mine[1], jax.random.key_data(second))
        key = first
