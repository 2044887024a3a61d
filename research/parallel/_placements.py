"""The placements that `--parallel` names: `none` (one device), `sharded` and `fsdp` (`jax.jit` over a
device mesh, `research.parallel.MeshPlacement`) and `pmap`, the one special case (`jax.pmap`).

All keep the single-device fast path (partition once, a flat list of array leaves, donated
buffers, metrics summed on the device, many steps per call on device-resident data) and change only
where things live:

- `sharded`: a mesh whose one axis, `"data"`, splits each batch's rows; the state replicated; the
  step sees the global batch and XLA inserts the reductions.
- `fsdp`: the same mesh, every large array of the state split along its largest axis the devices
  divide (`research.parallel.LargestAxis`, big_vision's rule); XLA inserts the all-gathers before use
  and the reduce-scatters of the gradients. Each device holds about 1/N of the state.
- `Pmap`: leaves stacked along a leading device axis (one copy per local device); each device gets
  `[per_device_batch, ...]` and its traced step sees the device axis `"devices"`, over which the
  loss combines its gradient (`GlobalBatch.value_and_grad`).

With several processes each process feeds only its rows of every global batch (devices are ordered
process by process, so process `p` owns rows `[p * B / P, (p + 1) * B / P)`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ConfigError, DeviceError
from ..typing import PyTree
from ._mesh import (
    EXACT_COMPILER_OPTIONS,
    LargestAxis,
    Leaves,
    MeshPlacement,
    Placement,
    batch_norm_layers,
    check_batch_norm_axis,
    check_device_count,
    check_micro_batches,
    check_split,
    copy_leaves,
    devices_of_every_process,
    first_device,
    one_device,
    process_rows,
)

DEVICE_AXIS = "devices"  # pmap's axis name; BatchNorm reduces over (DEVICE_AXIS, "batch") under pmap
ParallelName = Literal["auto", "none", "pmap", "sharded", "fsdp"]


def batch_axis_name(parallel: str, deterministic_reduction: bool = False) -> str | tuple[str, str]:
    """The `axis_name` a BatchNorm layer needs to reduce over the whole global batch: the vmap axis
    `"batch"`, and under pmap also the device axis (each device vmaps over its slice only). With
    `--deterministic-reduction` each micro-batch is normalised on its own: `"batch"` alone."""
    return (DEVICE_AXIS, "batch") if parallel == "pmap" and not deterministic_reduction else "batch"


def sharded(devices: int = 1, *, micro_batches: int | None = None) -> MeshPlacement:
    """`--parallel sharded`: data parallelism over a mesh of `devices` devices per process."""
    return MeshPlacement("sharded", devices, micro_batches=micro_batches)


def fsdp(devices: int = 1, min_size: int = 1024, *, micro_batches: int | None = None) -> MeshPlacement:
    """`--parallel fsdp`: fully sharded data parallelism; arrays of the state of at least `min_size`
    elements split over the devices (`LargestAxis`). Under `micro_batches` every device gathers the
    whole state for the step, whose reductions are then those of one device."""
    return MeshPlacement("fsdp", devices, LargestAxis(min_size), micro_batches=micro_batches)


def unreplicate(x: jax.Array) -> jax.Array:
    """One copy of a value replicated along pmap's leading device axis (`[devices, ...]`), read from
    this process's first device: no gather across devices or processes, unlike `x[0]`."""
    return x.addressable_data(0)[0]


def across_processes(x: jax.Array) -> jax.Array:
    """A value each process holds the same copy of on its first device, as one global array replicated
    over those devices (no transfer): what Orbax saves once, from process 0."""
    if jax.process_count() == 1:
        return x
    devices = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    sharding = NamedSharding(Mesh(np.array(devices), ("processes",)), PartitionSpec())
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [x])


