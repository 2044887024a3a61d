"""MNIST-1D (Greydanus, "Scaling Down Deep Learning"): one model of the zoo, picked with `--model`.

The data (4,000 training and 1,000 test signals of length 40, 10 classes) is generated locally by
the `mnist1d` package and cached in `--data-dir`. Options left unset (`None`) take the model's
default from `RECIPES`. The paper's recipe for every model is Adam, lr 1e-2, batch 100, 8,000 steps
(`--schedule constant --weight-decay 0 --batch-size 100 --steps 8000`); ours adds a cosine schedule
and decoupled weight decay where that measured better over 3 seeds on a validation split
(`--val-size 500` holds out 500 training examples as `val/...`; docs/results.md has both).
Run `./scripts/run mnist1d --help` for the options.
"""

import dataclasses
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

import jax
import optax

from research.cli import TrainConfig, Training, group, main_entry, non_negative, option, positive
from research.data import (
    MNIST1D_CLASSES,
    MNIST1D_LENGTH,
    MNIST1D_TRAIN_SIZE,
    eval_loader,
    load_mnist1d,
    split_validation,
    train_and_eval_loaders,
)
from research.experiment import Setup, run_experiment
from research.nn import build_model, model_names
from research.services import Headline
from research.train import TrainState

# Python puts this script's directory first on sys.path, and there this file would shadow the
# `mnist1d` package that generates the data.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

ModelName = Literal["logistic", "mlp", "cnn", "gru", "resnet", "transformer"]

# Constructor arguments of each model (besides length and classes); the MLP is the paper's 40-100-100-10.
MODEL_HPARAMS: dict[str, dict[str, Any]] = {
    "logistic": {},
    "mlp": {"hidden": (100, 100), "activation": "relu"},
    "cnn": {"channels": 25},
    "gru": {"hidden_size": 64},
    "resnet": {"widths": (32, 64, 64)},
    "transformer": {"patch": 4, "dim": 32, "depth": 2, "heads": 4, "mlp_dim": 64, "dropout": 0.1},
}

# Per-model values of the options left unset. The recipes: logistic, mlp and cnn chosen by 3-seed
# sweeps over learning rate, weight decay, batch size and schedule on the validation split
# (`--val-size 500`; docs/results.md); the CNN and the MLP gain most from smaller batches and longer
# training with weight decay.
# steps_per_call, from steps/s over 300 steps on a 2-core CPU, one step per call vs 50 in one compiled
# loop: logistic 4086 vs 20181, mlp 2291 vs 5227, gru 130 vs 118, resnet 40 vs 5, transformer 75 vs
# 71; XLA CPU runs convolutions much slower inside a loop, so the ResNet takes one step per call (the
# CNN computes its convolutions as matmuls and gains from the loop).
RECIPES: dict[str, dict[str, Any]] = {
    "logistic": {
        "lr": 3e-3,
        "batch_size": 100,
        "steps": 8000,
        "weight_decay": 0.0,
        "schedule": "cosine",
        "steps_per_call": 100,
    },
    "mlp": {
        "lr": 1e-2,
        "batch_size": 32,
        "steps": 16000,
        "weight_decay": 0.3,
        "schedule": "cosine",
        "steps_per_call": 100,
    },
    "cnn": {
        "lr": 1e-2,
        "batch_size": 32,
        "steps": 16000,
        "weight_decay": 0.1,
        "schedule": "cosine",
        "steps_per_call": 100,
    },
    "gru": {
        "lr": 1e-2,
        "batch_size": 100,
        "steps": 8000,
        "weight_decay": 0.0,
        "schedule": "constant",
        "steps_per_call": 100,
    },
    "resnet": {
        "lr": 1e-3,
        "batch_size": 100,
        "steps": 8000,
        "weight_decay": 0.0,
        "schedule": "constant",
        "steps_per_call": 1,
    },
    "transformer": {
        "lr": 1e-3,
        "batch_size": 100,
        "steps": 8000,
        "weight_decay": 0.0,
        "schedule": "constant",
        "steps_per_call": 100,
    },
}
assert set(RECIPES) == set(MODEL_HPARAMS) == set(ModelName.__args__) <= set(model_names())


def below_training_size(value: int) -> str | None:
    return None if 0 <= value < MNIST1D_TRAIN_SIZE else f"must be in [0, {MNIST1D_TRAIN_SIZE})"


