"""The fast path: partition the train state once, jit over its flat list of array leaves, donate them.

`eqx.filter_jit` flattens and hashes the whole model on every call (hundreds of microseconds on a
small model). Here the split into arrays and static structure happens once; each call then passes
a plain list of arrays to a `jax.jit` function, which costs what hand-written JAX costs. A small
state's leaves travel packed into one buffer (`_packing.py`), since each array in or out of a call
costs dispatch time.
"""

import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ..data import take_rows
from ..debug import RetraceLog
from ..parallel import Leaves, Placement, one_device
from ..typing import Array, PyTree
from ._global_batch import GlobalBatch
from ._networks import strong
from ._packing import Packing, describe_spec
from ._state import SupervisedStep
from ._stats import Layout, StepMetrics, StepStats, layout_of
from ._step import AbstractTrainState, Step, advanced, all_finite, split_key, take_step


class CompiledTrainer:
    """Compiled train steps for one `Step`, state structure, placement and non-finite policy: the one
    trainer, whatever the step (`SupervisedStep`, a GAN's), the placement (one device, pmap, a mesh;
    `Placement` says where arrays live and how a function compiles) and whether the state is one model
    or a population.

    Build it with `compiled_trainer(step, state, placement=...)` (cached: the same structure reuses
    the same compiled code). The train loop works on `leaves = trainer.place(state)` and turns them
    back into a state with `trainer.state(leaves)` only to evaluate or save. Leaves passed to
    `step`/`run` are donated: do not use them (or a state built from them) afterwards. With a
    `packing` (small states on one device; see `compiled_trainer`) `leaves` are the packed ones, and
    `unpack(leaves)` gives one array per `leaf_names()` entry.

    `population=True`: every array of the state has a leading member axis (`research.population`);
    the step is vmapped over the members, all of them on the same batch (with `member_batches=True`,
    each on its own: batches have a leading member axis), and each metric has one value per member.

    With `skip_nonfinite=True` a step one of whose `finite_metrics` is NaN/Inf leaves the state
    unchanged but for its step counter and key (the data advances too); in a population, member by
    member.

    `num_traces` counts how many times each function was traced, to catch silent recompilation;
    `traces` records each trace's abstract signature (argument shapes, dtypes, weak types) and logs,
    on the first retrace of a function, which argument changed (`traces.explanations`).
    """

    # (jax.tree_util.PyTreeDef is an alias of a compiled class, which pyright reads as a variable.)
    def __init__(
        self,
        step: Step,
        static: AbstractTrainState,
        treedef: jax.tree_util.PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
        skip_nonfinite: bool = False,
        packing: Packing | None = None,
        *,
        placement: Placement = one_device(),
        population: bool = False,
        member_batches: bool = False,
    ):
        takes_member_batches = placement.on_one_device or getattr(placement, "member_batches", False)
        if member_batches and not (population and takes_member_batches):
            raise ValueError(
                "member_batches: a population's own batches per member need one device or a population_mesh"
            )
        self.train_step = step
        self.skip_nonfinite = skip_nonfinite
        self.packing = packing
        self.placement = placement
        self.population, self.member_batches = population, member_batches
        self._static = static
        self._treedef = treedef
        self.num_traces = {"step": 0, "run": 0}
        self.traces = RetraceLog()
        self._leaf_names: list[str] | None = None
        self._layouts: dict[str, Layout] = {}
        self._step = placement.compile(self._step_impl)
        self._run = placement.compile(self._run_impl, broadcast_last=True)

    # -- conversions -------------------------------------------------------------------------
    def leaves(self, state: AbstractTrainState) -> Leaves:
        """The arrays of `state` as `step` and `run` take them (packed when the trainer packs)."""
        dynamic, _ = eqx.partition(state, eqx.is_array)
        leaves, treedef = jax.tree.flatten(strong(dynamic))  # a weakly typed leaf would compile the step again
        if treedef != self._treedef:
            raise ValueError(
                "this state does not have the structure the trainer was compiled for "
                f"(expected {self._treedef}, got {treedef})"
            )
        return self._pack(leaves, "this state's leaves differ from the ones the trainer packs", on_host=True)

    def unpack(self, leaves: Leaves, *, on_host: bool = False) -> Leaves:
        """One array per `leaf_names()` entry, from leaves as `step` and `run` take them; `on_host`
        unpacks concrete arrays in numpy (one transfer instead of an op per leaf; the leaves are copies)."""
        if self.packing is None:
            return leaves
        return self.packing.unpack_on_host(leaves) if on_host else self.packing.unpack(leaves)

    def _pack(self, leaves: Leaves, problem: str, *, on_host: bool = False) -> Leaves:
        if self.packing is None:
            return leaves
        specs = Packing.specs_of(leaves)
        if specs != self.packing.specs:
            changed = [
                f"{name}: {describe_spec(a)} -> {describe_spec(b)}"
                for name, a, b in zip(self.leaf_names(), self.packing.specs, specs, strict=True)
                if a != b
            ]
            raise ValueError(f"{problem}: {'; '.join(changed)}")
        return self.packing.pack_on_host(leaves) if on_host else self.packing.pack(leaves)

    def leaf_names(self) -> list[str]:
        """`state.model.layers[0].weight`, ...: the state's path of each leaf, for messages."""
        if self._leaf_names is None:
            skeleton = jax.tree.unflatten(self._treedef, list(range(self._treedef.num_leaves)))
            paths = jax.tree_util.tree_flatten_with_path(skeleton)[0]
            self._leaf_names = ["state" + jax.tree_util.keystr(path) for path, _ in paths]
        return self._leaf_names

    def _record_trace(self, name: str, leaves: Leaves, **arguments) -> None:
        if not isinstance(leaves[0], Tracer):
            return  # not a trace: jax_debug_nans re-running the step op by op on concrete arrays
        self.num_traces[name] += 1
        named_leaves = dict(zip(self.leaf_names(), leaves, strict=True))
        self.traces.record(f"train {name} function", {**named_leaves, **arguments})

    def _combine(self, leaves: Leaves) -> AbstractTrainState:
        return eqx.combine(jax.tree.unflatten(self._treedef, leaves), self._static)

    # -- placement: where leaves, batches and statistics live ------------------------------------
    def place(self, state: AbstractTrainState) -> Leaves:
        """Fresh leaves of `state` on the placement's devices. The compiled steps donate their inputs;
        a copy keeps the caller's state (and model) valid."""
        return self.placement.place(self.leaves(state))

    def state(self, leaves: Leaves) -> AbstractTrainState:
        """The state of `leaves`, usable on the host: to evaluate, save or return."""
        return self._combine(self.unpack(self.placement.gather(leaves), on_host=True))

    def saved_state(self, leaves: Leaves) -> AbstractTrainState:
        """The state of `leaves` as a checkpoint saves it: fresh copies, where the placement keeps
        them (a sharded array stays in its shards, which each process saves)."""
        # A packed (small, one-device) state unpacks on the host: one transfer, not an op per leaf.
        return self._combine(self.placement.to_save(self.unpack(leaves, on_host=True)))

    def host(self, tree):
        """One copy of values the compiled steps keep on every device (statistics), readable on the host."""
        return self.placement.host(tree)

    def init_stats(self, leaves: Leaves, batch: PyTree) -> StepStats:
        """Zeroed step statistics laid out for the step's metrics, placed on the devices."""
        return self.placement.put_stats(StepStats.init(self.stats_layout(leaves, batch)))

    def stats_layout(self, leaves: Leaves, batch: PyTree) -> Layout:
        """The `StepStats` layout of the metrics of a step on batches shaped like `batch`."""
        signature = str(jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), batch))
        layout = self._layouts.get(signature)
        if layout is None:
            one_step = lambda packed, b: self._one(self.unpack(packed), b)[1]  # noqa: E731
            shapes = self.placement.metric_shapes(one_step, leaves, batch)
            layout = self._layouts[signature] = layout_of(shapes, self.train_step.finite_metrics)
        return layout

    # -- compiled functions ------------------------------------------------------------------
    def _one(self, leaves: Leaves, batch: PyTree) -> tuple[Leaves, StepMetrics]:
        old = self._combine(leaves)
        batch = self.placement.constrain(batch)
        new, metrics = self._population_step(old, batch) if self.population else self._global_step()(old, batch)
        if self.skip_nonfinite:
            new = _kept_where_finite(all_finite(metrics, self.train_step.finite_metrics), new, old)
        new_leaves, _ = eqx.partition(new, eqx.is_array)
        flat, treedef = jax.tree.flatten(new_leaves)
        if treedef != self._treedef:
            raise ValueError(f"the train step changed the state's structure: {self._treedef} -> {treedef}")
        return self.placement.constrain_state(flat), metrics

    def _global_step(self) -> Callable:
        """`take_step` of the step as a function of `(state, batch)`, run as the placement runs a step."""
        micro_batches = self.placement.micro_batches
        return self.placement.per_device(
            lambda s, b, axis: take_step(self.train_step, s, b, GlobalBatch(axis, micro_batches))
        )

    def _population_step(self, old: Any, batch: PyTree) -> tuple[Any, StepMetrics]:
        """The step of every member: vmapped; under micro-batches (where a vmapped update rounds otherwise
        on one device and on several), a `SupervisedStep`'s gradients vmapped and each member's update on
        its own, any other step member by member (`_member_by_member`)."""
        # Array leaves only: a module's other leaves (BatchNorm's axis name) are not mapped.
        members = (eqx.if_array(0), eqx.if_array(0) if self.member_batches else None)
        micro_batches = self.placement.micro_batches
        if micro_batches is None:
            return eqx.filter_vmap(self._global_step(), in_axes=members)(old, batch)
        step = self.train_step
        if not isinstance(step, SupervisedStep):
            if self.member_batches:
                return _member_by_member(self._global_step(), old, batch)
            return _member_by_member(lambda s: self._global_step()(s, batch), old)

        def gradient(s: Any, b: PyTree, axis: str | None) -> tuple[Any, Any]:
            key, step_key = split_key(s.key)
            half, metrics = step.gradient(s, b, step_key, GlobalBatch(axis, micro_batches))
            return (half, key), metrics

        def apply(s: Any, half_and_key: tuple[Any, Any], metrics: Any) -> tuple[Any, Any]:
            half, key = half_and_key
            new, metrics = step.apply(s, half, metrics)
            return advanced(s, new, key), metrics

        gradients = eqx.filter_vmap(self.placement.per_device(gradient), in_axes=members)(old, batch)
        return _member_by_member(apply, old, *gradients)

    def _record(self, leaves: Leaves, stats: jax.Array, batch: PyTree) -> tuple[Leaves, jax.Array]:
        """One step, its metrics added to `stats` (`StepStats.words`, laid out for those metrics)."""
        step = self._combine(leaves).step
        step = step[0] if self.population else step  # members step together
        leaves, metrics = self._one(leaves, batch)
        layout = layout_of(metrics, self.train_step.finite_metrics)
        words = StepStats(stats, layout).record(step, metrics).words
        assert isinstance(words, jax.Array)  # computed by JAX (only fresh statistics hold numpy words)
        return leaves, words

    def _step_impl(self, leaves: Leaves, stats: jax.Array, batch: PyTree) -> tuple[Leaves, jax.Array]:
        leaves = self.unpack(leaves)
        self._record_trace("step", leaves, stats=stats, batch=batch)
        leaves, stats = self._record(leaves, stats, batch)
        return self._pack(leaves, "the train step changed the shape or dtype of state leaves"), stats

    def _run_impl(
        self, leaves: Leaves, stats: jax.Array, data: PyTree, indices: jax.Array, num_steps: jax.Array
    ) -> tuple[Leaves, jax.Array]:
        # Packed leaves are unpacked once a call: the loop carries (and its body sees) plain leaves.
        leaves = self.unpack(leaves)
        self._record_trace("run", leaves, stats=stats, data=data, indices=indices, num_steps=num_steps)

        def body(i, carry):
            leaves, stats = carry
            return self._record(leaves, stats, take_rows(data, indices[i]))

        def masked(i, carry):  # a step past num_steps is dropped
            return jax.tree.map(lambda new, old: jnp.where(i < num_steps, new, old), body(i, carry), carry)

        if indices.shape[0] == 1:
            # One row: no loop. XLA CPU runs convolutions several times slower inside a while loop
            # (CNN1d on MNIST-1D: ~5 ms a step straight, ~24 ms in a one-step fori_loop).
            leaves, stats = masked(0, (leaves, stats))
        elif static_trip_count():
            leaves, stats = jax.lax.fori_loop(0, indices.shape[0], masked, (leaves, stats))
        else:
            leaves, stats = jax.lax.fori_loop(0, num_steps, body, (leaves, stats))
        return self._pack(leaves, "the train step changed the shape or dtype of state leaves"), stats

    def replay_eagerly(self, leaves: Leaves, batch: PyTree) -> None:
        """Run one train step op by op (no jit) with `jax_debug_nans` and `jax_debug_infs` on: the
        first operation that makes a NaN or an Inf raises `FloatingPointError` naming it. Slow; for
        debugging a step already known to go non-finite."""
        with jax.disable_jit(), jax.debug_nans(True), jax.debug_infs(True):
            self._one(self.unpack(leaves), batch)

    def step_jaxpr(self, leaves: Leaves, stats: StepStats, batch: PyTree):
        """The jaxpr of one compiled train step (what `step` runs, less any packing), for inspection;
        records no trace. Its inputs are `leaf_names()` in order, then the step statistics, then the batch."""
        return jax.make_jaxpr(self._record)(self.unpack(leaves), stats.words, batch)

    def step(self, leaves: Leaves, stats: StepStats, batch: PyTree) -> tuple[Leaves, StepStats]:
        """One step on a host or device batch; metrics are accumulated in `stats` on the device."""
        leaves, words = self._step(leaves, stats.words, batch)
        return leaves, StepStats(words, stats.layout)

    def run(
        self, leaves: Leaves, stats: StepStats, data: PyTree, indices: np.ndarray | jax.Array, num_steps: int
    ) -> tuple[Leaves, StepStats]:
        """`num_steps` steps in one compiled call on device-resident `data`; step `i` uses the examples
        `indices[i]`. `indices` has a fixed number of rows (>= num_steps) so the call compiles once."""
        leaves, words = self._run(leaves, stats.words, data, indices, self.placement.put_count(num_steps))
        return leaves, StepStats(words, stats.layout)


