"""Placements: where the train state, the batches and the step statistics live, and how one
compiled function runs over them. The trainer (`CompiledTrainer`) is the same for every placement;
it is given one, never subclassed.

`OneDevice` is here, the multi-device ones (`Pmap`, `Sharded`) in `research.parallel`. A placement
is a small frozen (hashable) object: trainers are cached per placement.
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..data import Batch
from ..errors import ConfigError

Leaves = list[jax.Array]


class Placement(abc.ABC):
    """Where a run's arrays live and how its compiled steps run.

    - `name`: what `--parallel` calls it (`none`, `pmap`, `sharded`, `fsdp`).
    - `micro_batches`: `None`, or the fixed number of micro-batches of a layout-invariant step
      (`--deterministic-reduction`, `_micro.py`): each device then runs the step on its own rows.
    - `per_device(step)`: `step(state, batch, axis_name)` as a function of `(state, batch)`, run as
      the placement runs a step: given the named device axis its batch is split over (`jax.pmap`, or
      a mesh under `micro_batches`), or `None` when it sees the whole global batch (one device, or
      `jax.jit` over a mesh, where XLA inserts the reductions).
    - `packs`: whether a small state may travel packed into one buffer (`_packing.py`).
    - `compile(fn, broadcast_last=...)`: `fn(leaves, stats, *inputs)` compiled with the leaves and
      statistics donated; `broadcast_last`: the last input is one host scalar for every device.
    - `constrain(batch)`: inside a traced step, the batch as the placement wants it laid out;
      `constrain_state(leaves)`: the same for the state's leaves a step returns (FSDP keeps them sharded).
    - `place(leaves)`: fresh copies of host leaves (or of restored arrays) on the devices (the steps
      donate their inputs); `gather(leaves)`: one host-usable copy of each placed leaf (with several
      processes every process calls it: it may gather across them).
    - `to_save(leaves)`: fresh copies of placed leaves as a checkpoint saves them: global arrays that
      every process hands to Orbax, one copy of a replicated value, a sharded value in its shards;
      `restore_sharding(shape)`: where an array of the state restored from a checkpoint goes.
    - `put_stats`, `put_batch`, `put_data`, `put_indices`, `put_count`: host values as the compiled
      functions take them (`put_batch`: this process's rows of a host batch, all of it with one process:
      a host loader reads only those); `host(tree)`: one copy of values the steps keep on every device.
    - `metric_shapes(fn, leaves, batch)`: the shapes of one device's `fn(leaves, batch)`, traced.
    - `check(model, rows)`: refuse, before any work, a model or a batch of `rows` rows that this
      placement cannot train correctly (BatchNorm statistics over the wrong axis, an uneven split).
    """

    name: str
    packs: Any
    micro_batches: int | None

    @abc.abstractmethod
    def per_device(self, step: Callable) -> Callable: ...

    @abc.abstractmethod
    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable: ...

    @abc.abstractmethod
    def constrain(self, batch: Batch) -> Batch: ...

    @abc.abstractmethod
    def constrain_state(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def place(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def gather(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def to_save(self, leaves: Leaves) -> Leaves: ...

    @abc.abstractmethod
    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding: ...

    @abc.abstractmethod
    def put_stats(self, stats: Any) -> Any: ...

    @abc.abstractmethod
    def put_batch(self, batch: Batch) -> Batch: ...

    @abc.abstractmethod
    def put_data(self, host: Batch, device: Batch) -> Batch: ...

    @abc.abstractmethod
    def put_indices(self, indices: np.ndarray) -> Any: ...

    @abc.abstractmethod
    def put_count(self, count: int) -> Any: ...

    @abc.abstractmethod
    def host(self, tree: Any) -> Any: ...

    @abc.abstractmethod
    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]: ...

    @abc.abstractmethod
    def check(self, model: eqx.Module, rows: int) -> None: ...


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


def batch_norm_layers(model: eqx.Module) -> list[eqx.nn.BatchNorm]:
    return [
        m
        for m in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, eqx.nn.BatchNorm))
        if isinstance(m, eqx.nn.BatchNorm)
    ]


def check_micro_batches(micro_batches: int | None, rows: int, devices: int) -> None:
    """Refuse micro-batches that `rows` rows or `devices` devices (in all processes) cannot share evenly."""
    if micro_batches is None:
        return
    if rows % micro_batches or micro_batches % devices:
        raise ConfigError(
            f"--deterministic-reduction splits the batch of {rows} rows into --micro-batches {micro_batches}, which "
            f"must divide the batch size and be a multiple of the {devices} device(s) it runs on"
        )


def check_batch_norm_axis(model: eqx.Module, axis_name: str | tuple[str, ...]) -> None:
    """Refuse a model whose BatchNorm layers would not reduce over the whole (global) batch."""
    for layer in batch_norm_layers(model):
        axis = tuple(layer.axis_name) if isinstance(layer.axis_name, (tuple, list)) else layer.axis_name
        if axis != axis_name:
            raise ConfigError(
                f"a BatchNorm layer reduces over axis {axis!r}, but this placement needs {axis_name!r} for its "
                "statistics to cover the whole batch; build the model with "
                "axis_name=research.parallel.batch_axis_name(parallel)"
            )


@dataclasses.dataclass(frozen=True)
class OneDevice(Placement):
    """One device, one process: everything on the default device, plain `jax.jit`."""

    devices: int = 1  # for symmetry with the multi-device placements' `devices`
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "none"
    packs = True
    batch_axis = "batch"

    def per_device(self, step: Callable) -> Callable:
        return lambda state, batch: step(state, batch, None)

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        return jax.jit(fn, donate_argnums=(0, 1))

    def constrain(self, batch: Batch) -> Batch:
        return batch

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return leaves

    def place(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)

    def gather(self, leaves: Leaves) -> Leaves:
        return leaves

    def to_save(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return first_device()

    def put_stats(self, stats: Any) -> Any:
        return stats

    def put_batch(self, batch: Batch) -> Batch:
        return batch

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return device

    def put_indices(self, indices: np.ndarray) -> np.ndarray:
        return indices

    def put_count(self, count: int) -> np.int32:
        return np.int32(count)

    def host(self, tree: Any) -> Any:
        return tree

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        return jax.eval_shape(fn, leaves, batch)

    def check(self, model: eqx.Module, rows: int) -> None:
        check_micro_batches(self.micro_batches, rows, 1)
        check_batch_norm_axis(model, self.batch_axis)
