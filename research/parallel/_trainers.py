"""The fast path of `research.train` (`CompiledTrainer`) on several devices.

Both trainers keep the single-device design (partition once, a flat list of array leaves, donated
buffers, metrics summed on the device, many steps per call on device-resident data) and change only
where things live:

- `PmapTrainer`: `jax.pmap` over leaves stacked along a leading device axis (one copy per local
  device); each device gets `[per_device_batch, ...]`; `train_step(..., axis_name="devices")`
  averages gradients and metrics with `lax.pmean`.
- `ShardedTrainer`: `jax.jit` over a `Mesh` whose one axis, `"data"`, splits the batch; leaves are
  replicated `NamedSharding`s; XLA inserts the reductions.

With several processes each process feeds only its rows of every global batch (devices are ordered
process by process, so process `p` owns rows `[p * B / P, (p + 1) * B / P)`).
"""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..data import Batch
from ..train import CompiledTrainer, TrainState
from ..train._compiled import Leaves, StepStats

DEVICE_AXIS = "devices"  # pmap's axis name; BatchNorm reduces over (DEVICE_AXIS, "batch") under pmap
DATA_AXIS = "data"  # the mesh axis that splits the batch under jit


def process_rows(array: np.ndarray, axis: int = 0) -> np.ndarray:
    """This process's contiguous share of `array` along `axis` (all of it with one process)."""
    count, index = jax.process_count(), jax.process_index()
    size = array.shape[axis] // count
    return np.take(array, np.arange(index * size, (index + 1) * size), axis=axis)


def unreplicate(x: jax.Array) -> jax.Array:
    """One copy of a value replicated along pmap's leading device axis (`[devices, ...]`), read from
    this process's first device: no gather across devices or processes, unlike `x[0]`."""
    return x.addressable_data(0)[0]


def local_copy(x: jax.Array) -> jax.Array:
    """This process's first copy of an array replicated over a mesh (a single-device array that a
    checkpoint or an evaluation can use even when the mesh spans other processes)."""
    return x.addressable_data(0)


