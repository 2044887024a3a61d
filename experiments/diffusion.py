"""A denoising diffusion model (DDPM, Ho et al. 2020) on the images of --data: a small U-Net
(`research.nn.UNet`) learns to predict the noise added to an image at a random step of a linear noise
schedule, and images are drawn by DDIM's deterministic sampler (Song et al. 2021) in `--sample-steps` steps,
from the EMA of the weights (`--ema-decay`, 0.999 by default).

The training step is the engine's `SupervisedStep` with a loss of its own over images alone: no labels,
no classifier. A grid of samples from fixed noise is saved at every evaluation (`samples.png`); every
evaluation reports the denoising loss on the test images (from fixed noise and steps) and, with
`--judge RUN_DIR` (a classifier `images` trained on the same data), `fid`: the Fréchet distance between as
many drawn images as the test set holds and the test images in the judge's feature space.
`./scripts/sample RUN_DIR` draws images of a trained run. Run `./scripts/run diffusion --help` for the options.

    ./scripts/run diffusion --data data/digits8.npz --judge runs/judge8
"""

import dataclasses
import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import EMA, ConfigError, TrainConfig, Training, group, main_entry, option, positive, unit_interval
from research.data import FORMATS_HELP, IMAGE_COLUMN_HELP, LABEL_COLUMN_HELP, DeviceLoader, read_image_data
from research.experiment import Setup, run_experiment
from research.judge import draw_samples, frechet_baselines, frechet_evaluator, load_judge, print_frechet
from research.nn import UNet
from research.services import Headline, RunDir
from research.train import SupervisedStep, TrainState, batch_evaluator
from research.train.evaluation import combined_evaluator
from research.typing import Array, Float, PRNGKeyArray, RowKeys


@dataclasses.dataclass(frozen=True)
class DiffusionTraining(Training):
    lr: float = option(2e-4, "Adam learning rate", check=positive, vmappable=True)
    batch_size: int = option(64, "images a step", check=positive)
    steps_per_call: int = option(10, "training steps per compiled call", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)
    eval_every: int = option(2500, "steps between evaluations (samples.png, the test loss, fid)", check=positive)


@dataclasses.dataclass(frozen=True)
class DiffusionEMA(EMA):
    ema_decay: float = option(
        0.999, "decay of the EMA of the weights that draws the images and is evaluated (0: none)", check=unit_interval
    )


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a denoising diffusion model on the training images of --data (labels unused)."""

    headline: ClassVar[Headline] = Headline("fid", goal="min", percent=False)
    training: DiffusionTraining = group(DiffusionTraining)
    ema: DiffusionEMA = group(DiffusionEMA)
    data: str | None = option(None, f"the images: {FORMATS_HELP} (default: none; required)")
    image_column: str | None = option(None, IMAGE_COLUMN_HELP)
    label_column: str | None = option(None, LABEL_COLUMN_HELP)
    steps: int = option(10000, "training steps", check=positive, resumable=True)
    features: int = option(32, "channels of the U-Net's first level (doubled at each level below)", check=positive)
    levels: int = option(2, "resolutions below the input's the U-Net goes down to", check=positive)
    diffusion_steps: int = option(1000, "steps of the noise schedule (DDPM's T)", check=positive)
    sample_steps: int = option(50, "DDIM steps drawing an image (at most --diffusion-steps)", check=positive)
    judge: str | None = option(
        None, "an `images` run trained on the same data, whose features measure the Fréchet distance (fid)"
    )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """DDPM's linear schedule: `betas[t]` from 1e-4 to 0.02 over `steps`, `alpha_bars[t]` their running
    product of `1 - beta` (float32, what the noise at step `t` keeps of the image)."""

    steps: int

    @property
    def alpha_bars(self) -> np.ndarray:
        betas = np.linspace(1e-4, 0.02, self.steps, dtype=np.float64)
        return np.cumprod(1 - betas).astype(np.float32)


def to_signed(images: Array) -> Float[Array, "*batch height width channels"]:
    """Stored images (uint8 0-255) in the model's range, [-1, 1]."""
    return images.astype(jnp.float32) / 127.5 - 1


class DenoisingLoss(eqx.Module):
    """DDPM's simple loss: each image noised at a step `t` drawn uniformly, `x_t = sqrt(a_t) x + sqrt(1 -
    a_t) noise`, and the mean squared error of the model's prediction of the noise from `(x_t, t / T)`.
    Each image's step and noise come from its key (its key in the global batch: the same on any placement)."""

    schedule: Schedule = eqx.field(static=True)

    def __call__(self, model: UNet, model_state: None, images: Array, keys: RowKeys):
        alpha_bars = jnp.asarray(self.schedule.alpha_bars)

        def one(image: Array, key: PRNGKeyArray) -> Float[Array, ""]:
            step_key, noise_key = jax.random.split(key)
            t = jax.random.randint(step_key, (), 0, self.schedule.steps)
            noise = jax.random.normal(noise_key, image.shape)
            noisy = jnp.sqrt(alpha_bars[t]) * image + jnp.sqrt(1 - alpha_bars[t]) * noise
            return jnp.mean((model(noisy, t.astype(jnp.float32) / self.schedule.steps) - noise) ** 2)

        loss = jnp.mean(jax.vmap(one)(to_signed(images), keys))
        return loss, ({"loss": loss}, model_state)


