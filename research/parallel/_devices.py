"""How many devices a run has, and simulating several on the CPU.

XLA creates the CPU devices when JAX initialises its backends (the first array, computation or
device query), not when `jax` is imported: `--xla_force_host_platform_device_count` in `XLA_FLAGS`
and `jax_num_cpu_devices` only need to be set before that. Experiment scripts do it in
`research.cli.main_entry`, right after parsing the command line and before `main` builds any array.
"""

import os
import re

import jax

from ..errors import DeviceError

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def backends_started() -> bool:
    from jax._src import xla_bridge  # no public equivalent; the check is only a guard

    return xla_bridge.backends_are_initialized()


def simulate_cpu_devices(count: int) -> None:
    """Give the CPU backend `count` devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`).

    Must run before JAX's backends start; raises `DeviceError` otherwise (unless the CPU already has
    `count` devices). Accelerator backends are unaffected: there `--devices N` takes the first N.
    """
    if backends_started():
        if jax.local_device_count() < count and jax.default_backend() == "cpu":
            raise DeviceError(
                f"--devices {count}: JAX already started with {jax.local_device_count()} CPU device(s), so no "
                "more can be simulated; pass --devices on the command line of an experiment script (it is "
                "applied before any array exists), or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{count} before starting Python"
            )
        return
    flags = _COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    jax.config.update("jax_num_cpu_devices", count)


def check_device_count(devices_per_process: int) -> None:
    """Refuse a run that asks for more devices per process than this process has."""
    available = jax.local_device_count()
    if devices_per_process > available:
        where = f"process {jax.process_index()}" if jax.process_count() > 1 else "this machine"
        raise DeviceError(
            f"--devices {devices_per_process}: only {available} {jax.default_backend()} device(s) on {where}; "
            f"pass --devices {available} or fewer"
        )
