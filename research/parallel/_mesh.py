"""Placements: where the train state, the batches and the step statistics live, and how one
compiled function runs over them. The trainer (`CompiledTrainer`) is the same for every placement;
it is given one, never subclassed.

There are two. `MeshPlacement` (here) is `jax.jit` over a one-axis device mesh with a state rule
saying where each array of the state lives (`replicated`: data parallelism; `LargestAxis`: FSDP;
`leading`: a population's members) and a batch split along the rows (or a population's members);
one device is a mesh of one (`one_device()`). `Pmap` (`_placements.py`) is the one special case:
`jax.pmap`, whose arrays carry a stacked device axis. `make_placement` and `population_placement`
build the placements that `--parallel` names. A placement is a small frozen (hashable) object:
trainers are cached per placement.
"""

import abc
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ConfigError, DeviceError
from ..typing import PyTree

# What XLA must not choose per program for a micro-batched step to round the same way in every program:
# its CPU backend hands a dot to a YNNPACK fusion in some programs and to its own dot emitter in others (a
# one-device step and the same step on each of several devices), and the two add the products in different
# orders. Placements compile a step with micro-batches with these options (`jax.jit(compiler_options=...)`).
EXACT_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}

Leaves = list[jax.Array]
DATA_AXIS = "data"  # the mesh axis that splits the batch's rows (and FSDP's state)
MEMBER_AXIS = "members"  # the mesh axis that splits a population's members


class Placement(abc.ABC):
    """Where a run's arrays live and how its compiled steps run. What an implementation says:

    - `name`: what `--parallel` calls it (`none`, `pmap`, `sharded`, `fsdp`).
    - `micro_batches`: `None`, or the fixed number of micro-batches of a layout-invariant step
      (`--deterministic-reduction`, `_micro.py`): each device then runs the step on its own rows.
    - `on_one_device`: plain arrays on one device of one process, where host values go straight into
      the compiled calls, a small state may travel packed into one buffer (`packs`, `_packing.py`)
      and a step can be replayed op by op (`debug_nans`).
    - `per_device(step)`: `step(state, batch, axis_name)` as a function of `(state, batch)`, run as
      the placement runs a step: given the named device axis its batch is split over (`jax.pmap`, or
      a mesh under `micro_batches`), or `None` when it sees the whole global batch (one device, or
      `jax.jit` over a mesh, where XLA inserts the reductions).
    - `compile(fn, broadcast_last=...)`: `fn(leaves, stats, *inputs)` compiled with the leaves and
      statistics donated; `broadcast_last`: the last input is one host scalar for every device.
    - `constrain(batch)`: inside a traced step, the batch as the placement wants it laid out;
      `constrain_state(leaves)`: the same for the state's leaves a step returns (FSDP keeps them sharded).
    - `place(leaves)`: fresh copies of host leaves (or of restored arrays) on the devices (the steps
      donate their inputs); `host(tree)`: one host-usable copy of placed values (the state's leaves
      to evaluate, the statistics; with several processes every process calls it: it may gather).
    - `to_save(leaves)`: fresh copies of placed leaves as a checkpoint saves them: global arrays that
      every process hands to Orbax, one copy of a replicated value, a sharded value in its shards;
      `restore_sharding(shape)`: where an array of the state restored from a checkpoint goes.
    - `replicate(x)`: a host value that every device holds whole, as the compiled functions take it;
      `put_batch`, `put_indices`: a host batch (this process's rows of it: a host loader reads only
      those) and the step indices into device data, as the compiled functions take them.
    - `metric_shapes(fn, leaves, batch)`: the shapes of one device's `fn(leaves, batch)`, traced.
    - `check(state, rows)`: refuse, before any work, a train state (its models) or a batch of `rows` rows
      that this placement cannot train correctly (BatchNorm statistics over the wrong axis, an uneven split).

    From these: `gather`, `put_stats`, `put_data`, `put_count` and `packs`.
    """

    name: str
    micro_batches: int | None
    on_one_device: bool

    @abc.abstractmethod
    def per_device(self, step: Callable) -> Callable: ...

    @abc.abstractmethod
    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable: ...

    @abc.abstractmethod
    def constrain(self, batch: PyTree) -> PyTree: ...

    @abc.abstractmethod
    def constrain_state(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def place(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def host(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def to_save(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding: ...

    @abc.abstractmethod
    def replicate(self, x: Any) -> Any: ...

    @abc.abstractmethod
    def put_batch(self, batch: PyTree) -> PyTree: ...

    @abc.abstractmethod
    def put_indices(self, indices: np.ndarray) -> Any: ...

    @abc.abstractmethod
    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: PyTree) -> dict[str, jax.ShapeDtypeStruct]: ...

    @abc.abstractmethod
    def check(self, state: Any, rows: int) -> None: ...

    @property
    def packs(self) -> bool:
        """Whether a small state may travel packed into one buffer (`_packing.py`): on one device."""
        return self.on_one_device

    def gather(self, leaves: Leaves) -> Leaves:
        """One host-usable copy of each placed leaf, to evaluate or return."""
        return self.host(leaves)

    def put_stats(self, stats: Any) -> Any:
        """Step statistics (`StepStats`), which every device keeps whole (on one device as they are, with
        no tree map: fresh ones are taken at every logging stop)."""
        return stats if self.on_one_device else jax.tree.map(self.replicate, stats)

    def put_data(self, host: PyTree, device: PyTree) -> PyTree:
        """A dataset that every device holds whole: on one device its device copy as it is (no second
        copy), else copies of `host`."""
        return device if self.on_one_device else jax.tree.map(self.replicate, host)

    def put_count(self, count: int) -> np.int32:
        """How many steps a `run` call takes: a host scalar, which the compiled call puts on its devices."""
        return np.int32(count)


def bytes_on_first_device(leaves: Leaves) -> int:
    """The bytes of `leaves` held by this process's first device (a replica, or its shards)."""
    device = jax.local_devices()[0]
    return sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards if shard.device == device)


@jax.jit
def copy_leaves(leaves: Leaves) -> Leaves:
    return [x.copy() for x in leaves]


def first_device() -> jax.sharding.SingleDeviceSharding:
    """This process's first device, where a state restored for one device (or for replicas) goes."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def local_copy(x: jax.Array) -> jax.Array:
    """This process's first copy of an array replicated over a mesh (a single-device array that a
    checkpoint or an evaluation can use even when the mesh spans other processes)."""
    return x.addressable_data(0)


def process_rows(array: np.ndarray, axis: int = 0) -> np.ndarray:
    """This process's contiguous share of `array` along `axis` (all of it with one process)."""
    count, index = jax.process_count(), jax.process_index()
    size = array.shape[axis] // count
    return np.take(array, np.arange(index * size, (index + 1) * size), axis=axis)


def batch_norm_layers(model: Any) -> list[eqx.nn.BatchNorm]:
    return [
        m
        for m in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, eqx.nn.BatchNorm))
        if isinstance(m, eqx.nn.BatchNorm)
    ]


