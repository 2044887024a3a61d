"""`ImageData`, what every reader of image classification data returns (`_images.py`, `_hf_datasets.py`),
and the checks it makes of what a reader read."""

import dataclasses
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import DataError
from ._loaders import Batch, RowArray

Format = Literal["idx", "cifar", "folder", "datasets", "npz", "npy"]


@dataclasses.dataclass(frozen=True)
class ImageData:
    """A labelled image data set read from files.

    **Fields:**

    - `train`, `test`: `Batch(inputs, labels)`: `uint8` images `[examples, height, width, channels]`
      (memory-mapped for an uncompressed IDX file read with `mmap=True`; for a datasets directory so
      read, `ArrowImages`) and `int32` labels.
    - `classes`: the class names (an image folder's directories, CIFAR's meta file) or `"0"`, `"1"`, ...
    - `format`: which reader read it; `path`: what it read.
    """

    train: Batch
    test: Batch
    classes: tuple[str, ...]
    format: Format
    path: Path

    def __post_init__(self) -> None:
        for name, part in (("train", self.train), ("test", self.test)):
            _check_images(part.inputs, f"{self.path} ({name} images)")
            if len(part.inputs) != len(part.labels):
                raise DataError(f"{self.path}: {len(part.inputs)} {name} images but {len(part.labels)} labels")
            bad = np.flatnonzero((part.labels < 0) | (part.labels >= len(self.classes)))
            if bad.size:
                raise DataError(
                    f"{self.path}: {name} label {int(part.labels[bad[0]])} (example {bad[0]}) is out of "
                    f"range for {len(self.classes)} classes"
                )
        if self.train.inputs.shape[1:] != self.test.inputs.shape[1:]:
            raise DataError(
                f"{self.path}: training images are {_size(self.train.inputs)}, test images {_size(self.test.inputs)}"
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """`(height, width, channels)`."""
        return tuple(self.train.inputs.shape[1:])  # type: ignore[return-value]


def _size(images: RowArray) -> str:
    return "x".join(map(str, images.shape[1:]))


def _check_images(images: RowArray, where: str) -> None:
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DataError(
            f"{where}: expected uint8 images [examples, height, width, channels], got {images.dtype} "
            f"{list(images.shape)}"
        )


def numbered_classes(labels: np.ndarray) -> tuple[str, ...]:
    """`"0"` .. `"K-1"`, where 0 .. K-1 are the training labels up to the first gap: every class has
    training examples, so a label past a gap (a damaged byte: 0 .. 9 and a 200) is out of range."""
    present = np.zeros(int(labels.max(initial=0)) + 2, bool)
    present[labels[labels >= 0]] = True
    return tuple(map(str, range(int(np.argmin(present)))))