@dataclasses.dataclass(frozen=True)
class Pmap(Placement):
    """`jax.pmap` over `devices` devices per process; the state is replicated along a stacked axis."""

    devices: int = 1
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "pmap"
    on_one_device = False  # a stacked device axis, even on one device

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
        if self.micro_batches is not None:
            return self._compile_exact(fn, broadcast_last)
        in_axes = (0, 0, 0, 0, None) if broadcast_last else 0
        return jax.pmap(fn, DEVICE_AXIS, in_axes=in_axes, donate_argnums=(0, 1))

    def _compile_exact(self, fn: Callable, broadcast_last: bool) -> Callable:
        """What `jax.pmap` compiles (a `jax.jit` of a `jax.shard_map` over the stacked device axis of every
        process's devices), with the compiler options of a micro-batched step, which `jax.pmap` takes none of."""
        mesh = Mesh(devices_of_every_process(self.devices), (DEVICE_AXIS,))

        def per_device(*args: Any) -> Any:
            mapped = len(args) - 1 if broadcast_last else len(args)
            out = fn(*jax.tree.map(lambda x: x[0], args[:mapped]), *args[mapped:])
            return jax.tree.map(lambda x: x[None], out)

        def specs(count: int) -> tuple[PartitionSpec, ...]:
            last = count - 1 if broadcast_last else count
            return tuple(PartitionSpec(DEVICE_AXIS) if i < last else PartitionSpec() for i in range(count))

        def run(*args: Any) -> Any:
            mapped = jax.shard_map(
                per_device, mesh=mesh, in_specs=specs(len(args)), out_specs=PartitionSpec(DEVICE_AXIS), check_vma=False
            )
            return mapped(*args)

        compiled = jax.jit(run, donate_argnums=(0, 1), compiler_options=EXACT_COMPILER_OPTIONS)
        if jax.process_count() == 1:
            return compiled

        def across_processes(*args: Any) -> Any:  # this process's stacked arrays <-> global ones, as pmap does
            args = multihost_utils.host_local_array_to_global_array(args, mesh, specs(len(args)))
            return multihost_utils.global_array_to_host_local_array(compiled(*args), mesh, PartitionSpec(DEVICE_AXIS))

        return across_processes

    def constrain(self, batch: PyTree) -> PyTree:
        return batch

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return leaves

    def replicate(self, x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.device_put(np.broadcast_to(host, (self.devices, *host.shape)), self._stacked)

    def _per_device(self, x) -> np.ndarray:
        """This process's rows of a batch -> `[devices, per_device_batch, ...]`."""
        rows = np.asarray(x)
        return rows.reshape(self.devices, -1, *rows.shape[1:])

    def place(self, leaves: Leaves) -> Leaves:
        return [self.replicate(x) for x in leaves]

    def host(self, tree: Any) -> Any:
        return jax.tree.map(unreplicate, tree)

    def to_save(self, leaves: Leaves) -> Leaves:
        return [across_processes(x) for x in copy_leaves(self.gather(leaves))]

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return first_device()  # `place` replicates it

    def put_batch(self, batch: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jax.device_put(self._per_device(x), self._stacked), batch)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        rows = process_rows(indices, axis=1)  # [steps, process batch]
        per_device = rows.reshape(rows.shape[0], self.devices, -1).transpose(1, 0, 2)
        return jax.device_put(np.ascontiguousarray(per_device), self._stacked)

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: PyTree) -> dict[str, jax.ShapeDtypeStruct]:
        # One device's metrics, traced under vmap to bind the device axis.
        example = jax.tree.map(self._per_device, batch)
        mapped = jax.eval_shape(jax.vmap(fn, axis_name=DEVICE_AXIS), leaves, example)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), mapped)

    def check(self, state: Any, rows: int) -> None:
        check_device_count(self.devices)
        if jax.process_count() > 1 and self.devices != jax.local_device_count():
            raise DeviceError(
                f"--parallel pmap with several processes uses every local device: pass --devices "
                f"{jax.local_device_count()} (got {self.devices})"
            )
        check_split(rows, self.devices)
        check_micro_batches(self.micro_batches, rows, self.devices * jax.process_count())
        check_batch_norm_axis(state, self.batch_axis)
        if any(layer.mode == "ema" for layer in batch_norm_layers(state)):
            # jax.pmap is shard_map underneath (jax >= 0.8); there eqx.nn.State.set refuses the constant
            # BatchNorm(mode="ema") writes ("Old and new values have different structures").
            raise ConfigError(
                'eqx.nn.BatchNorm(mode="ema") cannot run under jax.pmap with this equinox; build it '
                'with mode="batch", or use --parallel sharded'
            )


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
        return one_device(micro_batches=micro_batches)
    return {"pmap": Pmap, "sharded": sharded, "fsdp": fsdp}[parallel](devices, micro_batches=micro_batches)