class DDIM(eqx.Module):
    """`sample(model, _, keys) -> images in [-1, 1]`: DDIM with eta 0 from the noise of each key, over
    `steps` steps of the schedule evenly spaced from its last step to its first. (A module, not a closure:
    equal samplers share their compiled programs.)"""

    schedule: Schedule = eqx.field(static=True)
    steps: int = eqx.field(static=True)

    def __call__(self, model: UNet, _: Any, keys: jax.Array) -> Float[Array, "batch height width channels"]:
        total = self.schedule.steps
        steps = np.round(np.linspace(total - 1, 0, min(self.steps, total))).astype(np.int32)
        alpha_bars = self.schedule.alpha_bars
        now, after = alpha_bars[steps], np.append(alpha_bars[steps[1:]], np.float32(1))  # after the last: the image

        def one(key: PRNGKeyArray) -> Float[Array, "height width channels"]:
            def denoise(x: Array, at: tuple[Array, Array, Array]) -> tuple[Array, None]:
                t, a_now, a_after = at
                noise = model(x, t.astype(jnp.float32) / total)
                image = jnp.clip((x - jnp.sqrt(1 - a_now) * noise) / jnp.sqrt(a_now), -1, 1)
                return jnp.sqrt(a_after) * image + jnp.sqrt(1 - a_after) * noise, None

            start = jax.random.normal(key, (model.height, model.width, model.channels))
            image, _ = jax.lax.scan(denoise, start, (jnp.asarray(steps), jnp.asarray(now), jnp.asarray(after)))
            return image

        return jax.vmap(one)(keys)


def sampler(config: Config) -> DDIM:
    return DDIM(Schedule(config.diffusion_steps), config.sample_steps)


class TestLoss(eqx.Module):
    """The denoising loss of one evaluation batch of test images, each from its fixed step and noise (the
    evaluation's keys), summed over the batch's real rows."""

    schedule: Schedule = eqx.field(static=True)

    def __call__(self, model: UNet, _: Any, images: Array, mask: Array, key: PRNGKeyArray) -> dict[str, Array]:
        loss = DenoisingLoss(self.schedule)
        losses = jax.vmap(lambda image, k: loss(model, None, image[None], jax.random.split(k, 1))[0])(
            images, jax.random.split(key, images.shape[0])
        )
        return {"loss": jnp.sum(losses * mask)}


def build_state(config: Config, image_shape: tuple[int, int, int]) -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    height, width, channels = image_shape
    model = UNet(channels, config.features, config.levels, height=height, width=width, key=model_key)
    return TrainState.create(model, optimizer(config.training.lr), key=train_key)


@functools.cache
def optimizer(lr: float) -> optax.GradientTransformation:
    """Adam after clipping the gradient's norm to 1 (DDPM's), the learning rate in its state
    (`inject_hyperparams`: seeds and rates train as one population). One object per rate: runs in one
    process whose states hold the same object share the compiled step."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=lr))


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr diffusion --data PATH` uses it)."""
    if config.data is None:
        raise ConfigError(f"--data names the images to train on: {FORMATS_HELP}")
    if config.sample_steps > config.diffusion_steps:
        raise ConfigError(
            f"--sample-steps {config.sample_steps} is more than --diffusion-steps {config.diffusion_steps}"
        )
    data = read_image_data(config.data, image_column=config.image_column, label_column=config.label_column)
    image_shape = data.train.inputs.shape[1:]
    height, width, _ = image_shape
    if height % 2**config.levels or width % 2**config.levels:
        raise ConfigError(
            f"--levels {config.levels} halves the resolution {config.levels} times; {height}x{width} does not"
        )
    if config.training.batch_size > len(data.train.inputs):
        raise ConfigError(f"--batch-size {config.training.batch_size} is more than the {len(data.train.inputs)} images")
    train_data = DeviceLoader(data.train.inputs, None, config.training.batch_size, seed=config.training.seed)
    test_data = DeviceLoader(data.test.inputs, None, min(500, len(data.test.inputs)), shuffle=False)
    schedule, sample = Schedule(config.diffusion_steps), sampler(config)
    judge = None if config.judge is None else load_judge(config.judge, image_shape)
    evaluators = [batch_evaluator(TestLoss(schedule))] + ([] if judge is None else [frechet_evaluator(judge, sample)])

    def baselines(run: RunDir, summary: dict[str, Any]) -> dict[str, float]:
        """The Fréchet distances to read the run's beside: of as many training images, of the untrained model."""
        return frechet_baselines(judge, sample, build_state(config, image_shape), data.train.inputs, test_data)

    return Setup(
        build_state=lambda: build_state(config, image_shape),
        train_data=train_data,
        num_steps=config.steps,
        eval_data=test_data,
        step=SupervisedStep(DenoisingLoss(schedule)),
        evaluator=combined_evaluator(*evaluators),
        summarize_run=None if judge is None else baselines,
        draw=lambda state, directory: draw_samples(directory / "samples.png", sample, state),
    )


def main(config: Config) -> dict:
    summary = run_experiment("diffusion", config, setup(config))
    print_frechet("diffusion", summary)
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
