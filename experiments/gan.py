"""A DCGAN (Radford et al. 2016) on the images of --data: a generator and a discriminator, each with its
own Adam, trained by alternating updates through the engine, as a `Step` of its own (`GANStep`).

Each step takes `--critic-steps` discriminator updates, each on `--batch-size` real images and as many
generated ones, then one generator update (the non-saturating loss). A grid of samples from fixed latents
is saved at every evaluation (`samples.png`), and every evaluation reports the discriminator's loss on the
test images against as many generated ones (`d_loss`, `d_real`, `d_fake`). With `--judge RUN_DIR` (a
classifier `images` trained on the same data) it reports `fid` too: the Fréchet distance between as many
generated images as the test set holds and the test images, in the judge's feature space; the summary adds
the distance of the untrained generator and of as many training images (the floor sampling noise alone
gives). `--ema-decay` samples from an EMA of the generator's weights. Run `./scripts/run gan --help` for
the options.

    ./scripts/run images --data data/digits8.npz --crop-padding 0 --epochs 15 --run-dir runs/judge8
    ./scripts/run gan --data data/digits8.npz --judge runs/judge8
"""

import dataclasses
import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from research.cli import ConfigError, TrainConfig, Training, group, main_entry, option, positive, unit_interval
from research.data import FORMATS_HELP, IMAGE_COLUMN_HELP, LABEL_COLUMN_HELP, DeviceLoader, read_image_data
from research.experiment import Setup, run_experiment
from research.judge import draw_samples, frechet_baselines, frechet_evaluator, load_judge, print_frechet
from research.nn import Discriminator, Generator
from research.services import Headline, RunDir
from research.train import AbstractNetworksState, GlobalBatch, Network, Step
from research.train.evaluation import combined_evaluator, evaluate_batches, mean_of_sums
from research.train.precision import InPrecision, Precision
from research.typing import Array, Float, PRNGKeyArray, RowKeys


@dataclasses.dataclass(frozen=True)
class GanTraining(Training):
    lr: float = option(2e-4, "Adam learning rate of both networks", check=positive, vmappable=True)
    batch_size: int = option(64, "real images a discriminator update (and generated ones)", check=positive)
    steps_per_call: int = option(10, "training steps per compiled call", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)
    eval_every: int = option(500, "steps between evaluations (samples.png, and fid with --judge)", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a DCGAN on the training images of --data (labels unused)."""

    headline: ClassVar[Headline] = Headline("fid", goal="min", percent=False)
    training: GanTraining = group(GanTraining)
    data: str | None = option(None, f"the images: {FORMATS_HELP} (default: none; required)")
    image_column: str | None = option(None, IMAGE_COLUMN_HELP)
    label_column: str | None = option(None, LABEL_COLUMN_HELP)
    steps: int = option(3000, "generator updates", check=positive, resumable=True)
    latent: int = option(64, "size of the generator's latent vector", check=positive)
    features: int = option(32, "channels of both networks' widest-resolution layer", check=positive)
    critic_steps: int = option(1, "discriminator updates a generator update", check=positive)
    beta1: float = option(0.5, "Adam's first-moment decay (DCGAN's 0.5)", check=unit_interval)
    judge: str | None = option(
        None, "an `images` run trained on the same data, whose features measure the Fréchet distance (fid)"
    )


class GANState(AbstractNetworksState):
    """A GAN's train state: the generator (the run's model) and the discriminator, each with its Adam."""

    generator: Network
    discriminator: Network


def to_signed(images: Array) -> Float[Array, "*batch height width channels"]:
    """Stored images (uint8 0-255) in the generator's range, [-1, 1]."""
    return images.astype(jnp.float32) / 127.5 - 1


def latents(keys: RowKeys, size: int) -> Float[Array, "rows latent"]:
    """One latent vector a row, from the row's key (a loss's `keys`: its key in the global batch)."""
    return jax.vmap(lambda k: jax.random.normal(k, (size,)))(keys)


