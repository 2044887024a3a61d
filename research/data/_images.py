"""Image classification data in the formats it comes in, read into arrays: IDX files (MNIST,
Fashion-MNIST, KMNIST), CIFAR-10 and CIFAR-100 binary batches, a folder of images per class, a Hugging Face
`datasets` directory (`research.data.read_datasets_images`), a `.npz`.

`read_image_data(path)` tells the format from the path and returns an `ImageData`: `uint8` images
`[examples, height, width, channels]` and `int32` labels for the training and the test set. Nothing is
unpickled (`np.load(..., allow_pickle=False)`); a damaged or inconsistent file is refused with a
`DataError` that names it: a wrong magic number, a truncated record, a label out of range, images of
different sizes. Uncompressed IDX files (and the `.npy` files of `read_array`, and a datasets directory's
Arrow files) can be memory-mapped, so a data set larger than memory streams from disk (`TorchLoader`,
`GrainLoader`).
"""

import gzip
import re
from pathlib import Path

import numpy as np
from jaxtyping import Shaped

from ..errors import DataError
from ..typing import typecheck
from ._hf_datasets import read_datasets_images
from ._image_data import Format, ImageData, numbered_classes
from ._loaders import Batch

FORMATS_HELP = (
    "an IDX directory (MNIST-style *-images-idx3-ubyte[.gz] and *-labels-idx1-ubyte[.gz]), a CIFAR-10 "
    "or CIFAR-100 binary directory (data_batch_*.bin + test_batch.bin, or train.bin + test.bin), an image "
    "folder (DIR/train/<class>/*.png|jpg, DIR/test/<class>/...), a Hugging Face datasets directory "
    "(DatasetDict.save_to_disk: train and test splits of images and labels), a .npz with x_train, y_train, x_test, "
    "y_test, or a directory of those four as .npy files"
)
IMAGE_COLUMN_HELP = (
    "the images' column of a Hugging Face datasets directory --data (default: image or img, else its one Image, "
    "Array2D or Array3D column)"
)
LABEL_COLUMN_HELP = (
    "the labels' column of a Hugging Face datasets directory --data (default: label, else its one ClassLabel column; "
    "name one where several could serve, as CIFAR-100's fine_label and coarse_label)"
)
NPY_FILES = ("x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy")
IDX_TYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


def detect_format(path: str | Path) -> Format:
    """Which reader `read_image_data` uses for `path`; a `DataError` that lists the formats when none fits."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory; it takes {FORMATS_HELP}")
    if path.is_file():
        if path.suffix == ".npz":
            return "npz"
        raise DataError(f"--data {path}: a file, but not a .npz; it takes {FORMATS_HELP}")
    names = {p.name for p in path.iterdir()}
    if "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names:  # before "folder": train/
        return "datasets"
    if any(_IDX_NAME.match(name) for name in names):
        return "idx"
    if "x_train.npy" in names:
        return "npy"
    if "test_batch.bin" in names or "test.bin" in names:
        return "cifar"
    if (path / "train").is_dir():
        return "folder"
    raise DataError(f"--data {path}: cannot tell its format; it takes {FORMATS_HELP}")


def read_image_data(
    path: str | Path, *, mmap: bool = False, image_column: str | None = None, label_column: str | None = None
) -> ImageData:
    """The training and test images of `path`, in whichever format it is (`detect_format`); `mmap`:
    memory-map uncompressed IDX files, .npy files and a datasets directory's Arrow files instead of reading
    them (a data set larger than memory streams from disk through `TorchLoader` or `GrainLoader`);
    `image_column`, `label_column`: a datasets directory's columns (`read_datasets_images`), refused for
    another format."""
    path = Path(path)
    format = detect_format(path)
    if format != "datasets" and (image_column is not None or label_column is not None):
        raise DataError(
            f"--image-column and --label-column name columns of a Hugging Face datasets directory; --data {path} "
            f"is not one (its format: {format})"
        )
    if format == "idx":
        return read_idx_directory(path, mmap=mmap)
    if format == "npy":
        return read_npy_directory(path, mmap=mmap)
    if format == "cifar":
        return read_cifar(path)
    if format == "folder":
        return read_image_folder(path)
    if format == "datasets":
        return read_datasets_images(path, mmap=mmap, image_column=image_column, label_column=label_column)
    return read_npz(path)


# -- IDX -------------------------------------------------------------------------------------------
_IDX_NAME = re.compile(r"^(train|t10k|test)[-.](images|labels)[-.]idx(\d)-ubyte(\.gz)?$")


@typecheck
def read_idx(path: str | Path, *, mmap: bool = False) -> Shaped[np.ndarray, "..."]:
    """The array of one IDX file (`.gz` too): two zero bytes, a type code, the number of dimensions,
    each dimension as a big-endian uint32, then the data, big-endian. `mmap`: a read-only memory map
    of an uncompressed file (a data set larger than memory)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            opener = gzip.open if f.read(2) == b"\x1f\x8b" else open  # gzip's magic number
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in IDX_TYPES:
                raise DataError(
                    f"{path}: not an IDX file (wrong magic number {head.hex() or 'none'}: expected 00 00, "
                    "a type code (08 for uint8), then the number of dimensions)"
                )
            dtype, ndim = np.dtype(IDX_TYPES[head[2]]), head[3]
            dims = f.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise DataError(f"{path}: truncated IDX header ({ndim} dimensions announced)")
            shape = tuple(int.from_bytes(dims[4 * i : 4 * i + 4], "big") for i in range(ndim))
            expected = int(np.prod(shape)) * dtype.itemsize
            if mmap and opener is open:
                size = path.stat().st_size - 4 - 4 * ndim
                data = np.memmap(path, dtype, "r", offset=4 + 4 * ndim, shape=shape) if size == expected else None
            else:
                raw = f.read(expected + 1)
                size = len(raw)
                data = np.frombuffer(raw[:expected], dtype).reshape(shape) if size == expected else None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot read it ({e})") from None
    if data is None:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path}: {what}: {shape} of {dtype.name} is {expected} bytes of data, found {size}")
    return data if dtype.byteorder in ("=", "|") or mmap else data.astype(dtype.newbyteorder("="))


