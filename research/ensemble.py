"""Ensembles of seeds in one compiled program.

Build K train states from K keys with `eqx.filter_vmap` (every array gains a leading member axis;
the model's structure and the optimizer are shared), train all K with ONE vmapped `train_step`
(the same pure step a single model uses: member k sees exactly what it would see alone), and
evaluate each member and the averaged-prediction ensemble (mean of the members' probabilities).

All members see the same batches in the same order; they differ by initialisation and by the
training keys (dropout) derived from their own key.
"""

import dataclasses
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Key, UInt32

from .data import Batch, DeviceLoader
from .state import RunningMean
from .train import LossFn, TrainState, classification_loss, classification_metrics, forward, train_step
from .progress import Progress
from .typing import Array, Float, Int, PRNGKeyArray, typecheck

# One value per member.
MemberMetrics = dict[str, Float[Array, " members"]]


def stack_states(
    build_state: Callable[[PRNGKeyArray], TrainState], keys: Key[Array, " members"] | UInt32[Array, "members 2"]
) -> TrainState:
    """`K` TrainStates, one per key, stacked: `eqx.filter_vmap(build_state)(keys)`.

    `build_state(key)` must build the same structure (model, optimizer) for every key; only the
    arrays differ. Take member `k` back out with `member(states, k)`. Built under `eqx.filter_jit`:
    one compilation instead of one per eager operation.
    """
    return eqx.filter_jit(eqx.filter_vmap(build_state))(keys)


def num_members(states: TrainState) -> int:
    return int(states.step.shape[0]) if states.step.ndim == 1 else 0


def member(states: TrainState, index: int) -> TrainState:
    """Member `index` of stacked states, as an ordinary TrainState."""
    return jax.tree.map(lambda x: x[index] if eqx.is_array(x) else x, states)


def ensemble_train_step(
    states: TrainState, batch: Batch, loss_fn: LossFn = classification_loss
) -> tuple[TrainState, MemberMetrics]:
    """`train_step` on every member at once (vmapped over the stacked states, the batch shared);
    each metric has one value per member."""
    return eqx.filter_vmap(lambda state: train_step(state, batch, loss_fn))(states)


@dataclasses.dataclass
class EnsembleResult:
    states: TrainState
    train_metrics: dict[str, np.ndarray]  # per member, means over the last logging window
    wall_seconds: float


class EnsembleTrainer:
    """Steps of `ensemble_train_step` compiled once: the stacked state is partitioned once, a
    `jax.jit` function runs several steps (a `fori_loop` over rows of batch indices into
    device-resident data) on its array leaves, donated."""

    def __init__(self, states: TrainState, loss_fn: LossFn = classification_loss):
        dynamic, self._static = eqx.partition(states, eqx.is_array)
        self._treedef = jax.tree.structure(dynamic)
        self.loss_fn = loss_fn
        self.num_traces = 0
        self._metric_shapes: MemberMetrics | None = None
        self._run = jax.jit(self._run_impl, donate_argnums=(0, 1))

    def leaves(self, states: TrainState) -> list[jax.Array]:
        return jax.tree.leaves(eqx.partition(states, eqx.is_array)[0])

    def states(self, leaves: list[jax.Array]) -> TrainState:
        return eqx.combine(jax.tree.unflatten(self._treedef, leaves), self._static)

    def init_metrics(self, leaves: list[jax.Array], data: Batch, batch_size: int) -> RunningMean:
        """Zero running sums shaped like the step's metrics (one value per member)."""
        if self._metric_shapes is None:
            batch = Batch(data.inputs[:batch_size], data.labels[:batch_size])
            step_metrics = lambda l: ensemble_train_step(self.states(l), batch, self.loss_fn)[1]  # noqa: E731
            self._metric_shapes = jax.eval_shape(step_metrics, leaves)
        return RunningMean.init(self._metric_shapes)

    def _run_impl(self, leaves, sums: RunningMean, data: Batch, indices: Int[Array, "rows batch"], num_steps):
        self.num_traces += 1

        def body(i, carry):
            leaves, sums = carry
            batch = Batch(data.inputs[indices[i]], data.labels[indices[i]])
            states, metrics = ensemble_train_step(self.states(leaves), batch, self.loss_fn)
            sums, _ = sums.update(metrics)
            return self.leaves(states), sums

        return jax.lax.fori_loop(0, num_steps, body, (leaves, sums))

    def run(self, leaves, sums: RunningMean, data: Batch, indices: np.ndarray, num_steps: int):
        """`num_steps` (<= rows of `indices`) steps in one compiled call; `leaves` and `sums` are donated."""
        return self._run(leaves, sums, data, indices, jnp.asarray(num_steps, jnp.int32))


