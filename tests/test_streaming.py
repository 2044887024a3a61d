"""Host loaders that stream from disk and resume in O(1): the torch DataLoader and Grain read the batches
the device loader gathers, starting at any step without reading the ones before it."""

import itertools
import shutil
import sys
import threading

import numpy as np
import pytest

from research.cli import main_entry
from research.data import ArrayDataset, BatchOrder, DeviceLoader, GrainLoader, TorchLoader, read_array
from research.experiment import load_experiment
from research.services import RunDir, read_header


class CountingDataset(ArrayDataset):
    """An ArrayDataset that counts the examples it reads."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read, self._lock = 0, threading.Lock()

    def __getitems__(self, indices):
        with self._lock:
            self.read += len(indices)
        return super().__getitems__(indices)


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """60,000 images of 28 x 28 in a .npy file, read memory-mapped."""
    path = tmp_path_factory.mktemp("stream") / "x.npy"
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(60_000, 28, 28))
    images[:] = np.arange(60_000, dtype=np.uint32)[:, None, None].astype(np.uint8)  # row i holds i % 256
    images.flush()
    return read_array(path), np.arange(60_000, dtype=np.int32)


def loaders(dataset):
    return {"torch": TorchLoader(dataset, 64, seed=3), "grain": GrainLoader(dataset, 64, seed=3, workers=0)}


def test_every_loader_serves_the_device_loaders_batches_across_epochs():
    inputs, labels = np.arange(50 * 2, dtype=np.float32).reshape(50, 2), np.arange(50) % 3
    device = DeviceLoader(inputs, labels, 8, seed=3)
    streams = {
        "torch": TorchLoader(ArrayDataset(inputs, labels), 8, seed=3, num_workers=2),
        "grain": GrainLoader(ArrayDataset(inputs, labels), 8, seed=3, workers=2),
    }
    for name, loader in streams.items():
        batches = list(itertools.islice(loader.batches(0), 20))  # 6 steps an epoch: three epochs and more
        for step, batch in enumerate(batches):
            rows = device.step_indices(step, 1)[0]
            np.testing.assert_array_equal(batch.inputs, inputs[rows], err_msg=name)
            np.testing.assert_array_equal(batch.labels, labels[rows], err_msg=name)
        resumed = list(itertools.islice(loader.batches(13), 4))
        for a, b in zip(batches[13:17], resumed, strict=True):
            np.testing.assert_array_equal(a.inputs, b.inputs, err_msg=name)


@pytest.mark.parametrize("name", ["torch", "grain"])
def test_a_resume_at_step_10000_reads_no_more_than_one_at_step_10(mapped, name):
    """The first batch after a resume is read straight from the memory-mapped file: as many examples are
    read before it at step 10,000 (10 epochs in) as at step 10."""
    images, labels = mapped
    order = BatchOrder(60_000, 64, seed=3)
    reads = {}
    for step in (10, 10_000):
        dataset = CountingDataset(images, labels)
        first = next(loaders(dataset)[name].batches(step))
        rows = order.step_indices(step, 1)[0]
        np.testing.assert_array_equal(first.labels, rows)
        np.testing.assert_array_equal(first.inputs[:, 0, 0], (rows % 256).astype(np.uint8))
        reads[step] = dataset.read
    assert reads[10] == reads[10_000] <= 64 * 4  # the batch, and what Grain reads ahead
    assert isinstance(images, np.memmap)


@pytest.mark.slow
def test_host_batches_are_put_on_the_device_two_ahead_with_the_loaders_state_after_each():
    """The engine copies each host batch to the devices two steps before the step that takes it, and keeps the
    loader's state as it was right after that batch (what a checkpoint of that step must hold), not the state
    of the loader that has read ahead."""
    from research.train._engine import _put_ahead

    read, put = [], []
    batches = iter(range(5))
    state = lambda: {"next_index": len(read)}  # noqa: E731

    def reading():
        for b in batches:
            read.append(b)
            yield b

    ahead = _put_ahead(reading(), lambda b: put.append(b) or f"device {b}", state, 2)
    assert next(ahead) == (0, "device 0", {"next_index": 1}) and put == [0, 1, 2]
    assert next(ahead) == (1, "device 1", {"next_index": 2}) and put == [0, 1, 2, 3]
    assert [b for b, _, _ in ahead] == [2, 3, 4]  # the last ones, when the loader ends


@pytest.mark.slow  # runs of images end to end, a ResNet compiled
def test_grain_keeps_its_iterator_state_in_the_checkpoint_and_resumes_from_it(digits_formats, tmp_path, monkeypatch):
    """`images --loader grain` on a memory-mapped .npy directory: every checkpoint holds Grain's iterator
    state at its step; a run cut at step 20 and resumed ends where a run never cut ends."""
    monkeypatch.chdir(tmp_path)
    images = load_experiment("images")
    data = tmp_path / "npy"
    data.mkdir()
    npz = np.load(digits_formats["npz"])
    for key in npz.files:  # every third image: 479 training ones, 14 steps of 32 an epoch
        np.save(data / f"{key}.npy", npz[key][::3])
    argv = [
        "--data",
        str(data),
        "--loader",
        "grain",
        "--epochs",
        "2",
        "--features",
        "4",
        "--blocks",
        "1",
        "--batch-size",
        "32",
        "--checkpoint-every",
        "10",
        "--log-every",
        "10",
        "--no-progress",
    ]
    argv0, sys.argv[0] = sys.argv[0], "images.py"
    try:
        main_entry(images.main, images.Config, [*argv, "--run-dir", "straight"])
        main_entry(images.main, images.Config, [*argv, "--run-dir", "cut"])
        run = RunDir(tmp_path / "cut")
        assert [read_header(p)["data"] for p in run.checkpoint_paths()] == [
            {"next_index": 10},
            {"next_index": 20},
            {"next_index": 28},
        ]
        shutil.rmtree(run.checkpoint_paths()[-1])  # as if killed after step 20's checkpoint
        run.summary_file.unlink()
        main_entry(images.main, images.Config, [*argv, "--run-dir", "cut", "--resume", "auto"])
    finally:
        sys.argv[0] = argv0

    def untimed(path):
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(tmp_path / path).read_metrics()]

    assert untimed("cut") == untimed("straight")
    assert (
        RunDir(tmp_path / "cut").read_summary()["test_accuracy"]
        == RunDir(tmp_path / "straight").read_summary()["test_accuracy"]
    )
