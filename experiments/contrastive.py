"""SimCLR (Chen et al. 2020) on the images of --data: two views of every image, each randomly cropped and
resized, its intensity (and, for colour images, its colour) jittered, and flipped with --flip, drawn on the
device with the image's own key; a ResNet encoder (`research.nn.ImageResNet`) and a projection head; NT-Xent
at --temperature over the GLOBAL batch (`research.train.nt_xent`). No labels train: they only evaluate.

The loss of one view depends on every other view of the batch, so it is no mean of per-example terms, and
its gradient is not a mean of the devices' (or micro-batches', or parts') gradients. It is a
`research.train.AbstractBatchLoss`: the engine's `SupervisedStep` takes its gradient through
`GlobalBatch.value_and_grad`, which gathers every device's embeddings, computes the loss and its gradient of
the whole global batch, and pulls each device's share back through its rows (`research/train/_batch_loss.py`).
The same function of the global batch on 1, 2 or 4 devices: to float rounding, and to the bit with
`--deterministic-reduction`.

Every evaluation fits a linear probe (logistic regression, L-BFGS) on the frozen encoder's features of the
training images and reports its accuracy on the test images (`probe_accuracy`, the headline) and a weighted
20-nearest-neighbour vote's beside it (`knn_accuracy`); the summary adds both for the encoder as it starts
(`probe_accuracy_init`, `knn_accuracy_init`), and `views.png` shows eight training images and two views of
each. Run `./scripts/run contrastive --help` for the options.

    ./scripts/run contrastive --data data/digits8.npz
"""

import dataclasses
import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import ConfigError, TrainConfig, Training, group, main_entry, non_negative, option, positive
from research.data import (
    FORMATS_HELP,
    IMAGE_COLUMN_HELP,
    LABEL_COLUMN_HELP,
    DeviceLoader,
    colour_jitter,
    random_crop_flip,
    random_resized_crop,
    read_image_data,
)
from research.experiment import Setup, run_experiment
from research.nn import ImageResNet
from research.parallel import batch_axis_name
from research.report import save_image_grid
from research.services import Headline, RunDir
from research.train import AbstractBatchLoss, SupervisedStep, TrainState, forward, nt_xent
from research.train.evaluation import probe_evaluator
from research.typing import Array, Float, Integer, RowKeys


