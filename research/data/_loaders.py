import copy
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np

from ..errors import DataError

# torch is imported where a DataLoader is made, not here: it takes ~2 s to import, and runs on
# device-resident data never need it.


class Batch(NamedTuple):
    """Inputs and integer labels of a batch (numpy on the host, jax arrays on the device)."""

    inputs: Any
    labels: Any

    def take(self, rows: Any) -> "Batch":
        """The examples at `rows` as a batch (`take_rows`)."""
        return take_rows(self, rows)


def take_rows(batch: Any, rows: Any) -> Any:
    """The examples at `rows` of a batch (any pytree of arrays with a leading row axis): a step's indices
    (`[batch]`, or `[members, batch]` for a population), numpy or jax, traced or not. Every gather of a
    step's batch goes through here."""
    return jax.tree.map(lambda x: x[rows], batch)


# `take_rows` of device arrays as one compiled program: run op by op, an indexing is several programs (the
# indices' upload, their bounds, the gather), each traced and lowered again in every process.
_gather_rows = jax.jit(take_rows)


@runtime_checkable
class Dataset(Protocol):
    """A map-style dataset as torch's `DataLoader` takes one: `len(dataset)` examples, `dataset[i]`
    an `(input, label)` pair. A `torch.utils.data.Dataset` subclass is one; so is any class with
    these two methods (`XORDataset`, `ArrayDataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class RowArray(Protocol):
    """What a host loader reads examples from: an array along its first axis, indexed by an int or an
    array of rows (`np.asarray` of it reads it whole). A numpy array is one, a memory-mapped file too,
    and so is `ArrowImages`: the images of a Hugging Face datasets directory, read from its Arrow files
    by rows."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def ndim(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...


# What `fit` and `evaluate` take besides a `DeviceLoader`: a torch DataLoader of numpy batches
# (annotated structurally, so that importing this module does not import torch).
HostLoader = Iterable


def numpy_collate(samples: Sequence[Any]) -> Any:
    """`collate_fn` for `torch.utils.data.DataLoader` that builds numpy arrays instead of tensors: samples
    that are arrays, numbers, tuples or lists (collated position by position) or dicts (key by key). A
    `Batch` (or any other batch) that a dataset's `__getitems__` read whole passes as it is."""
    if not isinstance(samples, list):
        return samples
    first = samples[0]
    if isinstance(first, np.ndarray):
        return np.stack(samples)
    if isinstance(first, (tuple, list)):
        return [numpy_collate(list(group)) for group in zip(*samples, strict=True)]
    if isinstance(first, dict):
        return {key: numpy_collate([sample[key] for sample in samples]) for key in first}
    return np.asarray(samples)


def as_batch(collated: Any) -> Any:
    """A collated batch as the engine takes it: an `(inputs, labels)` pair as a `Batch`, anything else
    (a dict, images alone) as it is."""
    if isinstance(collated, (list, tuple)) and not isinstance(collated, Batch) and len(collated) == 2:
        return Batch(*collated)
    return collated


def check_rows(tree: Any, what: str = "the data") -> int:
    """The rows every array of `tree` has along its leading axis; `DataError` when they differ."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise DataError(f"{what} holds no arrays")
    rows = {jax.tree_util.keystr(path) or "the array": np.shape(x)[0] if np.ndim(x) else None for path, x in leaves}
    counts = {count for count in rows.values() if count is not None}
    if None in rows.values() or len(counts) > 1:
        found = ", ".join(f"{name} {count}" for name, count in rows.items())
        raise DataError(f"{what}: every array needs the same number of rows along its first axis; got {found}")
    return counts.pop()


def dataset_arrays(dataset: Dataset) -> Any:
    """The whole of an in-memory dataset as numpy arrays: a `Batch` (inputs, labels) of a dataset of
    pairs, else the collated examples (a dict of arrays, images alone)."""
    inputs, labels = getattr(dataset, "inputs", None), getattr(dataset, "labels", None)
    if inputs is not None and labels is not None:  # an in-memory dataset's arrays, whole
        return Batch(np.asarray(inputs), np.asarray(labels))
    return as_batch(numpy_collate([dataset[i] for i in range(len(dataset))]))


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed that depends on (seed, epoch) only: each epoch's order is a pure function of both."""
    return int(np.random.SeedSequence((seed, epoch)).generate_state(1, np.uint64)[0] >> 1)


