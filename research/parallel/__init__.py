"""Data parallelism: one device, `jax.pmap`, `jax.jit` over a sharded mesh, several processes.

`fit(..., placement=make_placement("pmap", devices=4))` trains on 4 devices with the same numbers
as on one. Experiment scripts take `--devices N --parallel {auto,none,pmap,sharded,fsdp}` and, for
several processes, `--coordinator-address --num-processes --process-id` (or `scripts/launch`).
"""

from ..train import (
    DATA_AXIS,
    MEMBER_AXIS,
    LargestAxis,
    MeshPlacement,
    Placement,
    check_device_count,
    check_split,
    leading,
    local_copy,
    one_device,
    process_rows,
    replicated,
)
from ._devices import DeviceError, simulate_cpu_devices
from ._distributed import LOST_PEER_STATUS, ProcessGroup, exit_together, process_group, process_zero_text, setup_devices
from ._placements import DEVICE_AXIS, ParallelName, Pmap, batch_axis_name, fsdp, make_placement, sharded, unreplicate
from ._population import population_mesh, population_placement

__all__ = [
    "DATA_AXIS",
    "DEVICE_AXIS",
    "DeviceError",
    "LOST_PEER_STATUS",
    "MEMBER_AXIS",
    "LargestAxis",
    "MeshPlacement",
    "ParallelName",
    "Placement",
    "Pmap",
    "ProcessGroup",
    "batch_axis_name",
    "check_device_count",
    "check_split",
    "exit_together",
    "fsdp",
    "leading",
    "local_copy",
    "make_placement",
    "one_device",
    "population_mesh",
    "population_placement",
    "process_group",
    "process_zero_text",
    "process_rows",
    "replicated",
    "setup_devices",
    "sharded",
    "simulate_cpu_devices",
    "unreplicate",
]