class DiscriminatorLoss(eqx.Module):
    """The discriminator's loss on real images and as many of the (fixed) generator's: softplus(-D(real))
    + softplus(D(fake)), averaged; metrics: that loss, and D's mean probability of "real" on each kind."""

    generator: Generator
    latent: int = eqx.field(static=True)

    def __call__(self, discriminator: Discriminator, _: None, images: Array, keys: RowKeys):
        fake = jax.vmap(self.generator)(latents(keys, self.latent))
        real_logits, fake_logits = jax.vmap(discriminator)(to_signed(images)), jax.vmap(discriminator)(fake)
        loss = jnp.mean(jax.nn.softplus(-real_logits)) + jnp.mean(jax.nn.softplus(fake_logits))
        metrics = {
            "d_loss": loss,
            "d_real": jnp.mean(jax.nn.sigmoid(real_logits)),
            "d_fake": jnp.mean(jax.nn.sigmoid(fake_logits)),
        }
        return loss, (metrics, None)


class GeneratorLoss(eqx.Module):
    """The generator's non-saturating loss against the (fixed) discriminator: softplus(-D(G(z))), averaged
    over as many latents as the batch has rows."""

    discriminator: Discriminator
    latent: int = eqx.field(static=True)

    def __call__(self, generator: Generator, _: None, images: Array, keys: RowKeys):
        fake = jax.vmap(generator)(latents(keys, self.latent))
        loss = jnp.mean(jax.nn.softplus(-jax.vmap(self.discriminator)(fake)))
        return loss, ({"g_loss": loss}, None)


class GANStep(Step):
    """`critic_steps` discriminator updates, each on every `critic_steps`-th row of the batch (rows `i`,
    `i + critic_steps`, ...: on any placement the same images), then one generator update. Metrics: the last
    discriminator update's `d_loss`, `d_real`, `d_fake`, the generator's `g_loss`, and both gradients' norms.
    `grad_accum` (`--grad-accum`) takes each gradient in parts; `precision` (`--precision`) computes each
    network's loss in it (the other network in float32)."""

    latent: int = eqx.field(static=True)
    critic_steps: int = eqx.field(static=True, default=1)
    grad_accum: int = eqx.field(static=True, default=1)
    precision: Precision = eqx.field(static=True, default="float32")
    finite_metrics: ClassVar[tuple[str, ...]] = ("d_loss", "g_loss", "d_grad_norm", "g_grad_norm")

    def with_grad_accum(self, grad_accum: int) -> "GANStep":
        return dataclasses.replace(self, grad_accum=grad_accum)

    def with_precision(self, precision: Precision) -> "GANStep":
        return dataclasses.replace(self, precision=precision)

    def _in_precision(self, loss: Any) -> Any:
        return loss if self.precision == "float32" else InPrecision(loss, self.precision)

    def __call__(self, state: GANState, batch: Array, key: PRNGKeyArray, global_batch: GlobalBatch):
        keys = jax.random.split(key, self.critic_steps + 1)
        generator = state.generator.model
        for i in range(self.critic_steps):
            d_loss = self._in_precision(DiscriminatorLoss(generator, self.latent))
            (_, (metrics, _)), d_grads = global_batch.value_and_grad(
                d_loss,
                state.discriminator.model,
                None,
                batch[i :: self.critic_steps],
                keys[i],
                grad_accum=self.grad_accum,
            )
            state = state.updated("discriminator", d_grads)
        g_loss = self._in_precision(GeneratorLoss(state.discriminator.model, self.latent))
        (_, (g_metrics, _)), g_grads = global_batch.value_and_grad(
            g_loss, generator, None, batch[:: self.critic_steps], keys[-1], grad_accum=self.grad_accum
        )
        norms = {"d_grad_norm": optax.tree.norm(d_grads), "g_grad_norm": optax.tree.norm(g_grads)}
        return state.updated("generator", g_grads), {**metrics, **g_metrics, **norms}


class HeldOut(eqx.Module):
    """One evaluation batch: the discriminator's loss on the test images against as many generated ones, and
    its mean probability of "real" on each (sums over the batch's real rows). A discriminator that has learned
    its training images by heart tells the test images from generated ones no better than chance."""

    latent: int = eqx.field(static=True)

    def __call__(self, networks: tuple[Generator, Discriminator], _: None, images: Array, mask: Array, key: Any):
        generator, discriminator = networks
        fake = jax.vmap(lambda k: generator(jax.random.normal(k, (self.latent,))))(jax.random.split(key, len(images)))
        real_logits, fake_logits = jax.vmap(discriminator)(to_signed(images)), jax.vmap(discriminator)(fake)
        losses = jax.nn.softplus(-real_logits) + jax.nn.softplus(fake_logits)
        return {
            "d_loss": jnp.sum(losses * mask),
            "d_real": jnp.sum(jax.nn.sigmoid(real_logits) * mask),
            "d_fake": jnp.sum(jax.nn.sigmoid(fake_logits) * mask),
        }