def check_device_count(devices_per_process: int) -> None:
    """Refuse a run that asks for more devices per process than this process has."""
    available = jax.local_device_count()
    if devices_per_process > available:
        where = f"process {jax.process_index()}" if jax.process_count() > 1 else "this machine"
        raise DeviceError(
            f"--devices {devices_per_process}: only {available} {jax.default_backend()} device(s) on {where}; "
            f"pass --devices {available} or fewer"
        )


def check_split(rows: int, devices: int) -> None:
    """Refuse a global batch of `rows` rows that `devices` devices per process cannot share evenly."""
    total = devices * jax.process_count()
    if rows % total:
        raise DeviceError(
            f"a training batch of {rows} rows cannot be split evenly over {total} devices ({devices} per process x "
            f"{jax.process_count()} process(es)); pick a batch size that is a multiple of {total}"
        )


def check_micro_batches(micro_batches: int | None, rows: int, devices: int) -> None:
    """Refuse micro-batches that `rows` rows or `devices` devices (in all processes) cannot share evenly."""
    if micro_batches is None:
        return
    if rows % micro_batches or micro_batches % devices:
        raise ConfigError(
            f"--deterministic-reduction splits the batch of {rows} rows into --micro-batches {micro_batches}, which "
            f"must divide the batch size and be a multiple of the {devices} device(s) it runs on"
        )


def check_batch_norm_axis(model: Any, axis_name: str | tuple[str, ...]) -> None:
    """Refuse a model whose BatchNorm layers would not reduce over the whole (global) batch."""
    for layer in batch_norm_layers(model):
        axis = tuple(layer.axis_name) if isinstance(layer.axis_name, (tuple, list)) else layer.axis_name
        if axis != axis_name:
            raise ConfigError(
                f"a BatchNorm layer reduces over axis {axis!r}, but this placement needs {axis_name!r} for its "
                "statistics to cover the whole batch; build the model with "
                "axis_name=research.parallel.batch_axis_name(parallel)"
            )


