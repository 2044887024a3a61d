"""Hugging Face `datasets` directories (`save_to_disk`) as data: the digits as a DatasetDict read to the .npz's
very arrays (encoded images, Array3D, lists of lists), memory-mapped and read by rows; every loader serving the
.npz's batches, resumed in O(1); damaged or unexpected directories refused in one line naming the file or the
column; a text column for the language model; without `datasets`, one line naming the install."""

import itertools
import json
import shutil
import sys

import numpy as np
import pytest
from _entry import run_entry
from _image_formats import DATASETS_KINDS, digits, write_datasets

datasets = pytest.importorskip("datasets")

from research.data import (  # noqa: E402
    ArrayDataset,
    ArrowImages,
    BatchOrder,
    DeviceLoader,
    GrainLoader,
    TorchLoader,
    detect_format,
    read_datasets_text,
    read_image_data,
)
from research.data._hf_datasets import EncodedImages  # noqa: E402
from research.errors import ConfigError, DataError  # noqa: E402
from research.services import RunDir  # noqa: E402


@pytest.fixture(scope="module")
def digits_datasets(tmp_path_factory):
    """(train, test, {kind: a DatasetDict directory of the digits}, the .npz of the same digits)."""
    train, test = digits()
    root = tmp_path_factory.mktemp("hf")
    paths = {kind: write_datasets(root / kind, train, test, kind) for kind in DATASETS_KINDS}
    npz = root / "digits.npz"
    np.savez(npz, x_train=train.inputs, y_train=train.labels, x_test=test.inputs, y_test=test.labels)
    return train, test, paths, npz


@pytest.mark.parametrize("kind", DATASETS_KINDS)
def test_a_datasets_directory_reads_the_npz_arrays_in_memory_and_memory_mapped(digits_datasets, kind):
    train, test, paths, npz = digits_datasets
    assert detect_format(paths[kind]) == "datasets"
    npz_data = read_image_data(npz)
    for mmap in (False, True):
        data = read_image_data(paths[kind], mmap=mmap)
        assert data.format == "datasets" and data.image_shape == (32, 32, 3)
        assert data.classes == npz_data.classes == tuple(map(str, range(10)))
        assert isinstance(data.train.inputs, ArrowImages if mmap else np.ndarray)
        for got, want in ((data.train, npz_data.train), (data.test, npz_data.test)):
            assert got.labels.dtype == np.int32 and np.asarray(got.inputs).dtype == np.uint8
            np.testing.assert_array_equal(np.asarray(got.inputs), want.inputs)
            np.testing.assert_array_equal(got.labels, want.labels)
    images = read_image_data(paths[kind], mmap=True).train.inputs
    rows = np.array([[1436, 0], [479, 958]])  # across the three shards, any order, any shape of rows
    np.testing.assert_array_equal(images[rows], train.inputs[rows])
    np.testing.assert_array_equal(images[-1], train.inputs[-1])
    np.testing.assert_array_equal(images[470:490], train.inputs[470:490])
    assert len(images) == 1437 and images.shape == (1437, 32, 32, 3) and len(images.parts) >= 3  # Arrow's chunks


def test_arrays_stay_in_the_memory_mapped_arrow_files(digits_datasets):
    _, _, paths, _ = digits_datasets
    parts = read_image_data(paths["array"], mmap=True).train.inputs.parts
    assert all(isinstance(p, np.ndarray) and not p.flags.owndata and not p.flags.writeable for p in parts)
    assert all(isinstance(p, EncodedImages) for p in read_image_data(paths["image"], mmap=True).train.inputs.parts)


@pytest.mark.parametrize("kind", ["image", "array"])
def test_every_loader_serves_the_npz_batches_and_resumes_at_any_step(digits_datasets, kind):
    train, _, paths, _ = digits_datasets
    images = read_image_data(paths[kind], mmap=True).train
    expected = DeviceLoader(train.inputs, train.labels, 32, seed=3)  # the .npz's arrays
    loaders = {
        "device": DeviceLoader(np.asarray(images.inputs), images.labels, 32, seed=3),
        "torch": TorchLoader(ArrayDataset(images.inputs, images.labels), 32, seed=3, num_workers=2),
        "grain": GrainLoader(ArrayDataset(images.inputs, images.labels), 32, seed=3, workers=2),
    }
    for name, loader in loaders.items():
        for start in (0, 40):  # 44 steps an epoch: the first, and a resume across an epoch's end
            if isinstance(loader, DeviceLoader):
                batches = [loader.step_batch(step) for step in range(start, start + 8)]
            else:
                batches = list(itertools.islice(loader.batches(start), 8))
            for step, batch in enumerate(batches, start):
                want = expected.step_batch(step)
                np.testing.assert_array_equal(np.asarray(batch.inputs), np.asarray(want.inputs), err_msg=name)
                np.testing.assert_array_equal(np.asarray(batch.labels), np.asarray(want.labels), err_msg=name)


