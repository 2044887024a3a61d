"""Checkpoints whose arrays carry their names (Orbax alone reads them back named), checkpoints of the first
(unnamed) format still loading, and weights exported to safetensors / .npz and loaded back."""

import json
import sys

import equinox as eqx
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from research import load_run
from research.cli import main_entry
from research.experiment import load_experiment
from research.nn import MLP, array_names, build_model, load_weights, named_arrays, read_weights, save_weights
from research.services import RunDir, checkpoint_digest, load_checkpoint, save_checkpoint, tree_digest
from research.services._checkpoint import COMMIT_FILE, _file_digests, write_atomic
from research.tools import export
from research.train import TrainState

xor = load_experiment("xor")
QUICK = ["--epochs", "2", "--train-size", "256", "--test-size", "64", "--batch-size", "32", "--no-progress"]


@pytest.mark.slow
def test_array_names_follow_fields_indices_and_state_owners(getkey):
    model, state = build_model("image_resnet", features=4, blocks=1, key=getkey())
    names = array_names(model)
    assert names[:3] == ["stem.weight", "stem_norm.weight", "stem_norm.bias"]
    assert "blocks.1.shortcut.weight" in names and names[-2:] == ["head.weight", "head.bias"]
    assert array_names(state)[:3] == [
        "ImageResNet.stem_norm.batch_counter",
        "ImageResNet.stem_norm.batch_state_index.0",
        "ImageResNet.stem_norm.batch_state_index.1",
    ]
    train_state = TrainState.create(model, optax.adam(1e-3), key=getkey(), model_state=state)
    assert "opt_state.0.mu.blocks.0.conv1.weight" in array_names(train_state)
    assert len(named_arrays(train_state)) == len(jax.tree.leaves(eqx.filter(train_state, eqx.is_array)))


def test_orbax_alone_restores_a_checkpoint_as_a_named_tree(tmp_path, getkey):
    state = TrainState.create(MLP(2, 3, hidden=(4,), key=getkey()), optax.adam(0.1), key=getkey()).with_ema(0.9)
    save_checkpoint(tmp_path / "step_000000001", state, {"step": 1})
    restored = ocp.StandardCheckpointer().restore((tmp_path / "step_000000001").absolute())  # no skeleton
    assert sorted(restored) == ["ema", "key", "model", "opt_state", "step"]
    np.testing.assert_array_equal(restored["model"]["layers"]["0"]["weight"], state.model.layers[0].weight)
    np.testing.assert_array_equal(restored["ema"]["average"]["0"]["layers"]["1"]["bias"], state.model.layers[1].bias)
    loaded, header = load_checkpoint(tmp_path / "step_000000001", state)
    assert tree_digest(loaded) == tree_digest(state) == checkpoint_digest(tmp_path / "step_000000001")
    assert header["names"][:2] == ["step", "model.layers.0.weight"]


def test_a_checkpoint_of_the_first_unnamed_format_still_loads(tmp_path, getkey):
    """What the writer before named checkpoints left: Orbax's files of a plain list of arrays, and a
    checkpoint.json of format "research-orbax 1" without names."""
    state = TrainState.create(MLP(2, 3, hidden=(4,), key=getkey()), optax.sgd(0.1), key=getkey())
    path = (tmp_path / "step_000000005").absolute()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, jax.tree.leaves(state))
    checkpointer.wait_until_finished()
    checkpointer.close()
    leaves = [
        [jax.tree_util.keystr(p), list(x.shape), str(x.dtype)]
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    record = {"format": "research-orbax 1", "header": {"step": 5, "leaves": leaves}, "files": _file_digests(path)}
    write_atomic(path / COMMIT_FILE, json.dumps(record).encode())
    loaded, header = load_checkpoint(path, state)
    assert header["step"] == 5 and tree_digest(loaded) == tree_digest(state) == checkpoint_digest(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An xor run with an EMA, and an image run (BatchNorm statistics in its state)."""
    root = tmp_path_factory.mktemp("export")
    argv0, sys.argv[0] = sys.argv[0], "xor.py"
    try:
        main_entry(xor.main, xor.Config, [*QUICK, "--ema-decay", "0.9", "--run-dir", str(root / "xor")])
    finally:
        sys.argv[0] = argv0
    return root


@pytest.mark.parametrize("format", ["safetensors", "npz"])
@pytest.mark.parametrize("ema", [False, True])
def test_export_writes_the_models_arrays_under_their_names_with_the_config(trained, tmp_path, format, ema):
    out = tmp_path / f"xor.{format}"
    export.main([str(trained / "xor"), "--format", format, *(["--ema"] if ema else []), "-o", str(out)])
    run = load_run(trained / "xor")
    model = run.ema_model if ema else run.model
    if format == "safetensors":
        from safetensors import safe_open
        from safetensors.numpy import load_file

        arrays = load_file(str(out))  # the safetensors library alone
        with safe_open(str(out), framework="numpy") as f:
            metadata = f.metadata()
    else:
        arrays, metadata = read_weights(out)
    assert sorted(arrays) == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    for name, value in named_arrays(model).items():
        np.testing.assert_array_equal(arrays[name], value)
    assert json.loads(metadata["config"]) == RunDir(trained / "xor").read_config()["config"]
    assert (metadata["experiment"], metadata["step"], metadata["model"]) == ("xor", "16", "MLP")
    skeleton, _ = build_model("mlp", in_size=2, out_size=1, hidden=(8,), activation="tanh", key=jax.random.key(9))
    loaded, no_state = load_weights(out, skeleton)
    assert no_state is None and tree_digest(loaded) == tree_digest(model)


@pytest.mark.slow
def test_a_stateful_model_exports_its_batchnorm_statistics_and_loads_back(tmp_path, getkey):
    model, state = build_model("image_resnet", height=8, width=8, channels=1, features=2, blocks=1, key=getkey())
    state = jax.tree.map(lambda x: x + 1, state)  # statistics that are not the initial ones
    save_weights(tmp_path / "w.safetensors", model, state)
    fresh, fresh_state = build_model("image_resnet", height=8, width=8, channels=1, features=2, blocks=1, key=getkey())
    loaded, loaded_state = load_weights(tmp_path / "w.safetensors", fresh, fresh_state)
    assert tree_digest(loaded) == tree_digest(model) and tree_digest(loaded_state) == tree_digest(state)


def test_weights_of_another_model_or_a_run_without_ema_are_refused_in_one_line(trained, tmp_path, capsys):
    export.main([str(trained / "xor"), "-o", str(tmp_path / "w.safetensors")])
    other, _ = build_model("mlp", in_size=2, out_size=1, hidden=(16,), key=jax.random.key(0))
    with pytest.raises(Exception, match=r"layers.0.weight is \[8, 2\] float32, the model's \[16, 2\] float32"):
        load_weights(tmp_path / "w.safetensors", other)
    plain = tmp_path / "plain"
    argv0, sys.argv[0] = sys.argv[0], "xor.py"
    try:
        main_entry(xor.main, xor.Config, [*QUICK, "--run-dir", str(plain)])
    finally:
        sys.argv[0] = argv0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        export.main([str(plain), "--ema"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "kept no EMA of its weights" in err
