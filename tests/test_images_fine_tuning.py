"""experiments/images.py fine-tuning a pretrained model: a ViT that `transformers` saved (tiny, random weights, made
here: nothing downloaded) or another images run, in full, in part (`--trainable`) or through LoRA adapters, and
the ViT exported back to a directory `transformers` loads with its image processor."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _entry import run_entry
from _image_formats import native_digits
from test_pretrained import their_classes, vit

from research.errors import CheckpointError
from research.experiment import load_experiment, load_run
from research.nn import load_vit, named_arrays, save_vit

transformers = pytest.importorskip("transformers")


def digits(path, side: int = 16, classes: int = 5):
    """scikit-learn's digits of the first `classes` classes, grown to `side` x `side` RGB, as a .npz."""
    train, test = native_digits()
    grown = lambda part: np.repeat(part.inputs.repeat(side // 8, 1).repeat(side // 8, 2), 3, axis=-1)  # noqa: E731
    parts = {}
    for name, part, size in (("train", train, 128), ("test", test, 32)):
        kept = np.flatnonzero(part.labels < classes)[:size]
        parts[f"x_{name}"], parts[f"y_{name}"] = grown(part)[kept], part.labels[kept]
    np.savez(path, **parts)
    return path


def processor(directory=None):
    """`transformers`' image processor: the one saved in `directory`, else ViTImageProcessor's defaults for 16 px."""
    if directory is not None:
        return transformers.AutoImageProcessor.from_pretrained(directory)
    return transformers.ViTImageProcessor(size={"height": 16, "width": 16})


def prepared(images: np.ndarray, image_processor) -> np.ndarray:
    """`pixel_values` of uint8 images as the image processor makes them, channels last (what `their_classes` takes)."""
    values = image_processor(list(images), return_tensors="np")["pixel_values"]
    return values.transpose(0, 2, 3, 1)


def ours(model, images: np.ndarray) -> np.ndarray:
    return np.asarray(eqx.filter_jit(eqx.filter_vmap(model))(jnp.asarray(images)))


UINT8 = np.random.default_rng(2).integers(0, 256, (4, 16, 16, 3)).astype(np.uint8)


def test_a_vit_takes_uint8_images_as_its_image_processor_prepares_them(tmp_path):
    """A uint8 image goes through the mean and std of the processor saved beside the ViT (0.5 and 0.5 without one),
    so its logits are transformers' of what the processor makes of it; save_vit writes that processor out."""
    directory, theirs = vit(tmp_path)
    model = load_vit(directory)
    assert model.mean == model.std == (0.5, 0.5, 0.5)
    np.testing.assert_allclose(ours(model, UINT8), their_classes(theirs, prepared(UINT8, processor())), atol=1e-5)
    statistics = {"image_mean": [0.2, 0.4, 0.6], "image_std": [0.3, 0.2, 0.1]}
    transformers.ViTImageProcessor(size={"height": 16, "width": 16}, **statistics).save_pretrained(directory)
    model = load_vit(directory)
    assert model.mean == (0.2, 0.4, 0.6) and model.std == (0.3, 0.2, 0.1)
    expected = their_classes(theirs, prepared(UINT8, processor(directory)))
    np.testing.assert_allclose(ours(model, UINT8), expected, atol=1e-5, rtol=0)
    save_vit(model, tmp_path / "again")
    again = transformers.ViTForImageClassification.from_pretrained(tmp_path / "again").eval()
    np.testing.assert_array_equal(their_classes(again, prepared(UINT8, processor(tmp_path / "again"))), expected)
    config = json.loads((directory / "preprocessor_config.json").read_text())
    (directory / "preprocessor_config.json").write_text(json.dumps({**config, "rescale_factor": 1.0}))
    with pytest.raises(CheckpointError, match="only an image processor that rescales by 1/255 is read here"):
        load_vit(directory)


def images_run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """experiments/images.py on `argv`: its exit status and its lines on stderr."""
    capsys.readouterr()
    code = run_entry([*argv, "--no-progress"], "images")
    return code, capsys.readouterr().err.strip().splitlines()


TINY = ["--epochs", "1", "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.01", "--crop-padding", "0"]


@pytest.mark.slow
def test_images_fine_tunes_the_head_of_a_transformers_vit(tmp_path, monkeypatch, capsys):
    """`images --init-from DIR --trainable head`: the run starts from transformers' logits of its images; after
    training every parameter but the head's has the ViT's bits, and AdamW kept moments for the head alone."""
    monkeypatch.chdir(tmp_path)
    directory, theirs = vit(tmp_path)
    data = digits(tmp_path / "digits.npz")
    images = load_experiment("images")
    flags = ["--data", str(data), "--init-from", str(directory), "--trainable", "head", *TINY]
    config = images.Config.from_options(data=str(data), init_from=str(directory), trainable="head")
    start = images.setup(config).build_state().model
    test_images = np.load(data)["x_test"][:8]
    expected = their_classes(theirs, prepared(test_images, processor()))
    np.testing.assert_allclose(ours(start, test_images), expected, atol=1e-5, rtol=0)

    assert images_run([*flags, "--run-dir", "head"], capsys)[0] == 0
    run = load_run("head")
    trained, initial = named_arrays(run.model), named_arrays(load_vit(directory))
    moved = sorted(name for name in initial if not np.array_equal(trained[name], initial[name]))
    assert moved == ["head.bias", "head.weight"]
    moments = sum(x.size for x in jax.tree.leaves(eqx.filter(run.state.opt_state, eqx.is_inexact_array)))
    head = initial["head.weight"].size + initial["head.bias"].size
    assert 2 * head <= moments < 2 * head + 8  # mu and nu of the head (and AdamW's hyperparameters)


@pytest.mark.slow
def test_other_classes_get_a_new_head_that_trains_beside_what_trainable_names(tmp_path, monkeypatch, capsys):
    """A 5-class ViT on 10 classes of digits: the head starts as zeros of 10 rows and trains with the norms that
    `--trainable norm` names; the rest keeps the ViT's bits."""
    monkeypatch.chdir(tmp_path)
    directory, _ = vit(tmp_path)
    data = digits(tmp_path / "digits.npz", classes=10)
    images = load_experiment("images")
    config = images.Config.from_options(data=str(data), init_from=str(directory), trainable="norm")
    start = images.setup(config).build_state().model
    assert start.classes == 10 and start.head.weight.shape == (10, 32) and not np.any(start.head.weight)
    flags = ["--data", str(data), "--init-from", str(directory), "--trainable", "norm", *TINY]
    assert images_run([*flags, "--run-dir", "norm"], capsys)[0] == 0
    trained, initial = named_arrays(load_run("norm").model), named_arrays(load_vit(directory))
    moved = sorted(name for name in initial if "head" in name or not np.array_equal(trained[name], initial[name]))
    assert moved == sorted(name for name in initial if "norm" in name or name.startswith("head."))
    assert np.any(trained["head.weight"])


@pytest.mark.slow
def test_a_lora_fine_tuned_vit_exports_merged_to_a_directory_transformers_loads(tmp_path, monkeypatch, capsys):
    """`images --init-from DIR --lora-rank 2` trains its adapters alone; `scripts/export --format hf` merges them
    into the weights: transformers loads the directory and its image processor with no adapter code and computes
    the run's logits of uint8 images."""
    from research.tools import export

    monkeypatch.chdir(tmp_path)
    directory, theirs = vit(tmp_path)
    data = digits(tmp_path / "digits.npz")
    flags = ["--data", str(data), "--init-from", str(directory), "--lora-rank", "2", *TINY]
    assert images_run([*flags, "--run-dir", "lora"], capsys)[0] == 0
    run = load_run("lora")
    assert sorted(run.model.adapters) == [
        f"blocks.{layer}" for layer in ("attention.key_proj", "attention.output_proj", "attention.query_proj",
                                        "attention.value_proj", "mlp_in", "mlp_out")
    ]  # fmt: skip
    base, initial = named_arrays(run.model.model), named_arrays(load_vit(directory))
    assert all(np.array_equal(base[name], initial[name]) for name in initial)  # the ViT itself did not train
    export.main(["lora", "--format", "hf"])
    assert "written to lora/hf" in capsys.readouterr().err
    loaded = transformers.ViTForImageClassification.from_pretrained(tmp_path / "lora/hf").eval()
    merged = ours(run.model.merged(), UINT8)
    np.testing.assert_allclose(
        their_classes(loaded, prepared(UINT8, processor(tmp_path / "lora/hf"))), merged, atol=1e-5
    )
    assert np.abs(merged - their_classes(theirs, prepared(UINT8, processor()))).max() > 1e-3  # the adapters moved it


@pytest.mark.slow
def test_images_starts_from_another_images_run(tmp_path, monkeypatch, capsys):
    """`--init-from RUN_DIR` starts from that run's trained ResNet and its BatchNorm statistics, its batch norm
    reducing over this run's axes (pmap's), and a ViT run's LoRA adapters come merged."""
    monkeypatch.chdir(tmp_path)
    data = digits(tmp_path / "digits.npz")
    images = load_experiment("images")
    resnet = ["--data", str(data), "--features", "4", "--blocks", "1", *TINY]
    assert images_run([*resnet, "--run-dir", "resnet"], capsys)[0] == 0
    source = load_run("resnet")
    config = images.Config.from_options(data=str(data), init_from="resnet", parallel="pmap")
    state = images.setup(config).build_state()
    for mine, theirs in ((state.model, source.model), (state.model_state, source.model_state)):
        assert jax.tree.all(jax.tree.map(np.array_equal, named_arrays(mine), named_arrays(theirs)))
    tuned = ["--data", str(data), "--init-from", "resnet", "--parallel", "pmap", "--trainable", "head", *TINY]
    assert images_run([*tuned, "--run-dir", "tuned"], capsys)[0] == 0
    trained, initial = named_arrays(load_run("tuned").model), named_arrays(source.model)
    assert sorted(n for n in initial if not np.array_equal(trained[n], initial[n])) == ["head.bias", "head.weight"]

    vit_flags = ["--data", str(data), "--model", "vit", "--dim", "16", "--depth", "1", "--heads", "2", "--patch", "8"]
    assert images_run([*vit_flags, *TINY, "--lora-rank", "2", "--run-dir", "vit"], capsys)[0] == 0
    merged = load_run("vit").model.merged()
    config = images.Config.from_options(data=str(data), init_from="vit")
    start = images.setup(config).build_state().model
    assert type(start) is type(merged) and jax.tree.all(
        jax.tree.map(np.array_equal, named_arrays(start), named_arrays(merged))
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--init-from", "{vit}", "--dim", "32"], "--init-from takes the model's shape from .*: drop --dim"),
        (["--init-from", "{vit}", "--model", "resnet"], "--init-from .* holds a vit: drop --model resnet"),
        (["--init-from", "{vit32}"], r"takes 32x32x3 images \(height x width x channels\), --data's are 16x16x3"),
        (["--init-from", "{xor}"], "--init-from .* is a run of xor, not of images"),
        (["--init-from", "{vit}", "--lora-rank", "2", "--trainable", "head"], "--lora-rank trains its adapters alone"),
        (["--init-from", "{vit}", "--lora-rank", "64"], "--lora-rank 64 is above the 32 inputs or outputs of blocks"),
        (["--init-from", "{vit}", "--trainable", "nothing"], "--trainable nothing finds no parameter of the model"),
        (["--model", "resnet", "--dim", "32"], r"--model resnet takes no --dim \(the other model's options\)"),
        (["--model", "vit", "--blocks", "3"], r"--model vit takes no --blocks"),
        (["--model", "vit", "--patch", "5"], "--patch 5 must divide the images' side, 16"),
        (["--model", "vit", "--heads", "3"], "--heads 3 must divide --dim 64"),
        (["--lora-rank", "2"], r"--lora-targets 'attention\|mlp_' finds no linear layer \(they are: head\)"),
    ],
)
def test_images_refuses_fine_tuning_options_that_cannot_work(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    paths = {"vit": vit(tmp_path)[0], "vit32": vit(tmp_path, "vit32", image_size=32)[0], "xor": tmp_path / "xor"}
    (tmp_path / "xor").mkdir()
    (tmp_path / "xor/config.json").write_text(json.dumps({"experiment": "xor", "config": {}}))
    data = digits(tmp_path / "digits.npz")
    code, err = images_run(["--data", str(data), *(f.format(**paths) for f in flags)], capsys)
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "runs").exists()
