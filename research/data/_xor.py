import numpy as np

from ..typing import typecheck


class XORDataset:
    """Noisy XOR: corners of {0,1}^2 plus Gaussian noise, labelled 1 when exactly one coordinate is 1.
    A map-style dataset (`len`, `[i]`) for a torch DataLoader or `DeviceLoader.from_dataset`.

    Generated once from `np.random.default_rng(seed)`, so the same seed always gives the same points.

    **Arguments:**

    - `size`: number of points.
    - `seed`: seed of the numpy Generator.
    - `std`: standard deviation of the noise added to each coordinate.
    """

    @typecheck
    def __init__(self, size: int, seed: int, std: float = 0.1):
        if size <= 0:
            raise ValueError(f"XORDataset size must be positive, got {size}")
        rng = np.random.default_rng(seed)
        corners = rng.integers(0, 2, size=(size, 2))
        self.labels = (corners.sum(axis=1) == 1).astype(np.int32)
        self.inputs = (corners + rng.normal(0.0, std, size=corners.shape)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        return self.inputs[index], self.labels[index]
