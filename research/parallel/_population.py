"""A population (`research.population`: a leading member axis on every array of the train state) on
several devices of one process: `jax.jit` over a one-axis mesh that splits either the members or
each batch's rows.

- `split="members"` (the devices divide the members): every array of the state, and each member's
  batches, are split along the member axis, so each device trains its own members whole. Nothing
  crosses devices but the step statistics, and each member computes what it computes on one device.
- `split="batch"`: the state is replicated and each batch split along its rows (data parallelism,
  XLA inserting the reductions), for a population whose members the devices do not divide.

`population_placement` picks it for a population where `make_placement` would give `Sharded`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..data import Batch
from ..errors import ConfigError, DeviceError
from ..train import Leaves, Placement, check_batch_norm_axis, check_micro_batches, copy_leaves, first_device
from ._devices import check_device_count
from ._placements import DATA_AXIS, Fsdp, Pmap, Sharded, check_split, local_copy

MEMBER_AXIS = "members"  # the mesh axis that splits a population's members


@dataclasses.dataclass(frozen=True)
class PopulationMesh(Placement):
    """`jax.jit` over `devices` devices of this process for a population, split along `split`;
    `member_batches`: each member takes its own batches (`DeviceLoader.for_members`: batches and
    step indices have a member axis before the rows)."""

    devices: int = 1
    split: Literal["members", "batch"] = "members"
    member_batches: bool = False
    micro_batches: int | None = dataclasses.field(default=None, kw_only=True)
    name = "sharded"
    packs = False
    batch_axis = "batch"

    def per_device(self, step: Callable) -> Callable:
        # Split over the members, each member's step (micro-batched or not) runs whole on one device;
        # split over the rows, XLA inserts the reductions (`population_placement` refuses micro-batches there).
        return lambda state, batch: step(state, batch, None)

    @functools.cached_property
    def _axis(self) -> str:
        return MEMBER_AXIS if self.split == "members" else DATA_AXIS

    @functools.cached_property
    def _mesh(self) -> Mesh:
        return Mesh(np.array(jax.local_devices()[: self.devices]), (self._axis,))

    def _sharding(self, *spec: str | None) -> NamedSharding:
        return NamedSharding(self._mesh, PartitionSpec(*spec))

    @functools.cached_property
    def _state(self) -> NamedSharding:
        return self._sharding(self._axis) if self.split == "members" else self._sharding()

    @functools.cached_property
    def _batch_spec(self) -> tuple[str | None, ...]:
        """The partition of a batch's leading axes: `(members, rows)` with member batches, else `(rows,)`."""
        if self.split == "members":
            return (self._axis,) if self.member_batches else ()
        return (None, self._axis) if self.member_batches else (self._axis,)

    @functools.cached_property
    def _replicated(self) -> NamedSharding:
        return self._sharding()

    def compile(self, fn: Callable, *, broadcast_last: bool = False) -> Callable:
        return jax.jit(fn, donate_argnums=(0, 1), out_shardings=(self._state, self._replicated))

    def constrain(self, batch: Batch) -> Batch:
        return jax.lax.with_sharding_constraint(batch, self._sharding(*self._batch_spec))

    def constrain_state(self, leaves: Leaves) -> Leaves:
        return [jax.lax.with_sharding_constraint(x, self._state) for x in leaves]

    def _put(self, x: Any, sharding: NamedSharding) -> jax.Array:
        return jax.device_put(np.asarray(x), sharding)  # through the host: a fresh copy the steps may donate

    def place(self, leaves: Leaves) -> Leaves:
        return [self._put(x, self._state) for x in leaves]

    def gather(self, leaves: Leaves) -> Leaves:
        return [jax.device_put(x, first_device()) for x in leaves]  # whole, on one device, to evaluate

    def to_save(self, leaves: Leaves) -> Leaves:
        return copy_leaves(leaves)  # split over the members: Orbax writes each device's shard

    def restore_sharding(self, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return first_device()  # `place` splits it

    def put_stats(self, stats: Any) -> Any:
        return jax.tree.map(lambda x: self._put(x, self._replicated), stats)

    def put_batch(self, batch: Batch) -> Batch:
        return jax.tree.map(lambda x: self._put(x, self._sharding(*self._batch_spec)), batch)

    def put_data(self, host: Batch, device: Batch) -> Batch:
        return jax.tree.map(lambda x: self._put(x, self._replicated), host)

    def put_indices(self, indices: np.ndarray) -> jax.Array:
        return self._put(indices, self._sharding(None, *self._batch_spec))  # [steps, (members,) rows]

    def put_count(self, count: int) -> jax.Array:
        return self._put(np.int32(count), self._replicated)

    def host(self, tree: Any) -> Any:
        return jax.tree.map(local_copy, tree)

    def metric_shapes(self, fn: Callable, leaves: Leaves, batch: Batch) -> dict[str, jax.ShapeDtypeStruct]:
        return jax.eval_shape(fn, leaves, batch)

    def check(self, model: eqx.Module, rows: int) -> None:
        check_device_count(self.devices)
        if self.split == "batch":
            check_split(rows, self.devices)
        check_micro_batches(self.micro_batches, rows, 1)  # each member's batch on one device
        check_batch_norm_axis(model, self.batch_axis)


def population_placement(placement: Placement, *, members: int, rows: int, member_batches: bool) -> Placement:
    """Where a population of `members` members, taking batches of `rows` rows (each member its own with
    `member_batches`), trains instead of `placement` (`make_placement`'s): on a mesh of this process's
    devices (`Sharded`'s), split over the members when the devices divide them, else over each batch's
    rows. One device, several processes, pmap and FSDP keep `placement`; a population with its own
    batches per member is refused under pmap and FSDP, which would split the member axis as rows."""
    if member_batches and isinstance(placement, (Pmap, Fsdp)):
        raise ConfigError(
            f"--parallel {placement.name} cannot train a population whose members take their own batches; "
            "pass --parallel sharded (or auto), which splits the members or the batches over the devices"
        )
    if not isinstance(placement, Sharded) or jax.process_count() > 1:
        return placement
    if members % placement.devices and rows % placement.devices:
        raise DeviceError(
            f"a population of {members} members with batches of {rows} rows cannot be split over "
            f"{placement.devices} devices: pick a number of devices that divides the members or the batch size"
        )
    split = "members" if members % placement.devices == 0 else "batch"
    if split == "batch" and placement.micro_batches is not None:
        raise ConfigError(
            f"--deterministic-reduction trains a population on several devices by splitting its {members} members "
            f"over them: pick a number of devices that divides {members}"
        )
    return PopulationMesh(placement.devices, split, member_batches, micro_batches=placement.micro_batches)
