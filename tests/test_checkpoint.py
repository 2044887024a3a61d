import hashlib
import io
import json
import shutil
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.cli import main_entry
from research.errors import CheckpointError
from research.experiment import load_experiment
from research.nn import MLP
from research.services import (
    CheckpointWriter,
    RunDir,
    checkpoint_digest,
    load_checkpoint,
    read_header,
    save_checkpoint,
    tree_digest,
)
from research.train import TrainState


def make_state(seed=0, hidden=8):
    model_key, train_key = jax.random.split(jax.random.key(seed))
    return TrainState.create(MLP(2, 1, hidden=(hidden,), key=model_key), optax.adam(1e-3), key=train_key)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def largest_data_file(path):
    """The biggest file Orbax wrote (the array bytes), as `checkpoint.json` names it."""
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    return path / max(files, key=lambda name: files[name][0])


def single_file_checkpoint(path, tree, header):
    """A checkpoint in the earlier single-file format, made as its writer made it."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, tree)
    payload = buffer.getvalue()
    arrays = eqx.filter(tree, eqx.is_array)
    leaves = [
        [jax.tree_util.keystr(p), list(x.shape), str(x.dtype)]
        for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]
    ]
    full = {**header, "leaves": leaves, "sha256": hashlib.sha256(payload).hexdigest(), "payload_bytes": len(payload)}
    path.write_bytes(b"RESEARCH-CHECKPOINT 1\n" + json.dumps(full).encode() + b"\n" + payload)


def test_round_trip_restores_every_leaf_and_the_header(tmp_path):
    saved = make_state(seed=1)
    saved = eqx.tree_at(lambda s: s.step, saved, jnp.asarray(17, jnp.int32))
    save_checkpoint(tmp_path / "a", saved, {"config": {"hidden": 8}, "step": 17})
    restored, header = load_checkpoint(tmp_path / "a", make_state(seed=2))
    assert_same(restored, saved)
    assert header["config"] == {"hidden": 8} and header["step"] == 17
    key = jax.random.wrap_key_data(restored.key)  # the key comes back usable
    assert jax.random.normal(key).shape == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary directory left behind
    assert checkpoint_digest(tmp_path / "a") == tree_digest(saved) != tree_digest(make_state(seed=2))


def test_the_writer_saves_in_the_background_and_commits_last(tmp_path):
    """`save` returns before the commit; `wait` commits; `on_commit` runs after it, on process 0."""
    committed = []
    writer = CheckpointWriter(on_commit=lambda path: committed.append((path.name, (path / "checkpoint.json").exists())))
    states = [make_state(seed=s) for s in (3, 4)]
    for step, state in enumerate(states):
        writer.save(tmp_path / f"step_{step}", state, {"step": step})  # the second waits for the first
    writer.close()
    assert committed == [("step_0", True), ("step_1", True)]
    assert [read_header(tmp_path / f"step_{s}")["step"] for s in (0, 1)] == [0, 1]
    assert checkpoint_digest(tmp_path / "step_1") == tree_digest(states[1])


def test_truncated_file_is_detected_naming_it(tmp_path):
    path = tmp_path / "t"
    save_checkpoint(path, make_state(), {"step": 0})
    data = largest_data_file(path)
    data.write_bytes(data.read_bytes()[:-10])
    name = data.relative_to(path).as_posix()
    with pytest.raises(CheckpointError, match=f"{path} is truncated: {name} has"):
        load_checkpoint(path, make_state())


def test_flipped_byte_is_detected_by_the_checksum(tmp_path):
    path = tmp_path / "c"
    save_checkpoint(path, make_state(), {"step": 0})
    data = largest_data_file(path)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted: checksum mismatch in "):
        read_header(path)
    data.unlink()
    with pytest.raises(CheckpointError, match=f"is incomplete: {data.relative_to(path).as_posix()} is missing"):
        read_header(path)
    (path / "checkpoint.json").write_text('{"header": {')
    with pytest.raises(CheckpointError, match="has a damaged header"):
        read_header(path)


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"\x80\x04pickle")
    with pytest.raises(CheckpointError, match="not a checkpoint file"):
        read_header(path)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_header(tmp_path / "missing")
    (tmp_path / "uncommitted").mkdir()
    with pytest.raises(CheckpointError, match="was not committed"):
        read_header(tmp_path / "uncommitted")


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "m"
    save_checkpoint(path, make_state(hidden=8), {"step": 0})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, make_state(hidden=16))
    assert f"checkpoint {path} is of a different architecture: " in str(info.value)
    assert ".model.layers[0].weight: saved (8, 2) float32, expected (16, 2) float32" in str(info.value)


def test_a_skeleton_of_shapes_alone_restores_the_same_arrays_and_is_checked_alike(tmp_path):
    """A skeleton made by `eqx.filter_eval_shape` (no array computed) restores every leaf as a concrete
    skeleton does, in both formats, and a wrong shape in it is refused the same way."""
    saved = make_state(seed=1)
    save_checkpoint(tmp_path / "a", saved, {"step": 0})
    single_file_checkpoint(tmp_path / "old.ckpt", saved, {"step": 0})
    abstract = eqx.filter_eval_shape(make_state, 2)
    leaves = jax.tree.leaves(abstract)
    assert len(leaves) == len(jax.tree.leaves(saved)) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    for path in (tmp_path / "a", tmp_path / "old.ckpt"):
        restored, _ = load_checkpoint(path, abstract)
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored))
        assert tree_digest(restored) == tree_digest(saved)
    with pytest.raises(CheckpointError, match=r"saved \(8, 2\) float32, expected \(16, 2\) float32"):
        load_checkpoint(tmp_path / "a", eqx.filter_eval_shape(make_state, 0, 16))
    for path in (tmp_path / "a", tmp_path / "old.ckpt"):  # while JAX traces (a skeleton that restores another run)
        inside = eqx.filter_eval_shape(lambda path=path: tree_digest(load_checkpoint(path, abstract)[0]))
        assert inside == tree_digest(saved)  # restored concretely, a constant of the trace


def test_a_single_file_checkpoint_of_the_earlier_format_still_loads(tmp_path):
    saved = make_state(seed=5)
    path = tmp_path / "old.ckpt"
    single_file_checkpoint(path, saved, {"step": 3})
    restored, header = load_checkpoint(path, make_state())
    assert_same(restored, saved) and header["step"] == 3
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{path} is truncated"):
        load_checkpoint(path, make_state())


def test_a_run_checkpointed_in_the_earlier_format_resumes_and_continues_in_directories(tmp_path, monkeypatch):
    """Step 19 of a run as the earlier writer left it (one file), the run killed before step 38:
    `--resume` continues from the file and ends at the bits of the run never stopped."""
    monkeypatch.chdir(tmp_path)
    xor = load_experiment("xor")
    args = ["--epochs", "2", "--checkpoint-every", "19", "--no-progress", "--run-dir", "r"]  # 19 steps an epoch
    main_entry(xor.main, xor.Config, args)
    run = RunDir(tmp_path / "r")
    straight = checkpoint_digest(run.checkpoint_path(38))
    skeleton = xor.build_state(xor.Config.from_options())
    state, header = load_checkpoint(run.checkpoint_path(19), skeleton)
    del header["leaves"]
    single_file_checkpoint(run.checkpoints / "step_000000019.ckpt", state, header)
    for step in (19, 38):
        shutil.rmtree(run.checkpoint_path(step))
    main_entry(xor.main, xor.Config, [*args, "--resume"])
    assert [p.name for p in run.checkpoint_paths()] == ["step_000000019.ckpt", "step_000000038"]
    assert checkpoint_digest(run.checkpoint_path(38)) == straight


def test_run_dir_falls_back_to_the_newest_valid_checkpoint_and_prunes(tmp_path):
    run = RunDir(tmp_path / "run").create()
    single_file_checkpoint(run.checkpoints / "step_000000005.ckpt", make_state(), {"step": 5})  # an older run's
    for step in (10, 20, 30):
        save_checkpoint(run.checkpoint_path(step), make_state(), {"step": step})
    (run.checkpoint_path(30) / "checkpoint.json").write_text('{"sha')  # a damaged newest one
    (run.checkpoint_path(40) / "d").mkdir(parents=True)  # an interrupted save: not a checkpoint
    (run.checkpoints / "step_000000050.orbax-checkpoint-tmp").mkdir()
    assert [p.name for p in run.checkpoint_paths()] == [
        "step_000000005.ckpt",
        "step_000000010",
        "step_000000020",
        "step_000000030",
    ]
    path, problems = run.latest_valid_checkpoint()
    assert path == run.checkpoint_path(20)
    assert problems == [f"checkpoint {run.checkpoint_path(30)} has a damaged header"]
    run.prune_checkpoints(keep=2)
    assert [p.name for p in run.checkpoint_paths()] == ["step_000000020", "step_000000030"]
    run.remove_uncommitted()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_000000020", "step_000000030"]


def test_run_dir_metrics_are_truncated_past_a_step(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for step in (5, 10, 15):
        run.log({"step": step, "train/loss": float(step)})
    run.log({"step": 20, "train/loss": float("nan")})
    assert run.read_metrics()[-1]["train/loss"] == "nan"
    run.truncate_metrics(after_step=10)
    assert [r["step"] for r in run.read_metrics()] == [5, 10]


def test_run_dir_metrics_as_columns_align_every_record_and_keep_non_finite_numbers(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.log({"step": 5, "train/loss": 2.5, "train/member_loss": [2.0, 3.0]})
    run.log({"step": 10, "train/loss": float("inf"), "train/member_loss": [float("nan"), 1.0], "test/accuracy": 0.5})
    run.log({"step": 15, "train/loss": float("nan")})
    columns = run.metric_columns()
    assert list(columns) == ["step", "train/loss", "train/member_loss", "test/accuracy"]
    assert columns["step"].dtype == np.int64 and columns["step"].tolist() == [5, 10, 15]
    np.testing.assert_array_equal(columns["train/loss"], [2.5, np.inf, np.nan])
    np.testing.assert_array_equal(columns["train/member_loss"], [[2.0, 3.0], [np.nan, 1.0], [np.nan, np.nan]])
    np.testing.assert_array_equal(columns["test/accuracy"], [np.nan, 0.5, np.nan])
    assert RunDir(tmp_path / "none").metric_columns() == {}
    frame = run.metric_frame()  # the same columns in pandas, one a member
    assert list(frame.columns) == ["train/loss", "train/member_loss/0", "train/member_loss/1", "test/accuracy"]
    assert frame.index.tolist() == [5, 10, 15] and frame.index.name == "step"
    np.testing.assert_array_equal(frame["train/member_loss/0"], [2.0, np.nan, np.nan])
    np.testing.assert_array_equal(frame["test/accuracy"], columns["test/accuracy"])


def test_metric_frame_without_pandas_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    missing = r"\(not metric_columns\) needs the pandas package, which is not installed: pip install pandas$"
    with pytest.raises(ImportError, match=missing):
        RunDir(tmp_path).metric_frame()