def read_idx_directory(path: str | Path, *, mmap: bool = False) -> ImageData:
    """An MNIST-style directory: `train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`,
    `t10k-images-idx3-ubyte[.gz]` (or `test-...`), `t10k-labels-idx1-ubyte[.gz]`."""
    path = Path(path)
    found: dict[tuple[str, str], Path] = {}
    for file in sorted(path.iterdir()):
        match = _IDX_NAME.match(file.name)
        if match:
            split = "train" if match.group(1) == "train" else "test"
            found.setdefault((split, match.group(2)), file)
    parts = {}
    for split in ("train", "test"):
        missing = [kind for kind in ("images", "labels") if (split, kind) not in found]
        if missing:
            prefix, rank = "train" if split == "train" else "t10k", 3 if missing[0] == "images" else 1
            raise DataError(
                f"{path}: no {split} {' or '.join(missing)} IDX file (expected names like "
                f"{prefix}-{missing[0]}-idx{rank}-ubyte[.gz])"
            )
        images = read_idx(found[split, "images"], mmap=mmap)
        labels = read_idx(found[split, "labels"])
        if images.ndim == 3:
            images = images[..., None]
        if images.dtype != np.uint8 or images.ndim != 4:
            raise DataError(
                f"{found[split, 'images']}: expected uint8 images of 3 or 4 dimensions, got "
                f"{images.dtype} {list(images.shape)}"
            )
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(
                f"{found[split, 'labels']}: expected one integer label an example, got {labels.dtype} "
                f"{list(labels.shape)}"
            )
        parts[split] = Batch(images, labels.astype(np.int32))
    return ImageData(parts["train"], parts["test"], numbered_classes(parts["train"].labels), "idx", path)


# -- CIFAR -----------------------------------------------------------------------------------------
def read_cifar(path: str | Path) -> ImageData:
    """CIFAR-10 (`data_batch_1.bin` .. `data_batch_5.bin`, `test_batch.bin`: records of a label byte and
    3,072 image bytes) or CIFAR-100 (`train.bin`, `test.bin`: a coarse and a fine label byte, then the
    image; the fine labels are used). Class names come from `batches.meta.txt` / `fine_label_names.txt`
    when present."""
    path = Path(path)
    hundred = (path / "test.bin").exists() and not (path / "test_batch.bin").exists()
    train_files = [path / "train.bin"] if hundred else sorted(path.glob("data_batch_*.bin"))
    if not train_files or not all(f.exists() for f in train_files):
        raise DataError(f"{path}: no CIFAR training batches ({'train.bin' if hundred else 'data_batch_*.bin'})")
    test_file = path / ("test.bin" if hundred else "test_batch.bin")
    labels_bytes, classes = (2, 100) if hundred else (1, 10)
    train = _cifar_records(train_files, labels_bytes)
    test = _cifar_records([test_file], labels_bytes)
    names_file = path / ("fine_label_names.txt" if hundred else "batches.meta.txt")
    names = tuple(n for n in names_file.read_text().split("\n") if n.strip()) if names_file.exists() else ()
    return ImageData(train, test, names if len(names) == classes else tuple(map(str, range(classes))), "cifar", path)


def _cifar_records(files: list[Path], label_bytes: int) -> Batch:
    record = label_bytes + 3 * 32 * 32
    parts = []
    for file in files:
        data = np.fromfile(file, np.uint8)
        if data.size % record:
            raise DataError(
                f"{file}: truncated: {data.size} bytes is not a whole number of {record}-byte CIFAR "
                "records (a label byte"
                + (", a fine label byte" if label_bytes == 2 else "")
                + " and a 3x32x32 image each)"
            )
        parts.append(data.reshape(-1, record))
    rows = np.concatenate(parts)
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # channels last
    return Batch(np.ascontiguousarray(images), rows[:, label_bytes - 1].astype(np.int32))


