"""The multi-device placements: `jax.pmap`, and `jax.jit` over a device mesh.

Both keep the single-device fast path (partition once, a flat list of array leaves, donated
buffers, metrics summed on the device, many steps per call on device-resident data) and change only
where things live:

- `Pmap`: leaves stacked along a leading device axis (one copy per local device); each device gets
  `[per_device_batch, ...]` and its traced step sees the device axis `"devices"`, over which the
  loss combines its gradient (`research.train.loss_value_and_grad`).
- `Sharded`: `jax.jit` over a `Mesh` whose one axis, `"data"`, splits the batch; leaves are
  replicated `NamedSharding`s; the step sees the global batch and XLA inserts the reductions.

With several processes each process feeds only its rows of every global batch (devices are ordered
process by process, so process `p` owns rows `[p * B / P, (p + 1) * B / P)`).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..data import Batch
from ..errors import ConfigError, DeviceError
from ..train import (
    Leaves,
    OneDevice,
    Placement,
    batch_norm_layers,
    check_batch_norm_axis,
    check_micro_batches,
    copy_leaves,
    first_device,
)
from ._devices import check_device_count

DEVICE_AXIS = "devices"  # pmap's axis name; BatchNorm reduces over (DEVICE_AXIS, "batch") under pmap
DATA_AXIS = "data"  # the mesh axis that splits the batch under jit
ParallelName = Literal["auto", "none", "pmap", "sharded", "fsdp"]


def batch_axis_name(parallel: str, deterministic_reduction: bool = False) -> str | tuple[str, str]:
    """The `axis_name` a BatchNorm layer needs to reduce over the whole global batch: the vmap axis
    `"batch"`, and under pmap also the device axis (each device vmaps over its slice only). With
    `--deterministic-reduction` each micro-batch is normalised on its own: `"batch"` alone."""
    return (DEVICE_AXIS, "batch") if parallel == "pmap" and not deterministic_reduction else "batch"


def per_device_on_mesh(mesh: Mesh, step: Callable, micro_batches: int | None) -> Callable:
    """`step(state, batch, axis_name)` under `jax.jit` over `mesh`: given the whole global batch (XLA
    inserts the reductions), or, with `micro_batches`, run by every device on its own rows
    (`jax.shard_map`; the state replicated), the step doing its own fixed-order reductions over `"data"`."""
    if micro_batches is None:
        return lambda state, batch: step(state, batch, None)

    def run(state: Any, batch: Batch) -> tuple[Any, Any]:
        dynamic, static = eqx.partition(state, eqx.is_array)
        new_static = []  # the non-array part of the new state, seen while tracing `local`

        def local(dynamic: Any, batch: Batch) -> tuple[Any, Any]:
            new, metrics = step(eqx.combine(dynamic, static), batch, DATA_AXIS)
            new_dynamic, static_part = eqx.partition(new, eqx.is_array)
            new_static.append(static_part)
            return new_dynamic, metrics

        # (No varying-axis check: the outputs are the same on every device because every device
        # computes them from the same gathered values, which the check cannot see.)
        mapped = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(DATA_AXIS)),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
        new_dynamic, metrics = mapped(dynamic, batch)
        return eqx.combine(new_dynamic, new_static[-1]), metrics

    return run


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


def across_processes(x: jax.Array) -> jax.Array:
    """A value each process holds the same copy of on its first device, as one global array replicated
    over those devices (no transfer): what Orbax saves once, from process 0."""
    if jax.process_count() == 1:
        return x
    devices = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    sharding = NamedSharding(Mesh(np.array(devices), ("processes",)), PartitionSpec())
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [x])


def check_split(rows: int, devices: int) -> None:
    """Refuse a global batch of `rows` rows that `devices` devices per process cannot share evenly."""
    total = devices * jax.process_count()
    if rows % total:
        raise DeviceError(
            f"a training batch of {rows} rows cannot be split evenly over {total} devices ({devices} per process x "
            f"{jax.process_count()} process(es)); pick a batch size that is a multiple of {total}"
        )


@dataclasses.dataclass(frozen=True)
class Pmap(Placement):
    """`jax.pmap` over `devices` devices per process; the state is replicated along a stacked axis."""

    devices: int = 1
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "pmap"
    packs = False

    @property
    def batch_axis(self) -> str | tuple[str, str]:
        return batch_axis_name(self.name, self.micro_batches is not None)

    def per_device(self, step: Callable) -> Callable:
        return lambda state, batch: step(state, batch, DEVICE_AXIS)

    @functools.cached_property
    def _stacked(self) -> NamedSharding:
        devices = jax.local_devices()[: self.devices]
        return NamedSharding(Mesh(np.array(devices), (DEVICE_AXIS,)), PartitionSpec(DEVICE_AXIS))

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        in_axes = (0, 0, 0, 0, None) if broadcast_last else 0
        return jax.pmap(fn, DEVICE_AXIS, in_axes=in_axes, donate_argnums=(0, 1))

    def constrain(self, batch: Batch) -> Batch:
        return batch

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return leaves

    def _replicate(self, x) -> jax.Array:
        host = np.asarray(x)
        return jax.device_put(np.broadcast_to(host, (self.devices, *host.shape)), self._stacked)

    def _per_device(self, x) -> np.ndarray:
        """This process's rows of a batch -> `[devices, per_device_batch, ...]`."""
        rows = np.asarray(x)
        return rows.reshape(self.devices, -1, *rows.shape[1:])

    def place(self, leaves: Leaves) -> Leaves:
        return [self._replicate(x) for x in leaves]

    def gather(self, leaves: Leaves) -> Leaves:
        return [unreplicate(x) for x in leaves]

    def to_save(self, leaves: Leaves) -> Leaves:
        return [across_processes(x) for x in copy_leaves(self.gather(leaves))]

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return first_device()  # `place` replicates it

    def put_stats(self, stats: Any) -> Any:
        return jax.tree.map(self._replicate, stats)

    def put_batch(self, batch: Batch) -> Batch:
        return jax.tree.map(lambda x: jax.device_put(self._per_device(x), self._stacked), batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return jax.tree.map(self._replicate, host)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        rows = process_rows(indices, axis=1)  # [steps, process batch]
        per_device = rows.reshape(rows.shape[0], self.devices, -1).transpose(1, 0, 2)
        return jax.device_put(np.ascontiguousarray(per_device), self._stacked)

    def put_count(self, count: int) -> np.int32:
        return np.int32(count)

    def host(self, tree: Any) -> Any:
        return jax.tree.map(unreplicate, tree)

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        # One device's metrics, traced under vmap to bind the device axis.
        example = jax.tree.map(self._per_device, batch)
        mapped = jax.eval_shape(jax.vmap(fn, axis_name=DEVICE_AXIS), leaves, example)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), mapped)

    def check(self, model: eqx.Module, rows: int) -> None:
        check_device_count(self.devices)
        if jax.process_count() > 1 and self.devices != jax.local_device_count():
            raise DeviceError(
                f"--parallel pmap with several processes uses every local device: pass --devices "
                f"{jax.local_device_count()} (got {self.devices})"
            )
        check_split(rows, self.devices)
        check_micro_batches(self.micro_batches, rows, self.devices * jax.process_count())
        check_batch_norm_axis(model, self.batch_axis)
        if any(layer.mode == "ema" for layer in batch_norm_layers(model)):
            # jax.pmap is shard_map underneath (jax >= 0.8); there eqx.nn.State.set refuses the constant
            # BatchNorm(mode="ema") writes ("Old and new values have different structures").
            raise ConfigError(
                'eqx.nn.BatchNorm(mode="ema") cannot run under jax.pmap with this equinox; build it '
                'with mode="batch", or use --parallel sharded'
            )