def fit_ensemble(
    states: TrainState,
    train_data: DeviceLoader,
    *,
    num_steps: int,
    loss_fn: LossFn = classification_loss,
    steps_per_call: int = 100,
    log_every: int | None = None,
    progress: bool = True,
) -> EnsembleResult:
    """Train stacked `states` until their step reaches `num_steps`, all members in one compiled program.

    Batches come from `train_data.step_indices` exactly as in `research.train.fit`, so member `k`
    ends where `fit(member(states, k), train_data, ...)` would (up to float rounding).
    """
    start = time.perf_counter()
    trainer = EnsembleTrainer(states, loss_fn)
    leaves = [jnp.array(x, copy=True) for x in trainer.leaves(states)]  # the caller's states stay valid
    sums = trainer.init_metrics(leaves, train_data.arrays, train_data.batch_size)
    step = int(np.max(np.asarray(states.step)))
    log_every = log_every or steps_per_call
    bar = Progress(num_steps, initial=step, desc=f"train x{num_members(states)}", enabled=progress)
    train_metrics: dict[str, np.ndarray] = {}
    try:
        while step < num_steps:
            until, window_start = min(num_steps, (step // log_every + 1) * log_every), step
            while step < until:
                n = min(steps_per_call, until - step)
                indices = np.zeros((steps_per_call, train_data.batch_size), np.int32)
                indices[:n] = train_data.step_indices(step, n)
                leaves, sums = trainer.run(leaves, sums, train_data.arrays, indices, n)
                step += n
            bar.update(step - window_start)
            train_metrics = {k: np.asarray(v) for k, v in jax.device_get(sums.mean()).items()}
            sums = trainer.init_metrics(leaves, train_data.arrays, train_data.batch_size)
            bar.report(step, {f"mean {k}": float(np.mean(v)) for k, v in train_metrics.items() if k in ("loss", "accuracy")})
    finally:
        bar.close()
    return EnsembleResult(trainer.states(leaves), train_metrics, time.perf_counter() - start)



def _log_probabilities(logits: Float[Array, "members batch classes"]) -> Float[Array, "members batch outcomes"]:
    # One logit is a binary classifier: its two outcomes are (label 0, label 1).
    if logits.shape[-1] == 1:
        return jnp.stack([jax.nn.log_sigmoid(-logits[..., 0]), jax.nn.log_sigmoid(logits[..., 0])], axis=-1)
    return jax.nn.log_softmax(logits, axis=-1)


@eqx.filter_jit
@typecheck
def _ensemble_eval_sums(
    models: eqx.Module, model_states: eqx.nn.State | None, batch: Batch, mask: Float[Array, " batch"]
) -> tuple[Float[Array, " members"], Float[Array, " members"], Float[Array, ""], Float[Array, ""]]:
    logits, _ = eqx.filter_vmap(lambda m, s: forward(m, s, batch.inputs, key=None))(models, model_states)
    losses, correct = jax.vmap(classification_metrics, in_axes=(0, None))(logits, batch.labels)
    log_probs = _log_probabilities(logits)
    # The ensemble predicts the mean of the members' probabilities (computed in log space).
    mean_log_probs = jax.nn.logsumexp(log_probs, axis=0) - jnp.log(log_probs.shape[0])
    ensemble_losses = -jnp.take_along_axis(mean_log_probs, batch.labels[:, None], axis=1)[:, 0]
    ensemble_correct = jnp.argmax(mean_log_probs, axis=1) == batch.labels
    return (
        jnp.sum(losses * mask[None, :], axis=1),
        jnp.sum(correct * mask[None, :], axis=1),
        jnp.sum(ensemble_losses * mask),
        jnp.sum(ensemble_correct * mask),
    )


def evaluate_ensemble(models: eqx.Module, model_states: eqx.nn.State | None, data: DeviceLoader) -> dict[str, np.ndarray | float]:
    """Each member's and the ensemble's mean loss and accuracy over every example of `data`, in inference mode.

    **Returns:** `member_loss`, `member_accuracy` (arrays, one value per member) and `loss`,
    `accuracy` of the ensemble that averages the members' predicted probabilities.
    """
    models = eqx.nn.inference_mode(models)
    totals = [
        _ensemble_eval_sums(models, model_states, Batch(jnp.asarray(b.inputs), jnp.asarray(b.labels)), jnp.asarray(mask))
        for b, mask in data.padded_batches()
    ]
    member_loss, member_correct, loss, correct = (np.sum(np.stack(x), axis=0) for x in zip(*jax.device_get(totals)))
    return {
        "member_loss": member_loss / data.size,
        "member_accuracy": member_correct / data.size,
        "loss": float(loss / data.size),
        "accuracy": float(correct / data.size),
    }