# -- state rules: where one array of the state lives on a one-axis mesh ---------------------------
StateRule = Callable[[tuple[int, ...], str, int], PartitionSpec]  # (shape, mesh axis, devices) -> spec


def replicated(shape: tuple[int, ...], axis: str, devices: int) -> PartitionSpec:
    """Whole on every device (data parallelism)."""
    return PartitionSpec()


def leading(shape: tuple[int, ...], axis: str, devices: int) -> PartitionSpec:
    """Split along the leading axis (a population's members, which the devices divide)."""
    return PartitionSpec(axis)


@dataclasses.dataclass(frozen=True)
class LargestAxis:
    """FSDP (big_vision's rule): an array of at least `min_size` elements split along its largest axis
    that the devices divide; smaller arrays (and those no axis of which they divide) replicated."""

    min_size: int = 1024

    def __call__(self, shape: tuple[int, ...], axis: str, devices: int) -> PartitionSpec:
        divisible = [a for a, size in enumerate(shape) if size % devices == 0 and size >= devices]
        if math.prod(shape) < self.min_size or not divisible:
            return PartitionSpec()
        largest = max(divisible, key=lambda a: shape[a])
        return PartitionSpec(*(axis if a == largest else None for a in range(len(shape))))


def devices_of_every_process(devices: int) -> np.ndarray:
    """The first `devices` local devices of each process, process by process (each process's rows of a batch
    are then contiguous): a mesh's device array."""
    return np.array([d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[:devices]])