@dataclasses.dataclass(frozen=True)
class Sharded(Placement):
    """`jax.jit` over a mesh of `devices` devices per process, the batch split along `"data"`."""

    devices: int = 1
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "sharded"
    packs = False
    batch_axis = "batch"

    def per_device(self, step: Callable) -> Callable:
        return per_device_on_mesh(self.mesh, step, self.micro_batches)

    @functools.cached_property
    def mesh(self) -> Mesh:
        # Process by process, so that each process's rows of the batch are contiguous.
        devices = [d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[: self.devices]]
        return Mesh(np.array(devices), (DATA_AXIS,))

    @functools.cached_property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @functools.cached_property
    def _batch(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(DATA_AXIS))

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        both = (self._replicated, self._replicated)
        return jax.jit(fn, donate_argnums=(0, 1), out_shardings=both)

    def constrain(self, batch: Batch) -> Batch:
        return jax.lax.with_sharding_constraint(batch, self._batch)

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return leaves

    def _replicate(self, x) -> jax.Array:
        return jax.make_array_from_process_local_data(self._replicated, np.asarray(x))

    def place(self, leaves: Leaves) -> Leaves:
        return [self._replicate(x) for x in leaves]

    def gather(self, leaves: Leaves) -> Leaves:
        return [local_copy(x) for x in leaves]

    def to_save(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)  # replicated over the mesh: Orbax writes one copy, from process 0

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return first_device()  # `place` replicates it

    def put_stats(self, stats: Any) -> Any:
        return jax.tree.map(self._replicate, stats)

    def put_batch(self, batch: Batch) -> Batch:
        def put(rows: Any) -> jax.Array:  # this process's rows of the global batch
            rows = np.asarray(rows)
            return jax.make_array_from_process_local_data(
                self._batch, rows, (len(rows) * jax.process_count(), *rows.shape[1:])
            )

        return jax.tree.map(put, batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return jax.tree.map(self._replicate, host)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        rows = NamedSharding(self.mesh, PartitionSpec(None, DATA_AXIS))
        return jax.make_array_from_process_local_data(rows, process_rows(indices, axis=1), indices.shape)

    def put_count(self, count: int) -> jax.Array:
        return self._replicate(np.int32(count))

    def host(self, tree: Any) -> Any:
        return jax.tree.map(local_copy, tree)

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        return jax.eval_shape(fn, leaves, batch)

    def check(self, model: eqx.Module, rows: int) -> None:
        check_device_count(self.devices)
        check_split(rows, self.devices)
        check_micro_batches(self.micro_batches, rows, self.devices * jax.process_count())
        check_batch_norm_axis(model, self.batch_axis)


@dataclasses.dataclass(frozen=True)
class Fsdp(Placement):
    """Fully sharded data parallelism: `jax.jit` over the same mesh as `Sharded`, the batch split along
    `"data"`, and every array of the train state (parameters, optimizer state, EMA) of at least
    `min_size` elements sharded along its largest axis that the devices divide (big_vision's fsdp
    rule); smaller arrays are replicated. XLA inserts the all-gathers before use and the
    reduce-scatters of the gradients. Each device holds about 1/N of the state."""

    devices: int = 1
    min_size: int = 1024
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "fsdp"
    packs = False
    batch_axis = "batch"

    @functools.cached_property
    def _sharded(self) -> Sharded:  # the mesh, the batch layout and the replicated values are Sharded's
        return Sharded(self.devices, micro_batches=self.micro_batches)

    def per_device(self, step: Callable) -> Callable:
        # Under micro_batches every device gathers the whole state for the step (the state stays
        # sharded between steps and in checkpoints): its reductions are then those of one device.
        return self._sharded.per_device(step)

    def leaf_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        """Where one array of the state lives: split along its largest axis the devices divide."""
        count = self._sharded.mesh.size
        axes = [a for a, size in enumerate(shape) if size % count == 0 and size >= count]
        if math.prod(shape) < self.min_size or not axes:
            return PartitionSpec()
        axis = max(axes, key=lambda a: shape[a])
        return PartitionSpec(*(DATA_AXIS if a == axis else None for a in range(len(shape))))

    def _sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self._sharded.mesh, self.leaf_spec(shape))

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        return jax.jit(fn, donate_argnums=(0, 1))  # the state's layout is set inside (constrain_state)

    def constrain(self, batch: Batch) -> Batch:
        return self._sharded.constrain(batch)

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return [jax.lax.with_sharding_constraint(x, self._sharding(x.shape)) for x in leaves]

    def place(self, leaves: Leaves) -> Leaves:
        def put(x) -> jax.Array:
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # restored in shards across processes
                return copy_leaves([jax.device_put(x, self._sharding(x.shape))])[0]
            host = np.asarray(x)  # every process holds the whole state; each places its devices' shards
            return jax.make_array_from_callback(host.shape, self._sharding(host.shape), lambda index: host[index])

        return [put(x) for x in leaves]

    @functools.cached_property
    def _all_gather(self) -> Callable[[Leaves], Leaves]:
        return jax.jit(lambda leaves: [x.copy() for x in leaves], out_shardings=self._sharded._replicated)

    def gather(self, leaves: Leaves) -> Leaves:
        """Whole arrays on this process's first device, for evaluation (an all-gather over the mesh,
        which every process takes part in)."""
        return [local_copy(x) for x in self._all_gather(leaves)]

    def to_save(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)  # in their shards: each process writes those it holds

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return self._sharding(shape)  # each device reads its own shard

    def put_stats(self, stats: Any) -> Any:
        return self._sharded.put_stats(stats)

    def put_batch(self, batch: Batch) -> Batch:
        return self._sharded.put_batch(batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return self._sharded.put_data(host, device)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        return self._sharded.put_indices(indices)

    def put_count(self, count: int) -> jax.Array:
        return self._sharded.put_count(count)

    def host(self, tree: Any) -> Any:
        return jax.tree.map(
            lambda x: local_copy(x if x.is_fully_replicated else jax.device_put(x, self._sharded._replicated)), tree
        )

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        return jax.eval_shape(fn, leaves, batch)

    def check(self, model: eqx.Module, rows: int) -> None:
        self._sharded.check(model, rows)


def make_placement(parallel: ParallelName, devices: int = 1, micro_batches: int | None = None) -> Placement:
    """The placement named on the command line. `auto` is `none` for one device in one process and
    `sharded` otherwise; `none` refuses more than one device or process. `micro_batches`: the step
    is layout-invariant (`--deterministic-reduction`)."""
    processes = jax.process_count()
    if parallel == "auto":
        parallel = "none" if devices * processes == 1 else "sharded"
    if parallel == "none":
        if devices * processes != 1:
            raise DeviceError(
                f"--parallel none trains on one device, but --devices is {devices} with {processes} process(es); "
                "pass --parallel sharded or pmap"
            )
        return OneDevice(1, micro_batches=micro_batches)
    return {"pmap": Pmap, "sharded": Sharded, "fsdp": Fsdp}[parallel](devices, micro_batches=micro_batches)
