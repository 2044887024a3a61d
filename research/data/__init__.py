"""Datasets, numpy collation, a torch DataLoader builder and a device-resident loader."""

from ._loaders import (
    ArrayDataset,
    Batch,
    DataError,
    Dataset,
    DeviceLoader,
    HostLoader,
    TorchLoader,
    dataset_arrays,
    epoch_seed,
    make_dataloader,
    numpy_collate,
    train_and_eval_loaders,
)
from ._mnist1d import (
    MNIST1D_CLASSES,
    MNIST1D_LENGTH,
    MNIST1D_SEED,
    MNIST1D_TEST_SIZE,
    MNIST1D_TRAIN_SIZE,
    generate_mnist1d,
    load_mnist1d,
)
from ._xor import XORDataset

__all__ = [
    "MNIST1D_CLASSES",
    "MNIST1D_LENGTH",
    "MNIST1D_SEED",
    "MNIST1D_TEST_SIZE",
    "MNIST1D_TRAIN_SIZE",
    "ArrayDataset",
    "Batch",
    "DataError",
    "Dataset",
    "DeviceLoader",
    "HostLoader",
    "TorchLoader",
    "XORDataset",
    "dataset_arrays",
    "epoch_seed",
    "generate_mnist1d",
    "load_mnist1d",
    "make_dataloader",
    "numpy_collate",
    "train_and_eval_loaders",
]
