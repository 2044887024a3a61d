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


@pytest.fixture(scope="session")
def mnist1d_dir(tmp_path_factory):
    """A data directory holding the generated MNIST-1D cache (generated once per test session)."""
    from research.data import load_mnist1d

    path = tmp_path_factory.mktemp("mnist1d")
    load_mnist1d(path)
    return path
