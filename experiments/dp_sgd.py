"""DP-SGD on MNIST-1D: the reference CNN trained with per-example clipping and Gaussian noise.

Batches are drawn by Poisson sampling (each example joins a step's batch with probability
batch_size / 4000), every example's gradient is clipped to `--clip-norm`, the clipped sum gets
Gaussian noise of standard deviation `--noise-multiplier * --clip-norm`, and the result divided by
the expected batch size goes to the optimizer. The privacy spent, epsilon at `--delta`, comes from
`dp-accounting` (privacy loss distributions) for exactly that sampler. Run with
`./scripts/run dp_sgd --help` for the options.
"""

import dataclasses
from typing import ClassVar, Literal

import jax
import optax

from research.cli import (
    TrainConfig,
    Training,
    group,
    main_entry,
    micro_batches,
    non_negative,
    open_unit_interval,
    option,
    positive,
)
from research.data import DeviceLoader, load_mnist1d
from research.experiment import Setup, run_experiment
from research.nn import build_model
from research.per_example import DPSGDLoss, PoissonLoader
from research.services import Headline
from research.train import SupervisedStep, TrainState


@dataclasses.dataclass(frozen=True)
class DPSGDTraining(Training):
    batch_size: int = option(512, "expected examples per step (Poisson sampling)", check=positive)
    lr: float = option(3e-2, "learning rate", check=positive)
    steps_per_call: int = option(100, "training steps per compiled call", check=positive)
    log_every: int = option(100, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train the MNIST-1D CNN with DP-SGD; print the test accuracy and the privacy spent (epsilon at delta)."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: DPSGDTraining = group(DPSGDTraining)
    noise_multiplier: float = option(
        2.0, "sigma: noise std on the clipped sum, in units of --clip-norm", check=non_negative
    )
    clip_norm: float = option(1.0, "C: every per-example gradient is clipped to this L2 norm", check=positive)
    delta: float = option(
        1e-5, "the delta epsilon is reported at (well below 1 / 4000 examples)", check=open_unit_interval
    )
    max_batch_size: int = option(
        0,
        "rows of a compiled batch (0: expected + 4 std + 4, rounded up to a multiple of the devices, or of "
        "--micro-batches under --deterministic-reduction, times --grad-accum); larger draws are truncated to a "
        "random subset, which the accounting includes",
        check=non_negative,
    )
    epochs: int = option(
        100,
        "expected passes over the training set: steps = epochs * round(4000 / batch_size)",
        check=positive,
        resumable=True,
    )
    optimizer: Literal["adam", "sgd"] = option("adam", "adam (DP-Adam) or sgd with momentum 0.9 (DP-SGD)")
    channels: int = option(25, "channels of the CNN's convolutions", check=positive)
    chunk_size: int = option(
        64, "per-example gradients this many examples at a time (0: the whole batch)", check=non_negative
    )
    clipping: Literal["auto", "ghost", "vmap"] = option(
        "auto",
        "how per-example gradients are clipped: vmap materialises each of them; ghost takes their norms "
        "and the clipped sum from each layer's inputs and output gradients, one backward pass (no per-example "
        "gradients); auto: ghost where the model is covered, else vmap. The same update up to float "
        "rounding",
        resumable=True,
    )
    data_dir: str = option("data", "where MNIST-1D is generated and cached")


def build_state(config: Config) -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    model, _ = build_model("cnn", channels=config.channels, key=model_key)
    optimizer = (
        optax.adam(config.training.lr) if config.optimizer == "adam" else optax.sgd(config.training.lr, momentum=0.9)
    )
    return TrainState.create(model, optimizer, key=train_key)


def setup(config: Config) -> Setup:
    """The state, the Poisson-sampled data and the DP-SGD loss of a run, without training."""
    train, test = load_mnist1d(config.data_dir)
    train_data = PoissonLoader(
        train.inputs,
        train.labels,
        config.training.batch_size,
        seed=config.training.seed,
        max_batch_size=config.max_batch_size or None,
        multiple_of=(micro_batches(config.devices) or config.devices.devices * jax.process_count())
        * config.training.grad_accum,
    )
    return Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=DeviceLoader(test.inputs, test.labels, 500, shuffle=False),
        num_steps=config.epochs * train_data.steps_per_epoch,
        step=SupervisedStep(
            DPSGDLoss(
                config.clip_norm,
                config.noise_multiplier,
                train_data.expected_batch_size,
                chunk_size=config.chunk_size or None,
                method=config.clipping,
            )
        ),
    )


def main(config: Config) -> dict:
    run = setup(config)
    sampler = run.train_data
    epsilon = sampler.epsilon(config.noise_multiplier, run.num_steps, config.delta)
    privacy = {
        "epsilon": epsilon,
        "delta": config.delta,
        "sampling_probability": sampler.sampling_probability,
        "max_batch_size": sampler.max_batch_size,
    }
    summary = run_experiment("dp_sgd", config, run, summary_extra=privacy)
    print(
        f"dp_sgd: ({epsilon:.2f}, {config.delta:g})-DP: noise multiplier {config.noise_multiplier}, clip norm "
        f"{config.clip_norm}, {run.num_steps} steps of Poisson sampling with q = {sampler.sampling_probability:.4f} "
        f"(batches truncated at {sampler.max_batch_size}; dp-accounting PLD, add/remove-one)"
    )
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
