import itertools

import jax
import pytest

# Implicit rank promotion hides shape bugs (a (batch,) array silently broadcast against (batch, 1)).
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key on every call, deterministic per test."""
    counter = itertools.count()
    root = jax.random.key(0)
    return lambda: jax.random.fold_in(root, next(counter))
