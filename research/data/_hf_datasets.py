"""Hugging Face `datasets` directories, as `Dataset.save_to_disk` and `DatasetDict.save_to_disk` write them:
labelled images for `read_image_data`, a text column for the language model.

`datasets.load_from_disk` memory-maps the Arrow files. Images stored as arrays (`Array3D`, `Array2D`, lists
of lists of `uint8`) are then views of the mapped files, and encoded images (the `Image` feature: PNG, JPEG,
...) are decoded by Pillow; with `mmap=True` both are read by rows as a batch asks for them (`ArrowImages`),
otherwise into memory, as the other readers read. A damaged directory or a column of the wrong kind is
refused in one line (`DataError`) that names the file or the column; without the `datasets` package (the
`hf` extra), in one line that names the install (`MissingExtra`).
"""

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from ..install import require_extra
from ._image_data import ImageData, numbered_classes
from ._loaders import Batch
from ._text import split_held_out

IMAGE_COLUMNS = ("image", "img")  # the names Hugging Face's image sets give their images (MNIST's, CIFAR's)
TEST_SPLITS = ("test", "validation")  # the split evaluated on: the first of these a DatasetDict has


def is_datasets_directory(path: str | Path) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote: a `DatasetDict`'s (`dataset_dict.json`) or a
    `Dataset`'s (`state.json` beside `dataset_info.json`). Tells from the file names alone, without
    `datasets`."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def load_datasets_directory(path: str | Path) -> Any:
    """`datasets.load_from_disk(path)`: the `Dataset` or `DatasetDict`, its Arrow files memory-mapped.

    **Raises:** `MissingExtra` without the `datasets` package; `DataError` naming the file that is missing
    or that Arrow cannot read."""
    require_extra(f"{path} (a Hugging Face datasets directory)", "datasets")
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 (datasets, json and pyarrow raise their own kinds for a damaged directory)
        raise DataError(f"{_unreadable_file(Path(path))}: load_from_disk cannot read it ({_line(e)})") from None


def _line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _unreadable_file(path: Path) -> Path:
    """The first JSON or Arrow file under a `save_to_disk` directory that does not parse, else the directory."""
    import pyarrow as pa

    for file in sorted(path.rglob("*.json")) + sorted(path.rglob("*.arrow")):
        try:
            if file.suffix == ".json":
                json.loads(file.read_text())
            else:
                with pa.memory_map(str(file)) as source:
                    pa.ipc.open_stream(source).read_all()
        except Exception:  # noqa: BLE001
            return file
    return path


def _is_dict(loaded: Any) -> bool:
    return hasattr(loaded, "keys")  # a DatasetDict; a Dataset has column_names, not keys


def _test_split(loaded: Any) -> str | None:
    return next((name for name in TEST_SPLITS if name in loaded), None)


def _columns(dataset: Any) -> str:
    """`image (Image), label (ClassLabel)`: a dataset's columns and the kinds of their features."""
    return ", ".join(f"{name} ({type(feature).__name__})" for name, feature in dataset.features.items())


# -- images ---------------------------------------------------------------------------------------------
def read_datasets_images(
    path: str | Path, *, mmap: bool = False, image_column: str | None = None, label_column: str | None = None
) -> ImageData:
    """A `DatasetDict` directory of images and labels: its `train` split trains and its `test` split
    (else `validation`) is the test set.

    **Arguments:**

    - `path`: what `DatasetDict.save_to_disk` wrote.
    - `mmap`: leave the images in the memory-mapped Arrow files, read by rows as they are indexed
      (`ArrowImages`); otherwise read them into memory (numpy).
    - `image_column`: default `image` or `img`, else the one `Image`, `Array2D` or `Array3D` column.
      Arrays of `uint8` `[height, width]` or `[height, width, channels]`, or encoded images that Pillow reads
      (all grey: one channel; else RGB), all of one size.
    - `label_column`: default `label`, else the one `ClassLabel` column; integers, named by the
      `ClassLabel`'s names (else `"0"`, `"1"`, ... as a .npz's).
    """
    path = Path(path)
    loaded = load_datasets_directory(path)
    if not _is_dict(loaded) or "train" not in loaded or _test_split(loaded) is None:
        has = f"splits {', '.join(loaded)}" if _is_dict(loaded) else "one Dataset"
        raise DataError(
            f"{path}: images need a DatasetDict with train and test (or validation) splits; it has {has} "
            "(DatasetDict({'train': ..., 'test': ...}).save_to_disk(path))"
        )
    parts, names = {}, {}
    for split, name in (("train", "train"), ("test", _test_split(loaded))):
        where = path / str(name)
        dataset = loaded[name]
        images = _images(dataset, _image_column(dataset, where, image_column), where)
        label = _label_column(dataset, where, label_column)
        names[split] = _class_names(dataset.features[label])
        parts[split] = Batch(images if mmap else np.asarray(images), _labels(dataset, label, where, names[split]))
    if names["test"] != names["train"]:
        raise DataError(f"{path}: the {_test_split(loaded)} split's classes differ from the train split's")
    classes = names["train"] or numbered_classes(parts["train"].labels)
    return ImageData(parts["train"], parts["test"], classes, "datasets", path)


