"""Placements: where a run's arrays live and how its compiled steps run. One device (a mesh of one),
`jax.jit` over a sharded mesh (data parallelism, FSDP, a population's members), `jax.pmap`, and
several processes (`jax.distributed`).

`fit(..., placement=make_placement("pmap", devices=4))` trains on 4 devices with the same numbers
as on one. Experiment scripts take `--devices N --parallel {auto,none,pmap,sharded,fsdp}` and, for
several processes, `--coordinator-address --num-processes --process-id` (or `scripts/launch`).
"""

from ._devices import DeviceError, simulate_cpu_devices
from ._distributed import LOST_PEER_STATUS, ProcessGroup, exit_together, process_group, process_zero_text, setup_devices
from ._mesh import (
    DATA_AXIS,
    EXACT_COMPILER_OPTIONS,
    MEMBER_AXIS,
    LargestAxis,
    Leaves,
    MeshPlacement,
    Placement,
    batch_norm_layers,
    bytes_on_first_device,
    check_batch_norm_axis,
    check_device_count,
    check_micro_batches,
    check_split,
    copy_leaves,
    devices_of_every_process,
    first_device,
    leading,
    local_copy,
    one_device,
    process_rows,
    replicated,
)
from ._placements import DEVICE_AXIS, ParallelName, Pmap, batch_axis_name, fsdp, make_placement, sharded, unreplicate
from ._population import population_mesh, population_placement

__all__ = [
    "DATA_AXIS",
    "DEVICE_AXIS",
    "EXACT_COMPILER_OPTIONS",
    "LOST_PEER_STATUS",
    "MEMBER_AXIS",
    "DeviceError",
    "LargestAxis",
    "Leaves",
    "MeshPlacement",
    "ParallelName",
    "Placement",
    "Pmap",
    "ProcessGroup",
    "batch_axis_name",
    "batch_norm_layers",
    "bytes_on_first_device",
    "check_batch_norm_axis",
    "check_device_count",
    "check_micro_batches",
    "check_split",
    "copy_leaves",
    "devices_of_every_process",
    "exit_together",
    "first_device",
    "fsdp",
    "leading",
    "local_copy",
    "make_placement",
    "one_device",
    "population_mesh",
    "population_placement",
    "process_group",
    "process_rows",
    "process_zero_text",
    "replicated",
    "setup_devices",
    "sharded",
    "simulate_cpu_devices",
    "unreplicate",
]
