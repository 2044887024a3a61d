"""Training batches through Grain, the JAX ecosystem's data loader (the `grain` extra)."""

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import DataError
from ..install import require_extra
from ._loaders import BatchOrder, Dataset, dataset_arrays

STEPS = 2**40  # Grain's datasets have a length: the steps a run could ever take


class GrainLoader:
    """Training batches through Grain: a `grain.MapDataset` of steps, each step mapped to this process's
    rows of its batch (`BatchOrder`: the order of the other loaders), read by `workers` threads ahead of
    training. Its iterator's state (`{"next_index": step}`) is what a checkpoint keeps (`state()`), and a
    resumed run sets it: the batch of the step it resumes at is the first one read, whatever the step.
    With several processes each reads only its rows of every batch.

    **Arguments:**

    - `dataset`: a map-style dataset (`research.data.ArrayDataset` of memory-mapped arrays: a data set
      larger than memory; its `__getitems__` reads a batch at once).
    - `batch_size`: examples a step, over all processes; `seed`: the shuffling's.
    - `workers`: Grain's reading threads (0: read in the training thread).
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int, workers: int = 2):
        require_extra("--loader grain", "grain")
        self.dataset = dataset
        self.order = BatchOrder(len(dataset), batch_size, seed=seed)
        self.batch_size, self.seed, self.workers = batch_size, seed, workers
        self.steps_per_epoch = self.order.steps_per_epoch
        self._iterator: Any = None

    def _read(self, step: int) -> Any:
        rows = self.order.process_rows(int(step))
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return getitems(rows.tolist())
        return dataset_arrays(_Rows(self.dataset, rows))

    def batches(self, start_step: int, state: Any = None) -> Iterator[Any]:
        """This process's rows of the batches of steps `start_step`, ... forever; `state`: the `state()`
        a checkpoint of step `start_step` kept (its position must be that step)."""
        import grain

        position = {"next_index": start_step}
        if state is not None and state != position:
            raise DataError(f"the checkpoint's Grain iterator state {state} is not at its step {start_step}")
        steps = grain.MapDataset.range(STEPS).map(self._read)
        options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=2 * max(self.workers, 1))
        self._iterator = iter(steps.to_iter_dataset(options))
        self._iterator.set_state(position)
        yield from self._iterator

    def state(self) -> Any:
        """The Grain iterator's state: the step of the next batch it gives."""
        return None if self._iterator is None else self._iterator.get_state()


class _Rows:
    """Some rows of a dataset, for `dataset_arrays`."""

    def __init__(self, dataset: Dataset, rows: np.ndarray):
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.rows[index])]
