"""An ensemble of seeds on MNIST-1D: K members trained as one population by the ordinary engine.

K models are built from K keys with `eqx.filter_vmap` (`research.population.stack_states`) and
trained as ONE vmapped train state (member k sees the batches a single run would), so the run has
every option a single run has: placements, EMA, checkpoints and resume, metrics, progress. Each
member and the ensemble that averages their predicted probabilities are evaluated on the test set.
`--compare-sequential` also trains the K members one after another and prints both wall times.
Run with `./scripts/run ensemble --help` for the options.
"""

import dataclasses
import time
from typing import ClassVar, Literal

import jax
import numpy as np
import optax

from research.cli import TrainConfig, Training, group, main_entry, option, positive
from research.data import MNIST1D_CLASSES, MNIST1D_LENGTH, load_mnist1d, train_and_eval_loaders
from research.experiment import Setup, run_experiment
from research.nn import build_model
from research.population import member, stack_states
from research.services import Headline
from research.train import TrainState, evaluate, fit


@dataclasses.dataclass(frozen=True)
class EnsembleTraining(Training):
    batch_size: int = option(100, "examples per training step", check=positive)
    lr: float = option(1e-2, "Adam learning rate", check=positive)
    steps_per_call: int = option(125, "training steps per compiled call", check=positive)
    log_every: int = option(250, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train --num-members MNIST-1D models from different seeds in one compiled program; print each
    member's test accuracy and the averaged-prediction ensemble's."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: EnsembleTraining = group(EnsembleTraining)
    num_members: int = option(8, "K: members, each with its own initialisation and training key", check=positive)
    model: Literal["mlp", "cnn"] = option(
        "mlp", "mlp: 40 -> hidden -> hidden -> 10 (ReLU); cnn: MNIST-1D's reference CNN"
    )
    hidden: int = option(100, "hidden units of the mlp", check=positive)
    epochs: int = option(50, "passes over the 4000 training examples", check=positive, resumable=True)
    loader: Literal["device", "torch"] = option(
        "device", "device: batches gathered on the device; torch: a torch DataLoader with numpy collate"
    )
    compare_sequential: bool = option(False, "also train the members one by one; compare accuracy and time")
    data_dir: str = option("data", "where MNIST-1D is generated and cached")


def build_member(config: Config, key) -> TrainState:
    model_key, train_key = jax.random.split(key)
    if config.model == "cnn":
        model, _ = build_model("cnn", key=model_key)
    else:
        model, _ = build_model(
            "mlp",
            in_size=MNIST1D_LENGTH,
            out_size=MNIST1D_CLASSES,
            hidden=(config.hidden, config.hidden),
            activation="relu",
            key=model_key,
        )
    return TrainState.create(model, optax.adam(config.training.lr), key=train_key)


def setup(config: Config) -> Setup:
    train, test = load_mnist1d(config.data_dir)
    train_data, test_data = train_and_eval_loaders(
        train, test, config.training.batch_size, seed=config.training.seed, kind=config.loader, eval_batch_size=500
    )
    keys = jax.random.split(jax.random.key(config.training.seed), config.num_members)
    return Setup(
        build_state=lambda: stack_states(lambda key: build_member(config, key), keys),
        population=True,
        train_data=train_data,
        eval_data=test_data,
        num_steps=config.epochs * train_data.steps_per_epoch,
    )


def main(config: Config) -> dict:
    run = setup(config)
    summary = run_experiment("ensemble", config, run)
    if config.compare_sequential:
        summary.update(compare_sequential(config, run))
    return summary


def compare_sequential(config: Config, run: Setup) -> dict:
    """Train every member alone with `fit` (one compilation, reused) and time it; over thousands of
    steps float rounding moves the parameters apart, so accuracy is the comparison that stays meaningful."""
    start, accuracies, seconds = run.build_state(), [], 0.0
    for k in range(config.num_members):
        begin = time.perf_counter()
        alone = fit(
            member(start, k),
            run.train_data,
            num_steps=run.num_steps,
            steps_per_call=config.training.steps_per_call,
            log_every=run.num_steps,
            progress=False,
        )
        seconds += time.perf_counter() - begin
        accuracies.append(evaluate(alone.state.model, alone.state.model_state, run.eval_data)["accuracy"])
    mean, std = np.mean(accuracies), np.std(accuracies, ddof=1) if len(accuracies) > 1 else 0.0
    if jax.process_index() == 0:
        print(
            f"sequential training of {config.num_members} members with fit: {seconds:.1f} s; member test accuracy "
            f"{100 * mean:.2f}% +- {100 * std:.2f}%"
        )
    return {
        "sequential_wall_seconds": seconds,
        "sequential_member_test_accuracy": [float(a) for a in accuracies],
        "sequential_member_test_accuracy_mean": float(mean),
        "sequential_member_test_accuracy_std": float(std),
    }


if __name__ == "__main__":
    main_entry(main, Config)
