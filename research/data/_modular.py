"""Modular addition `a + b mod p` as token sequences (Power et al. 2022, "Grokking"; Nanda et al. 2023)."""

import numpy as np

from ..errors import DataError
from ._loaders import Batch


def modular_addition(modulus: int, train_fraction: float, *, seed: int) -> tuple[Batch, Batch]:
    """Every pair `(a, b)` of `0 .. modulus-1`, split at random into `(train, test)`.

    Inputs are the tokens `[a, b, =]` (`int32`, shape `(pairs, 3)`, the `=` token is `modulus`, so the
    vocabulary has `modulus + 1` tokens); labels are `(a + b) % modulus`. The `modulus**2` pairs are
    permuted by `np.random.default_rng(seed)` and the first `round(train_fraction * modulus**2)` are the
    training set, the rest the test set: a partition of all pairs that depends on `seed` only.
    """
    if modulus < 2 or not 0 < train_fraction < 1:
        raise DataError(
            f"modular addition needs a modulus >= 2 and a train fraction in (0, 1), got {modulus} and {train_fraction}"
        )
    pairs = modulus * modulus
    a, b = np.divmod(np.arange(pairs), modulus)
    inputs = np.stack([a, b, np.full_like(a, modulus)], axis=1).astype(np.int32)
    labels = ((a + b) % modulus).astype(np.int32)
    order = np.random.default_rng(seed).permutation(pairs)
    count = int(round(train_fraction * pairs))
    if not 0 < count < pairs:
        raise DataError(f"a train fraction of {train_fraction} leaves no training or no test pair of {pairs}")
    train, test = order[:count], order[count:]
    return Batch(inputs[train], labels[train]), Batch(inputs[test], labels[test])