class PmapTrainer(CompiledTrainer):
    """`CompiledTrainer` under `jax.pmap` on this process's first `num_devices` devices."""

    parallel = True

    def __init__(self, loss_fn, static: TrainState, treedef, num_devices: int, skip_nonfinite: bool = False):
        super().__init__(loss_fn, static, treedef, skip_nonfinite)
        self.axis_name = DEVICE_AXIS  # train_step averages gradients and metrics over it
        self.devices = jax.local_devices()[:num_devices]
        self._stacked = NamedSharding(Mesh(np.array(self.devices), (DEVICE_AXIS,)), PartitionSpec(DEVICE_AXIS))
        self._step = jax.pmap(self._step_impl, DEVICE_AXIS, donate_argnums=(0, 1))
        self._run = jax.pmap(self._run_impl, DEVICE_AXIS, in_axes=(0, 0, 0, 0, None), donate_argnums=(0, 1))

    # -- placement -----------------------------------------------------------------------------
    def _replicate(self, x) -> jax.Array:
        host = np.asarray(x)
        return jax.device_put(np.broadcast_to(host, (len(self.devices), *host.shape)), self._stacked)

    def _per_device(self, x) -> np.ndarray:
        """`[global batch, ...]` -> this process's rows as `[devices, per_device_batch, ...]`."""
        rows = process_rows(np.asarray(x))
        return rows.reshape(len(self.devices), -1, *rows.shape[1:])

    def place(self, state: TrainState) -> Leaves:
        return [self._replicate(x) for x in self.leaves(state)]

    def state(self, leaves: Leaves) -> TrainState:
        return self._combine([unreplicate(x) for x in leaves])

    def metric_shapes(self, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        # One device's metrics, traced under vmap to bind the device axis.
        example = jax.tree.map(self._per_device, batch)
        mapped = jax.eval_shape(jax.vmap(lambda l, b: self._one(l, b)[1], axis_name=DEVICE_AXIS), leaves, example)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), mapped)

    def put_stats(self, stats: StepStats) -> StepStats:
        return jax.tree.map(self._replicate, stats)

    def put_batch(self, batch: Batch) -> Batch:
        return jax.tree.map(lambda x: jax.device_put(self._per_device(x), self._stacked), batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return jax.tree.map(self._replicate, host)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        rows = process_rows(indices, axis=1)  # [steps, process batch]
        per_device = rows.reshape(rows.shape[0], len(self.devices), -1).transpose(1, 0, 2)
        return jax.device_put(np.ascontiguousarray(per_device), self._stacked)

    def host(self, tree):
        return jax.tree.map(unreplicate, tree)


class ShardedTrainer(CompiledTrainer):
    """`CompiledTrainer` under `jax.jit` on a one-axis mesh: batch split along `"data"`, state replicated."""

    parallel = True

    def __init__(self, loss_fn, static: TrainState, treedef, mesh: Mesh, skip_nonfinite: bool = False):
        super().__init__(loss_fn, static, treedef, skip_nonfinite)
        self.mesh = mesh
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._batch = NamedSharding(mesh, PartitionSpec(DATA_AXIS))
        self._rows = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))
        both = (self._replicated, self._replicated)
        self._step = jax.jit(self._step_impl, donate_argnums=(0, 1), out_shardings=both)
        self._run = jax.jit(self._run_impl, donate_argnums=(0, 1), out_shardings=both)

    def _one(self, leaves: Leaves, batch: Batch) -> tuple[Leaves, dict]:
        batch = jax.lax.with_sharding_constraint(batch, self._batch)
        return super()._one(leaves, batch)

    # -- placement -----------------------------------------------------------------------------
    def _replicate(self, x) -> jax.Array:
        return jax.make_array_from_process_local_data(self._replicated, np.asarray(x))

    def place(self, state: TrainState) -> Leaves:
        return [self._replicate(x) for x in self.leaves(state)]

    def state(self, leaves: Leaves) -> TrainState:
        return self._combine([local_copy(x) for x in leaves])

    def put_stats(self, stats: StepStats) -> StepStats:
        return jax.tree.map(self._replicate, stats)

    def put_batch(self, batch: Batch) -> Batch:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._batch, process_rows(np.asarray(x)), x.shape), batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return jax.tree.map(self._replicate, host)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self._rows, process_rows(indices, axis=1), indices.shape)

    def run(self, leaves: Leaves, stats: StepStats, data: Batch, indices: jax.Array, num_steps: int):
        return self._run(leaves, stats, data, indices, self._replicate(np.int32(num_steps)))

    def host(self, tree):
        return jax.tree.map(local_copy, tree)


def check_batch_norm(model: eqx.Module, axis_name: str | tuple[str, ...], *, under_pmap: bool = False) -> None:
    """Refuse a model whose BatchNorm layers would not reduce over the whole (global) batch, or that
    cannot run under `jax.pmap`."""
    layers = [m for m in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, eqx.nn.BatchNorm))
              if isinstance(m, eqx.nn.BatchNorm)]
    for layer in layers:
        axis = tuple(layer.axis_name) if isinstance(layer.axis_name, (tuple, list)) else layer.axis_name
        if axis != axis_name:
            raise ValueError(
                f"a BatchNorm layer reduces over axis {axis!r}, but this strategy needs {axis_name!r} for its "
                "statistics to cover the whole batch; build the model with "
                "axis_name=research.parallel.batch_axis_name(parallel)"
            )
        if under_pmap and layer.mode == "ema":
            # jax.pmap is shard_map underneath (jax >= 0.8); there eqx.nn.State.set refuses the constant
            # BatchNorm(mode="ema") writes ("Old and new values have different structures").
            raise ValueError(
                'eqx.nn.BatchNorm(mode="ema") cannot run under jax.pmap with this equinox; build it with '
                'mode="batch", or use --parallel sharded'
            )
