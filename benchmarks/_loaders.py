"""Case (h): the host loaders against the device loader (issue 26). Training steps per second of the
MNIST-1D MLP recipe with each loader; reading a memory-mapped 60,000 x 28 x 28 set a batch at a time;
and the time to the first batch of a run resumed at step 10 and at step 10,000 of that set, beside the
torch loader before issue 26 (a DataLoader per epoch, reading and dropping the epoch's batches before
the resume point)."""

import itertools
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

from research.data import (
    ArrayDataset,
    Batch,
    DeviceLoader,
    GrainLoader,
    TorchLoader,
    epoch_seed,
    load_mnist1d,
    make_dataloader,
    read_array,
)
from research.nn import MLP
from research.train import TrainState, fit

from ._timing import Timing, interleave, timed

BATCH = 128


def _mlp_state() -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(0))
    return TrainState.create(MLP(40, 10, hidden=(100, 100), key=model_key), optax.adam(1e-3), key=train_key)


def _training(quick: bool) -> dict[str, Timing]:
    """Seconds per step of `fit` (warm: its compiled step is cached) with each loader, MNIST-1D MLP."""
    train, _ = load_mnist1d("data")
    steps = 200 if quick else 2000
    loaders = {
        "device loader (100 steps a call)": (DeviceLoader(train.inputs, train.labels, BATCH, seed=0), 100),
        "torch DataLoader, in process": (TorchLoader(ArrayDataset(*train), BATCH, seed=0), 1),
        "torch DataLoader, 2 workers": (TorchLoader(ArrayDataset(*train), BATCH, seed=0, num_workers=2), 1),
        "Grain, 2 threads": (GrainLoader(ArrayDataset(*train), BATCH, seed=0, workers=2), 1),
    }
    state = _mlp_state()

    def run(loader, per_call):
        return lambda: timed(
            lambda: fit(state, loader, num_steps=steps, log_every=steps, steps_per_call=per_call, progress=False), steps
        )

    candidates = {name: run(*args) for name, args in loaders.items()}
    for candidate in candidates.values():
        candidate()  # compiled, workers started once
    return interleave(candidates, 2 if quick else 5)


def _big_set(root: Path, quick: bool) -> tuple[np.ndarray, np.ndarray]:
    count = 6_000 if quick else 60_000
    path = root / "images.npy"
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(count, 28, 28))
    images[:] = np.random.default_rng(0).integers(0, 256, (count, 28, 28), dtype=np.uint8)
    images.flush()
    return read_array(path), np.random.default_rng(1).integers(0, 10, count).astype(np.int32)


def _reading(images: np.ndarray, labels: np.ndarray, quick: bool) -> dict[str, Timing]:
    """Seconds per batch of 128 from the memory-mapped set, each loader's iterator kept warm."""
    batches = 20 if quick else 200
    device = DeviceLoader(np.asarray(images), labels, BATCH, seed=0)
    gather = jax.jit(lambda data, rows: data[rows])
    position = itertools.count()

    def on_device():
        rows = device.step_indices(next(position), batches)
        return timed(lambda: [jax.block_until_ready(gather(device.arrays.inputs, r)) for r in rows], batches)

    streams = {
        "torch DataLoader, in process": TorchLoader(ArrayDataset(images, labels), BATCH, seed=0).batches(0),
        "torch DataLoader, 2 workers": TorchLoader(ArrayDataset(images, labels), BATCH, seed=0, num_workers=2).batches(
            0
        ),
        "Grain, 2 threads": GrainLoader(ArrayDataset(images, labels), BATCH, seed=0, workers=2).batches(0),
    }

    def pulled(stream):
        return lambda: timed(lambda: [next(stream) for _ in range(batches)], batches)

    candidates = {
        "device loader (gather on the device)": on_device,
        **{name: pulled(stream) for name, stream in streams.items()},
    }
    for candidate in candidates.values():
        candidate()
    return interleave(candidates, 3 if quick else 7)


def _earlier_torch_loader(dataset: ArrayDataset, start_step: int) -> Batch:
    """The first batch as the torch loader before issue 26 reached it: a DataLoader for the epoch, whose
    batches before the resume point are read and dropped."""
    steps_per_epoch = len(dataset) // BATCH
    epoch, offset = divmod(start_step, steps_per_epoch)
    loader = make_dataloader(dataset, BATCH, shuffle=True, seed=epoch_seed(0, epoch), drop_last=True)
    return next(itertools.islice(iter(loader), offset, None))


def _resume(images: np.ndarray, labels: np.ndarray, quick: bool) -> dict[str, Timing]:
    """Seconds to the first batch of a run resumed at step 10 and at step 10,000 (a fresh loader each)."""
    dataset = ArrayDataset(images, labels)
    late = 10_000 if not quick else 1_000
    makers = {
        "torch DataLoader": lambda s: next(TorchLoader(dataset, BATCH, seed=0).batches(s)),
        "Grain": lambda s: next(GrainLoader(dataset, BATCH, seed=0, workers=0).batches(s)),
        "torch DataLoader before issue 26": lambda s: _earlier_torch_loader(dataset, s),
    }
    candidates = {
        f"{name}, resumed at step {step:,}": (lambda m=make, s=step: timed(lambda: m(s)))
        for name, make in makers.items()
        for step in (10, late)
    }
    for candidate in candidates.values():
        candidate()
    return interleave(candidates, 2 if quick else 5)


def run(quick: bool) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        images, labels = _big_set(Path(scratch), quick)
        reading, resume = _reading(images, labels, quick), _resume(images, labels, quick)
        del images
    return {
        "training": list(_training(quick).values()),
        "reading": list(reading.values()),
        "resume": list(resume.values()),
        "size": 6_000 if quick else 60_000,
        "seconds": time.perf_counter() - start,
    }
