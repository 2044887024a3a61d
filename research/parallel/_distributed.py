"""Several processes through JAX's own runtime (`jax.distributed`), with gloo collectives on the CPU.

Every process runs the same script with the same flags, plus its own `--process-id` (or the
environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, which is how
`scripts/launch` starts them). Started by `srun` as a job step of several tasks on a SLURM cluster
(`SLURM_STEP_NUM_TASKS` > 1), with none of those, the processes find each other through JAX's own
SLURM detection (`jax.distributed.initialize()`: the step's first node coordinates). Process 0 hosts
the coordination service. A process that dies stops
sending heartbeats; after `--distributed-timeout` seconds the service tells the others, which then
exit with an error instead of waiting forever in a collective.
"""

import contextlib
import dataclasses
import ipaddress
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..errors import ConfigError
from ._devices import deterministic_gpu_ops, simulate_cpu_devices
from ._mesh import check_device_count

logger = logging.getLogger(__name__)  # research.messages: what shows them, and where

# The exit status of a process that stops because another one died (EX_TEMPFAIL), so that a launcher
# can tell the cause of a failed run from its consequences.
LOST_PEER_STATUS = 75

ENVIRONMENT = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator_address: str
    num_processes: int
    process_id: int


def process_group(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> ProcessGroup | None:
    """The multi-process setup from the flags, else the environment; `None` for a single process."""
    given: dict[str, Any] = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    for name, variable in ENVIRONMENT.items():
        if given[name] is None and os.environ.get(variable):
            value = os.environ[variable]
            try:
                given[name] = value if name == "coordinator_address" else int(value)
            except ValueError:
                raise ConfigError(f"${variable} must be an integer (got {value!r})") from None
    if all(value is None for value in given.values()):
        return _slurm_step()
    if (given["num_processes"] or 1) == 1:
        return None
    missing = [f"--{name.replace('_', '-')} (or ${ENVIRONMENT[name]})" for name, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"a run of {given['num_processes']} processes needs " + " and ".join(missing))
    if not 0 <= given["process_id"] < given["num_processes"]:
        raise ConfigError(f"the process id must be in 0 .. {given['num_processes'] - 1} (got {given['process_id']})")
    if ":" not in given["coordinator_address"]:
        raise ConfigError(f"the coordinator address must be host:port (got {given['coordinator_address']!r})")
    return ProcessGroup(**given)


def _slurm_step() -> ProcessGroup | None:
    """The processes of a SLURM job step `srun` started with several tasks, to be found by JAX's SLURM
    detection (an empty coordinator address); `None` outside such a step (a batch script is one process)."""
    tasks, rank = os.environ.get("SLURM_STEP_NUM_TASKS"), os.environ.get("SLURM_PROCID")
    if not tasks or rank is None or not tasks.isdigit() or int(tasks) < 2:
        return None
    return ProcessGroup("", int(tasks), int(rank))


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_device_ids(group: ProcessGroup, devices_per_process: int) -> list[int] | None:
    """The accelerators a process of a local run (a loopback coordinator: `scripts/launch`, every process on
    this machine) takes: process i the i-th `devices_per_process` of them, so that they do not all take the
    same ones. `None` (JAX's default) for a run across machines, a SLURM step (JAX gives each task its own),
    or where `$JAX_LOCAL_DEVICE_IDS` or `$CUDA_VISIBLE_DEVICES` already says. A CPU run ignores it."""
    if not _is_loopback(group.coordinator_address) or any(
        os.environ.get(v) for v in ("JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES")
    ):
        return None
    first = group.process_id * devices_per_process
    return list(range(first, first + devices_per_process))


def join(group: ProcessGroup, timeout_seconds: int, devices_per_process: int = 1) -> None:
    """`jax.distributed.initialize` with gloo CPU collectives. With a loopback coordinator address
    (a local run) the coordination service and gloo's sockets listen on loopback only, and each process
    takes accelerators of its own (`local_device_ids`); by default the service listens on every
    interface and gloo on the address of the machine's host name."""
    loopback = _is_loopback(group.coordinator_address)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    found = (
        {}
        if not group.coordinator_address
        else {  # "": a SLURM step, which JAX finds by itself
            "coordinator_address": group.coordinator_address,
            "num_processes": group.num_processes,
            "process_id": group.process_id,
        }
    )
    jax.distributed.initialize(
        **found,
        local_device_ids=local_device_ids(group, devices_per_process),
        coordinator_bind_address=group.coordinator_address if loopback else None,
        initialization_timeout=timeout_seconds,
        heartbeat_timeout_seconds=timeout_seconds,
        shutdown_timeout_seconds=timeout_seconds,
    )
    if loopback:
        _gloo_on_loopback()


def _gloo_on_loopback() -> None:
    # JAX builds gloo without a host name (so gloo resolves the machine's) and no public option sets it:
    # register the CPU backend with gloo bound to 127.0.0.1 through JAX's internals. A JAX whose internals
    # moved gets its default gloo (enough wherever the host name resolves), with a warning.
    import functools

    from jax.extend.backend import register_backend_factory

    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname="127.0.0.1"
        )
        make_cpu_client = functools.partial(xla_bridge.make_cpu_client, collectives=collectives)
    except (ImportError, AttributeError, TypeError) as e:
        logger.warning(
            "gloo stays on the host name's address: JAX %s has no %s to bind it to 127.0.0.1", jax.__version__, e
        )
        return
    register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def setup_devices(devices: Any, batch_size: int | None = None) -> None:
    """Apply a config's device and process options (`devices`: its `research.config.Devices` group)
    before any JAX array exists: simulate `--devices` CPU devices, join the other processes, and refuse
    (`ConfigError`) a `batch_size` the global device count does not divide, or more devices than this
    process has."""
    group = process_group(devices.coordinator_address, devices.num_processes, devices.process_id)
    # --deterministic-reduction: the CPU client's threads by the micro-batches, not the devices (_devices.py)
    threads = 2 * devices.micro_batches if devices.deterministic_reduction else None
    if devices.deterministic_reduction:
        deterministic_gpu_ops()
    simulate_cpu_devices(devices.devices, threads)
    if group is not None:
        global_devices = devices.devices * group.num_processes
        if batch_size is not None and batch_size % global_devices:
            raise ConfigError(
                f"--batch-size {batch_size} is not divisible by the {global_devices} devices "
                f"({group.num_processes} processes x {devices.devices}); pick a multiple of {global_devices}"
            )
        if devices.parallel == "none":
            raise ConfigError("--parallel none trains in one process; pass --parallel sharded or pmap")
        join(group, devices.distributed_timeout, devices.devices)
        if group.process_id != 0:
            logger.info("process %s of %s: joined %s", group.process_id, group.num_processes, group.coordinator_address)
    check_device_count(devices.devices)


