"""The fast path: partition the TrainState once, jit over its flat list of array leaves, donate them.

`eqx.filter_jit` flattens and hashes the whole model on every call (hundreds of microseconds on a
small model). Here the split into arrays and static structure happens once; each call then passes
a plain list of arrays to a `jax.jit` function, which costs what hand-written JAX costs.
"""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import Batch
from ..state import RunningMean
from ._state import LossFn, Metrics, TrainState, train_step

Leaves = list[jax.Array]


class CompiledTrainer:
    """Compiled train steps for one TrainState structure and one loss function.

    Build it with `compiled_trainer(loss_fn, state)` (cached: the same structure reuses the same
    compiled code). The train loop works on `leaves = trainer.leaves(state)` and turns them back
    into a `TrainState` with `trainer.state(leaves)` only to evaluate or save. Leaves passed to
    `step`/`run` are donated: do not use them (or a state built from them) afterwards.

    `num_traces` counts how many times each function was traced, to catch silent recompilation.
    """

    def __init__(self, loss_fn: LossFn, static: TrainState, treedef: jax.tree_util.PyTreeDef):
        self.loss_fn = loss_fn
        self._static = static
        self._treedef = treedef
        self.num_traces = {"step": 0, "run": 0}
        self._metric_shapes: dict[str, Metrics] = {}
        self._step = jax.jit(self._step_impl, donate_argnums=(0, 1))
        self._run = jax.jit(self._run_impl, donate_argnums=(0, 1))

    # -- conversions -------------------------------------------------------------------------
    def leaves(self, state: TrainState) -> Leaves:
        dynamic, _ = eqx.partition(state, eqx.is_array)
        leaves, treedef = jax.tree.flatten(dynamic)
        if treedef != self._treedef:
            raise ValueError(
                "this TrainState does not have the structure the trainer was compiled for "
                f"(expected {self._treedef}, got {treedef})"
            )
        return leaves

    def state(self, leaves: Leaves) -> TrainState:
        return eqx.combine(jax.tree.unflatten(self._treedef, leaves), self._static)

    def init_metrics(self, leaves: Leaves, batch: Batch) -> RunningMean:
        """Zero running sums with the structure of the step's metrics."""
        signature = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), batch)
        shapes = self._metric_shapes.get(str(signature))
        if shapes is None:
            shapes = jax.eval_shape(lambda l, b: self._one(l, b)[1], leaves, batch)
            self._metric_shapes[str(signature)] = shapes
        return RunningMean.init(shapes)

    # -- compiled functions ------------------------------------------------------------------
    def _one(self, leaves: Leaves, batch: Batch) -> tuple[Leaves, Metrics]:
        new_state, metrics = train_step(self.state(leaves), batch, self.loss_fn)
        new_leaves, new_static = eqx.partition(new_state, eqx.is_array)
        flat, treedef = jax.tree.flatten(new_leaves)
        if treedef != self._treedef:
            raise ValueError(f"the train step changed the state's structure: {self._treedef} -> {treedef}")
        return flat, metrics

    def _step_impl(self, leaves: Leaves, sums: RunningMean, batch: Batch) -> tuple[Leaves, RunningMean]:
        self.num_traces["step"] += 1
        leaves, metrics = self._one(leaves, batch)
        sums, _ = sums.update(metrics)
        return leaves, sums

    def _run_impl(
        self, leaves: Leaves, sums: RunningMean, data: Batch, indices: jax.Array, num_steps: jax.Array
    ) -> tuple[Leaves, RunningMean]:
        self.num_traces["run"] += 1

        def body(i, carry):
            leaves, sums = carry
            index = indices[i]
            batch = Batch(data.inputs[index], data.labels[index])
            leaves, metrics = self._one(leaves, batch)
            sums, _ = sums.update(metrics)
            return leaves, sums

        return jax.lax.fori_loop(0, num_steps, body, (leaves, sums))

    def step(self, leaves: Leaves, sums: RunningMean, batch: Batch) -> tuple[Leaves, RunningMean]:
        """One step on a host or device batch; metrics are added to the running sums on the device."""
        return self._step(leaves, sums, batch)

    def run(
        self, leaves: Leaves, sums: RunningMean, data: Batch, indices: np.ndarray | jax.Array, num_steps: int
    ) -> tuple[Leaves, RunningMean]:
        """`num_steps` steps in one compiled call on device-resident `data`; step `i` uses the examples
        `indices[i]`. `indices` has a fixed number of rows (>= num_steps) so the call compiles once."""
        return self._run(leaves, sums, data, indices, jnp.asarray(num_steps, jnp.int32))


_cache: dict[tuple, CompiledTrainer] = {}
_cache_lock = threading.Lock()


def compiled_trainer(loss_fn: LossFn, state: TrainState) -> CompiledTrainer:
    """The `CompiledTrainer` for this loss and this state's structure, built once and reused, so a
    second `fit` with the same model, optimizer object and loss starts warm."""
    dynamic, static = eqx.partition(state, eqx.is_array)
    treedef = jax.tree.structure(dynamic)
    key = (loss_fn, treedef, static)
    with _cache_lock:
        try:
            return _cache[key]
        except TypeError:  # an unhashable static field: compile privately
            return CompiledTrainer(loss_fn, static, treedef)
        except KeyError:
            trainer = _cache[key] = CompiledTrainer(loss_fn, static, treedef)
            return trainer