def test_a_resume_at_step_10000_decodes_no_more_than_one_at_step_10(digits_datasets, monkeypatch):
    """The batch a resumed run reads first is decoded straight from the Arrow files: no image before it."""
    train, _, paths, _ = digits_datasets
    decoded = []
    getitem = EncodedImages.__getitem__
    monkeypatch.setattr(EncodedImages, "__getitem__", lambda self, rows: decoded.extend(rows) or getitem(self, rows))
    images = read_image_data(paths["image"], mmap=True).train
    reads = {}
    for step in (10, 10_000):
        decoded.clear()
        first = next(TorchLoader(ArrayDataset(images.inputs, images.labels), 32, seed=3).batches(step))
        rows = BatchOrder(1437, 32, seed=3).step_indices(step, 1)[0]
        np.testing.assert_array_equal(first.inputs, train.inputs[rows])
        reads[step] = len(decoded)
    assert reads[10] == reads[10_000] == 32


def _save(path, train: dict, test: dict | None = None, features=None):
    split = lambda columns: datasets.Dataset.from_dict(columns, features=features)  # noqa: E731
    whole = split(train) if test is None else datasets.DatasetDict({"train": split(train), "test": split(test)})
    whole.save_to_disk(str(path))
    return path


def damage(kind, tmp_path, paths):
    """A datasets directory damaged as `kind` says: (its path, what the one-line error must say)."""
    grey = np.zeros((4, 8, 8), np.uint8)
    labels = datasets.ClassLabel(names=["a", "b"])
    if kind in ("missing arrow", "garbled arrow", "garbled json"):
        path = tmp_path / "copy"
        shutil.copytree(paths["image"], path)
        if kind == "missing arrow":
            (path / "train" / "data-00001-of-00003.arrow").unlink()
            return path, "data-00001-of-00003.arrow"
        if kind == "garbled json":
            (path / "dataset_dict.json").write_text("{'splits': ")
            return path, "dataset_dict.json: load_from_disk cannot read it"
        shard = path / "train" / "data-00002-of-00003.arrow"
        shard.write_bytes(shard.read_bytes()[:5000])
        return path, "train/data-00002-of-00003.arrow: load_from_disk cannot read it"
    if kind == "one Dataset":
        return _save(tmp_path / "d", {"image": grey, "label": [0, 1, 0, 1]}), "images need a DatasetDict with train"
    if kind == "no test split":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"image": grey})}).save_to_disk(str(tmp_path / "d"))
        return tmp_path / "d", "images need a DatasetDict with train and test (or validation) splits; it has splits"
    columns, features = {"image": grey, "label": [0, 1, 0, 1]}, None
    if kind == "no label column":
        columns = {"image": grey, "caption": ["x"] * 4}
        message = "train: no label column (expected a column label, or one ClassLabel column); it has image (List)"
    elif kind == "no image column":
        columns = {"picture": [[1]] * 4, "label": [0, 1, 0, 1]}
        message = "no image column (expected a column image or img, or one Image, Array2D or Array3D column)"
    elif kind == "float pixels":
        columns["image"] = grey.astype(np.float32)
        message = "train: column 'image': expected uint8 images [height, width] or [height, width, channels], got float"
    elif kind == "text labels":
        columns["label"] = ["a", "b", "a", "b"]
        message = "train: column 'label' holds string values: expected an integer label an example"
    elif kind == "label outside classes":
        bad = datasets.Dataset.from_dict({"image": grey, "label": [0, 1, 0, 7]}).cast_column("label", labels)
        datasets.DatasetDict({"train": bad, "test": bad}).save_to_disk(
            str(tmp_path / "d")
        )  # cast_column checks nothing
        return tmp_path / "d", "train: column 'label': label 7 (example 3) is outside the 2 classes of its ClassLabel"
    elif kind == "ragged arrays":
        columns["image"] = [grey[0], grey[1], grey[2, :7], grey[3]]
        message = "train: column 'image': ragged images: example 2 has 7 values along axis 0 where example 0 has 8"
    elif kind == "ragged encoded":
        from PIL import Image

        features = datasets.Features({"image": datasets.Image(), "label": labels})
        columns["image"] = [Image.fromarray(np.zeros(size, np.uint8)) for size in ((8, 8), (8, 8), (8, 8), (6, 8))]
        message = "train: column 'image': example 3 is 8x6 pixels, example 0 8x8: images of different sizes"
    else:
        raise AssertionError(kind)
    return _save(tmp_path / "d", columns, columns, features), message