def static_trip_count() -> bool:
    """Whether a compiled call's loop runs all its rows of indices, the steps past the call's count computed and
    dropped (a masked tail), rather than a count known only at run time: on a GPU, where a loop of unknown
    trip count reads its condition back to the host every step; not on a CPU, where it costs nothing and a
    short call's dropped steps would (a call is short at the end of a logging window)."""
    return jax.default_backend() == "gpu"


def _broadcast(flags: Array, like: Array) -> Array:
    """Per-member flags `[members]` shaped to select along the leading axis of `like`."""
    return flags.reshape(flags.shape + (1,) * (like.ndim - flags.ndim))


def _kept_where_finite(ok: Array, new: Any, old: Any) -> Any:
    """`new` where the step was finite (`ok`: one flag per member in a population), else `old`, but for the
    step counter and the key, which advance either way. Arrays only: a state's other leaves (Dropout's
    `p`) are the same in both. (A NaN folded into an EMA would stay there for good.)"""
    kept = jax.tree.map(lambda a, b: jnp.where(_broadcast(ok, a), a, b) if eqx.is_array(a) else a, new, old)
    return eqx.tree_at(lambda s: (s.step, s.key), kept, (new.step, new.key))


def _member_by_member(fn: Callable, *trees: Any) -> Any:
    """`fn` over a population's members one after another (`lax.map`), not vmapped: a member's optimizer
    update then compiles to the same program on one device and on each of several (vmapped, XLA rewrote the
    divides of Adam's bias correction, by a per-member step count, differently in the two programs)."""
    arrays, static = eqx.partition(trees, eqx.is_array)
    out_static = []  # the non-array part of `fn`'s result, seen while tracing

    def one(member_arrays: Any) -> Any:
        out_arrays, out_static_part = eqx.partition(fn(*eqx.combine(member_arrays, static)), eqx.is_array)
        out_static.append(out_static_part)
        return out_arrays

    out_arrays = jax.lax.map(one, arrays)
    return eqx.combine(out_arrays, out_static[-1])


