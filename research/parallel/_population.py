"""A population (`research.population`: a leading member axis on every array of the train state) on
several devices of one process: `jax.jit` over a one-axis mesh (`research.parallel.MeshPlacement`) that
splits either the members or each batch's rows.

- `split="members"` (the devices divide the members): every array of the state, and each member's
  batches, are split along the member axis, so each device trains its own members whole. Nothing
  crosses devices but the step statistics, and each member computes what it computes on one device.
- `split="batch"`: the state is replicated and each batch split along its rows (data parallelism,
  XLA inserting the reductions), for a population whose members the devices do not divide, and for
  any population under `--deterministic-reduction` (each device then runs its micro-batches).

`population_placement` picks it for a population where `make_placement` would give `sharded`.
"""

from typing import Literal

import jax

from ..errors import ConfigError, DeviceError
from ._mesh import MeshPlacement, Placement, leading, replicated


def population_mesh(
    devices: int = 1,
    split: Literal["members", "batch"] = "members",
    member_batches: bool = False,
    *,
    micro_batches: int | None = None,
) -> MeshPlacement:
    """A population on a mesh of `devices` devices of this process, split along `split`;
    `member_batches`: each member takes its own batches (`DeviceLoader.for_members`: batches and
    step indices have a member axis before the rows)."""
    rule = leading if split == "members" else replicated
    return MeshPlacement("sharded", devices, rule, split, member_batches, micro_batches=micro_batches)


def population_placement(placement: Placement, *, members: int, rows: int, member_batches: bool) -> Placement:
    """Where a population of `members` members, taking batches of `rows` rows (each member its own with
    `member_batches`), trains instead of `placement` (`make_placement`'s): on a mesh of this process's
    devices (`sharded`'s), split over the members when the devices divide them, else over each batch's
    rows. One device, several processes, pmap and FSDP keep `placement`; a population with its own
    batches per member is refused under pmap and FSDP, which would split the member axis as rows."""
    if member_batches and placement.name in ("pmap", "fsdp"):
        raise ConfigError(
            f"--parallel {placement.name} cannot train a population whose members take their own batches; "
            "pass --parallel sharded (or auto), which splits the members or the batches over the devices"
        )
    if not isinstance(placement, MeshPlacement) or placement.name != "sharded" or jax.process_count() > 1:
        return placement
    devices = placement.devices
    if members % devices and rows % devices:
        raise DeviceError(
            f"a population of {members} members with batches of {rows} rows cannot be split over "
            f"{devices} devices: pick a number of devices that divides the members or the batch size"
        )
    # With --deterministic-reduction each batch's rows: the layout that gives a population the bits of one device
    # (split over its members, a device's share of them changes how XLA compiles the members' updates).
    split = "members" if members % devices == 0 and placement.micro_batches is None else "batch"
    return population_mesh(devices, split, member_batches, micro_batches=placement.micro_batches)