def _image_column(dataset: Any, where: Path, wanted: str | None) -> str:
    import datasets

    if wanted is not None and wanted in dataset.column_names:
        return wanted
    named = [name for name in IMAGE_COLUMNS if name in dataset.column_names]
    kinds = (datasets.Image, datasets.Array2D, datasets.Array3D)
    typed = [name for name, feature in dataset.features.items() if isinstance(feature, kinds)]
    if wanted is None and (named or len(typed) == 1):
        return (named or typed)[0]
    expected = f"a column {wanted!r}" if wanted else "a column image or img, or one Image, Array2D or Array3D column"
    choose = "; name one with --image-column" if wanted is None else ""
    raise DataError(f"{where}: no image column (expected {expected}); it has {_columns(dataset)}{choose}")


def _label_column(dataset: Any, where: Path, wanted: str | None) -> str:
    import datasets

    if wanted is not None and wanted in dataset.column_names:
        return wanted
    typed = [name for name, feature in dataset.features.items() if isinstance(feature, datasets.ClassLabel)]
    if wanted is None and ("label" in dataset.column_names or len(typed) == 1):
        return "label" if "label" in dataset.column_names else typed[0]
    expected = f"a column {wanted!r}" if wanted else "a column label, or one ClassLabel column"
    choose = "; name one with --label-column" if wanted is None else ""
    raise DataError(f"{where}: no label column (expected {expected}); it has {_columns(dataset)}{choose}")


def _class_names(feature: Any) -> tuple[str, ...]:
    return tuple(getattr(feature, "names", None) or ())


def _labels(dataset: Any, column: str, where: Path, names: tuple[str, ...]) -> np.ndarray:
    """The integer labels of `column` as int32, each within the ClassLabel's classes (any int32 without one)."""
    import pyarrow as pa

    values = dataset.data.table.column(column)
    if not pa.types.is_integer(values.type) or values.null_count:
        what = f"{values.null_count} missing labels" if values.null_count else f"{values.type} values"
        raise DataError(f"{where}: column {column!r} holds {what}: expected an integer label an example (a ClassLabel)")
    labels = values.to_numpy()
    bad = np.flatnonzero((labels < 0) | (labels >= (len(names) or np.iinfo(np.int32).max)))
    if bad.size:
        classes = f"the {len(names)} classes of its ClassLabel" if names else "int32"
        raise DataError(f"{where}: column {column!r}: label {labels[bad[0]]} (example {bad[0]}) is outside {classes}")
    return labels.astype(np.int32)


def _images(dataset: Any, column: str, where: Path) -> "ArrowImages":
    import datasets

    chunks = [chunk for chunk in dataset.data.table.column(column).chunks if len(chunk)]
    if not chunks:
        raise DataError(f"{where}: column {column!r} holds no images")
    where_column = f"{where}: column {column!r}"
    if isinstance(dataset.features[column], datasets.Image):
        return _encoded_images(chunks, where_column)
    starts = np.cumsum([0] + [len(chunk) for chunk in chunks])[:-1]
    parts = [_pixel_view(chunk, where_column, int(start)) for chunk, start in zip(chunks, starts, strict=True)]
    for part, start in zip(parts, starts, strict=True):
        if part.shape[1:] != parts[0].shape[1:]:
            raise DataError(
                f"{where_column}: example {start} is {_size(part.shape)}, example 0 {_size(parts[0].shape)}: "
                "images of different sizes (resize them to one size first)"
            )
    return ArrowImages(parts)


