"""Lottery tickets on MNIST-1D (Greydanus 2020, notebook "lottery tickets", after Frankle & Carbin 2019).

Iterative magnitude pruning with rewinding: round 0 trains the dense 40-500-500-10 MLP (ReLU, the
second hidden layer residual) with Adam; every later round r keeps, in every layer (its weights and
bias together), the largest-magnitude 1 - r / --schedule-length of the previous round's trained
weights, rewinds the survivors to their initial values and trains again from a fresh Adam. The last
round's network is the ticket. Two controls at the ticket's sparsity start from another random
initialisation: the ticket's mask ("reinit"), and a random mask (the notebook's "random" pruning,
which the published "random" accuracy is of).

The whole experiment is one run of the engine: (--rounds + 3) phases of --steps steps each (round 0,
the pruning rounds, the two controls), in one run directory with one metrics.jsonl. A hook
(`PruneAndRewind`) ends each phase: from the trained state it makes the next phase's masks, rewinds
the survivors and starts a fresh Adam (`StepInfo.replace_state`). Masks are boolean arrays of the model
(`research.nn.Masked`), applied in every forward pass: a pruned weight gets an exactly zero gradient
and stays zero, and the masks are saved in the checkpoints with the model; the phase follows from the
step, so `--resume` continues where the run stopped. The test set is evaluated every --eval-every
steps of each phase and at its last step; accuracy is reported as the notebook does, the maximum over
a round's evaluations, and at its end (`summary.json`, from metrics.jsonl).
Run `./scripts/run lottery_ticket --help` for the options.
"""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import Training, WithDevices, WithTracking, group, main_entry, non_negative, option, positive
from research.data import MNIST1D_CLASSES, MNIST1D_LENGTH, load_mnist1d, train_and_eval_loaders
from research.errors import ConfigError
from research.experiment import Setup, run_experiment
from research.nn import MLP, Masked, build_model
from research.services import Headline, RunDir
from research.train import StepInfo, TrainState
from research.typing import PRNGKeyArray, PyTree

NAME = "lottery_ticket"
# Maximum test accuracy the notebook prints over its trials: the dense network, the ticket at 90-92%
# sparsity and a randomly pruned network of that sparsity. It plots the reinitialised ticket too, with
# no number printed.
PUBLISHED = {"dense": (0.654, 0.664), "ticket": (0.741, 0.761), "random_pruning": (0.611, 0.657)}
CONTROLS = ("reinit_ticket", "random_pruning")  # the phases after the last round, in this order


