"""XOR classification, the "Introduction to JAX + Flax" tutorial rewritten the Equinox way.

MLP 2 -> 8 (tanh) -> 1 on noisy XOR points, sigmoid cross-entropy on the logit, SGD. Run with
`./scripts/run xor --help` for the options.
"""

import dataclasses
from typing import ClassVar, Literal

import jax
import optax

from research.cli import TrainConfig, Training, group, main_entry, option, positive
from research.data import DeviceLoader, TorchLoader, XORDataset, make_dataloader
from research.experiment import Setup, run_experiment
from research.nn import build_model
from research.services import Headline
from research.train import TrainState


@dataclasses.dataclass(frozen=True)
class XorTraining(Training):
    lr: float = option(0.1, "SGD learning rate", check=positive, vmappable=True)
    steps_per_call: int = option(100, "training steps per compiled call (device loader)", check=positive)
    log_every: int = option(190, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train an MLP on noisy XOR (2,500 training points, 500 test points)."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: XorTraining = group(XorTraining)
    epochs: int = option(100, "passes over the training set", check=positive, resumable=True)
    hidden: int = option(8, "hidden units", check=positive)
    train_size: int = option(2500, "training points", check=positive)
    test_size: int = option(500, "test points", check=positive)
    train_seed: int = option(42, "seed of the training points")
    test_seed: int = option(123, "seed of the test points")
    loader: Literal["device", "torch"] = option(
        "device", "device: batches gathered on the device; torch: a torch DataLoader with numpy collate"
    )


def build_state(config: Config) -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    model, _ = build_model("mlp", in_size=2, out_size=1, hidden=(config.hidden,), activation="tanh", key=model_key)
    # The learning rate lives in the optimizer's state, so runs that differ in it train as one population.
    return TrainState.create(
        model, optax.inject_hyperparams(optax.sgd)(learning_rate=config.training.lr), key=train_key
    )


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr xor` uses it too)."""
    train_set = XORDataset(config.train_size, seed=config.train_seed)
    test_set = XORDataset(config.test_size, seed=config.test_seed)
    if config.loader == "device":
        train_data = DeviceLoader.from_dataset(train_set, config.training.batch_size, seed=config.training.seed)
        test_data = DeviceLoader.from_dataset(test_set, min(config.training.batch_size, len(test_set)), shuffle=False)
    else:
        train_data = TorchLoader(train_set, config.training.batch_size, seed=config.training.seed)
        test_data = make_dataloader(test_set, min(config.training.batch_size, len(test_set)), shuffle=False)
    return Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=test_data,
        num_steps=config.epochs * train_data.steps_per_epoch,
    )


def main(config: Config) -> dict:
    return run_experiment("xor", config, setup(config))


if __name__ == "__main__":
    main_entry(main, Config)