@dataclasses.dataclass(frozen=True)
class MNIST1DTraining(Training):
    lr: float | None = option(
        None,
        "Adam learning rate (default: per model: logistic 3e-3; mlp, cnn, gru 1e-2; resnet, transformer 1e-3)",
        check=positive,
        vmappable=True,
    )
    batch_size: int | None = option(
        None, "examples per training step (default: per model: mlp, cnn 32; others 100)", check=positive
    )
    steps_per_call: int | None = option(
        None,
        "training steps per compiled call, device loader (default: per model: resnet 1; others 100)",
        check=positive,
    )
    log_every: int = option(500, "steps between logged training metrics", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train one model of the zoo on MNIST-1D (4,000 training / 1,000 test signals of length 40).
    Options whose default is None take the model's value from RECIPES in experiments/mnist1d.py."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: MNIST1DTraining = group(MNIST1DTraining)
    model: ModelName = option("cnn", "which model of research.nn to train")
    steps: int | None = option(
        None, "training steps (default: per model: mlp, cnn 16000; others 8000)", check=positive, resumable=True
    )
    weight_decay: float | None = option(
        None,
        "decoupled weight decay, AdamW (default: per model: mlp 0.3, cnn 0.1, others 0)",
        check=non_negative,
        vmappable=True,
    )
    schedule: Literal["constant", "cosine"] | None = option(
        None, "learning-rate schedule over --steps (default: per model: logistic, mlp, cnn cosine; others constant)"
    )
    loader: Literal["device", "torch"] = option(
        "device", "device: batches gathered on the device; torch: a torch DataLoader with numpy collate"
    )
    val_size: int = option(
        0,
        "training examples held out as a validation set, evaluated as val/... (the same examples for every "
        "--seed; 0: train on all 4,000)",
        check=below_training_size,
    )
    data_dir: str = option("data", "where the generated MNIST-1D arrays are cached (mnist1d-seed42.npz)")

    def resolved(self) -> "Config":
        """This config with every unset option replaced by the model's recipe value. Parsing the command
        line (and `Config.from_options`) calls it, so the rest of this file sees every option set."""
        values = self.to_dict()
        return self.replace(**{k: v for k, v in RECIPES[self.model].items() if values[k] is None})


def learning_rate(config: Config) -> optax.Schedule:
    if config.schedule == "cosine":
        return optax.cosine_decay_schedule(config.training.lr, decay_steps=config.steps)
    return optax.constant_schedule(config.training.lr)


def optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW (weight decay 0 is Adam) at a constant rate, or scaled by the cosine schedule's shape. The
    learning rate and the weight decay live in its state, so runs that differ in them train as one
    vmapped population (`scripts/sweep --vmapped`)."""
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=config.training.lr, weight_decay=config.weight_decay)
    if config.schedule == "cosine":
        return optax.chain(adamw, optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, decay_steps=config.steps)))
    return adamw


def build_state(config: Config) -> TrainState:
    """The step-0 state of a resolved config: the model of `--model` and Adam (AdamW with weight decay)."""
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    hparams = dict(MODEL_HPARAMS[config.model])
    if config.model == "mlp":
        hparams.update(in_size=MNIST1D_LENGTH, out_size=MNIST1D_CLASSES)
    else:
        hparams.update(length=MNIST1D_LENGTH, classes=MNIST1D_CLASSES)
    model, model_state = build_model(config.model, key=model_key, **hparams)
    return TrainState.create(model, optimizer(config), key=train_key, model_state=model_state)


def setup(config: Config) -> Setup:
    """The state and the data of a run, without training (`scripts/show_jaxpr mnist1d` uses it too)."""
    train, test = load_mnist1d(config.data_dir)
    train, val = split_validation(train, config.val_size)
    train_data, test_data = train_and_eval_loaders(
        train,
        test,
        config.training.batch_size,
        seed=config.training.seed,
        kind=config.loader,
        eval_batch_size=len(test.labels),
    )
    return Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=test_data,
        val_data=eval_loader(val, len(val.labels), config.loader) if config.val_size else None,
        num_steps=config.steps,
        lr_schedule=learning_rate(config),
    )


# Test accuracies published with MNIST-1D (Greydanus 2020, "Scaling Down Deep Learning").
PUBLISHED = {"logistic": 0.32, "mlp": 0.68, "cnn": 0.94, "gru": 0.91}


def main(config: Config) -> dict:
    summary = run_experiment("mnist1d", config, setup(config))
    if config.model in PUBLISHED and jax.process_index() == 0:
        published, reached = PUBLISHED[config.model], summary["test_accuracy"]
        verdict = "at or above" if reached >= published else "BELOW"
        print(
            f"{config.model}: {100 * reached:.2f}% is {verdict} the published {100 * published:.0f}% (Greydanus 2020)"
        )
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