DAMAGES = [
    "missing arrow",
    "garbled arrow",
    "garbled json",
    "one Dataset",
    "no test split",
    "no label column",
    "no image column",
    "float pixels",
    "text labels",
    "label outside classes",
    "ragged arrays",
    "ragged encoded",
]


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_or_unexpected_directory_is_refused_in_one_line_naming_it(tmp_path, digits_datasets, kind):
    path, message = damage(kind, tmp_path, digits_datasets[2])
    for mmap in (False, True):
        with pytest.raises(DataError) as info:
            read_image_data(path, mmap=mmap)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_columns_are_chosen_by_name_where_several_could_serve(tmp_path, digits_datasets):
    """CIFAR-100's layout (an image column beside two ClassLabel columns) needs --label-column; a column
    named that is not there, or a column option for another format, is refused in one line."""
    _, _, _, npz = digits_datasets
    grey = np.arange(4 * 8 * 8, dtype=np.uint8).reshape(4, 8, 8)
    features = datasets.Features(
        {
            "img": datasets.Array2D((8, 8), "uint8"),
            "picture": datasets.Array2D((8, 8), "uint8"),
            "fine_label": datasets.ClassLabel(names=list("abcd")),
            "coarse_label": datasets.ClassLabel(names=["x", "y"]),
        }
    )
    columns = {"img": grey, "picture": 255 - grey, "fine_label": [0, 1, 2, 3], "coarse_label": [0, 0, 1, 1]}
    path = _save(tmp_path / "d", columns, columns, features)
    with pytest.raises(DataError, match=r"train: no label column .*coarse_label \(ClassLabel\); name one with"):
        read_image_data(path)
    data = read_image_data(path, label_column="coarse_label")
    assert data.classes == ("x", "y") and data.image_shape == (8, 8, 1)
    np.testing.assert_array_equal(data.train.labels, [0, 0, 1, 1])
    np.testing.assert_array_equal(data.test.inputs[..., 0], grey)  # `img`, by its name
    data = read_image_data(path, mmap=True, image_column="picture", label_column="fine_label")
    assert data.classes == tuple("abcd")
    np.testing.assert_array_equal(np.asarray(data.train.inputs)[..., 0], 255 - grey)
    with pytest.raises(DataError, match=r"train: no image column \(expected a column 'pixels'\); it has img"):
        read_image_data(path, image_column="pixels", label_column="fine_label")
    for flags in ({"label_column": "label"}, {"image_column": "image"}):
        with pytest.raises(DataError) as info:
            read_image_data(npz, **flags)
        assert str(info.value) == (
            "--image-column and --label-column name columns of a Hugging Face datasets directory; "
            f"--data {npz} is not one (its format: npz)"
        )


@pytest.mark.parametrize("experiment", ["images", "contrastive", "diffusion", "gan"])
def test_every_experiment_on_images_takes_the_column_options(digits_datasets, capsys, experiment):
    _, _, _, npz = digits_datasets
    capsys.readouterr()
    assert run_entry(["--data", str(npz), "--label-column", "label", "--no-progress"], experiment) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"--data {npz} is not one (its format: npz)"), err


def test_without_datasets_a_datasets_directory_is_refused_naming_the_install(digits_datasets, monkeypatch, capsys):
    _, _, paths, _ = digits_datasets
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert detect_format(paths["image"]) == "datasets"  # told from the file names alone
    for read in (read_image_data, read_datasets_text):
        with pytest.raises(ConfigError, match=r"needs the datasets package, which is not installed: .* -e '\.\[hf\]'"):
            read(paths["image"])
    assert run_entry(["--data", str(paths["image"])], "images") == 2
    err = capsys.readouterr().err
    assert err.startswith("images.py: error: ") and "-e '.[hf]'" in err and err.count("\n") == 1


ROWS = ["def f(x):\n    return x\n", "", "class A: pass", None]


