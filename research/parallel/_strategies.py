"""Data-parallel strategies: how `fit` spreads each global batch over devices and processes.

A strategy is a small frozen object; `fit(..., parallel=strategy)` asks it for the trainer of a
loss and a state structure. Everything around the trainer (logging, evaluation, checkpoints, resume)
is the same for every strategy, and so are the numbers: the global batch, the per-example keys and
the BatchNorm statistics do not depend on how the batch is split.
"""

import abc
import dataclasses
import threading
from typing import Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from ..train import CompiledTrainer, LossFn, TrainState, compiled_trainer
from ..train._compiled import static_key
from ._devices import DeviceError, check_device_count
from ._trainers import DATA_AXIS, DEVICE_AXIS, PmapTrainer, ShardedTrainer, check_batch_norm

ParallelName = Literal["auto", "none", "pmap", "sharded"]


def batch_axis_name(parallel: str) -> str | tuple[str, str]:
    """The `axis_name` a BatchNorm layer needs to reduce over the whole global batch: the vmap axis
    `"batch"`, and under pmap also the device axis (each device vmaps over its slice only)."""
    return (DEVICE_AXIS, "batch") if parallel == "pmap" else "batch"


@dataclasses.dataclass(frozen=True)
class Strategy(abc.ABC):
    """Base of the strategies. `devices` is the number of devices of each process."""

    devices: int = 1
    name = "base"

    @property
    def global_devices(self) -> int:
        return self.devices * jax.process_count()

    @property
    def batch_axis(self) -> str | tuple[str, str]:
        return batch_axis_name(self.name)

    def check_batch_size(self, batch_size: int) -> None:
        if batch_size % self.global_devices:
            raise DeviceError(
                f"--batch-size {batch_size} is not divisible by the {self.global_devices} devices "
                f"({self.devices} per process x {jax.process_count()} process(es)); pick a multiple of "
                f"{self.global_devices}"
            )

    @abc.abstractmethod
    def trainer(self, loss_fn: LossFn, state: TrainState, *, skip_nonfinite: bool = False) -> CompiledTrainer:
        """The compiled trainer of this strategy for `loss_fn` and `state`'s structure."""


class _SeveralDevices(Strategy):
    """Strategies whose trainers are built here, one per (strategy, loss, state structure)."""

    def trainer(self, loss_fn: LossFn, state: TrainState, *, skip_nonfinite: bool = False) -> CompiledTrainer:
        """The compiled trainer of this strategy for `loss_fn` and `state`'s structure (built once)."""
        check_device_count(self.devices)
        check_batch_norm(state.model, self.batch_axis, under_pmap=self.name == "pmap")
        dynamic, static = eqx.partition(state, eqx.is_array)
        treedef = jax.tree.structure(dynamic)
        key = (self, loss_fn, treedef, *static_key(static), skip_nonfinite)
        with _cache_lock:
            try:
                return _cache[key]
            except TypeError:  # an unhashable static field: compile privately
                return self._build(loss_fn, static, treedef, skip_nonfinite)
            except KeyError:
                trainer = _cache[key] = self._build(loss_fn, static, treedef, skip_nonfinite)
                return trainer

    @abc.abstractmethod
    def _build(self, loss_fn, static, treedef, skip_nonfinite: bool) -> CompiledTrainer:
        """A new trainer for this strategy."""


@dataclasses.dataclass(frozen=True)
class SingleDevice(Strategy):
    """One device, one process: `research.train`'s own fast path."""

    name = "none"

    def trainer(self, loss_fn: LossFn, state: TrainState, *, skip_nonfinite: bool = False) -> CompiledTrainer:
        check_batch_norm(state.model, self.batch_axis)
        return compiled_trainer(loss_fn, state, skip_nonfinite=skip_nonfinite)


@dataclasses.dataclass(frozen=True)
class Pmap(_SeveralDevices):
    """`jax.pmap` over `devices` devices per process; the state is replicated along a stacked axis."""

    name = "pmap"

    def _build(self, loss_fn, static, treedef, skip_nonfinite: bool) -> CompiledTrainer:
        if jax.process_count() > 1 and self.devices != jax.local_device_count():
            raise DeviceError(
                f"--parallel pmap with several processes uses every local device: pass --devices "
                f"{jax.local_device_count()} (got {self.devices})"
            )
        return PmapTrainer(loss_fn, static, treedef, self.devices, skip_nonfinite)


@dataclasses.dataclass(frozen=True)
class Sharded(_SeveralDevices):
    """`jax.jit` over a mesh of `devices` devices per process, the batch split along `"data"`."""

    name = "sharded"

    def mesh(self) -> Mesh:
        # Process by process, so that each process's rows of the batch are contiguous.
        devices = [d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[: self.devices]]
        return Mesh(np.array(devices), (DATA_AXIS,))

    def _build(self, loss_fn, static, treedef, skip_nonfinite: bool) -> CompiledTrainer:
        return ShardedTrainer(loss_fn, static, treedef, self.mesh(), skip_nonfinite)


def make_strategy(parallel: ParallelName, devices: int = 1) -> Strategy:
    """The strategy named on the command line. `auto` is `none` for one device in one process and
    `sharded` otherwise; `none` refuses more than one device or process."""
    processes = jax.process_count()
    if parallel == "auto":
        parallel = "none" if devices * processes == 1 else "sharded"
    if parallel == "none":
        if devices * processes != 1:
            raise DeviceError(
                f"--parallel none trains on one device, but --devices is {devices} with {processes} process(es); "
                "pass --parallel sharded or pmap"
            )
        return SingleDevice(1)
    return {"pmap": Pmap, "sharded": Sharded}[parallel](devices)


_cache: dict[tuple, CompiledTrainer] = {}
_cache_lock = threading.Lock()
