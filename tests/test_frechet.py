import numpy as np
import pytest
import scipy.linalg

from research.frechet import FeatureStatistics, frechet_distance


def reference(a: FeatureStatistics, b: FeatureStatistics) -> float:
    """The textbook formula, with scipy's general matrix square root (what FID's reference code uses)."""
    root = scipy.linalg.sqrtm(a.covariance @ b.covariance).real
    return float(np.sum((a.mean - b.mean) ** 2) + np.trace(a.covariance + b.covariance - 2 * root))


def test_it_equals_the_textbook_formula_on_random_features():
    rng = np.random.default_rng(0)
    a = FeatureStatistics.of(rng.normal(size=(300, 16)) @ rng.normal(size=(16, 16)))
    b = FeatureStatistics.of(rng.normal(size=(200, 16)) @ rng.normal(size=(16, 16)) + 0.5)
    assert frechet_distance(a, b) == pytest.approx(reference(a, b), rel=1e-9)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-9)


def test_it_is_zero_for_equal_sets_and_the_closed_form_for_diagonal_gaussians():
    rng = np.random.default_rng(1)
    features = rng.normal(size=(100, 8))
    same = FeatureStatistics.of(features)
    assert frechet_distance(same, same) == pytest.approx(0.0, abs=1e-9)
    # Commuting (diagonal) covariances: sum of squared mean differences + sum of (sigma_a - sigma_b)^2.
    a = FeatureStatistics(np.zeros(3), np.diag([1.0, 4.0, 9.0]), 10)
    b = FeatureStatistics(np.array([1.0, 0.0, 2.0]), np.diag([4.0, 4.0, 1.0]), 10)
    assert frechet_distance(a, b) == pytest.approx((1 + 4) + (1 + 0 + 4), rel=1e-12)


def test_it_refuses_too_few_features_and_other_dimensions():
    with pytest.raises(ValueError, match="count >= 2"):
        FeatureStatistics.of(np.zeros((1, 4)))
    with pytest.raises(ValueError, match="4 and 3 dimensions"):
        frechet_distance(FeatureStatistics.of(np.eye(4)), FeatureStatistics.of(np.eye(3)))
