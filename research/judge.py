"""Judging generated images: a classifier trained by `images` on the same data (`--judge RUN_DIR`), whose
pooled features are the space a Fréchet distance between generated and real images is measured in (FID,
with our own classifier in Inception's place: no download, and a feature space that knows the data).

`load_judge(run_dir, image_shape)` rebuilds the classifier through `load_run`; `frechet_evaluator(judge,
sample)` is an evaluator of a generative run: at every evaluation it draws as many images as the test set
holds, from the same keys each time, and reports `fid`, their Fréchet distance to the test images;
`real_frechet_distance` is the distance of as many training images to the test images (the floor that
sampling noise alone gives).
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConfigError
from .experiment import load_run
from .frechet import FeatureStatistics, frechet_distance
from .nn import ImageResNet
from .report import save_image_grid
from .train import Evaluator, batch_evaluator
from .train.evaluation import evaluate_batches
from .typing import Array, Float, Integer, PRNGKeyArray, typecheck

# sample(model, model_state, keys) -> images [batch, height, width, channels] in [-1, 1], one per key
Sampler = Callable[[Any, Any, jax.Array], Float[Array, "batch height width channels"]]


class Judge(eqx.Module):
    """A trained `images` classifier (in inference mode) and its state, as a feature extractor."""

    model: ImageResNet
    model_state: eqx.nn.State

    @typecheck
    def features(
        self, images: Integer[Array, "batch height width channels"] | Float[Array, "batch height width channels"]
    ) -> Float[Array, "batch features"]:
        """The classifier's pooled features of `images` as data stores them (uint8 0-255, or floats 0-1)."""
        return jax.vmap(lambda x: self.model.features(x, self.model_state)[0])(images)


def load_judge(run_dir: str | Path, image_shape: tuple[int, int, int]) -> Judge:
    """The classifier of an `images` run (its EMA model when it kept one), for images of `image_shape`
    (`height, width, channels`); `ConfigError` in one line for another experiment or another image size."""
    run = load_run(run_dir)
    if run.experiment != "images" or run.setup.population:
        raise ConfigError(
            f"--judge {run_dir}: a run of `images` (one classifier) judges images, not a {run.experiment} run"
        )
    model = run.ema_model if run.ema_model is not None else run.model
    state = run.ema_model_state if run.ema_model is not None else run.model_state
    assert isinstance(model, ImageResNet)  # what `images` trains
    shape = (model.height, model.width, model.channels)
    if shape != tuple(image_shape):
        raise ConfigError(
            f"--judge {run_dir}: its classifier reads {shape[0]}x{shape[1]}x{shape[2]} images, the data's are "
            f"{image_shape[0]}x{image_shape[1]}x{image_shape[2]}; train the judge on the same data"
        )
    return Judge(eqx.nn.inference_mode(model), state)


def to_unit(images: Float[Array, "*batch height width channels"]) -> Float[Array, "*batch height width channels"]:
    """Generated images in [-1, 1] as the judge reads stored ones: 0-1, on the 256 levels of a uint8 pixel."""
    return jnp.round((jnp.clip(images, -1, 1) + 1) * 127.5) / 255


class _Features(eqx.Module):
    """One evaluation batch: the judge's features of its real images and of as many generated ones."""

    judge: Judge
    sample: Sampler = eqx.field(static=True)

    def __call__(self, model: Any, model_state: Any, images: Any, mask: Any, key: PRNGKeyArray) -> dict[str, Any]:
        fake = self.sample(model, model_state, jax.random.split(key, images.shape[0]))
        return {"real": self.judge.features(images), "fake": self.judge.features(to_unit(fake)), "mask": mask}


def _frechet(results: list[dict[str, np.ndarray]], size: int) -> dict[str, float]:
    real, fake = ([r[name][r["mask"] > 0] for r in results] for name in ("real", "fake"))
    distance = frechet_distance(FeatureStatistics.of(np.concatenate(fake)), FeatureStatistics.of(np.concatenate(real)))
    return {"fid": distance}