def test_a_text_column_reads_a_row_a_line_split_as_a_files_bytes_are(tmp_path):
    rows = [f"line {i} " + "word " * (i % 7) for i in range(200)]
    text = "".join(f"{row}\n" for row in rows).encode()
    single = _save(tmp_path / "single", {"text": rows, "n": list(range(200))})
    train, held_out = read_datasets_text(single, held_out=0.1)
    assert bytes(train) + bytes(held_out) == text and len(held_out) == int(len(text) * 0.1)
    capped, _ = read_datasets_text(single, max_bytes=100, held_out=0.1)
    assert bytes(capped) == text[:90]
    both = _save(tmp_path / "both", {"story": rows[:150]}, {"story": rows[150:]})
    train, held_out = read_datasets_text(both, column="story", held_out=0.1)
    assert bytes(train) + bytes(held_out) == text
    train, held_out = read_datasets_text(both, column="story", max_bytes=1000, held_out=0.1)
    assert bytes(train) == text[:1000] and bytes(held_out) == "".join(f"{r}\n" for r in rows[150:]).encode()[:100]
    assert (
        bytes(read_datasets_text(_save(tmp_path / "kept", {"text": ROWS[:3]}), held_out=0.25)[0])
        + bytes(read_datasets_text(tmp_path / "kept", held_out=0.25)[1])
        == b"def f(x):\n    return x\n\nclass A: pass\n"
    )  # a newline only where a row has none
    for columns, column, message in (
        ({"text": rows}, "story", "single2: no text column 'story' (name it with --text-column); it has text (Value)"),
        ({"text": list(range(5))}, "text", "single2: column 'text' holds int64, not text"),
        ({"text": ROWS}, "text", "single2: column 'text': example 3 has no text (null)"),
    ):
        shutil.rmtree(tmp_path / "single2", ignore_errors=True)
        with pytest.raises(DataError) as info:
            read_datasets_text(_save(tmp_path / "single2", columns), column=column)
        assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_images_trains_on_a_datasets_directory_as_on_the_npz(digits_datasets, tmp_path, monkeypatch):
    """A run on the PNGs of a datasets directory (the device loader; and streamed from the memory-mapped
    Arrow files through torch's DataLoader) logs the very metrics of the same run on the .npz, and so does a
    run on its arrays through Grain, cut after step 40's checkpoint and resumed."""
    _, _, paths, npz = digits_datasets
    monkeypatch.chdir(tmp_path)
    flags = ["--epochs", "1", "--features", "4", "--blocks", "1", "--batch-size", "32", "--crop-padding", "0"]
    flags += ["--log-every", "10", "--checkpoint-every", "20", "--no-progress"]

    def metrics(name, data, *more):
        assert run_entry([*flags, "--data", str(data), "--run-dir", name, *more], "images") == 0
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(tmp_path / name).read_metrics()]

    expected = metrics("npz", npz)
    assert len(expected) >= 4 and expected[-1]["step"] == 1437 // 32
    assert metrics("datasets", paths["image"], "--image-column", "image", "--label-column", "label") == expected
    assert metrics("torch", paths["image"], "--loader", "torch", "--workers", "0") == expected
    cut = RunDir(tmp_path / "grain")
    assert metrics("grain", paths["array"], "--loader", "grain") == expected
    shutil.rmtree(cut.checkpoint_paths()[-1])  # as if killed after step 40's checkpoint
    cut.summary_file.unlink()
    assert metrics("grain", paths["array"], "--loader", "grain", "--resume", "auto") == expected
    accuracy = lambda name: json.loads((tmp_path / name / "summary.json").read_text())["test_accuracy"]  # noqa: E731
    assert accuracy("npz") == accuracy("datasets") == accuracy("torch") == accuracy("grain")


@pytest.mark.slow
def test_lm_learns_a_datasets_text_column_as_the_same_text_in_a_file(tmp_path, monkeypatch, capsys):
    rows = [f"sphinx of black quartz, judge my vow {i}." for i in range(300)]
    (tmp_path / "text.txt").write_text("".join(f"{row}\n" for row in rows))
    _save(tmp_path / "rows", {"sentence": rows})
    monkeypatch.chdir(tmp_path)
    flags = ["--steps", "6", "--context", "16", "--dim", "16", "--depth", "1", "--heads", "2", "--batch-size", "8"]
    flags += ["--steps-per-call", "3", "--log-every", "3", "--no-progress"]

    def metrics(name, *more):
        assert run_entry([*flags, "--run-dir", name, *more], "lm") == 0
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(tmp_path / name).read_metrics()]

    assert metrics("rows", "--text", "rows", "--text-column", "sentence") == metrics("file", "--text", "text.txt")
    capsys.readouterr()
    assert run_entry([*flags, "--text", "text.txt", "--text-column", "sentence"], "lm") == 2
    assert "--text-column names a column of a datasets directory; --text text.txt is not one" in capsys.readouterr().err
