"""Poisson sampling for DP-SGD and the privacy accounting that assumes exactly that sampler.

DP-SGD's privacy analysis depends on how batches are drawn. Here it is Poisson sampling: at every
step each example joins the batch independently with probability q. Compiled steps need a fixed
batch shape, so a batch holds at most `max_batch_size` examples (the rest of its rows are padding);
a step that draws more keeps a uniformly random subset of `max_batch_size` of them. That is the
*truncated* Poisson subsampled Gaussian mechanism, which Google's `dp-accounting` accounts for
exactly (`TruncatedSubsampledGaussianDpEvent`, privacy loss distributions, add-or-remove-one
neighbouring datasets): the sampler and the accountant describe the same algorithm. (The usual
shuffle-and-split epochs would not be covered by this accounting.)
"""

import math

import numpy as np

from ..data import DeviceLoader
from ..install import require_extra
from ._dp_sgd import PADDING_LABEL


def default_max_batch_size(size: int, expected_batch_size: float | int, multiple_of: int = 1) -> int:
    """Expected batch size + 4 standard deviations + 4 (truncation, when it happens, is accounted),
    rounded up to a multiple of `multiple_of` (the devices that share each batch) when the data allows."""
    q = expected_batch_size / size
    rows = math.ceil(expected_batch_size + 4 * math.sqrt(size * q * (1 - q))) + 4
    rows = -(-rows // multiple_of) * multiple_of
    return rows if rows <= size else size


class PoissonLoader(DeviceLoader):
    """Training batches by (truncated) Poisson sampling, device-resident, for `fit` with `DPSGDLoss`.

    Step `s` draws its batch from `numpy.random.default_rng((seed, s))`: every example independently
    with probability `expected_batch_size / size`; the drawn examples come first in the row, then
    padding (an all-zero example labelled `PADDING_LABEL`). Batches are a pure function of (seed,
    step), so a resumed run sees the same data.

    **Arguments:**

    - `inputs`, `labels`: numpy arrays with the examples along the first axis (labels >= 0).
    - `expected_batch_size`: q * size, the mean number of examples per step.
    - `seed`: seed of the sampling.
    - `max_batch_size`: rows per batch (the compiled batch shape); default `default_max_batch_size`.
    - `multiple_of`: the default `max_batch_size` is a multiple of it (the global device count).
    """

    def __init__(
        self,
        inputs: np.ndarray,
        labels: np.ndarray,
        expected_batch_size: float | int,
        *,
        seed: int,
        max_batch_size: int | None = None,
        multiple_of: int = 1,
    ):
        size = len(labels)
        if not 0 < expected_batch_size <= size:
            raise ValueError(
                f"expected batch size must be in (0, {size}] (the data set size), got {expected_batch_size}"
            )
        if np.any(np.asarray(labels) < 0):
            raise ValueError(f"labels must be >= 0: {PADDING_LABEL} marks padding in Poisson batches")
        max_batch_size = max_batch_size or default_max_batch_size(size, expected_batch_size, multiple_of)
        if not 0 < max_batch_size <= size:
            raise ValueError(f"max_batch_size must be between 1 and the data set size {size}, got {max_batch_size}")
        padded_inputs = np.concatenate([inputs, np.zeros((1, *np.shape(inputs)[1:]), np.asarray(inputs).dtype)])
        padded_labels = np.concatenate([labels, np.full(1, PADDING_LABEL, np.asarray(labels).dtype)])
        super().__init__(padded_inputs, padded_labels, max_batch_size, seed=seed, shuffle=True)
        self.size = size  # real examples; row `size` of the device arrays is the padding example
        self.expected_batch_size = float(expected_batch_size)
        self.sampling_probability = expected_batch_size / size
        self.max_batch_size = max_batch_size
        self.steps_per_epoch = max(1, round(size / expected_batch_size))  # steps that see `size` examples on average

    def step_indices(self, start_step: int, num_steps: int) -> np.ndarray:
        """Rows of example indices for steps `start_step ..`; padding rows index the padding example."""
        rows = np.full((num_steps, self.max_batch_size), self.size, dtype=np.int32)
        for i in range(num_steps):
            rng = np.random.default_rng((self.seed, start_step + i))
            drawn = np.flatnonzero(rng.random(self.size) < self.sampling_probability)
            if len(drawn) > self.max_batch_size:  # truncation: a uniformly random subset, as accounted
                drawn = np.sort(rng.choice(drawn, self.max_batch_size, replace=False))
            rows[i, : len(drawn)] = drawn
        return rows

    def padded_batches(self):
        raise TypeError("a PoissonLoader draws training batches; evaluate with a DeviceLoader(shuffle=False)")

    def epsilon(self, noise_multiplier: float | int, steps: int, delta: float) -> float:
        """The privacy spent by `steps` DP-SGD steps on this loader's batches (see `dp_sgd_epsilon`)."""
        return dp_sgd_epsilon(
            noise_multiplier=noise_multiplier,
            dataset_size=self.size,
            expected_batch_size=self.expected_batch_size,
            max_batch_size=self.max_batch_size,
            steps=steps,
            delta=delta,
        )


def dp_sgd_epsilon(
    *,
    noise_multiplier: float | int,
    dataset_size: int,
    expected_batch_size: float | int,
    max_batch_size: int,
    steps: int,
    delta: float,
    discretization: float = 1e-3,
) -> float:
    """Epsilon at `delta` of `steps` DP-SGD steps with truncated Poisson sampling (`PoissonLoader`).

    Computed by `dp_accounting`'s privacy-loss-distribution accountant (a pessimistic estimate:
    a valid upper bound; a smaller `discretization` tightens it and costs time) for add-or-remove-one
    neighbouring data sets. `noise_multiplier` 0 gives infinity.
    """
    require_extra("privacy accounting", "dp_accounting")
    import dp_accounting

    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if steps == 0:
        return 0.0
    event = dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=dataset_size,
        sampling_probability=expected_batch_size / dataset_size,
        truncated_batch_size=max_batch_size,
        noise_multiplier=noise_multiplier,
    )
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=discretization
    )
    accountant.compose(event, steps)
    return float(accountant.get_epsilon(delta))