def held_out_evaluator(config: Config):
    """`d_loss`, `d_real`, `d_fake` of the discriminator on the test images and the generator's images."""
    per_batch = eqx.filter_jit(HeldOut(config.latent))

    def evaluate(state: GANState, data: Any, *, progress: bool = False) -> dict[str, float]:
        networks = eqx.nn.inference_mode((state.model, state.discriminator.model))
        return mean_of_sums(*evaluate_batches(per_batch, networks, None, data, progress=progress))

    return evaluate


class Sampler(eqx.Module):
    """`sample(generator, _, keys) -> images in [-1, 1]`, one a key: what evaluation, samples.png and
    `scripts/sample` draw. (A module, not a closure: equal samplers share their compiled programs.)"""

    latent: int = eqx.field(static=True)

    def __call__(self, generator: Generator, _: Any, keys: jax.Array) -> Float[Array, "batch height width channels"]:
        return jax.vmap(lambda k: generator(jax.random.normal(k, (self.latent,))))(keys)


def sampler(config: Config) -> Sampler:
    return Sampler(config.latent)


@functools.cache
def adam(lr: float, beta1: float) -> optax.GradientTransformation:
    """Adam with the learning rate in its state (`inject_hyperparams`), so seeds and rates train as one
    population. One object per setting: the optimizer is a static field of the state, and runs in one process
    (a sweep's, a test's) whose states hold the same object share the compiled step."""
    return optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=beta1)


def build_state(config: Config, image_shape: tuple[int, int, int]) -> GANState:
    g_key, d_key, train_key = jax.random.split(jax.random.key(config.training.seed), 3)
    height, width, channels = image_shape
    generator = Generator(config.latent, height, width, channels, config.features, key=g_key)
    discriminator = Discriminator(height, width, channels, config.features, key=d_key)
    optimizer = adam(config.training.lr, config.beta1)
    return GANState.create(
        generator=Network.create(generator, optimizer),
        discriminator=Network.create(discriminator, optimizer),
        key=train_key,
    )


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr gan --data PATH` uses it)."""
    if config.data is None:
        raise ConfigError(f"--data names the images to train on: {FORMATS_HELP}")
    data = read_image_data(config.data, image_column=config.image_column, label_column=config.label_column)
    image_shape = data.train.inputs.shape[1:]
    height, width, _ = image_shape
    if height % 4 or width % 4:
        raise ConfigError(f"--data: the generator doubles its resolution twice; {height}x{width} images are not")
    rows = config.training.batch_size * config.critic_steps  # a step's real images: one batch per critic update
    if rows > len(data.train.inputs):
        raise ConfigError(
            f"--batch-size {config.training.batch_size} x --critic-steps {config.critic_steps} = {rows} images a "
            f"step, more than the {len(data.train.inputs)} training images"
        )
    train_data = DeviceLoader(data.train.inputs, None, rows, seed=config.training.seed)
    judge = None if config.judge is None else load_judge(config.judge, image_shape)
    test_data = DeviceLoader(data.test.inputs, None, min(500, len(data.test.inputs)), shuffle=False)
    sample = sampler(config)
    evaluators = [held_out_evaluator(config)] + ([] if judge is None else [frechet_evaluator(judge, sample)])

    def baselines(run: RunDir, summary: dict[str, Any]) -> dict[str, float]:
        """The Fréchet distances to read the run's beside: of as many training images, of the untrained model."""
        return frechet_baselines(judge, sample, build_state(config, image_shape), data.train.inputs, test_data)

    return Setup(
        build_state=lambda: build_state(config, image_shape),
        train_data=train_data,
        num_steps=config.steps,
        eval_data=test_data,
        step=GANStep(config.latent, config.critic_steps),
        evaluator=combined_evaluator(*evaluators),
        summarize_run=None if judge is None else baselines,
        draw=lambda state, directory: draw_samples(directory / "samples.png", sample, state),
    )


def main(config: Config) -> dict:
    summary = run_experiment("gan", config, setup(config))
    print_frechet("gan", summary)
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