def _check_batch_size(batch_size: int, size: int) -> None:
    if not 0 < batch_size <= size:
        raise DataError(f"batch size must be between 1 and the dataset size {size}, got {batch_size}")


def make_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
) -> HostLoader:
    """A torch `DataLoader` that yields numpy batches, shuffled by its own seeded generator."""
    import torch.utils.data

    _check_batch_size(batch_size, len(dataset))
    return torch.utils.data.DataLoader(
        dataset,  # pyright: ignore[reportArgumentType]  (torch takes any map-style dataset, not only its class)
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        collate_fn=numpy_collate,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
    )


class BatchOrder:
    """Which examples each training step takes: epoch `e` is `arange(size)` shuffled by
    `default_rng(epoch_seed(seed, e))` (in order without `shuffle`), cut into steps of `batch_size`, the
    last partial batch dropped so that every step has the same shape (one compilation). A pure function of
    (seed, step): any step's batch is known without the ones before it, so a run resumes in O(1), and every
    loader (`DeviceLoader`, `TorchLoader`, `GrainLoader`) trains on the same batches."""

    def __init__(self, size: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        _check_batch_size(batch_size, size)
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.steps_per_epoch = size // batch_size
        self._cache: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size, dtype=np.int32)
        if self._cache is None or self._cache[0] != epoch:
            order = np.arange(self.size, dtype=np.int32)  # shuffled in place: the order `permutation(size)` gives
            np.random.default_rng(epoch_seed(self.seed, epoch)).shuffle(order)
            self._cache = (epoch, order)
        return self._cache[1]

    def step_indices(self, start_step: int, num_steps: int) -> np.ndarray:
        """Indices `[num_steps, batch]` of the examples of global steps `start_step ..`."""
        rows = np.empty((num_steps, self.batch_size), dtype=np.int32)
        done = 0
        while done < num_steps:  # a slice per epoch touched: host time per step is what a tiny model pays
            epoch, offset = divmod(start_step + done, self.steps_per_epoch)
            count = min(self.steps_per_epoch - offset, num_steps - done)
            order = self.epoch_order(epoch)[offset * self.batch_size : (offset + count) * self.batch_size]
            rows[done : done + count] = order.reshape(count, self.batch_size)
            done += count
        return rows

    def process_rows(self, step: int) -> np.ndarray:
        """This process's share of step `step`'s indices: the contiguous rows its devices train on (all of
        them with one process), which are all a multi-process run reads on this process."""
        indices = self.step_indices(step, 1)[0]
        return indices.reshape(jax.process_count(), -1)[jax.process_index()]


class TorchLoader:
    """Training batches through a torch DataLoader (`num_workers` worker processes), positioned by global
    step: a run resumed at step `s` reads step `s`'s batch first and nothing before it (the order is a
    `BatchOrder`: the device loader's). With several processes each reads only its rows of every batch.
    A dataset with `__getitems__` (`ArrayDataset`: a memory-mapped file, say) reads a batch in one go."""

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int, num_workers: int = 0):
        self.dataset = dataset
        self.order = BatchOrder(len(dataset), batch_size, seed=seed)
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.steps_per_epoch = self.order.steps_per_epoch

    def batches(self, start_step: int, state: Any = None) -> Iterator[Any]:
        """Yield this process's rows of the batches of steps `start_step`, `start_step + 1`, ... forever."""
        import torch.utils.data

        steps = _StepRows(self.order, start_step)
        dataset: Any = self.dataset  # torch takes any map-style dataset, its stub only its own class
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=steps,
            collate_fn=numpy_collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
        for batch in loader:
            yield as_batch(batch)

    def state(self) -> Any:
        """Nothing beyond the step: the position of a `BatchOrder` is the step."""
        return None


class _StepRows:
    """A torch batch sampler: this process's indices of each step from `start` on."""

    def __init__(self, order: BatchOrder, start: int):
        self.order, self.start = order, start

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.order.process_rows(step).tolist()
            step += 1