def frechet_evaluator(judge: Judge, sample: Sampler) -> Evaluator:
    """An evaluator of a generative run's state: `fid`, the Fréchet
    distance in the judge's feature space between the test images (`eval_data`, images alone) and as many
    images `sample(model, model_state, keys)` draws, from keys that are the same at every evaluation."""
    return batch_evaluator(_Features(judge, sample), _frechet)


@eqx.filter_jit
def _judge_features(judge: Judge, _: None, images: Any, mask: Any, key: PRNGKeyArray) -> dict[str, Any]:
    return {"features": judge.features(images)}


def real_frechet_distance(judge: Judge, train: np.ndarray, test: np.ndarray, *, batch_size: int = 500) -> float:
    """The Fréchet distance between `len(test)` training images (the first ones) and the test images: what
    a generator that reproduced the data exactly would score, given the sampling noise of so few images."""
    from .data import DeviceLoader

    def features(images: np.ndarray) -> np.ndarray:
        loader = DeviceLoader(images, None, min(batch_size, len(images)), shuffle=False)
        results, _ = evaluate_batches(_judge_features, judge, None, loader)
        masks = [m for _, m in loader.padded_batches()]
        return np.concatenate([r["features"][m > 0] for r, m in zip(results, masks, strict=True)])

    count = min(len(train), len(test))
    return frechet_distance(FeatureStatistics.of(features(train[:count])), FeatureStatistics.of(features(test)))


def frechet_baselines(judge: Judge, sample: Sampler, untrained: Any, train: np.ndarray, test: Any) -> dict[str, float]:
    """The Fréchet distances a generative run's own `fid` is read beside (its `Setup.summarize_run`):
    `fid_real_vs_real`, of as many training images as `test` (a `DeviceLoader` of the test images) holds
    (`real_frechet_distance`), and `fid_untrained`, of the `untrained` state's model."""
    return {
        "fid_real_vs_real": real_frechet_distance(judge, train, test.host),
        "fid_untrained": frechet_evaluator(judge, sample)(untrained, test)["fid"],
    }


def print_frechet(experiment: str, summary: dict[str, Any]) -> None:
    """The line a generative run prints after its summary, when it was judged: its distance and the baselines'."""
    if "fid_real_vs_real" in summary:
        print(
            f"{experiment}: Fréchet distance to the test images {summary['test_fid']:.4g}; of the untrained model "
            f"{summary['fid_untrained']:.4g}, of as many training images {summary['fid_real_vs_real']:.4g}"
        )


def to_uint8(images: Float[Array, "*batch height width channels"]) -> Integer[Array, "*batch height width channels"]:
    """Generated images in [-1, 1] as stored ones: uint8, 0-255."""
    return jnp.round((jnp.clip(images, -1, 1) + 1) * 127.5).astype(jnp.uint8)


@functools.cache
def _compiled(sample: Sampler) -> Callable:
    return eqx.filter_jit(lambda model, model_state, keys: to_uint8(sample(model, model_state, keys)))


def sample_images(sample: Sampler, model: Any, model_state: Any, count: int, *, seed: int = 0) -> np.ndarray:
    """`count` images `sample` draws from `model` (in inference mode) with the keys of `seed`, as uint8."""
    keys = jax.random.split(jax.random.key(seed), count)
    return np.asarray(_compiled(sample)(eqx.nn.inference_mode(model), model_state, keys))


def draw_samples(path: Path, sample: Sampler, state: Any, *, count: int = 64, seed: int = 0) -> Path:
    """A grid of `count` images drawn from the same keys at every call (samples.png), by the model a train
    state stands for (its EMA's when it keeps one)."""
    shown = state.averaged()
    return save_image_grid(path, sample_images(sample, shown.model, shown.model_state, count, seed=seed))
