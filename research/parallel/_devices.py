"""How many devices a run has, and simulating several on the CPU.

XLA creates the CPU devices when JAX initialises its backends (the first array, computation or
device query), not when `jax` is imported: `--xla_force_host_platform_device_count` in `XLA_FLAGS`
and `jax_num_cpu_devices` only need to be set before that. Experiment scripts do it in
`research.cli.main_entry`, right after parsing the command line and before `main` builds any array.

Several CPU devices also need enough client threads. XLA's CPU client launches each device's share of
a multi-device call on a worker of a pool of `max(cores, devices)` threads, and a launch blocks in that
worker while its device already has 32 computations queued (`max_inflight_computations_per_device`).
A one-step-per-call loop (host batches, `steps_per_call=1`) dispatches faster than 4 simulated devices
on 2 cores compute, so it gets 32 steps ahead; the blocked launches then hold the threads the devices
of the next all-reduce need, and it waits forever ("Expected 4 threads to join the rendezvous, but only
3 of them arrived", SIGABRT after 60 s). With `2 * devices` threads the devices of one collective
always find a thread besides the at most `devices` blocked launches of the one call being dispatched.
XLA sizes the pool from `PJRT_NPROC` (else `NPROC`, else the cores) when the backend starts.

The pool's size also decides how XLA splits some dots over threads (a long contraction into a small
output: grokking's full-batch weight gradients), and so the order of their sums. `--deterministic-reduction`
therefore sizes it from the run's micro-batches, `2 * micro_batches` threads whatever the device count
(which divides the micro-batches), so that 1, 2, 4 and 8 devices in separate processes round alike.
"""

import os
import re

import jax

from ..errors import DeviceError

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _client_threads() -> int:
    """The size XLA's CPU client gives its thread pool (before it is raised to the device count)."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def backends_started() -> bool:
    """Whether JAX's backends exist yet. JAX has no public query; its public `jax_num_cpu_devices` option
    refuses a new value once they do, so the probe sets it to another value and back."""
    count = jax.config.jax_num_cpu_devices  # pyright: ignore[reportAttributeAccessIssue]
    try:
        jax.config.update("jax_num_cpu_devices", count + 1 if count > 0 else 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", count)
    return False


def deterministic_gpu_ops() -> None:
    """Ask XLA:GPU for reductions in a fixed order (`--xla_gpu_deterministic_ops` in `XLA_FLAGS`): scatter-adds
    such as an embedding's gradient without atomics, and cuDNN convolution algorithms that give the same
    bits every run. The CPU's reductions already are; there the flag changes nothing. Before the backends
    start, like `simulate_cpu_devices`."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_deterministic_ops" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()


def simulate_cpu_devices(count: int, threads: int | None = None) -> None:
    """Give the CPU backend `count` devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`).

    Must run before JAX's backends start; raises `DeviceError` otherwise (unless the CPU already has
    `count` devices). Accelerator backends are unaffected: there `--devices N` takes the first N.
    With several devices it also raises `PJRT_NPROC` to at least `2 * count`, the client threads a
    one-step-per-call loop needs not to deadlock in a collective (see the module docstring).
    `threads`: the client's threads whatever `count` (at least `2 * count`), unless `PJRT_NPROC` is set.
    """
    if backends_started():
        if jax.local_device_count() < count and jax.default_backend() == "cpu":
            raise DeviceError(
                f"--devices {count}: JAX already started with {jax.local_device_count()} CPU device(s), so no "
                "more can be simulated; pass --devices on the command line of an experiment script, or to "
                "research.train_experiment as the first thing a fresh Python (a restarted kernel) does (both "
                "apply it before any array exists), or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{count} before starting Python"
            )
        return
    flags = _COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    if threads is not None and not os.environ.get("PJRT_NPROC", "").strip():
        os.environ["PJRT_NPROC"] = str(max(threads, 2 * count))
    elif count > 1 and _client_threads() < 2 * count:
        os.environ["PJRT_NPROC"] = str(2 * count)
    jax.config.update("jax_num_cpu_devices", count)
