"""Label noise: a seeded share of the labels changed to another class (deep double descent's recipe)."""

import numpy as np

from ..errors import DataError


def corrupt_labels(labels: np.ndarray, fraction: float, classes: int, *, seed: int) -> np.ndarray:
    """A copy of `labels` in which exactly `round(fraction * len(labels))` of them, picked at random,
    are changed to another class drawn uniformly from the `classes - 1` others; the rest are kept.

    Which labels change and to what depends on `seed` only (`np.random.default_rng(seed)`).
    """
    if not 0 <= fraction <= 1 or classes < 2:
        raise DataError(f"label noise needs a fraction in [0, 1] and at least 2 classes, got {fraction} and {classes}")
    rng = np.random.default_rng(seed)
    noisy = np.array(labels, copy=True)
    changed = rng.choice(len(noisy), size=int(round(fraction * len(noisy))), replace=False)
    noisy[changed] = (noisy[changed] + rng.integers(1, classes, size=len(changed))) % classes  # never the same
    return noisy