@dataclasses.dataclass(frozen=True)
class LotteryTraining(Training):
    lr: float = option(2e-2, "Adam learning rate (a fresh Adam every round)", check=positive)
    batch_size: int = option(100, "examples per training step", check=positive)
    eval_every: int = option(
        100,
        "steps of a round between test evaluations (the maximum over them is reported; a round's last step "
        "is always evaluated)",
        check=non_negative,
        resumable=True,
    )
    log_every: int = option(100, "steps between logged training metrics", check=positive, resumable=True)
    steps_per_call: int = option(100, "training steps per compiled call", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(WithDevices, WithTracking):
    """Find a lottery ticket of an MNIST-1D MLP by iterative magnitude pruning with rewinding to the
    initial weights; print its accuracy, the dense network's and two controls' (a random mask, and the
    ticket's mask reinitialised) beside the published ones. One run of (--rounds + 3) x --steps steps."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: LotteryTraining = group(LotteryTraining)
    rounds: int = option(90, "pruning rounds after the dense one; the last one's network is the ticket", check=positive)
    schedule_length: int = option(
        99,
        "round r prunes min(r / this, 1) of every layer (the notebook's np.linspace(0, 1, 100) is 99: "
        "round 90 is 90.9% sparse)",
        check=positive,
    )
    steps: int = option(1501, "training steps of each round (and of each control)", check=positive)
    hidden: int = option(500, "width of both hidden layers", check=positive)
    data_dir: str = option("data", "where MNIST-1D is generated and cached")


def sparsity_schedule(config: Config) -> list[float]:
    """The fraction of every layer that round 0 (dense) .. `config.rounds` prunes."""
    return [min(r / config.schedule_length, 1.0) for r in range(config.rounds + 1)]


def num_phases(config: Config) -> int:
    """Round 0 (dense), the pruning rounds, and the two controls."""
    return config.rounds + 1 + len(CONTROLS)


def phase_of(step: int, config: Config) -> int:
    """The phase a record at `step` (steps taken) belongs to: phase p trains steps p*steps+1 .. (p+1)*steps."""
    return (step - 1) // config.steps


def evaluation_steps(config: Config) -> tuple[int, ...]:
    """The steps the test set is evaluated at: every --eval-every steps of each phase, and its last step."""
    every = config.training.eval_every or config.steps
    within = sorted({*range(every, config.steps, every), config.steps})
    return tuple(phase * config.steps + step for phase in range(num_phases(config)) for step in within)


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


def pruned_fraction(config: Config, fraction: float) -> float:
    """The sparsity of masks that prune `fraction` of every layer: `int(fraction * n)` of its `n` entries."""
    sizes = [layer.weight.size + layer.bias.size for layer in eqx.filter_eval_shape(initial_model, config).layers]
    return 1.0 - sum(n - int(fraction * n) for n in sizes) / sum(sizes)  # as `sparsity_of` counts


def rewound(config: Config, masks: PyTree | None, *, reinit: bool = False) -> Masked:
    """The initial MLP (or the controls' other initialisation) under `masks` (None: dense), pruned weights zeroed."""
    return Masked(initial_model(config, reinit=reinit), masks).zeroed()


def build_state(config: Config) -> TrainState:
    """Step 0: the dense MLP and Adam. Every round's fresh Adam is `init` of this optimizer, the state's
    static field: one object for the whole run, so the train step compiles once."""
    train_key = jax.random.split(jax.random.key(config.training.seed), 3)[1]
    return TrainState.create(rewound(config, None), optax.adam(config.training.lr), key=train_key)


def next_masks(config: Config, trained: Masked, phase: int) -> tuple[PyTree, bool]:
    """The masks of phase `phase` from the model phase - 1 trained, and whether it starts from the
    other initialisation: a pruning round's magnitude masks, the ticket's own mask, a random mask."""
    schedule = sparsity_schedule(config)
    if phase <= config.rounds:
        return magnitude_masks(trained.masked_model(), schedule[phase]), False
    if CONTROLS[phase - config.rounds - 1] == "reinit_ticket":
        return trained.masks, True
    key = jax.random.fold_in(jax.random.key(config.training.seed), 1)
    return random_masks(initial_model(config), schedule[-1], key), True


def start_of_phase(config: Config, state: TrainState, phase: int) -> TrainState:
    """The state phase `phase` starts from: its masks over the rewound weights, a fresh Adam; the step
    count and the key go on."""
    masks, reinit = next_masks(config, state.model, phase)
    model = rewound(config, masks, reinit=reinit)
    opt_state = state.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    return dataclasses.replace(state, model=model, opt_state=opt_state)


@dataclasses.dataclass(frozen=True)
class PruneAndRewind:
    """The hook that makes the rounds: at the last step of every phase but the last (after its
    evaluation), it goes on from the next phase's start (`start_of_phase`). The phase follows from the
    step, and the checkpoint taken there holds the new start, so a resumed run needs nothing more."""

    config: Config

    def __call__(self, info: StepInfo) -> None:
        phase, into = divmod(info.step, self.config.steps)
        if into == 0 and not info.final:
            info.replace_state(start_of_phase(self.config, info.state, phase))


def setup(config: Config) -> Setup:
    """The whole run: every phase's steps, the evaluations, the hook that prunes and rewinds
    (`scripts/show_jaxpr lottery_ticket` traces its step)."""
    if config.training.early_stopping:
        raise ConfigError(
            f"--early-stopping {config.training.early_stopping} would end the whole run inside one round; "
            "lottery_ticket trains every round for --steps steps"
        )
    if config.devices.num_processes not in (None, 1) or jax.process_count() > 1:
        raise ConfigError("lottery_ticket trains in one process (on its --devices); drop the multi-process options")
    train, test = load_mnist1d(config.data_dir)
    train_data, test_data = train_and_eval_loaders(
        train, test, config.training.batch_size, seed=config.training.seed, eval_batch_size=len(test.labels)
    )
    return Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=test_data,
        num_steps=num_phases(config) * config.steps,
        eval_at=evaluation_steps(config),
        hooks=(PruneAndRewind(config),),
        summarize_run=lambda run, _: summarize(config, run),
    )


def phase_numbers(config: Config, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phase's numbers from the run's records: its maximum test accuracy over its evaluations, its
    test accuracy and loss at its end, the last train loss logged in it, its test curve (step within it,
    accuracy)."""
    phases: list[dict[str, Any]] = [{"curve": [], "train_loss": None} for _ in range(num_phases(config))]
    for record in records:
        phase = phases[phase_of(record["step"], config)]
        if "train/loss" in record:
            phase["train_loss"] = record["train/loss"]
        if "test/accuracy" in record:
            phase["curve"].append(
                (record["step"] - phase_of(record["step"], config) * config.steps, record["test/accuracy"])
            )
            phase["test_accuracy"], phase["test_loss"] = record["test/accuracy"], record["test/loss"]
    for phase in phases:
        phase["max_test_accuracy"] = max(accuracy for _, accuracy in phase["curve"])
    return phases


def summarize(config: Config, run: RunDir) -> dict[str, Any]:
    """The summary's numbers from metrics.jsonl (the ticket's test and train numbers as `test_accuracy`,
    `test_loss`, `train_loss`), and `lottery.png`."""
    phases = phase_numbers(config, run.read_metrics())
    rounds = phases[: config.rounds + 1]
    runs = {"dense": rounds[0], "ticket": rounds[-1], **dict(zip(CONTROLS, phases[config.rounds + 1 :], strict=True))}
    round_sparsity = [pruned_fraction(config, fraction) for fraction in sparsity_schedule(config)]
    summary = {
        "rounds": config.rounds,
        "sparsity": round_sparsity[-1],
        **{
            f"{name}_{metric}": numbers[metric]
            for name, numbers in runs.items()
            for metric in ("max_test_accuracy", "test_accuracy")
        },
        **{key: runs["ticket"][key] for key in ("test_accuracy", "test_loss", "train_loss")},
        "round_sparsity": round_sparsity,
        "round_max_test_accuracy": [r["max_test_accuracy"] for r in rounds],
        "round_test_accuracy": [r["test_accuracy"] for r in rounds],
    }
    plot_lottery(run, summary, {name: numbers["curve"] for name, numbers in runs.items()})
    return summary


def main(config: Config) -> dict:
    summary = run_experiment(NAME, config, setup(config))
    if jax.process_index() == 0:
        print(report(summary))
    return summary


LABELS = {
    "dense": "dense",
    "ticket": "ticket",
    "random_pruning": "random pruning",
    "reinit_ticket": "ticket's mask reinitialised",
}


def report(summary: dict) -> str:
    ours = []
    for name, label in LABELS.items():
        low, high = PUBLISHED.get(name, (None, None))
        sparse = f" ({100 * summary['sparsity']:.1f}% sparse)" if name == "ticket" else ""
        published = "not printed" if low is None else f"{100 * low:.1f}-{100 * high:.1f}%"
        ours.append(f"{label}{sparse} {100 * summary[name + '_max_test_accuracy']:.2f}% | {published}")
    final = ", ".join(f"{label} {100 * summary[name + '_test_accuracy']:.2f}%" for name, label in LABELS.items())
    return (
        f"{NAME}: max test accuracy, ours | published (Greydanus 2020): {'; '.join(ours)}\n"
        f"{NAME}: final test accuracy: {final}; {summary['wall_seconds']:.0f} s (accuracy against sparsity "
        "and the test curves: lottery.png)"
    )


def plot_lottery(root: RunDir, summary: dict, curves: dict[str, list]) -> None:
    """`lottery.png`: max test accuracy against sparsity over the rounds (and the controls), and the test
    accuracy curves of the dense network, the ticket and the controls (against the step of their round);
    published ranges as bars and bands."""
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
    by_step.set(xlabel="step of the round", ylabel="test accuracy (%)", title="test accuracy (published max shaded)")
    for axes in (by_sparsity, by_step):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.savefig(root.path / "lottery.png")


if __name__ == "__main__":
    main_entry(main, Config)