@dataclasses.dataclass(frozen=True)
class ContrastiveTraining(Training):
    lr: float = option(2e-3, "peak AdamW learning rate (warmup over the first 5%, cosine to 0)", vmappable=True)
    batch_size: int = option(
        256, "images a step: 2x as many views, each contrasted with all the others", check=positive
    )
    steps_per_call: int = option(10, "training steps per compiled call", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)
    eval_every: int = option(100, "steps between evaluations (linear probe and k-NN)", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """SimCLR on the training images of --data; evaluated by a linear probe (and k-NN) on the frozen encoder's
    features of the labelled training images, measured on the test images. The loss is one of the whole
    global batch: --devices, --parallel and --deterministic-reduction change where it is computed, not
    what; --grad-accum and --micro-batches embed a part of the batch at a time, gather every part's
    embeddings, and pull the loss's gradient back part by part (the gathered-embedding trick: the same
    loss and gradient, BatchNorm's statistics aside, which each part computes on its own). DP-SGD does not
    apply (a per-example clip is not defined for a loss of the whole batch); --precision bf16 is refused."""

    headline: ClassVar[Headline] = Headline("probe_accuracy")
    training: ContrastiveTraining = group(ContrastiveTraining)
    data: str | None = option(None, f"the images: {FORMATS_HELP} (default: none; required)")
    image_column: str | None = option(None, IMAGE_COLUMN_HELP)
    label_column: str | None = option(None, LABEL_COLUMN_HELP)
    epochs: int = option(100, "passes over the training images", check=positive, resumable=True)
    temperature: float = option(0.2, "NT-Xent's temperature", check=positive)
    features: int = option(16, "channels of the ResNet's first stage (then twice, four times)", check=positive)
    blocks: int = option(2, "residual blocks a stage", check=positive)
    projection: int = option(64, "size of the projection head's output, where the loss compares views", check=positive)
    weight_decay: float = option(1e-4, "AdamW's weight decay", check=non_negative, vmappable=True)
    crop_scale: float = option(0.4, "the smallest fraction of an image's area a random crop keeps", check=positive)
    jitter: float = option(
        0.4, "brightness and contrast (and saturation) jitter: factors drawn in 1 +- this", check=non_negative
    )
    flip: bool = option(False, "random left-right flips (natural images; not digits)")
    neighbours: int = option(20, "k of the k-nearest-neighbour evaluation", check=positive)


@dataclasses.dataclass(frozen=True)
class Views:
    """Two views of an image (uint8), each its own random resized crop, intensity jitter (colour jitter and a
    grey view one time in five for colour images) and, with `flip`, left-right flip; 0-1 floats."""

    crop_scale: float
    jitter: float
    flip: bool

    def __call__(self, images: Array, keys: Array) -> Float[Array, "views height width channels"]:
        crop_keys, jitter_keys, flip_keys = (jax.vmap(lambda k: jax.random.split(k, 3))(keys)).swapaxes(0, 1)
        views = random_resized_crop(images.astype(jnp.float32) * (1 / 255), crop_keys, scale=(self.crop_scale, 1.0))
        views = colour_jitter(
            views,
            jitter_keys,
            brightness=self.jitter,
            contrast=self.jitter,
            saturation=self.jitter,
            grey_probability=0.2,
        )
        return random_crop_flip(views, flip_keys, padding=0, flip=self.flip)

    def pairs(self, images: Array, keys: RowKeys) -> Float[Array, "views height width channels"]:
        """Two views of each image, `[2 * images, ...]` (an image's two side by side), from its key (a loss's
        `keys`: its key in the global batch, so the same views however the batch is split)."""
        view_keys = jax.vmap(lambda k: jax.random.split(k, 2))(keys).reshape(-1)
        return self(jnp.repeat(images, 2, axis=0), view_keys)


class SimCLRNet(eqx.Module):
    """An `ImageResNet` encoder whose head is the projection's hidden layer, then ReLU and a linear layer: the
    projection the loss compares. `features` (the encoder's pooled activations) is what the probe reads."""

    encoder: ImageResNet
    projection: eqx.nn.Linear
    stateful = True

    def __call__(
        self, x: Float[Array, "height width channels"], state: eqx.nn.State, *, key: Any = None
    ) -> tuple[Float[Array, " projection"], eqx.nn.State]:
        hidden, state = self.encoder(x, state)
        return self.projection(jax.nn.relu(hidden)), state

    def features(
        self, x: Integer[Array, "height width channels"] | Float[Array, "height width channels"], state: eqx.nn.State
    ) -> tuple[Float[Array, " features"], eqx.nn.State]:
        return self.encoder.features(x, state)


class SimCLRLoss(AbstractBatchLoss):
    """NT-Xent over the two views of every image of the global batch."""

    views: Views = eqx.field(static=True)
    temperature: float = eqx.field(static=True)

    def embed(self, model: SimCLRNet, model_state: eqx.nn.State, images: Array, keys: RowKeys):
        embeddings, model_state = forward(model, model_state, self.views.pairs(images, keys), key=None)
        return embeddings.reshape(images.shape[0], 2, -1), model_state

    def loss(self, embeddings: Array):
        return nt_xent(embeddings, self.temperature)


def encoder_features(model: SimCLRNet, model_state: eqx.nn.State, images: Array) -> Float[Array, "batch features"]:
    """The frozen encoder's features of a batch of images (the model in inference mode)."""
    return jax.vmap(lambda x: model.features(x, model_state)[0])(images)


@functools.cache
def optimizer(lr: float, weight_decay: float, num_steps: int) -> optax.GradientTransformation:
    """AdamW under a linear warmup over the first 5% of the steps and a cosine decay to 0; the rate and the decay
    in its state (`inject_hyperparams`: seeds and rates train as one population). One object per setting."""
    shape = optax.warmup_cosine_decay_schedule(0.0, 1.0, max(1, num_steps // 20), num_steps)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=weight_decay)
    return optax.chain(adamw, optax.scale_by_schedule(shape))


def build_state(config: Config, images: np.ndarray, num_steps: int) -> TrainState:
    model_key, head_key, train_key = jax.random.split(jax.random.key(config.training.seed), 3)
    _, height, width, channels = images.shape
    # normalise by the pixels' per-channel statistics, of at most ~4,096 images (a large set is not copied whole)
    pixels = images[:: max(1, len(images) // 4096)].reshape(-1, channels) / 255
    axis_name = batch_axis_name(config.devices.parallel, config.devices.deterministic_reduction)
    hidden = 4 * config.features
    encoder, model_state = eqx.nn.make_with_state(ImageResNet)(
        height,
        width,
        channels,
        hidden,
        config.features,
        config.blocks,
        pixels.mean(0).tolist(),
        (pixels.std(0) + 1e-3).tolist(),
        axis_name,
        key=model_key,
    )
    model = SimCLRNet(encoder, eqx.nn.Linear(hidden, config.projection, key=head_key))
    opt = optimizer(config.training.lr, config.weight_decay, num_steps)
    return TrainState.create(model, opt, key=train_key, model_state=model_state)


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr contrastive --data PATH` uses it)."""
    if config.data is None:
        raise ConfigError(f"--data names the images to train on: {FORMATS_HELP}")
    if config.crop_scale > 1:
        raise ConfigError(f"--crop-scale is a fraction of the image's area, at most 1 (got {config.crop_scale})")
    data = read_image_data(config.data, image_column=config.image_column, label_column=config.label_column)
    train, test = data.train, data.test
    if config.training.batch_size > len(train.inputs):
        raise ConfigError(f"--batch-size {config.training.batch_size} is more than the {len(train.inputs)} images")
    train_data = DeviceLoader(train.inputs, None, config.training.batch_size, seed=config.training.seed)
    num_steps = config.epochs * train_data.steps_per_epoch
    labelled = lambda split: DeviceLoader(split.inputs, split.labels, min(500, len(split.inputs)), shuffle=False)  # noqa: E731
    evaluator = probe_evaluator(encoder_features, labelled(train), classes=len(data.classes), k=config.neighbours)
    views = Views(config.crop_scale, config.jitter, config.flip)
    start = lambda: build_state(config, train.inputs, num_steps)  # noqa: E731

    def summarize(run: RunDir, summary: dict[str, Any]) -> dict[str, Any]:
        """The probe's and k-NN's accuracy of the encoder as it starts; `views.png`: eight training images
        (top row) and two views of each."""
        pairs = np.asarray(views.pairs(jnp.asarray(train.inputs[:8]), jax.random.split(jax.random.key(0), 8))).reshape(
            8, 2, *data.image_shape
        )
        grid = (
            np.concatenate([train.inputs[:8, None] / 255, pairs], axis=1).swapaxes(0, 1).reshape(24, *data.image_shape)
        )
        save_image_grid(run.path / "views.png", np.round(grid * 255).astype(np.uint8), columns=8)
        initial = evaluator(start(), labelled(test))
        return {f"{name}_init": value for name, value in initial.items()}

    return Setup(
        build_state=start,
        train_data=train_data,
        num_steps=num_steps,
        eval_data=labelled(test),
        step=SupervisedStep(SimCLRLoss(views, config.temperature)),
        evaluator=evaluator,
        summarize_run=summarize,
    )


def main(config: Config) -> dict:
    summary = run_experiment("contrastive", config, setup(config))
    if "probe_accuracy_init" in summary:
        print(
            f"contrastive: linear probe {100 * summary['test_probe_accuracy']:.2f}% (k-NN "
            f"{100 * summary['test_knn_accuracy']:.2f}%); of the encoder as it started "
            f"{100 * summary['probe_accuracy_init']:.2f}% (k-NN {100 * summary['knn_accuracy_init']:.2f}%)"
        )
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
