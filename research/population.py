"""Populations: K members (seeds, hyperparameters) stacked on a leading axis of every array of ONE train state.

A population is not a trainer of its own. Build it with `stack_states(build_state, keys)` (every
array gains a leading member axis; the model's structure and the optimizer are shared), or from
states built one by one with `stack_members` (members that differ in hyperparameters the optimizer
keeps in its state), and train it through the engine like any state,
`fit(states, ..., population=True, evaluator=evaluate_population)`: the compiled step is
the step vmapped over the members, all on the same batches (or each on its own run's batches,
from `DeviceLoader.for_members`), so member k ends where its own run would (up to float rounding),
and the run gets the placements, EMA, checkpoints and resume, metrics and progress of any other
run. Each metric then has one value per member: the logs hold their mean (`train/loss`) and the
values (`train/member_loss`).
"""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Key, UInt32

from .data import Batch, DeviceLoader, HostLoader
from .errors import ConfigError
from .train import AbstractTrainState, Evaluator, TrainState, classification_metrics, forward
from .train.evaluation import padded_batches
from .typing import Array, Float, PRNGKeyArray, typecheck


def stack_states(
    build_state: Callable[[PRNGKeyArray], AbstractTrainState],
    keys: Key[Array, " members"] | UInt32[Array, "members 2"],
) -> AbstractTrainState:
    """`K` train states, one per key, stacked: `eqx.filter_vmap(build_state)(keys)`.

    `build_state(key)` must build the same structure (model, optimizer) for every key; only the
    arrays differ. Take member `k` back out with `member(states, k)`. Built under `eqx.filter_jit`:
    one compilation instead of one per eager operation.
    """
    return eqx.filter_jit(eqx.filter_vmap(build_state))(keys)


def stack_members(states: Sequence[AbstractTrainState]) -> AbstractTrainState:
    """Train states built one by one (say, from configs that differ in seed and learning rate) stacked
    into a population: every array gains a leading member axis; the non-array parts (the model's
    structure, the optimizer's functions) are member 0's.

    That is right when the members differ in array values only: a hyperparameter the optimizer reads
    from its state (`optax.inject_hyperparams`), never one baked into its functions. A member whose
    arrays differ in number, shape or dtype is refused (`ConfigError`).
    """
    dynamic, static = eqx.partition(states[0], eqx.is_array)
    first, treedef = jax.tree.flatten(dynamic)
    columns = [[leaf] for leaf in first]
    for k, state in enumerate(states[1:], start=1):
        leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
        shapes = [(x.shape, x.dtype) for x in leaves]
        if shapes != [(x.shape, x.dtype) for x in first]:
            raise ConfigError(
                f"member {k}'s state has other arrays than member 0's ({len(leaves)} vs {len(first)} "
                "arrays, or other shapes): only members of one model structure train as a population"
            )
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    return eqx.combine(jax.tree.unflatten(treedef, [jnp.stack(column) for column in columns]), static)


def num_members(states: AbstractTrainState) -> int:
    """K for a population, 0 for a single state."""
    return int(states.step.shape[0]) if states.step.ndim == 1 else 0


def member(states: AbstractTrainState, index: int) -> AbstractTrainState:
    """Member `index` of stacked states, as an ordinary train state."""
    return jax.tree.map(lambda x: x[index] if eqx.is_array(x) else x, states)


def with_ema(states: AbstractTrainState, decay: float) -> AbstractTrainState:
    """Every member with an EMA of its model (`with_ema` of its state), member by member."""
    return eqx.filter_vmap(lambda state: state.with_ema(decay))(states)


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


def evaluate_ensemble(
    models: eqx.Module, model_states: eqx.nn.State | None, data: DeviceLoader | HostLoader
) -> dict[str, np.ndarray | float]:
    """Each member's and the ensemble's mean loss and accuracy over every example of `data`, in inference mode.

    **Returns:** `member_loss`, `member_accuracy` (arrays, one value per member) and `loss`,
    `accuracy` of the ensemble that averages the members' predicted probabilities.
    """
    models = eqx.nn.inference_mode(models)
    batches, size = padded_batches(data)
    totals = [
        _ensemble_eval_sums(
            models, model_states, Batch(jnp.asarray(b.inputs), jnp.asarray(b.labels)), jnp.asarray(mask)
        )
        for b, mask in batches
    ]
    sums = zip(*jax.device_get(totals), strict=True)  # each of the four over the batches
    member_loss, member_correct, loss, correct = (np.sum(np.stack(x), axis=0) for x in sums)
    return {
        "member_loss": member_loss / size,
        "member_accuracy": member_correct / size,
        "loss": float(loss / size),
        "accuracy": float(correct / size),
    }


def _population_metrics(scores: dict[str, np.ndarray | float]) -> dict[str, float | list[float]]:
    return {
        "loss": float(np.mean(scores["member_loss"])),
        "accuracy": float(np.mean(scores["member_accuracy"])),
        "member_loss": [float(x) for x in np.asarray(scores["member_loss"])],
        "member_accuracy": [float(x) for x in np.asarray(scores["member_accuracy"])],
        "ensemble_loss": float(scores["loss"]),
        "ensemble_accuracy": float(scores["accuracy"]),
    }


def evaluate_population(
    states: TrainState, data: DeviceLoader | HostLoader, *, progress: bool = False
) -> dict[str, float | list[float]]:
    """The metrics of a population, like `research.train.evaluation.evaluate_state` of one state: the
    members' mean `loss` and `accuracy`, each member's (`member_loss`, `member_accuracy`), and the
    ensemble's that averages their probabilities (`ensemble_loss`, `ensemble_accuracy`)."""
    return _population_metrics(evaluate_ensemble(states.model, states.model_state, data))


def evaluate_members(evaluator: Evaluator) -> Evaluator:
    """A population's evaluator from one member's (`research.train.batch_evaluator`'s, a GAN's Fréchet
    distance): each member evaluated on its own, one after another; each metric is the members' mean,
    and `member_<metric>` their values (what `scripts/sweep --vmapped` writes into each member's run)."""

    def evaluate(states: AbstractTrainState, data: DeviceLoader | HostLoader, *, progress: bool = False):
        each = [evaluator(member(states, k), data, progress=progress) for k in range(num_members(states))]
        means = {name: float(np.mean([m[name] for m in each])) for name in each[0]}
        return {**means, **{f"member_{name}": [float(m[name]) for m in each] for name in each[0]}}

    return evaluate