@dataclasses.dataclass(frozen=True)
class MeshPlacement(Placement):
    """`jax.jit` over a one-axis mesh of `devices` devices per process (process by process, so that each
    process's rows of a batch are contiguous). `state_rule` says where each array of the state lives;
    `split` what each batch is split along: its rows (`"batch"`, over `DATA_AXIS`), or a population's
    members (`"members"`, over `MEMBER_AXIS`, each device training its members whole); with
    `member_batches` a batch has a member axis before its rows (`DeviceLoader.for_members`).

    On one device of one process (`on_one_device`) there is nothing to lay out: plain `jax.jit`, host
    batches and indices fed straight into the compiled calls, and arrays on that device as they are.
    """

    name: str = "none"
    devices: int = 1
    state_rule: StateRule = replicated
    split: Literal["batch", "members"] = "batch"
    member_batches: bool = False
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)

    @functools.cached_property
    def on_one_device(self) -> bool:  # (read on every call: cached)
        return self.devices * jax.process_count() == 1

    @property
    def axis(self) -> str:
        return MEMBER_AXIS if self.split == "members" else DATA_AXIS

    @functools.cached_property
    def mesh(self) -> Mesh:
        return Mesh(devices_of_every_process(self.devices), (self.axis,))

    @property
    def batch_spec(self) -> tuple[str | None, ...]:
        """How a batch's leading axes (`[members,] rows`) split over the mesh."""
        if self.split == "members":
            return (MEMBER_AXIS,) if self.member_batches else ()
        return (None, DATA_AXIS) if self.member_batches else (DATA_AXIS,)

    def leaf_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        """Where one array of the state lives, by the state rule."""
        return self.state_rule(shape, self.axis, self.mesh.size)

    def _sharding(self, *spec: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def per_device(self, step: Callable) -> Callable:
        # Without micro-batches the step sees the global batch and XLA inserts the reductions. Split over
        # a population's members, or on one device, each member's step (micro-batched or not) runs whole.
        if self.micro_batches is None or self.split == "members" or self.on_one_device:
            return lambda state, batch: step(state, batch, None)
        return self._on_each_device(step)

    def _on_each_device(self, step: Callable) -> Callable:
        """`step` run by every device on its own rows (`jax.shard_map`), the state whole on each (an FSDP
        state gathered for the step; it stays sharded between steps), doing its own fixed-order
        reductions over the data axis."""

        def run(state: Any, batch: PyTree) -> tuple[Any, Any]:
            dynamic, static = eqx.partition(state, eqx.is_array)
            new_static = []  # the non-array part of the new state, seen while tracing `local`

            def local(dynamic: Any, batch: PyTree) -> tuple[Any, Any]:
                new, metrics = step(eqx.combine(dynamic, static), batch, DATA_AXIS)
                new_dynamic, static_part = eqx.partition(new, eqx.is_array)
                new_static.append(static_part)
                return new_dynamic, metrics

            # (No varying-axis check: the outputs are the same on every device because every device
            # computes them from the same gathered values, which the check cannot see.)
            specs = (PartitionSpec(), PartitionSpec(DATA_AXIS))
            mapped = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)
            new_dynamic, metrics = mapped(dynamic, batch)
            return eqx.combine(new_dynamic, new_static[-1]), metrics

        return run

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        options = EXACT_COMPILER_OPTIONS if self.micro_batches is not None else None
        if self.on_one_device:
            return jax.jit(fn, donate_argnums=(0, 1), compiler_options=options)

        def laid_out(leaves: Leaves, stats: Any, *inputs: Any) -> tuple[Leaves, Any]:
            leaves, stats = fn(leaves, stats, *inputs)
            return self.constrain_state(leaves), jax.lax.with_sharding_constraint(stats, self._sharding())

        return jax.jit(laid_out, donate_argnums=(0, 1), compiler_options=options)

    def constrain(self, batch: PyTree) -> PyTree:
        if self.on_one_device:
            return batch
        return jax.lax.with_sharding_constraint(batch, self._sharding(*self.batch_spec))

    def constrain_state(self, leaves: Leaves) -> Leaves:
        if self.on_one_device:
            return leaves
        return [jax.lax.with_sharding_constraint(x, self._sharding(*self.leaf_spec(x.shape))) for x in leaves]

    def place(self, leaves: Leaves) -> Leaves:
        if self.on_one_device:
            return copy_leaves(leaves)

        def put(x: Any) -> jax.Array:
            sharding = self._sharding(*self.leaf_spec(np.shape(x)))
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # restored in shards across processes
                return copy_leaves([jax.device_put(x, sharding)])[0]
            host = np.asarray(x)  # every process holds the whole state; each places its devices' parts
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return [put(x) for x in leaves]

    @functools.cached_property
    def _all_gather(self) -> Callable[[Leaves], Leaves]:
        return jax.jit(lambda leaves: [x.copy() for x in leaves], out_shardings=self._sharding())

    def host(self, tree: Any) -> Any:
        if self.on_one_device:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        if not all(x.is_fully_replicated for x in leaves):  # split over the mesh: an all-gather (every process)
            leaves = self._all_gather(leaves)
        return jax.tree.unflatten(treedef, [local_copy(x) for x in leaves])

    def to_save(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)  # where they are: Orbax writes a replicated value once, a split one in its parts

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        spec = self.leaf_spec(shape)
        if self.on_one_device or not any(spec):
            return first_device()  # `place` copies it out
        return self._sharding(*spec)  # each device reads its own part

    def replicate(self, x: Any) -> Any:
        if self.on_one_device:
            return x  # the compiled call takes it
        return jax.make_array_from_process_local_data(self._sharding(), np.asarray(x))

    def put_batch(self, batch: PyTree) -> PyTree:
        if self.on_one_device:
            return batch  # the compiled call takes host arrays: no transfer of our own
        sharding = self._sharding(*self.batch_spec)
        return jax.tree.map(lambda rows: jax.make_array_from_process_local_data(sharding, np.asarray(rows)), batch)

    def put_indices(self, indices: np.ndarray) -> Any:
        if self.on_one_device:
            return indices
        spec = (None, *self.batch_spec)  # [steps, (members,) rows]
        local = process_rows(indices, spec.index(self.axis)) if self.axis in spec else indices
        return jax.make_array_from_process_local_data(self._sharding(*spec), local, indices.shape)

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: PyTree) -> dict[str, jax.ShapeDtypeStruct]:
        return jax.eval_shape(fn, leaves, batch)

    def check(self, state: Any, rows: int) -> None:
        check_device_count(self.devices)
        splits_rows = self.split == "batch"
        if splits_rows:
            check_split(rows, self.devices)
        check_micro_batches(self.micro_batches, rows, self.devices * jax.process_count() if splits_rows else 1)
        check_batch_norm_axis(state, "batch")


def one_device(*, micro_batches: int | None = None) -> MeshPlacement:
    """One device, one process (`--parallel none`): a mesh of one, where nothing is laid out."""
    return MeshPlacement("none", 1, micro_batches=micro_batches)
