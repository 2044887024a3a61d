"""Lottery tickets on MNIST-1D (Greydanus 2020, notebook "lottery tickets", after Frankle & Carbin 2019).

Iterative magnitude pruning with rewinding: round 0 trains the dense 40-500-500-10 MLP (ReLU, the
second hidden layer residual) with Adam; every later round r keeps, in every layer (its weights and
bias together), the largest-magnitude 1 - r / --schedule-length of the previous round's trained
weights, rewinds the survivors to their initial values and trains again from a fresh Adam. The last
round's network is the ticket. Two controls at the ticket's sparsity start from another random
initialisation: the ticket's mask (`reinit_NNN/`), and a random mask (`random_NNN/`, the notebook's
"random" pruning, which the published "random" accuracy is of).
Masks are boolean arrays of the model (`research.nn.Masked`), applied in every forward pass: a pruned
weight gets an exactly zero gradient and stays zero. Each round is an ordinary run of the engine
with its own run directory (`round_NNN/`, `reinit_NNN/`, `random_NNN/`) inside this run's directory, so an
interrupted experiment resumes round by round. Accuracy is reported as the notebook does, the
maximum test accuracy over the evaluations of a round (every --eval-every steps), and at its end.
Run `./scripts/run lottery_ticket --help` for the options.
"""

import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import Training, WithTracking, group, main_entry, non_negative, option, positive
from research.data import MNIST1D_CLASSES, MNIST1D_LENGTH, load_mnist1d, train_and_eval_loaders
from research.experiment import Setup, run_experiment
from research.nn import MLP, Masked, build_model
from research.run_plan import Finished, Fresh, plan_directory
from research.services import RunDir, load_checkpoint
from research.train import TrainState
from research.typing import PRNGKeyArray, PyTree

NAME = "lottery_ticket"
# Maximum test accuracy the notebook prints over its trials: the dense network, the ticket at 90-92%
# sparsity and a randomly pruned network of that sparsity. It plots the reinitialised ticket too, with
# no number printed.
PUBLISHED = {"dense": (0.654, 0.664), "ticket": (0.741, 0.761), "random_pruning": (0.611, 0.657)}


