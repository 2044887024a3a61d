"""Data parallelism: one device, `jax.pmap`, `jax.jit` over a sharded mesh, several processes.

`fit(..., parallel=make_strategy("pmap", devices=4))` trains on 4 devices with the same numbers as
on one. Experiment scripts take `--devices N --parallel {auto,none,pmap,sharded}` and, for several
processes, `--coordinator-address --num-processes --process-id` (or `scripts/launch`).
"""

from ._devices import DeviceError, check_device_count, simulate_cpu_devices
from ._distributed import ProcessGroup, exit_together, process_group, setup_devices
from ._strategies import (
    ParallelName,
    Pmap,
    Sharded,
    SingleDevice,
    Strategy,
    batch_axis_name,
    make_strategy,
)
from ._trainers import DATA_AXIS, DEVICE_AXIS, PmapTrainer, ShardedTrainer, local_copy, process_rows, unreplicate

__all__ = [
    "DATA_AXIS",
    "DEVICE_AXIS",
    "DeviceError",
    "ParallelName",
    "ProcessGroup",
    "Pmap",
    "PmapTrainer",
    "Sharded",
    "ShardedTrainer",
    "SingleDevice",
    "Strategy",
    "batch_axis_name",
    "check_device_count",
    "exit_together",
    "local_copy",
    "make_strategy",
    "process_group",
    "process_rows",
    "setup_devices",
    "simulate_cpu_devices",
    "unreplicate",
]
