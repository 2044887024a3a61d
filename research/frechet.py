"""The Fréchet distance between two sets of feature vectors (Heusel et al. 2017's FID when the features
are Inception's): the distance between the Gaussians of their means and covariances,

    |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^(1/2)),

computed in float64 on the host. `tr((S_a S_b)^(1/2))` is the sum of the square roots of the eigenvalues
of the symmetric `S_a^(1/2) S_b S_a^(1/2)` (the same eigenvalues), so no general matrix square root (and
no complex rounding residue) is needed.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class FeatureStatistics:
    """The mean and covariance (`count - 1` in the denominator) of `count` feature vectors."""

    mean: np.ndarray
    covariance: np.ndarray
    count: int

    @staticmethod
    def of(features: np.ndarray) -> "FeatureStatistics":
        """The statistics of `features`, `[count, dimensions]` (at least two rows)."""
        features = np.asarray(features, np.float64)
        if features.ndim != 2 or len(features) < 2:
            raise ValueError(f"feature statistics need a [count >= 2, dimensions] array, got shape {features.shape}")
        return FeatureStatistics(features.mean(axis=0), np.cov(features, rowvar=False), len(features))


def _symmetric_sqrt(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance(a: FeatureStatistics, b: FeatureStatistics) -> float:
    """The Fréchet distance between the Gaussians of `a` and `b` (0 for equal statistics; symmetric)."""
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"features of {a.mean.shape[0]} and {b.mean.shape[0]} dimensions cannot be compared")
    root = _symmetric_sqrt(a.covariance)
    product = root @ b.covariance @ root
    cross = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh((product + product.T) / 2), 0, None)))
    distance = np.sum((a.mean - b.mean) ** 2) + np.trace(a.covariance) + np.trace(b.covariance) - 2 * cross
    return float(max(distance, 0.0))
