"""Image classification on your own data: MNIST-style IDX files, CIFAR-10/100 binary batches, a folder of
images per class, a Hugging Face datasets directory, or a .npz (`--data PATH`;
`research.data.read_image_data`). A ResNet for 28-32 px images (`research.nn.ImageResNet`, BatchNorm
through explicit state), random crops and flips drawn on the device per example, label smoothing, SGD with
Nesterov momentum or AdamW under a warmup + cosine schedule.

    ./scripts/run images --data ~/data/cifar-10-batches-bin --flip --epochs 30
"""

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import (
    ConfigError,
    TrainConfig,
    Training,
    group,
    main_entry,
    non_negative,
    option,
    positive,
    unit_interval,
)
from research.data import (
    FORMATS_HELP,
    ArrayDataset,
    Batch,
    GrainLoader,
    ImageData,
    TorchLoader,
    eval_loader,
    make_dataloader,
    random_crop_flip,
    read_image_data,
    train_and_eval_loaders,
    validation_rows,
)
from research.experiment import Setup, run_experiment
from research.nn import build_model
from research.parallel import batch_axis_name
from research.train import SupervisedStep, TrainState, classification_metrics, example_keys, forward


@dataclasses.dataclass(frozen=True)
class ImagesTraining(Training):
    lr: float = option(
        0.1, "peak learning rate (after a warmup of one epoch; cosine decay to 0)", check=positive, vmappable=True
    )
    batch_size: int = option(128, "examples per training step", check=positive)
    steps_per_call: int = option(10, "training steps per compiled call (device loader)", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a ResNet on the images of --data (its training set; evaluated on its test set)."""

    training: ImagesTraining = group(ImagesTraining)
    data: str | None = option(None, f"the images: {FORMATS_HELP} (default: none; required)")
    epochs: int = option(30, "passes over the training set", check=positive, resumable=True)
    optimizer: Literal["sgd", "adamw"] = option(
        "sgd", "sgd: Nesterov momentum 0.9 with L2 weight decay; adamw: decoupled weight decay"
    )
    weight_decay: float = option(5e-4, "weight decay", check=non_negative, vmappable=True)
    label_smoothing: float = option(0.1, "label smoothing of the training loss", check=unit_interval)
    features: int = option(16, "channels of the ResNet's first stage (then twice, four times)", check=positive)
    blocks: int = option(2, "residual blocks a stage (3: ResNet-20)", check=positive)
    crop_padding: int = option(
        4, "random crops of the image padded by this many pixels (0: no crops)", check=non_negative
    )
    flip: bool = option(False, "random left-right flips (natural images, CIFAR; not digits or letters)")
    val_size: int = option(0, "training images held out as a validation set, evaluated as val/...", check=non_negative)
    loader: Literal["device", "torch", "grain"] = option(
        "device",
        "device: the images on the device, batches gathered there; torch: a torch DataLoader; grain: "
        "Grain. Both stream the images from disk (an uncompressed IDX or .npy file, or a datasets directory's "
        "Arrow files, memory-mapped: a data set larger than memory), each process reading only its rows of every "
        "batch",
    )
    workers: int = option(
        2,
        "torch: DataLoader worker processes; grain: reading threads (0: read in the training process)",
        check=non_negative,
    )


@dataclasses.dataclass(frozen=True)
class AugmentedLoss:
    """Mean label-smoothed cross-entropy of the batch's images, each randomly cropped and flipped on the
    device with its own key; metrics: that loss and the accuracy on the augmented images."""

    crop_padding: int
    flip: bool
    label_smoothing: float

    def __call__(self, model, model_state, batch, key):
        augment_key, model_key = jax.random.split(key)
        keys = example_keys(augment_key, batch.labels.shape[0])
        images = random_crop_flip(batch.inputs, keys, padding=self.crop_padding, flip=self.flip)
        logits, model_state = forward(model, model_state, images, key=model_key)
        _, correct = classification_metrics(logits, batch.labels)
        targets = optax.smooth_labels(jax.nn.one_hot(batch.labels, logits.shape[1]), self.label_smoothing)
        loss = jnp.mean(optax.softmax_cross_entropy(logits, targets))
        return loss, ({"loss": loss, "accuracy": jnp.mean(correct.astype(jnp.float32))}, model_state)


def schedule_shape(steps_per_epoch: int, num_steps: int) -> optax.Schedule:
    """The learning rate's shape, 0 to 1: a linear warmup over the first epoch, then cosine decay to 0."""
    return optax.warmup_cosine_decay_schedule(0.0, 1.0, min(steps_per_epoch, num_steps // 2), num_steps)


def optimizer(config: Config, shape: optax.Schedule) -> optax.GradientTransformation:
    """The learning rate and the weight decay live in the optimizer's state (`inject_hyperparams`), so runs
    that differ in them train as one vmapped population (`scripts/sweep --vmapped`)."""
    if config.optimizer == "sgd":
        decay = optax.inject_hyperparams(optax.add_decayed_weights)(weight_decay=config.weight_decay)
        sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=config.training.lr, momentum=0.9, nesterov=True)
        return optax.chain(decay, sgd, optax.scale_by_schedule(shape))
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=config.training.lr, weight_decay=config.weight_decay)
    return optax.chain(adamw, optax.scale_by_schedule(shape))


def channel_statistics(images: np.ndarray, rows: np.ndarray, chunk: int = 4096) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation (0-1 units) of `images[rows]`, a chunk at a time (a
    memory-mapped set is read once, never whole into memory)."""
    channels = images.shape[-1]
    total, squares, count = np.zeros(channels), np.zeros(channels), 0
    for start in range(0, len(rows), chunk):
        pixels = np.asarray(images[np.sort(rows[start : start + chunk])], np.float64).reshape(-1, channels) / 255
        total, squares, count = total + pixels.sum(0), squares + np.square(pixels).sum(0), count + len(pixels)
    mean = total / count
    return mean.tolist(), np.sqrt(np.maximum(squares / count - mean**2, 1e-12)).tolist()


def build_state(
    config: Config, data: ImageData, statistics: tuple[list[float], list[float]], shape: optax.Schedule
) -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    height, width, channels = data.image_shape
    mean, std = statistics  # of the training images, to normalise by
    model, model_state = build_model(
        "image_resnet",
        height=height,
        width=width,
        channels=channels,
        classes=len(data.classes),
        features=config.features,
        blocks=config.blocks,
        mean=mean,
        std=std,
        axis_name=batch_axis_name(config.devices.parallel, config.devices.deterministic_reduction),
        key=model_key,
    )
    return TrainState.create(model, optimizer(config, shape), key=train_key, model_state=model_state)


def loaders(config: Config, data: ImageData, kept: np.ndarray, held_out: np.ndarray) -> tuple[Any, Any, Any]:
    """(train, test, validation or None): on the device, or streamed from the (memory-mapped) arrays."""
    train, test = data.train, data.test
    if config.loader == "device":
        train_data, test_data = train_and_eval_loaders(
            Batch(train.inputs[kept], train.labels[kept]),
            test,
            config.training.batch_size,
            seed=config.training.seed,
            eval_batch_size=500,
        )
        held = Batch(train.inputs[held_out], train.labels[held_out])
        return train_data, test_data, eval_loader(held, 500) if len(held_out) else None
    rows = None if len(kept) == len(train.labels) else kept
    train_set = ArrayDataset(train.inputs, train.labels, rows)
    if config.loader == "torch":
        train_data = TorchLoader(
            train_set, config.training.batch_size, seed=config.training.seed, num_workers=config.workers
        )
    else:
        train_data = GrainLoader(
            train_set, config.training.batch_size, seed=config.training.seed, workers=config.workers
        )
    in_order = lambda dataset: make_dataloader(dataset, min(500, len(dataset)), shuffle=False)  # noqa: E731
    validation = in_order(ArrayDataset(train.inputs, train.labels, held_out)) if len(held_out) else None
    return train_data, in_order(ArrayDataset(test.inputs, test.labels)), validation


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr images --data PATH` uses it)."""
    if config.data is None:
        raise ConfigError(f"--data names the images to train on: {FORMATS_HELP}")
    data = read_image_data(config.data, mmap=config.loader != "device")
    kept, held_out = validation_rows(len(data.train.labels), config.val_size)
    train_data, test_data, val_data = loaders(config, data, kept, held_out)
    statistics = channel_statistics(data.train.inputs, kept)
    num_steps = config.epochs * train_data.steps_per_epoch
    shape = schedule_shape(train_data.steps_per_epoch, num_steps)
    return Setup(
        build_state=lambda: build_state(config, data, statistics, shape),
        train_data=train_data,
        eval_data=test_data,
        val_data=val_data,
        num_steps=num_steps,
        step=SupervisedStep(AugmentedLoss(config.crop_padding, config.flip, config.label_smoothing)),
        lr_schedule=lambda step: config.training.lr * shape(step),
    )


def main(config: Config) -> dict:
    return run_experiment("images", config, setup(config))


if __name__ == "__main__":
    main_entry(main, Config)