@dataclasses.dataclass(frozen=True)
class LotteryTraining(Training):
    lr: float = option(2e-2, "Adam learning rate (a fresh Adam every round)", check=positive)
    batch_size: int = option(100, "examples per training step", check=positive)
    eval_every: int = option(
        100, "steps between test evaluations (the maximum over them is reported)", check=non_negative, resumable=True
    )
    log_every: int = option(100, "steps between logged training metrics", check=positive, resumable=True)
    steps_per_call: int = option(100, "training steps per compiled call", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(WithTracking):
    """Find a lottery ticket of an MNIST-1D MLP by iterative magnitude pruning with rewinding to the
    initial weights; print its accuracy, the dense network's and two controls' (a random mask, and the
    ticket's mask reinitialised) beside the published ones."""

    training: LotteryTraining = group(LotteryTraining)
    rounds: int = option(
        90, "pruning rounds after the dense one; the last one's network is the ticket", check=positive, resumable=True
    )
    schedule_length: int = option(
        99,
        "round r prunes min(r / this, 1) of every layer (the notebook's np.linspace(0, 1, 100) is 99: "
        "round 90 is 90.9% sparse)",
        check=positive,
    )
    steps: int = option(1501, "training steps of each round", check=positive)
    hidden: int = option(500, "width of both hidden layers", check=positive)
    data_dir: str = option("data", "where MNIST-1D is generated and cached")


def sparsity_schedule(config: Config) -> list[float]:
    """The fraction of every layer that round 0 (dense) .. `config.rounds` prunes."""
    return [min(r / config.schedule_length, 1.0) for r in range(config.rounds + 1)]


def initial_model(config: Config, *, reinit: bool = False) -> MLP:
    """The MLP every round rewinds to (seeded by --seed), or the control's other initialisation."""
    keys = jax.random.split(jax.random.key(config.training.seed), 3)
    return build_model(
        "mlp",
        in_size=MNIST1D_LENGTH,
        out_size=MNIST1D_CLASSES,
        hidden=(config.hidden,) * 2,
        activation="relu",
        residual=True,
        key=keys[2 if reinit else 0],
    )[0]


def magnitude_masks(model: MLP, sparsity: float) -> PyTree:
    """Masks keeping, in each layer, all but the `int(sparsity * n)` smallest-magnitude of its `n` weights
    and biases (ties, as the zeros of earlier prunings, in order), as `Masked` takes them."""
    keeps = []
    for layer in model.layers:
        weight, bias = np.asarray(layer.weight), np.asarray(layer.bias)
        scores = np.abs(np.concatenate([weight.ravel(), bias.ravel()]))
        keep = np.ones(scores.size, bool)
        keep[np.argsort(scores, kind="stable")[: int(sparsity * scores.size)]] = False
        keeps += [keep[: weight.size].reshape(weight.shape), keep[weight.size :]]
    params = eqx.filter(model, eqx.is_inexact_array)
    return eqx.tree_at(
        lambda p: [a for layer in p.layers for a in (layer.weight, layer.bias)], params, [jnp.asarray(k) for k in keeps]
    )


def random_masks(model: MLP, sparsity: float, key: PRNGKeyArray) -> PyTree:
    """Masks pruning `int(sparsity * n)` entries of each layer at random: magnitude masks of random scores."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    scores = [jax.random.uniform(k, w.shape) for k, w in zip(jax.random.split(key, len(leaves)), leaves, strict=True)]
    return magnitude_masks(eqx.combine(jax.tree.unflatten(treedef, scores), static), sparsity)


def sparsity_of(masks: PyTree) -> float:
    leaves = jax.tree.leaves(masks)
    return 1.0 - sum(int(np.sum(m)) for m in leaves) / sum(m.size for m in leaves)


@functools.cache
def adam(lr: float) -> optax.GradientTransformation:
    # One optimizer object for every round: it is part of the train state's static structure, so a new
    # one each round would compile the train step again every round.
    return optax.adam(lr)


def build_state(config: Config, masks: PyTree | None = None, *, reinit: bool = False) -> TrainState:
    """A round's step-0 state: the initial MLP under `masks` (None: dense), pruned weights zeroed, fresh Adam."""
    train_key = jax.random.split(jax.random.key(config.training.seed), 3)[1]
    model = Masked(initial_model(config, reinit=reinit), masks).zeroed()
    return TrainState.create(model, adam(config.training.lr), key=train_key)


def setup(config: Config, masks: PyTree | None = None, *, reinit: bool = False) -> Setup:
    """One round's run (default: the dense round 0; `scripts/show_jaxpr lottery_ticket` traces it)."""
    train, test = load_mnist1d(config.data_dir)
    train_data, test_data = train_and_eval_loaders(
        train, test, config.training.batch_size, seed=config.training.seed, eval_batch_size=len(test.labels)
    )
    return Setup(
        build_state=lambda: build_state(config, masks, reinit=reinit),
        train_data=train_data,
        eval_data=test_data,
        num_steps=config.steps,
    )


def train_round(
    config: Config, run: RunDir, masks: PyTree | None, *, reinit: bool = False
) -> tuple[dict[str, Any], Masked]:
    """Train one round in `run` (or take it as it finished); returns its numbers and its trained model."""
    if run.read_summary() is None:  # not finished: start it, or continue it from its last checkpoint
        resume = "auto" if run.checkpoint_paths() or run.config_file.exists() else None
        rounds_group = config.tracking.group or run.path.parent.resolve().name  # the rounds, one group in the trackers
        run_experiment(
            NAME,
            config.replace(run_dir=str(run.path), resume=resume, group=rounds_group),
            setup(config, masks, reinit=reinit),
        )
    state, _ = load_checkpoint(run.latest_valid_checkpoint()[0], build_state(config, masks, reinit=reinit))
    evaluations = [r for r in run.read_metrics() if "test/accuracy" in r]
    summary = run.read_summary()
    numbers = {
        "sparsity": sparsity_of(state.model.masks),
        "test_accuracy": summary["test_accuracy"],
        "test_loss": summary["test_loss"],
        "train_loss": summary["train_loss"],
        "max_test_accuracy": max(r["test/accuracy"] for r in evaluations),
        "curve": [(r["step"], r["test/accuracy"]) for r in evaluations],
    }
    return numbers, state.model


def run_rounds(config: Config, root: RunDir) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Round 0 (dense), the pruning rounds, and the controls: the ticket's mask and a random mask, both
    from another initialisation."""
    rounds, masks, trained = [], None, None
    for r, sparsity in enumerate(sparsity_schedule(config)):
        if r:
            masks = magnitude_masks(trained.masked_model(), sparsity)
        numbers, trained = train_round(config, RunDir(root.path / f"round_{r:03d}"), masks)
        rounds.append(numbers)
        print(
            f"{NAME}: round {r}/{config.rounds}: {100 * numbers['sparsity']:.1f}% sparse, max test accuracy "
            f"{100 * numbers['max_test_accuracy']:.2f}%",
            file=sys.stderr,
        )
    reinit, _ = train_round(config, RunDir(root.path / f"reinit_{config.rounds:03d}"), masks, reinit=True)
    random = random_masks(initial_model(config), sparsity, jax.random.fold_in(jax.random.key(config.training.seed), 1))
    random, _ = train_round(config, RunDir(root.path / f"random_{config.rounds:03d}"), random, reinit=True)
    return rounds, {"reinit_ticket": reinit, "random_pruning": random}


def main(config: Config) -> dict:
    # `--resume` as for a single run, but the checkpoints are the rounds': more --rounds continue a finished run.
    plan = plan_directory(NAME, config, finished=lambda summary: summary["rounds"] == config.rounds)
    root = plan.run
    if isinstance(plan, Finished):  # a requeued finished run: report, touch nothing
        print(report(plan.summary, root))
        return plan.summary
    if isinstance(plan, Fresh):
        root.path.mkdir(parents=True, exist_ok=True)
        root.write_config(
            {
                "experiment": NAME,
                "config": config.to_dict(),
                "resolved": {"num_steps": config.steps},
                "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            }
        )
    start = time.perf_counter()
    rounds, controls = run_rounds(config, root)
    runs = {"dense": rounds[0], "ticket": rounds[-1], **controls}
    ticket = runs["ticket"]
    summary = {
        "experiment": NAME,
        "rounds": config.rounds,
        "sparsity": ticket["sparsity"],
        **{
            f"{name}_{metric}": run[metric]
            for name, run in runs.items()
            for metric in ("max_test_accuracy", "test_accuracy")
        },
        "test_accuracy": ticket["test_accuracy"],
        "test_loss": ticket["test_loss"],
        "train_loss": ticket["train_loss"],
        "step": config.steps,
        "round_sparsity": [r["sparsity"] for r in rounds],
        "round_max_test_accuracy": [r["max_test_accuracy"] for r in rounds],
        "round_test_accuracy": [r["test_accuracy"] for r in rounds],
        "wall_seconds": time.perf_counter() - start,
    }
    root.write_summary(summary)
    plot_lottery(root, summary, {name: run["curve"] for name, run in runs.items()})
    print(report(summary, root))
    return summary


LABELS = {
    "dense": "dense",
    "ticket": "ticket",
    "random_pruning": "random pruning",
    "reinit_ticket": "ticket's mask reinitialised",
}


def report(summary: dict, root: RunDir) -> str:
    ours = []
    for name, label in LABELS.items():
        low, high = PUBLISHED.get(name, (None, None))
        sparse = f" ({100 * summary['sparsity']:.1f}% sparse)" if name == "ticket" else ""
        published = "not printed" if low is None else f"{100 * low:.1f}-{100 * high:.1f}%"
        ours.append(f"{label}{sparse} {100 * summary[name + '_max_test_accuracy']:.2f}% | {published}")
    final = ", ".join(f"{label} {100 * summary[name + '_test_accuracy']:.2f}%" for name, label in LABELS.items())
    return (
        f"{NAME}: max test accuracy, ours | published (Greydanus 2020): {'; '.join(ours)}\n"
        f"{NAME}: final test accuracy: {final}; {summary['wall_seconds']:.0f} s\n"
        f"run directory: {root.path} (lottery.png; the runs in round_*/, reinit_*/, random_*/)"
    )


def plot_lottery(root: RunDir, summary: dict, curves: dict[str, list]) -> None:
    """`lottery.png`: max test accuracy against sparsity over the rounds (and the controls), and the test
    accuracy curves of the dense network, the ticket and the controls; published ranges as bars and bands."""
    from matplotlib.figure import Figure  # imported here: only needed at the end of a run

    figure = Figure(figsize=(11, 4.2), layout="constrained", dpi=110)
    by_sparsity, by_step = figure.subplots(1, 2)
    by_sparsity.plot(
        100 * np.asarray(summary["round_sparsity"]),
        100 * np.asarray(summary["round_max_test_accuracy"]),
        "o-",
        color="C0",
        markersize=3,
        label="magnitude pruning, rewound",
    )
    for k, (name, run) in enumerate(curves.items()):
        color, x = ("k", "C0", "C3", "C2")[k], 0 if name == "dense" else 100 * summary["sparsity"]
        steps, accuracy = zip(*run, strict=True)
        by_step.plot(steps, 100 * np.asarray(accuracy), color=color, label=LABELS[name])
        if name in ("random_pruning", "reinit_ticket"):
            by_sparsity.plot([x], [100 * summary[f"{name}_max_test_accuracy"]], "s", color=color, label=LABELS[name])
        if name in PUBLISHED:
            low, high = PUBLISHED[name]
            by_step.axhspan(100 * low, 100 * high, color=color, alpha=0.12)
            by_sparsity.errorbar(
                [x],
                [50 * (low + high)],
                yerr=[50 * (high - low)],
                color=color,
                capsize=4,
                label=f"published {LABELS[name]}",
            )
    by_sparsity.set(xlabel="sparsity (%)", ylabel="max test accuracy (%)", title="accuracy of each pruning round")
    by_step.set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy (published max shaded)")
    for axes in (by_sparsity, by_step):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.savefig(root.path / "lottery.png")


if __name__ == "__main__":
    main_entry(main, Config)