# -- an image folder -------------------------------------------------------------------------------
def read_image_folder(path: str | Path) -> ImageData:
    """`DIR/train/<class>/*.png|jpg|...` and `DIR/test/<class>/...`: one directory a class (named after
    it; sorted, the training set's), read through Pillow. Images in colour make every image RGB;
    all grey, one channel. Every image must have the size of the first."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    classes = tuple(sorted(d.name for d in (path / "train").iterdir() if d.is_dir()))
    if not classes:
        raise DataError(f"{path}/train: no class directories (expected {path}/train/<class>/*.png)")
    if not (path / "test").is_dir():
        raise DataError(f"{path}: no test directory (expected {path}/test/<class>/*.png beside train/)")
    extra = sorted(d.name for d in (path / "test").iterdir() if d.is_dir() and d.name not in classes)
    if extra:
        raise DataError(f"{path}/test/{extra[0]}: a class the training set does not have")
    files = {
        split: [
            (f, label)
            for label, name in enumerate(classes)
            for f in sorted((path / split / name).glob("*"))
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        for split in ("train", "test")
    }
    opened = {}
    for split, items in files.items():
        if not items:
            raise DataError(f"{path}/{split}: no images (.png, .jpg, ...)")
        for file, _ in items:
            try:
                with Image.open(file) as image:
                    opened[file] = (image.mode, image.size)
            except (UnidentifiedImageError, OSError) as e:
                raise DataError(f"{file}: not an image Pillow can read ({e})") from None
    grey = all(mode in ("L", "1") for mode, _ in opened.values())
    first_file, (_, size) = next(iter(opened.items()))
    for file, (_, other) in opened.items():
        if other != size:
            raise DataError(
                f"{file} is {other[0]}x{other[1]} pixels, {first_file} {size[0]}x{size[1]}: images of "
                "different sizes (resize them to one size first)"
            )
    parts = {}
    for split, items in files.items():
        images = np.stack([_pixels(f, "L" if grey else "RGB") for f, _ in items])
        parts[split] = Batch(images, np.array([label for _, label in items], np.int32))
    return ImageData(parts["train"], parts["test"], classes, "folder", path)


def _pixels(file: Path, mode: str) -> np.ndarray:
    from PIL import Image

    with Image.open(file) as image:
        pixels = np.asarray(image.convert(mode), np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels


# -- .npz ------------------------------------------------------------------------------------------
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def read_npz(path: str | Path) -> ImageData:
    """A `.npz` with `x_train`, `y_train`, `x_test`, `y_test` (Keras' layout): `uint8` images
    `[examples, height, width]` or `[..., channels]`, integer labels; never unpickled."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in NPZ_KEYS if k not in npz.files]
            if missing:
                raise DataError(
                    f"{path}: no {', '.join(missing)} (a .npz of x_train, y_train, x_test, y_test; it has "
                    f"{', '.join(npz.files) or 'nothing'})"
                )
            arrays = {k: npz[k] for k in NPZ_KEYS}
    except ValueError as e:  # an object array, which only pickle could read
        raise DataError(f"{path}: cannot read it without unpickling ({e})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npz ({e})") from None
    parts = {}
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if images.ndim == 3:
            images = images[..., None]
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(
                f"{path}: y_{split} must be one integer label an example, got {labels.dtype} {list(labels.shape)}"
            )
        parts[split] = Batch(images, labels.astype(np.int32))
    return ImageData(parts["train"], parts["test"], numbered_classes(parts["train"].labels), "npz", path)


def read_npy_directory(path: str | Path, *, mmap: bool = False) -> ImageData:
    """A directory of `x_train.npy`, `y_train.npy`, `x_test.npy`, `y_test.npy` (as the .npz reader takes
    them); with `mmap`, the images memory-mapped."""
    path = Path(path)
    missing = [name for name in NPY_FILES if not (path / name).is_file()]
    if missing:
        raise DataError(f"{path}: no {', '.join(missing)} (a directory of {', '.join(NPY_FILES)})")
    arrays = {name[:-4]: read_array(path / name, mmap=mmap and name.startswith("x")) for name in NPY_FILES}
    parts = {}
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(
                f"{path / f'y_{split}.npy'}: must be one integer label an example, got {labels.dtype} "
                f"{list(labels.shape)}"
            )
        parts[split] = Batch(images[..., None] if images.ndim == 3 else images, np.asarray(labels, np.int32))
    return ImageData(parts["train"], parts["test"], numbered_classes(parts["train"].labels), "npy", path)


# -- one array, streamed -----------------------------------------------------------------------------
@typecheck
def read_array(path: str | Path, *, mmap: bool = True) -> Shaped[np.ndarray, "..."]:
    """One array of a `.npy` or an IDX file, memory-mapped (read-only) unless `mmap=False`."""
    path = Path(path)
    if path.suffix == ".npy":
        try:
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{path}: not a .npy of numbers ({e})") from None
    return read_idx(path, mmap=mmap)