def _size(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape[1:]))


def _pixel_view(chunk: Any, where: str, first: int) -> np.ndarray:
    """`uint8 [rows, height, width, channels]`: the pixels of a chunk of nested lists (Array2D and Array3D
    store theirs so), a view of the Arrow buffer (of the memory-mapped file): nothing is read here but the
    lists' lengths, to refuse ragged images."""
    import pyarrow as pa

    values = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
    shape = [len(values)]
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    while any(is_list(values.type) for is_list in lists):
        lengths = values.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False)
        missing, odd = np.flatnonzero(lengths < 0), np.flatnonzero(lengths != lengths[0])
        if missing.size or odd.size:
            row = int(missing[0] if missing.size else odd[0])
            example = first + row // int(np.prod(shape[1:], dtype=np.int64))
            raise DataError(
                f"{where}: example {example} has no image (null)"
                if missing.size
                else f"{where}: ragged images: example {example} has {lengths[row]} values along axis {len(shape) - 1} "
                f"where example {first} has {lengths[0]} (images of one size: resize them first)"
            )
        shape.append(int(lengths[0]))
        values = values.flatten()
    if not pa.types.is_uint8(values.type) or values.null_count or len(shape) not in (3, 4):
        raise DataError(
            f"{where}: expected uint8 images [height, width] or [height, width, channels], got {values.type} "
            f"{shape[1:]}" + (f" with {values.null_count} missing values" if values.null_count else "")
        )
    pixels = values.to_numpy(zero_copy_only=True).reshape(shape)
    return pixels[..., None] if pixels.ndim == 3 else pixels


def _encoded_images(chunks: list[Any], where: str) -> "ArrowImages":
    """The images of an `Image` column (its structs of encoded `bytes` and a `path`), after a pass over
    their headers: every one readable and of one size; all grey read as one channel, else RGB."""
    from PIL import Image, UnidentifiedImageError

    parts = [EncodedImages(chunk, "RGB", where) for chunk in chunks]
    found = {}
    for part, start in zip(parts, np.cumsum([0] + [len(p) for p in parts])[:-1], strict=True):
        for row in range(len(part)):
            try:
                with Image.open(io.BytesIO(part.encoded(row))) as image:
                    found[int(start) + row] = (image.mode, image.size)
            except (UnidentifiedImageError, OSError) as e:
                raise DataError(f"{where}: example {int(start) + row} is not an image Pillow reads ({e})") from None
    size = found[0][1]
    for row, (_, other) in found.items():
        if other != size:
            raise DataError(
                f"{where}: example {row} is {other[0]}x{other[1]} pixels, example 0 {size[0]}x{size[1]}: images "
                "of different sizes (resize them to one size first)"
            )
    if all(mode in ("L", "1") for mode, _ in found.values()):
        parts = [EncodedImages(chunk, "L", where) for chunk in chunks]
    return ArrowImages(parts)


class EncodedImages:
    """One chunk of an `Image` column (structs of encoded `bytes`, or a `path` to a file where `bytes` is
    null), decoded by Pillow by rows: `uint8 [rows, height, width, channels]` in `mode` (`L`: one channel)."""

    def __init__(self, chunk: Any, mode: str, where: str):
        self.chunk, self.mode, self.where = chunk, mode, where
        self.bytes, self.paths = chunk.field("bytes"), chunk.field("path")

    def __len__(self) -> int:
        return len(self.chunk)

    def encoded(self, row: int) -> bytes:
        """The encoded bytes of image `row`: its `bytes`, else the file at its `path`."""
        valid = self.chunk[row].is_valid
        data, path = (self.bytes[row].as_py(), self.paths[row].as_py()) if valid else (None, None)
        if data is not None:
            return data
        if path is None or not Path(path).is_file():
            raise DataError(f"{self.where}: an image has no bytes and no file{f' ({path} is missing)' if path else ''}")
        return Path(path).read_bytes()

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        from PIL import Image

        pixels = []
        for row in np.asarray(rows).tolist():
            with Image.open(io.BytesIO(self.encoded(row))) as image:
                pixels.append(np.asarray(image.convert(self.mode), np.uint8))
        stacked = np.stack(pixels)
        return stacked[..., None] if stacked.ndim == 3 else stacked


