"""Readers of image data in standard formats: the same pixels from every format, and damaged files refused
in one line that names them."""

import gzip
import shutil

import numpy as np
import pytest
from _image_formats import digits, write_formats, write_idx

from research.data import ImageData, detect_format, read_array, read_idx, read_image_data
from research.errors import DataError


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    train, test = digits()
    return train, test, write_formats(tmp_path_factory.mktemp("digits"), train, test)


def test_every_format_reads_the_same_pixels_and_labels(formats):
    train, test, paths = formats
    assert train.inputs.shape == (1437, 32, 32, 3) and test.inputs.shape == (360, 32, 32, 3)
    for name, path in paths.items():
        data = read_image_data(path)
        assert data.format == name == detect_format(path)
        assert data.image_shape == (32, 32, 3) and len(data.classes) == 10
        for got, want in ((data.train, train), (data.test, test)):
            assert got.inputs.dtype == np.uint8 and got.labels.dtype == np.int32
            np.testing.assert_array_equal(got.inputs, want.inputs)
            np.testing.assert_array_equal(got.labels, want.labels)
    assert read_image_data(paths["folder"]).classes == tuple(str(d) for d in range(10))


def test_idx_of_every_type_gz_or_not_and_memory_mapped(tmp_path):
    for array in (
        np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        np.arange(-6, 6, dtype=np.int32),
        np.linspace(0, 1, 10, dtype=np.float32).reshape(5, 2),
    ):
        for compress in (False, True):
            path = write_idx(tmp_path / f"a{compress}.idx", array, compress=compress)
            read = read_idx(path)
            assert read.dtype == array.dtype and read.dtype.isnative
            np.testing.assert_array_equal(read, array)
        mapped = read_array(tmp_path / "aFalse.idx")
        assert isinstance(mapped, np.memmap)
        np.testing.assert_array_equal(mapped, array)
    np.save(tmp_path / "big.npy", np.arange(12).reshape(3, 4))
    assert isinstance(read_array(tmp_path / "big.npy"), np.memmap)


def test_a_memory_mapped_idx_directory_reads_the_same_images(formats, tmp_path):
    train, test, _ = formats
    write_idx(tmp_path / "train-images-idx3-ubyte", train.inputs[..., 0])  # greyscale: [n, 32, 32]
    write_idx(tmp_path / "train-labels-idx1-ubyte", train.labels.astype(np.uint8))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test.inputs[..., 0])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", test.labels.astype(np.uint8))
    data = read_image_data(tmp_path, mmap=True)
    assert isinstance(data.train.inputs.base, np.memmap) and data.image_shape == (32, 32, 1)
    np.testing.assert_array_equal(data.train.inputs[..., 0], train.inputs[..., 0])


def damage(tmp_path, formats, kind):
    """A copy of one format, damaged as `kind` says; returns (path to read, what the error must say)."""
    _, _, paths = formats
    name = {
        "magic": "idx",
        "truncated idx": "idx",
        "label": "idx",
        "truncated cifar": "cifar",
        "sizes": "folder",
        "pickle": "npz",
        "npz keys": "npz",
    }[kind]
    path = tmp_path / paths[name].name
    (shutil.copytree if paths[name].is_dir() else shutil.copy)(paths[name], path)
    if kind == "magic":
        labels = path / "train-labels-idx1-ubyte"
        labels.write_bytes(b"\x12\x34" + labels.read_bytes()[2:])
        return path, "train-labels-idx1-ubyte: not an IDX file (wrong magic number 1234"
    if kind == "truncated idx":
        images = path / "train-images-idx3-ubyte.gz"
        images.write_bytes(gzip.compress(gzip.decompress(images.read_bytes())[:-100]))
        return (
            path,
            "train-images-idx3-ubyte.gz: truncated: (1437, 32, 32, 3) of uint8 is 4414464 bytes of data, found 4414364",
        )
    if kind == "label":
        labels = read_idx(path / "train-labels-idx1-ubyte").copy()
        labels[7] = 200
        write_idx(path / "train-labels-idx1-ubyte", labels)
        return path, "train label 200 (example 7) is out of range for 10 classes"
    if kind == "truncated cifar":
        batch = path / "data_batch_3.bin"
        batch.write_bytes(batch.read_bytes()[:-5])
        return path, "data_batch_3.bin: truncated: 881946 bytes is not a whole number of 3073-byte CIFAR records"
    if kind == "sizes":
        from PIL import Image

        Image.new("RGB", (28, 28)).save(path / "test" / "3" / "odd.png")
        return path, "test/3/odd.png is 28x28 pixels"
    data = np.load(path)
    arrays = {k: data[k] for k in data.files}
    if kind == "pickle":
        arrays["x_train"] = np.array([{"a": 1}], dtype=object)
        np.savez(path, **arrays)
        return path, "cannot read it without unpickling"
    del arrays["x_test"], arrays["y_test"]
    np.savez(path, **arrays)
    return path, "no x_test, y_test (a .npz of x_train, y_train, x_test, y_test; it has x_train, y_train)"


@pytest.mark.parametrize("kind", ["magic", "truncated idx", "label", "truncated cifar", "sizes", "pickle", "npz keys"])
def test_a_damaged_file_is_refused_naming_it(tmp_path, formats, kind):
    path, message = damage(tmp_path, formats, kind)
    with pytest.raises(DataError) as info:
        read_image_data(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_path_of_no_known_format_lists_the_formats(tmp_path):
    for path in (tmp_path / "missing", tmp_path, tmp_path / "a.txt"):
        if path.name == "a.txt":
            path.write_text("x")
        with pytest.raises(
            DataError,
            match="it takes an IDX directory .* a CIFAR-10 or CIFAR-100 binary directory .* "
            "an image folder .* a .npz .* or a directory of those four as .npy",
        ):
            detect_format(path)


def test_image_data_checks_its_arrays(formats):
    train, test, paths = formats
    with pytest.raises(DataError, match="expected uint8 images"):
        ImageData(type(train)(train.inputs.astype(np.float32), train.labels), test, ("0",) * 10, "npz", paths["npz"])
    with pytest.raises(DataError, match="1437 train images but 10 labels"):
        ImageData(type(train)(train.inputs, train.labels[:10]), test, ("0",) * 10, "npz", paths["npz"])
