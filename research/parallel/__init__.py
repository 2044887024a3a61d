"""Data parallelism: one device, `jax.pmap`, `jax.jit` over a sharded mesh, several processes.

`fit(..., placement=make_placement("pmap", devices=4))` trains on 4 devices with the same numbers
as on one. Experiment scripts take `--devices N --parallel {auto,none,pmap,sharded}` and, for
several processes, `--coordinator-address --num-processes --process-id` (or `scripts/launch`).
"""

from ..train import OneDevice, Placement
from ._devices import DeviceError, check_device_count, simulate_cpu_devices
from ._distributed import LOST_PEER_STATUS, ProcessGroup, exit_together, process_group, process_zero_text, setup_devices
from ._placements import (
    DATA_AXIS,
    DEVICE_AXIS,
    Fsdp,
    ParallelName,
    Pmap,
    Sharded,
    batch_axis_name,
    check_split,
    local_copy,
    make_placement,
    process_rows,
    unreplicate,
)
from ._population import MEMBER_AXIS, PopulationMesh, population_placement

__all__ = [
    "DATA_AXIS",
    "DEVICE_AXIS",
    "DeviceError",
    "LOST_PEER_STATUS",
    "MEMBER_AXIS",
    "Fsdp",
    "OneDevice",
    "ParallelName",
    "Placement",
    "Pmap",
    "PopulationMesh",
    "ProcessGroup",
    "Sharded",
    "batch_axis_name",
    "check_device_count",
    "check_split",
    "exit_together",
    "local_copy",
    "make_placement",
    "population_placement",
    "process_group",
    "process_zero_text",
    "process_rows",
    "setup_devices",
    "simulate_cpu_devices",
    "unreplicate",
]
