import itertools
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch.utils.data

from research.data import (
    DeviceLoader,
    TorchLoader,
    XORDataset,
    dataset_arrays,
    make_dataloader,
    numpy_collate,
)


def test_xor_dataset_is_seeded_and_labelled_by_xor():
    a, b, c = XORDataset(300, seed=1), XORDataset(300, seed=1), XORDataset(300, seed=2)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs, c.inputs)
    corners = np.rint(a.inputs).astype(int)  # noise std 0.1: rounding recovers the corner
    np.testing.assert_array_equal(a.labels, corners[:, 0] ^ corners[:, 1])
    assert a.inputs.dtype == np.float32 and a.labels.dtype == np.int32
    assert abs(np.std(a.inputs - corners) - 0.1) < 0.01
    x, y = a[0]
    assert x.shape == (2,) and y in (0, 1)


def test_xor_dataset_refuses_an_empty_size():
    with pytest.raises(ValueError, match="size must be positive"):
        XORDataset(0, seed=0)


def test_numpy_collate_stacks_tuples_into_numpy_arrays():
    samples = [(np.ones(2, np.float32) * i, np.int32(i)) for i in range(4)]
    inputs, labels = numpy_collate(samples)
    assert isinstance(inputs, np.ndarray) and inputs.shape == (4, 2)
    np.testing.assert_array_equal(labels, np.arange(4))


def test_dataloader_yields_numpy_batches_covering_the_data_once():
    dataset = XORDataset(100, seed=0)
    loader = make_dataloader(dataset, 32, shuffle=True, seed=3)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [32, 32, 32, 4]
    assert all(isinstance(x, np.ndarray) and x.shape[1:] == (2,) for x, _ in batches)
    seen = np.concatenate([x for x, _ in batches])
    np.testing.assert_array_equal(np.sort(seen, axis=0), np.sort(dataset.inputs, axis=0))
    again = [x for x, _ in make_dataloader(dataset, 32, shuffle=True, seed=3)]
    np.testing.assert_array_equal(np.concatenate(again), seen)


def test_dataloader_rejects_a_batch_larger_than_the_data():
    with pytest.raises(ValueError, match="batch size must be between 1 and the dataset size 10, got 11"):
        make_dataloader(XORDataset(10, seed=0), 11, shuffle=False)


def test_dataset_arrays_collates_a_generic_dataset():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return np.array([i, i * i], np.float32), np.int32(i % 2)

    inputs, labels = dataset_arrays(Squares())
    np.testing.assert_array_equal(inputs[:, 1], [0, 1, 4, 9, 16])
    np.testing.assert_array_equal(labels, [0, 1, 0, 1, 0])


def test_device_loader_epochs_are_permutations_and_pure_functions_of_seed_and_epoch():
    dataset = XORDataset(50, seed=0)
    loader = DeviceLoader.from_dataset(dataset, 10, seed=7)
    assert loader.steps_per_epoch == 5
    epoch0 = loader.step_indices(0, 5)
    assert sorted(epoch0.ravel().tolist()) == list(range(50))
    epoch1 = loader.step_indices(5, 5)
    assert not np.array_equal(epoch0, epoch1)
    fresh = DeviceLoader.from_dataset(dataset, 10, seed=7)
    np.testing.assert_array_equal(fresh.step_indices(3, 4), np.concatenate([epoch0[3:], epoch1[:2]]))


def test_device_loader_padded_batches_cover_every_example_once():
    dataset = XORDataset(25, seed=0)
    loader = DeviceLoader.from_dataset(dataset, 10, shuffle=False)
    batches = list(loader.padded_batches())
    assert [b.inputs.shape[0] for b, _ in batches] == [10, 10, 10]
    assert all(isinstance(b.inputs, jax.Array) for b, _ in batches)  # gathered on the device: nothing re-uploaded
    masks = np.concatenate([m for _, m in batches])
    assert masks.sum() == 25
    kept = np.concatenate([b.inputs for b, _ in batches])[masks == 1]
    np.testing.assert_array_equal(kept, dataset.inputs)


def test_torch_loader_resumes_at_any_step_with_the_same_batches():
    dataset = XORDataset(40, seed=0)
    loader = TorchLoader(dataset, 8, seed=5)
    straight = [b.inputs for b in itertools.islice(loader.batches(0), 12)]
    resumed = [b.inputs for b in itertools.islice(loader.batches(7), 5)]
    for a, b in zip(straight[7:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(straight[0], straight[5])  # epochs are shuffled differently


def test_the_library_and_an_experiment_on_device_data_do_not_import_torch(tmp_path):
    """torch takes ~2 s to import: only making a DataLoader (`--loader torch`) may pay for it."""
    code = (
        "import sys, research, research.data, research.train, research.experiment, research.nn, "
        "research.parallel, research.per_example, research.population; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
    loader = make_dataloader(XORDataset(8, seed=0), 4, shuffle=False)  # this one needs torch, imported lazily
    assert [labels.tolist() for _, labels in loader] == [
        XORDataset(8, seed=0).labels[:4].tolist(),
        XORDataset(8, seed=0).labels[4:].tolist(),
    ]