class ArrowImages:
    """`uint8` images `[examples, height, width, channels]` of a datasets directory's Arrow files, read by rows
    as they are indexed (`images[rows]`, `images[i]`; `np.asarray(images)` reads them all): a memory-mapped
    set for `TorchLoader` and `GrainLoader`, as a memory-mapped `.npy` is.

    **Arguments:**

    - `parts`: the column's Arrow chunks in order, each indexed by its own rows: numpy views of the
      mapped pixels, or `EncodedImages` that decode theirs.
    """

    def __init__(self, parts: list[Any]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(part) for part in parts])
        self.shape = (int(self.starts[-1]), *parts[0][np.zeros(1, np.int64)].shape[1:])
        self.dtype = np.dtype(np.uint8)
        self.ndim = 4

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            return self[np.asarray([index])][0]
        rows = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index)
        if rows.dtype == bool or not np.issubdtype(rows.dtype, np.integer):
            raise IndexError(f"ArrowImages takes rows: an int, a slice or an integer array, not {rows.dtype}")
        flat = rows.reshape(-1)
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"rows out of range for {len(self)} images")
        part_of = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty((flat.size, *self.shape[1:]), self.dtype)
        for part in np.unique(part_of):
            here = part_of == part
            out[here] = self.parts[part][flat[here] - self.starts[part]]
        return out.reshape(*rows.shape, *self.shape[1:])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[np.arange(len(self))]
        return whole if dtype is None else whole.astype(dtype)


# -- text -----------------------------------------------------------------------------------------------
def read_datasets_text(
    path: str | Path, *, column: str = "text", max_bytes: int = 4_000_000, held_out: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """`(train, held_out)`: text bytes (uint8) of the string column `column` of a datasets directory, a row
    a line (a newline added to a row without one). A `DatasetDict` gives the first `max_bytes` of its
    `train` split and the first `held_out` x `max_bytes` of its `test` (else `validation`) split; a
    `Dataset` (or a DatasetDict of `train` alone) its first `max_bytes`, the last `held_out` of them held
    out, as `split_held_out` cuts the bytes of a file."""
    path = Path(path)
    loaded = load_datasets_directory(path)
    if not _is_dict(loaded):
        return split_held_out(_text_bytes(loaded, column, path, max_bytes), held_out)
    if "train" not in loaded:
        raise DataError(f"{path}: no train split to learn (it has {', '.join(loaded) or 'none'})")
    train = _text_bytes(loaded["train"], column, path / "train", max_bytes)
    test = _test_split(loaded)
    if test is None:
        return split_held_out(train, held_out)
    return train, _text_bytes(loaded[test], column, path / test, max(int(max_bytes * held_out), 1))


def _text_bytes(dataset: Any, column: str, where: Path, max_bytes: int) -> np.ndarray:
    import pyarrow as pa

    if column not in dataset.column_names:
        raise DataError(f"{where}: no text column {column!r} (name it with --text-column); it has {_columns(dataset)}")
    values = dataset.data.table.column(column)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DataError(f"{where}: column {column!r} holds {values.type}, not text (name a string one: --text-column)")
    lines, total = [], 0
    for chunk in values.chunks:
        if total >= max_bytes:
            break
        for text in chunk.to_pylist():
            if total >= max_bytes:
                break
            if text is None:
                raise DataError(f"{where}: column {column!r}: example {len(lines)} has no text (null)")
            lines.append(text.encode() if text.endswith("\n") else f"{text}\n".encode())
            total += len(lines[-1])
    data = np.frombuffer(b"".join(lines)[:max_bytes], np.uint8)
    if not data.size:
        raise DataError(f"{where}: column {column!r} holds no text")
    return data
