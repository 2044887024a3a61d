"""Image classification on your own data: MNIST-style IDX files, CIFAR-10/100 binary batches, a folder of
images per class, a Hugging Face datasets directory, or a .npz (`--data PATH`;
`research.data.read_image_data`). A ResNet for 28-32 px images (`research.nn.ImageResNet`, BatchNorm
through explicit state) or a vision transformer (`--model vit`, `research.nn.VisionTransformer`), random
crops and flips drawn on the device per example, label smoothing, SGD with Nesterov momentum or AdamW under a
warmup + cosine schedule.

    ./scripts/run images --data ~/data/cifar-10-batches-bin --flip --epochs 30

`--init-from DIR` fine-tunes a ViT that Hugging Face `transformers` saved, or the model of another images
run, in full, in part (`--trainable`) or through LoRA adapters (`--lora-rank`); `scripts/export RUN_DIR
--format hf` writes a ViT back out as a directory `transformers` loads.
"""

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import (
    ConfigError,
    FineTuning,
    TrainConfig,
    Training,
    flag_name,
    group,
    main_entry,
    non_negative,
    option,
    positive,
    unit_interval,
)
from research.data import (
    FORMATS_HELP,
    IMAGE_COLUMN_HELP,
    LABEL_COLUMN_HELP,
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
from research.experiment import Setup, initial_model, run_experiment
from research.nn import ImageResNet, VisionTransformer, build_model, load_vit
from research.parallel import batch_axis_name
from research.services import Headline
from research.train import SupervisedStep, TrainState, classification_metrics, example_keys, forward
from research.train.fine_tuning import Frozen, check_fine_tuning, only_trainable, trained_pattern, with_adapters
from research.typing import PRNGKeyArray

ModelName = Literal["resnet", "vit"]
MODEL_NAMES: dict[type, ModelName] = {ImageResNet: "resnet", VisionTransformer: "vit"}
SHAPE_OPTIONS: dict[ModelName, tuple[str, ...]] = {
    "resnet": ("features", "blocks"),
    "vit": ("patch", "dim", "depth", "heads"),
}


@dataclasses.dataclass(frozen=True)
class ImagesTraining(Training):
    lr: float = option(
        0.1, "peak learning rate (after a warmup of one epoch; cosine decay to 0)", check=positive, vmappable=True
    )
    batch_size: int = option(128, "examples per training step", check=positive)
    steps_per_call: int = option(10, "training steps per compiled call (device loader)", check=positive)
    log_every: int = option(50, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class ImagesFineTuning(FineTuning):
    init_from: str | None = option(
        None,
        "start from a ViT image classifier saved by Hugging Face transformers (a save_pretrained directory; its "
        "preprocessor_config.json's normalisation) or from an images run (its trained model, not its EMA's): its "
        "model and shape (--model's options then keep their defaults). Its image size and channels must be "
        "--data's; other classes than --data's get a new head, zeros, which trains whatever --trainable says",
    )


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a ResNet or a ViT on the images of --data (its training set; evaluated on its test set)."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: ImagesTraining = group(ImagesTraining)
    data: str | None = option(None, f"the images: {FORMATS_HELP} (default: none; required)")
    image_column: str | None = option(None, IMAGE_COLUMN_HELP)
    label_column: str | None = option(None, LABEL_COLUMN_HELP)
    epochs: int = option(30, "passes over the training set", check=positive, resumable=True)
    optimizer: Literal["sgd", "adamw"] = option(
        "sgd", "sgd: Nesterov momentum 0.9 with L2 weight decay; adamw: decoupled weight decay"
    )
    weight_decay: float = option(5e-4, "weight decay", check=non_negative, vmappable=True)
    label_smoothing: float = option(0.1, "label smoothing of the training loss", check=unit_interval)
    model: ModelName | None = option(
        None,
        "resnet: an ImageResNet (--features, --blocks); vit: a VisionTransformer (--patch, --dim, --depth, --heads; "
        "square images); default: resnet, or --init-from's model",
    )
    features: int = option(16, "ResNet: channels of its first stage (then twice, four times)", check=positive)
    blocks: int = option(2, "ResNet: residual blocks a stage (3: ResNet-20)", check=positive)
    patch: int = option(
        4, "ViT: the side of the square patches, one token each (must divide the images' side)", check=positive
    )
    dim: int = option(64, "ViT: token width", check=positive)
    depth: int = option(4, "ViT: encoder blocks (stacked and run with lax.scan)", check=positive)
    heads: int = option(4, "ViT: attention heads (must divide --dim)", check=positive)
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
    fine_tuning: ImagesFineTuning = group(ImagesFineTuning)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


@dataclasses.dataclass(frozen=True)
class AugmentedLoss:
    """Mean label-smoothed cross-entropy of the batch's images, each randomly cropped and flipped on the
    device with its own key; metrics: that loss and the accuracy on the augmented images.

    It takes the batch's one key and splits it itself (`example_keys`: each image's key in the global batch,
    so layout-free), which keeps the numbers of the runs made before losses got one key a row."""

    takes_batch_key: ClassVar[bool] = True
    layout_free: ClassVar[bool] = True
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


@dataclasses.dataclass(frozen=True)
class Initial:
    """The model (and its state) `--init-from` starts from, made ready for this run's data; `new` names the
    layers made afresh (`("head",)` for other classes), which train whatever `--trainable` says."""

    model: Any
    model_state: Any
    new: tuple[str, ...] = ()


def build_state(
    config: Config,
    data: ImageData,
    statistics: tuple[list[float], list[float]],
    shape: optax.Schedule,
    initial: Initial | None = None,
) -> TrainState:
    """The step-0 state: `initial`'s model or a new one, with LoRA's adapters (`--lora-rank`), and the optimizer
    on what trains (`--trainable`)."""
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    if initial is None:
        model, model_state = new_model(config, data, statistics, model_key)
    else:
        model, model_state = initial.model, initial.model_state
    model = with_adapters(model, config.fine_tuning, key=jax.random.fold_in(model_key, 1))
    transform = optimizer(config, shape)
    if pattern := trained_pattern(config.fine_tuning, initial.new if initial is not None else ()):
        transform = only_trainable(transform, pattern)
    return TrainState.create(model, transform, key=train_key, model_state=model_state)


def new_model(
    config: Config, data: ImageData, statistics: tuple[list[float], list[float]], key: PRNGKeyArray
) -> tuple[Any, Any]:
    """The model (and its state) that --model names, drawn with `key`, for the images of `data`."""
    height, width, channels = data.image_shape
    mean, std = statistics  # of the training images, to normalise by
    if config.model == "vit":
        return build_model(
            "vit",
            image_size=height,
            patch=config.patch,
            channels=channels,
            classes=len(data.classes),
            dim=config.dim,
            depth=config.depth,
            heads=config.heads,
            mean=mean,
            std=std,
            key=key,
        )
    return build_model(
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
        key=key,
    )


def _given(config: Config, names: Sequence[str]) -> list[str]:
    """The flags of the options in `names` that the config sets to other than their defaults."""
    return [flag_name(name) for name in names if getattr(config, name) != DEFAULTS[name]]


def check_model_options(config: Config, data: ImageData) -> None:
    """Refuse (one line) the other model's options, and a ViT that the images cannot feed."""
    name = config.model or "resnet"
    if given := _given(config, [n for other, names in SHAPE_OPTIONS.items() if other != name for n in names]):
        raise ConfigError(f"--model {name} takes no {', '.join(given)} (the other model's options): drop them")
    height, width, _ = data.image_shape
    if name == "vit" and height != width:
        raise ConfigError(f"--model vit takes square images; --data's are {height} x {width}")
    if name == "vit" and height % config.patch:
        raise ConfigError(f"--patch {config.patch} must divide the images' side, {height}")
    if name == "vit" and config.dim % config.heads:
        raise ConfigError(f"--heads {config.heads} must divide --dim {config.dim}")


def checked_initial(config: Config, data: ImageData) -> Initial:
    """--init-from's model, refused (before any work) where the other options or the data contradict it."""
    init_from = str(config.fine_tuning.init_from)
    if given := _given(config, [n for names in SHAPE_OPTIONS.values() for n in names]):
        raise ConfigError(f"--init-from takes the model's shape from {init_from}: drop {', '.join(given)}")
    model, model_state = initial_model(init_from, "images", load_vit)  # also refuses a damaged or foreign one
    name = MODEL_NAMES[type(model)]
    if config.model not in (None, name):
        raise ConfigError(f"--init-from {init_from} holds a {name}: drop --model {config.model}")
    if isinstance(model, VisionTransformer):
        size = (model.image_size, model.image_size, model.channels)
    else:  # its batch norm reduces over this run's axes, not over those of the run that trained it
        size = (model.height, model.width, model.channels)
        model = _with_batch_axis(
            model, batch_axis_name(config.devices.parallel, config.devices.deterministic_reduction)
        )
    if size != data.image_shape:
        raise ConfigError(
            f"--init-from {init_from} takes {'x'.join(map(str, size))} images (height x width x channels), "
            f"--data's are {'x'.join(map(str, data.image_shape))}"
        )
    if model.classes == len(data.classes):
        return Initial(model, model_state)
    return Initial(_with_new_head(model, len(data.classes)), model_state, ("head",))


def _with_new_head(model: Any, classes: int) -> Any:
    """`model` with a head of zeros for `classes` classes, as Dosovitskiy et al. (2021) fine-tune a ViT."""
    head = eqx.nn.Linear(model.head.in_features, classes, key=jax.random.key(0))
    head = eqx.tree_at(lambda h: (h.weight, h.bias), head, (jnp.zeros_like(head.weight), jnp.zeros_like(head.bias)))
    changed = eqx.tree_at(lambda m: m.head, model, head)
    object.__setattr__(changed, "classes", classes)  # a static field: not a leaf eqx.tree_at reaches
    return changed


def _with_batch_axis(model: Any, axis_name: Any) -> Any:
    """`model` with each BatchNorm layer reducing over `axis_name` (`research.parallel.batch_axis_name`)."""

    def rebound(layer: Any) -> Any:
        if not isinstance(layer, eqx.nn.BatchNorm):
            return layer
        changed = copy.copy(layer)
        object.__setattr__(changed, "axis_name", axis_name)  # static, as above
        return changed

    return jax.tree_util.tree_map(rebound, model, is_leaf=lambda x: isinstance(x, eqx.nn.BatchNorm))


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
    data = read_image_data(
        config.data, mmap=config.loader != "device", image_column=config.image_column, label_column=config.label_column
    )
    kept, held_out = validation_rows(len(data.train.labels), config.val_size)
    statistics = channel_statistics(data.train.inputs, kept)
    if config.fine_tuning.init_from is not None:
        initial = checked_initial(config, data)
        model = initial.model
    else:
        check_model_options(config, data)
        initial, model = None, eqx.filter_eval_shape(lambda: new_model(config, data, statistics, jax.random.key(0))[0])
    check_fine_tuning(model, config.fine_tuning)  # the shapes: nothing drawn
    train_data, test_data, val_data = loaders(config, data, kept, held_out)
    num_steps = config.epochs * train_data.steps_per_epoch
    shape = schedule_shape(train_data.steps_per_epoch, num_steps)
    loss = AugmentedLoss(config.crop_padding, config.flip, config.label_smoothing)
    pattern = trained_pattern(config.fine_tuning, initial.new if initial is not None else ())
    return Setup(
        build_state=lambda: build_state(config, data, statistics, shape, initial),
        train_data=train_data,
        eval_data=test_data,
        val_data=val_data,
        num_steps=num_steps,
        step=SupervisedStep(Frozen(loss, pattern) if pattern else loss),
        lr_schedule=lambda step: config.training.lr * shape(step),
    )


def main(config: Config) -> dict:
    return run_experiment("images", config, setup(config))


if __name__ == "__main__":
    main_entry(main, Config)