class DeviceLoader:
    """An in-memory data set kept on the device; batches are gathered inside the compiled step.

    The host only computes index arrays (numpy permutations, cheap), so a whole chunk of steps can run
    in one compiled call. Epoch `e`'s order is `default_rng(epoch_seed(seed, e)).permutation(n)`.

    **Arguments:**

    - `inputs`, `labels`: numpy arrays with the examples along the first axis: a batch is then a
      `Batch(inputs, labels)`. With `labels=None`, `inputs` is any pytree of such arrays (a dict of
      images and conditioning, images alone), and a batch is that pytree's rows.
    - `batch_size`: examples per step; the last partial batch of an epoch is dropped when training.
    - `seed`: seed of the shuffling.
    - `shuffle`: shuffle each epoch (training) or keep the order (evaluation).
    """

    def __init__(self, inputs: Any, labels: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if labels is not None and len(inputs) != len(labels):
            raise DataError(f"inputs and labels differ in length: {len(inputs)} vs {len(labels)}")
        data = inputs if labels is None else Batch(inputs, labels)
        self.host = jax.tree.map(np.asarray, data)
        self.size = check_rows(self.host)
        self.order = BatchOrder(self.size, batch_size, seed=seed, shuffle=shuffle)
        self.arrays = jax.tree.map(jax.device_put, self.host)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = self.order.steps_per_epoch
        self.members: tuple[DeviceLoader, ...] | None = None

    @classmethod
    def from_dataset(cls, dataset: Dataset, batch_size: int, **kwargs: Any) -> "DeviceLoader":
        inputs, labels = dataset_arrays(dataset)
        return cls(inputs, labels, batch_size, **kwargs)

    @classmethod
    def for_members(cls, loaders: Sequence["DeviceLoader"]) -> "DeviceLoader":
        """One loader for a population whose member k sees the batches `loaders[k]` gives its own run
        (the same examples, each member's own shuffling): `step_indices` then has a member axis,
        `[steps, members, batch]`. The data stays on the device once."""
        first = loaders[0]
        for k, other in enumerate(loaders[1:], start=1):
            if other.batch_size != first.batch_size or other.shuffle != first.shuffle:
                raise DataError(
                    f"member {k} takes batches of {other.batch_size}, member 0 of {first.batch_size}: "
                    "the members of one population step through their data together"
                )
            same = zip(jax.tree.leaves(other.host), jax.tree.leaves(first.host), strict=True)
            if not all(a.shape == b.shape and np.array_equal(a, b) for a, b in same):
                raise DataError(
                    f"member {k} trains on other examples than member 0: one population trains on "
                    "one data set (only the order may differ)"
                )
        loader = copy.copy(first)
        loader.members = tuple(loaders)
        return loader

    @property
    def index_shape(self) -> tuple[int, ...]:
        """The shape of one step's indices: `(batch,)`, or `(members, batch)` (`for_members`)."""
        return (self.batch_size,) if self.members is None else (len(self.members), self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return self.order.epoch_order(epoch)

    def step_indices(self, start_step: int, num_steps: int) -> np.ndarray:
        """Indices of the examples of global steps `start_step .. start_step + num_steps - 1`."""
        if self.members is not None:
            return np.stack([m.step_indices(start_step, num_steps) for m in self.members], axis=1)
        return self.order.step_indices(start_step, num_steps)

    def step_batch(self, step: int) -> Any:
        """The batch of training step `step`, gathered from the device arrays (one call's worth of
        steps gathers inside the compiled call instead, from `step_indices`)."""
        return _gather_rows(self.arrays, self.step_indices(step, 1)[0])

    def padded_batches(self) -> Iterator[tuple[Any, np.ndarray]]:
        """Every example once, in order, as full-size batches gathered from the device arrays (an evaluation
        uploads nothing but indices); the last one padded, with a 0/1 mask (numpy)."""
        for start in range(0, self.size, self.batch_size):
            index = np.arange(start, start + self.batch_size)
            mask = index < self.size
            yield _gather_rows(self.arrays, np.where(mask, index, 0)), mask.astype(np.float32)


class ArrayDataset:
    """Examples `(inputs[i], labels[i])` of two arrays (in memory, or memory-mapped: a data set larger than
    memory; `inputs` any `RowArray`) as a map-style dataset for a torch DataLoader; `rows`: only those rows
    of the arrays, in that order (a training set less its validation rows, without copying a memory-mapped
    file). A batch is read in one indexing (`__getitems__`); `dataset_arrays` reads the arrays whole."""

    def __init__(self, inputs: RowArray, labels: np.ndarray, rows: np.ndarray | None = None):
        if len(inputs) != len(labels):
            raise DataError(f"inputs and labels differ in length: {len(inputs)} vs {len(labels)}")
        self.rows = rows
        self._inputs, self._labels = inputs, labels

    @property
    def inputs(self) -> RowArray:
        return self._inputs if self.rows is None else self._inputs[self.rows]

    @property
    def labels(self) -> np.ndarray:
        return self._labels if self.rows is None else self._labels[self.rows]

    def __len__(self) -> int:
        return len(self._labels) if self.rows is None else len(self.rows)

    def __getitem__(self, index: int) -> tuple[np.ndarray, Any]:
        row = index if self.rows is None else self.rows[index]
        return self._inputs[row], self._labels[row]

    def __getitems__(self, indices: list[int]) -> Batch:
        rows = np.asarray(indices) if self.rows is None else self.rows[indices]
        ordered = np.argsort(rows)  # a memory-mapped file reads fastest front to back
        inputs = np.empty((len(rows), *self._inputs.shape[1:]), self._inputs.dtype)
        inputs[ordered] = self._inputs[rows[ordered]]
        return Batch(inputs, np.asarray(self._labels[rows]))


def validation_rows(count: int, size: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(kept, held_out)` row indices of `count` training examples, `size` of them held out as a validation
    set, picked by `seed` alone, so that every run (whatever its own seed) holds out the same ones; both in
    their original order."""
    if not 0 <= size < count:
        raise DataError(f"a validation set of {size} examples out of {count} training examples")
    held_out = np.zeros(count, bool)
    held_out[np.random.default_rng(seed).permutation(count)[:size]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def split_validation(train: Batch, size: int, *, seed: int = 0) -> tuple[Batch, Batch]:
    """`(train, validation)`: `size` examples of `train` held out (`validation_rows`); the rest keep their
    order."""
    kept, held_out = validation_rows(len(train.labels), size, seed=seed)
    return train.take(kept), train.take(held_out)


def eval_loader(data: Batch, batch_size: int, kind: Literal["device", "torch"] = "device") -> DeviceLoader | HostLoader:
    """Every example of `data` in order, in batches of at most `batch_size`: a `DeviceLoader`
    (`kind="device"`) or a torch `DataLoader` with numpy collate (`kind="torch"`)."""
    batch_size = min(batch_size, len(data.labels))
    if kind == "device":
        return DeviceLoader(data.inputs, data.labels, batch_size, shuffle=False)
    if kind == "torch":
        return make_dataloader(ArrayDataset(data.inputs, data.labels), batch_size, shuffle=False)
    raise ValueError(f"unknown loader kind {kind!r}; expected 'device' or 'torch'")


def train_and_eval_loaders(
    train: Batch,
    test: Batch,
    batch_size: int,
    *,
    seed: int,
    kind: Literal["device", "torch"] = "device",
    eval_batch_size: int | None = None,
) -> tuple[DeviceLoader | TorchLoader, DeviceLoader | HostLoader]:
    """The training and evaluation loaders of an in-memory data set, the two ways `fit` accepts.

    `kind="device"`: `DeviceLoader`s (arrays on the device, several steps per compiled call);
    `kind="torch"`: a `TorchLoader` and a torch `DataLoader` with numpy collate. Both shuffle the
    training set by `seed` and keep the test set in order (in batches of `eval_batch_size`, default
    `batch_size`).
    """
    test_data = eval_loader(test, eval_batch_size or batch_size, kind)
    if kind == "device":
        return DeviceLoader(train.inputs, train.labels, batch_size, seed=seed), test_data
    return TorchLoader(ArrayDataset(train.inputs, train.labels), batch_size, seed=seed), test_data
