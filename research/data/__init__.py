"""Datasets (XOR, MNIST-1D, byte-level text, modular addition), readers of image data in standard formats
(IDX, CIFAR binary, an image folder, .npz), label noise, numpy collation, a torch DataLoader builder and a
device-resident loader."""

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
    eval_loader,
    make_dataloader,
    numpy_collate,
    split_validation,
    train_and_eval_loaders,
)
from ._augment import random_crop_flip
from ._images import (
    FORMATS_HELP,
    ImageData,
    detect_format,
    read_array,
    read_cifar,
    read_idx,
    read_idx_directory,
    read_image_data,
    read_image_folder,
    read_npz,
)
from ._mnist1d import (
    MNIST1D_CLASSES,
    MNIST1D_LENGTH,
    MNIST1D_SAMPLES,
    MNIST1D_SEED,
    MNIST1D_TEST_SIZE,
    MNIST1D_TRAIN_SIZE,
    MNIST1D_TRAIN_SPLIT,
    generate_mnist1d,
    load_mnist1d,
)
from ._modular import modular_addition
from ._noise import corrupt_labels
from ._text import next_byte_windows, read_text_bytes, reference_bits_per_byte, split_held_out
from ._xor import XORDataset

__all__ = [
    "FORMATS_HELP",
    "ImageData",
    "MNIST1D_CLASSES",
    "MNIST1D_LENGTH",
    "MNIST1D_SAMPLES",
    "MNIST1D_SEED",
    "MNIST1D_TEST_SIZE",
    "MNIST1D_TRAIN_SIZE",
    "MNIST1D_TRAIN_SPLIT",
    "ArrayDataset",
    "Batch",
    "DataError",
    "Dataset",
    "DeviceLoader",
    "HostLoader",
    "TorchLoader",
    "XORDataset",
    "corrupt_labels",
    "dataset_arrays",
    "detect_format",
    "epoch_seed",
    "eval_loader",
    "generate_mnist1d",
    "load_mnist1d",
    "make_dataloader",
    "modular_addition",
    "next_byte_windows",
    "numpy_collate",
    "random_crop_flip",
    "read_array",
    "read_cifar",
    "read_idx",
    "read_idx_directory",
    "read_image_data",
    "read_image_folder",
    "read_npz",
    "read_text_bytes",
    "reference_bits_per_byte",
    "split_held_out",
    "split_validation",
    "train_and_eval_loaders",
]
