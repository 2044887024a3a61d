"""experiments/images.py on real images in every format, the ResNet for images, and its augmentation."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _entry import run_entry
from jaxtyping import TypeCheckError

from research.data import random_crop_flip
from research.nn import ImageResNet, build_model, conv2d_as_matmul
from research.services import RunDir
from research.train import forward

# Digits need no crops or flips; a small ResNet (8, 16, 32 channels, one block a stage).
DIGITS = [
    "--features",
    "8",
    "--blocks",
    "1",
    "--batch-size",
    "32",
    "--lr",
    "0.05",
    "--crop-padding",
    "0",
    "--no-progress",
]


def run_images(argv):
    return run_entry(argv, "images")


@pytest.mark.slow
def test_digits_in_every_format_train_alike_and_reach_97_percent(digits_formats, tmp_path, monkeypatch):
    """scikit-learn's digits written as IDX, CIFAR binary, an image folder and a .npz train to the same
    numbers, bit for bit (an epoch each: tests/test_image_data.py checks that every format reads the same
    pixels, so more epochs would repeat the same steps), and the .npz's 3 epochs pass 97% test accuracy."""
    monkeypatch.chdir(tmp_path)
    measured = {"wall_seconds", "compile_seconds", "peak_host_memory_bytes"}

    def run(name: str, path, epochs: str) -> tuple[dict, list[dict]]:
        assert run_images([*DIGITS, "--epochs", epochs, "--data", str(path), "--run-dir", name]) == 0
        summary = {k: v for k, v in RunDir(tmp_path / name).read_summary().items() if k not in measured}
        records = [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(tmp_path / name).read_metrics()]
        return summary, records

    one_epoch = {name: run(f"{name}-1", path, "1") for name, path in digits_formats.items()}
    assert one_epoch["npz"][0]["step"] == 1437 // 32
    for name, (summary, records) in one_epoch.items():
        assert summary == one_epoch["npz"][0] and records == one_epoch["npz"][1], name
    summary, _ = run("npz", digits_formats["npz"], "3")
    assert summary["test_accuracy"] >= 0.97 and summary["step"] == 3 * (1437 // 32)
    config = json.loads((tmp_path / "npz" / "config.json").read_text())
    assert config["parameters"] == {
        "total": 19_954,
        "by_field": {"stem": 216, "stem_norm": 16, "blocks": 19_392, "head": 330},
    }


def test_without_data_it_names_the_formats_in_one_line(capsys):
    assert run_images([]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("images.py: error: --data names the images to train on: an IDX directory")
        and err.count("\n") == 1
        and "CIFAR-10 or CIFAR-100" in err
        and "image folder" in err
        and ".npz" in err
    )


@pytest.mark.slow
def test_conv2d_as_matmul_is_conv2d_in_values_and_gradients(getkey):
    x = jax.random.normal(getkey(), (3, 10, 9))
    for kernel, stride, padding in ((3, 1, 1), (3, 2, 1), (1, 2, 0), (2, 1, 0)):
        conv = eqx.nn.Conv2d(3, 5, kernel, stride=stride, padding=padding, key=getkey())
        np.testing.assert_allclose(conv2d_as_matmul(conv, x), conv(x), atol=1e-5)
        grads = [
            eqx.filter_grad(lambda c, f=f: jnp.sum(jnp.sin(f(c, x))))(conv)
            for f in (conv2d_as_matmul, lambda c, x: c(x))
        ]
        np.testing.assert_allclose(grads[0].weight, grads[1].weight, atol=1e-4)


@pytest.mark.slow
def test_image_resnet_normalises_uint8_and_float_images_alike_and_names_a_wrong_size(getkey):
    model, state = build_model(
        "image_resnet",
        height=28,
        width=28,
        channels=1,
        classes=10,
        features=4,
        blocks=1,
        mean=[0.1307],
        std=[0.3081],
        key=getkey(),
    )
    assert isinstance(model, ImageResNet)
    pixels = jax.random.randint(getkey(), (6, 28, 28, 1), 0, 256).astype(jnp.uint8)
    inference = eqx.nn.inference_mode(model)
    as_bytes, _ = forward(inference, state, pixels, key=None)
    as_floats, _ = forward(inference, state, pixels.astype(jnp.float32) / 255, key=None)
    assert as_bytes.shape == (6, 10)
    np.testing.assert_allclose(as_bytes, as_floats, atol=1e-5)
    with pytest.raises(TypeCheckError) as info:
        inference(jnp.zeros((32, 32, 3), jnp.uint8), state)
    assert "self.height = 28" in str(info.value.__notes__)


@pytest.mark.slow
def test_random_crop_flip_moves_each_image_by_its_own_key(getkey):
    batch = jnp.arange(2 * 6 * 6 * 1, dtype=jnp.int32).reshape(2, 6, 6, 1) + 1
    keys = jax.random.split(getkey(), 2)
    out = random_crop_flip(batch, keys, padding=2, flip=True)
    assert out.shape == batch.shape and out.dtype == batch.dtype
    for image, moved in zip(np.asarray(batch), np.asarray(out), strict=True):
        padded = np.pad(image, ((2, 2), (2, 2), (0, 0)))
        windows = [padded[i : i + 6, j : j + 6] for i in range(5) for j in range(5)]
        assert any(np.array_equal(moved, w) or np.array_equal(moved, w[:, ::-1]) for w in windows)
    np.testing.assert_array_equal(out, random_crop_flip(batch, keys, padding=2, flip=True))  # a pure function
    np.testing.assert_array_equal(random_crop_flip(batch, keys, padding=0, flip=False), batch)
    many = random_crop_flip(jnp.repeat(batch[:1], 64, axis=0), jax.random.split(getkey(), 64), padding=2, flip=True)
    assert len({np.asarray(m).tobytes() for m in many}) > 10  # crops and flips differ between examples
