"""Datasets, numpy collation, a torch DataLoader builder and a device-resident loader."""

from ._loaders import (
    Batch,
    DataError,
    DeviceLoader,
    TorchLoader,
    dataset_arrays,
    epoch_seed,
    make_dataloader,
    numpy_collate,
)
from ._xor import XORDataset

__all__ = [
    "Batch",
    "DataError",
    "DeviceLoader",
    "TorchLoader",
    "XORDataset",
    "dataset_arrays",
    "epoch_seed",
    "make_dataloader",
    "numpy_collate",
]