_cache: dict[tuple, CompiledTrainer] = {}
_cache_lock = threading.Lock()


def static_key(static: AbstractTrainState) -> tuple:
    """A cache key for the non-array part of a state. Flattened, because `eqx.nn.State` hashes by
    identity and `eqx.partition` makes a new one on every call; its tree structure compares by value."""
    leaves, structure = jax.tree.flatten(static)
    return structure, tuple(leaves)


def compiled_trainer(
    step: Step,
    state: AbstractTrainState,
    *,
    skip_nonfinite: bool = False,
    placement: Placement = one_device(),
    population: bool = False,
    member_batches: bool = False,
) -> CompiledTrainer:
    """The `CompiledTrainer` for this step, this state's structure, placement and non-finite policy,
    built once and reused, so a second `fit` with the same model, optimizer object and step starts
    warm. A small state on a placement that `packs` travels packed."""
    dynamic, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    packing = Packing.of(leaves) if placement.packs else None
    key = (step, treedef, *static_key(static), skip_nonfinite, packing, placement, population, member_batches)

    def build() -> CompiledTrainer:
        return CompiledTrainer(
            step,
            static,
            treedef,
            skip_nonfinite,
            packing,
            placement=placement,
            population=population,
            member_batches=member_batches,
        )

    with _cache_lock:
        try:
            return _cache[key]
        except TypeError:  # an unhashable static field: compile privately
            return build()
        except KeyError:
            trainer = _cache[key] = build()
            return trainer