def process_zero_text(text: str) -> str:
    """Process 0's `text` on every process (a choice each process would make on its own, such as a
    run directory named after the time, must be one choice)."""
    if jax.process_count() == 1:
        return text
    data = np.frombuffer(text.encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))  # process 0's length
    mine = data if jax.process_index() == 0 else np.zeros(size, np.uint8)  # the others only give the shape
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine))).decode()


def _collective_failure(error: BaseException) -> str | None:
    """The cause of a failed cross-process collective (gloo's on CPUs, NCCL's on GPUs), or `None` for any other
    error."""
    text = str(error)
    if not isinstance(error, jax.errors.JaxRuntimeError) or not any(
        word in text for word in ("Gloo", "NCCL", "collective", "Collective")
    ):
        return None
    # Asynchronously dispatched steps nest "Error dispatching computation: " once per pending step.
    return text.rsplit("Error dispatching computation: ", 1)[-1].splitlines()[0]


@contextlib.contextmanager
def exit_together(prog: str) -> Iterator[None]:
    """In a multi-process run, turn any error into an immediate exit of this process.

    A normal exit waits in JAX's shutdown barrier for the other processes, which may be blocked in a
    collective waiting for this one; exiting at once closes this process's connections so that the
    others fail fast too (and a lost peer is reported in one line instead of a C++ abort).
    """
    try:
        yield
    except BaseException as error:
        if not jax.distributed.is_initialized():
            raise
        status = error.code if isinstance(error, SystemExit) else 1
        status = status if isinstance(status, int) else 1
        if status != 0:
            where = f"process {jax.process_index()} of {jax.process_count()}"
            cause = _collective_failure(error)
            if cause is not None:
                status = LOST_PEER_STATUS
                print(
                    f"{prog}: error: {where}: lost contact with another process, which probably died or was "
                    f"killed; see its output for the cause ({cause})",
                    file=sys.stderr,
                )
            elif not isinstance(error, SystemExit):
                traceback.print_exception(error)
                print(f"{prog}: error: {where} failed; stopping it without waiting for the others", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        raise
