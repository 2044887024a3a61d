"""Two noisy concentric circles: the experiment that docs/adding_an_experiment.md writes line by line."""

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import optax

from research.cli import TrainConfig, Training, group, main_entry, option, positive
from research.data import DeviceLoader
from research.experiment import Setup, run_experiment
from research.nn import build_model
from research.services import Headline
from research.train import TrainState
from research.typing import Float, Int, typecheck


@dataclasses.dataclass(frozen=True)
class CirclesTraining(Training):
    lr: float = option(0.01, "peak learning rate of the cosine schedule", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Tell the inner circle from the outer one with a tanh MLP (Adam, cosine learning-rate decay)."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: CirclesTraining = group(CirclesTraining)
    epochs: int = option(10, "passes over the 2,000 training points", check=positive, resumable=True)
    hidden: int = option(32, "units in each of the two hidden layers", check=positive)
    noise: float = option(0.1, "standard deviation of the noise added to each coordinate", check=positive)


@typecheck
def circles(size: int, noise: float, seed: int) -> tuple[Float[np.ndarray, "size 2"], Int[np.ndarray, " size"]]:
    """`size` points: label 1 on the circle of radius 1, label 0 on the circle of radius 0.5."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size).astype(np.int32)
    angles = rng.uniform(0, 2 * np.pi, size)
    radii = np.where(labels == 1, 1.0, 0.5)
    points = np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)
    return (points + rng.normal(0, noise, points.shape)).astype(np.float32), labels


def setup(config: Config) -> Setup:
    """The model, optimizer and data of a run, built without training anything."""
    training = config.training
    train = DeviceLoader(*circles(2000, config.noise, seed=1), training.batch_size, seed=training.seed)
    test = DeviceLoader(*circles(500, config.noise, seed=2), training.batch_size, shuffle=False)
    num_steps = config.epochs * train.steps_per_epoch
    schedule = optax.cosine_decay_schedule(training.lr, decay_steps=num_steps)
    model_key, train_key = jax.random.split(jax.random.key(training.seed))

    def build_state() -> TrainState:
        model, _ = build_model("mlp", in_size=2, out_size=2, hidden=(config.hidden,) * 2, key=model_key)
        return TrainState.create(model, optax.adam(schedule), key=train_key)

    return Setup(build_state, train_data=train, eval_data=test, num_steps=num_steps, lr_schedule=schedule)


def main(config: Config) -> dict:
    return run_experiment("circles", config, setup(config))


if __name__ == "__main__":
    main_entry(main, Config)
