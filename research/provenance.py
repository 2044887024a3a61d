"""What a run records about itself besides its config (big_vision's and Levanter's run records): the
model's parameter count, the machine, the library versions, the git commit of the code, the peak
memory and the compile time of the first step.
"""

import dataclasses
import importlib.metadata
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

VERSIONED = ("research", "jax", "jaxlib", "equinox", "optax", "jaxtyping", "numpy", "torch", "orbax-checkpoint", "tyro")

# The phases of one compilation, as JAX reports them (`jax.monitoring`): tracing to a jaxpr, lowering to
# MLIR, and XLA's compilation (or a load from the persistent compilation cache).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def parameter_counts(model: Any, members: int | None = None) -> dict[str, Any]:
    """`{"total": n, "by_field": {field: n, ...}}`: the elements of the model's floating-point arrays, in
    all and under each top-level field of the module (fields without any left out); `members`: the
    model is a population's, its arrays stacked on a leading axis, and the counts are one member's."""

    def count(tree: Any) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)))

    per = members or 1
    fields = dataclasses.fields(model) if dataclasses.is_dataclass(model) else ()
    by_field = {f.name: count(getattr(model, f.name)) // per for f in fields}
    return {"total": count(model) // per, "by_field": {k: n for k, n in by_field.items() if n}}


def describe_parameters(counts: dict[str, Any]) -> str:
    """`5,210 parameters (layers 5,210)` from `parameter_counts`."""
    parts = ", ".join(f"{name} {n:,}" for name, n in counts["by_field"].items())
    return f"{counts['total']:,} parameters" + (f" ({parts})" if parts else "")


def git_state(source: Path | None = None) -> dict[str, Any] | str:
    """`{"commit": sha, "dirty": bool}` of the git checkout holding the `research` package (dirty: a
    tracked file differs from the commit), or "not a git checkout" (an installed package)."""
    package = source or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        result = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=30)
        if result.returncode:
            raise OSError(result.stderr.strip())
        return result.stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if (top / package.name).resolve() != package:  # a package installed into a venv inside some repository
            return "not a git checkout"
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"


def versions() -> dict[str, str]:
    """The versions of the libraries a run's numbers depend on, and Python's."""
    found = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def machine(devices_used: int) -> dict[str, Any]:
    """The host, the kind of device, how many this run uses of how many there are, and the processes."""
    device = jax.devices()[0]
    return {
        "host": socket.gethostname(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": devices_used,
        "devices_available": jax.device_count(),
        "processes": jax.process_count(),
    }


def peak_memory() -> dict[str, int]:
    """`peak_host_memory_bytes` (this process's peak resident memory) and, where the backend reports it
    (GPUs and TPUs; not the CPU), `peak_device_memory_bytes`: the most any local device held at once."""
    found = {"peak_host_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    if any(p is not None for p in peaks):
        found["peak_device_memory_bytes"] = max(p for p in peaks if p is not None)
    return found


class CompileTimer:
    """Seconds JAX spends compiling (tracing, lowering, XLA or a cache load) from `start()` until
    `freeze()`; `seconds` is the total. Used as a context manager, it stops listening on exit."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._listening = False

    def _listen(self, event: str, duration_secs: float, **_: Any) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration_secs

    def start(self) -> "CompileTimer":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        self._listening = True
        return self

    def freeze(self) -> float:
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._listen)
            self._listening = False
        return self.seconds

    def __enter__(self) -> "CompileTimer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.freeze()
