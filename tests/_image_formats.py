"""Real images written into each format `research.data` reads: scikit-learn's bundled 8x8 digits (1,797
of them, shipped inside the package, no download), grown to 32x32 RGB so that every format (CIFAR's
binary records are 32x32x3) holds the very same pixels."""

import gzip
from pathlib import Path

import numpy as np

from research.data import Batch

TEST_SIZE = 360


def native_digits(train_size: int | None = None, test_size: int | None = None) -> tuple[Batch, Batch]:
    """(train, test): the digits as scikit-learn ships them, uint8 images [n, 8, 8, 1] (its 17 grey levels
    scaled to 0-255) and int32 labels; a fixed split of 1,437 / 360 (the first `train_size` / `test_size`)."""
    from sklearn.datasets import load_digits

    found = load_digits()
    images = np.round(found.images * (255 / 16)).astype(np.uint8)[..., None]
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:TEST_SIZE][:test_size], order[TEST_SIZE:][:train_size]
    labels = found.target.astype(np.int32)
    return Batch(images[train], labels[train]), Batch(images[test], labels[test])


def digits() -> tuple[Batch, Batch]:
    """(train, test): uint8 images [n, 32, 32, 3] (each digit pixel a 4x4 block, grey in RGB) and int32
    labels; a fixed split of 1,437 / 360."""
    from sklearn.datasets import load_digits

    found = load_digits()
    images = np.round(found.images * (255 / 16)).astype(np.uint8).repeat(4, axis=1).repeat(4, axis=2)
    images = np.repeat(images[..., None], 3, axis=-1)
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    labels = found.target.astype(np.int32)
    # Each split in class order, as an image folder lists it (class by class): every format, the same order.
    by_class = lambda rows: rows[np.argsort(labels[rows], kind="stable")]  # noqa: E731
    return tuple(Batch(images[rows], labels[rows]) for rows in (by_class(train), by_class(test)))


def write_idx(path: Path, array: np.ndarray, *, compress: bool = False) -> Path:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_formats(root: Path, train: Batch, test: Batch) -> dict[str, Path]:
    """The same images in every format under `root`: {format: the path `--data` takes}."""
    from PIL import Image

    paths = {name: root / name for name in ("idx", "cifar", "folder")}
    for path in paths.values():
        path.mkdir(parents=True)
    for split, part, prefix in (("train", train, "train"), ("test", test, "t10k")):
        write_idx(paths["idx"] / f"{prefix}-images-idx3-ubyte.gz", part.inputs, compress=True)
        write_idx(paths["idx"] / f"{prefix}-labels-idx1-ubyte", part.labels.astype(np.uint8))
        records = np.concatenate(
            [part.labels.astype(np.uint8)[:, None], part.inputs.transpose(0, 3, 1, 2).reshape(len(part.labels), -1)],
            axis=1,
        )
        chunks = np.array_split(records, 5) if split == "train" else [records]
        for i, chunk in enumerate(chunks, 1):
            (paths["cifar"] / (f"data_batch_{i}.bin" if split == "train" else "test_batch.bin")).write_bytes(
                chunk.tobytes()
            )
        for i, (image, label) in enumerate(zip(part.inputs, part.labels, strict=True)):
            folder = paths["folder"] / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i:05d}.png")
    paths["npz"] = root / "digits.npz"
    np.savez(paths["npz"], x_train=train.inputs, y_train=train.labels, x_test=test.inputs, y_test=test.labels)
    return paths


DATASETS_KINDS = ("image", "array", "list")


def write_datasets(path: Path, train: Batch, test: Batch, kind: str = "image") -> Path:
    """The images as a Hugging Face datasets directory (`DatasetDict.save_to_disk`), made with
    `datasets.Dataset.from_dict`: `kind` "image" PNGs in an `Image` column and the labels a `ClassLabel`;
    "array" an `Array3D` column and a `ClassLabel`; "list" lists of lists of uint8 and integer labels, as
    `from_dict` infers them from the arrays. The training split in three shards: three Arrow files."""
    import datasets
    from PIL import Image

    def split(part: Batch) -> "datasets.Dataset":
        labels = datasets.ClassLabel(names=[str(d) for d in range(10)])
        if kind == "list":
            return datasets.Dataset.from_dict({"image": part.inputs, "label": part.labels})
        if kind == "array":
            features = datasets.Features({"image": datasets.Array3D(part.inputs.shape[1:], "uint8"), "label": labels})
            return datasets.Dataset.from_dict({"image": part.inputs, "label": part.labels}, features=features)
        features = datasets.Features({"image": datasets.Image(), "label": labels})
        pictures = [Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image) for image in part.inputs]
        return datasets.Dataset.from_dict({"image": pictures, "label": part.labels}, features=features)

    datasets.disable_progress_bars()
    splits = {"train": split(train), "test": split(test)}
    datasets.DatasetDict(splits).save_to_disk(str(path), num_shards={"train": 3, "test": 1})
    return path
