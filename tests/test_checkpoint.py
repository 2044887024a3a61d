import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.nn import MLP
from research.train import CheckpointError, RunDir, TrainState, load_checkpoint, read_header, save_checkpoint


def make_state(seed=0, hidden=8):
    model_key, train_key = jax.random.split(jax.random.key(seed))
    return TrainState.create(MLP(2, 1, hidden=(hidden,), key=model_key), optax.adam(1e-3), key=train_key)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_restores_every_leaf_and_the_header(tmp_path):
    saved = make_state(seed=1)
    saved = eqx.tree_at(lambda s: s.step, saved, jnp.asarray(17, jnp.int32))
    save_checkpoint(tmp_path / "a.ckpt", saved, {"config": {"hidden": 8}, "step": 17})
    restored, header = load_checkpoint(tmp_path / "a.ckpt", make_state(seed=2))
    assert_same(restored, saved)
    assert header["config"] == {"hidden": 8} and header["step"] == 17
    key = jax.random.wrap_key_data(restored.key)  # the key comes back usable
    assert jax.random.normal(key).shape == ()
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_truncated_file_is_detected_naming_it(tmp_path):
    path = tmp_path / "t.ckpt"
    save_checkpoint(path, make_state(), {"step": 0})
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{path} is truncated"):
        load_checkpoint(path, make_state())


def test_flipped_byte_is_detected_by_the_checksum(tmp_path):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, make_state(), {"step": 0})
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted: checksum mismatch"):
        read_header(path)


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"\x80\x04pickle")
    with pytest.raises(CheckpointError, match="not a checkpoint file"):
        read_header(path)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_header(tmp_path / "missing.ckpt")


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "m.ckpt"
    save_checkpoint(path, make_state(hidden=8), {"step": 0})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, make_state(hidden=16))
    assert f"checkpoint {path} is of a different architecture: " in str(info.value)
    assert ".model.layers[0].weight: saved (8, 2) float32, expected (16, 2) float32" in str(info.value)


def test_run_dir_falls_back_to_the_newest_valid_checkpoint_and_prunes(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for step in (10, 20, 30):
        save_checkpoint(run.checkpoint_path(step), make_state(), {"step": step})
    run.checkpoint_path(30).write_bytes(b"RESEARCH-CHECKPOINT 1\n{\"sha")  # a damaged newest file
    path, problems = run.latest_valid_checkpoint()
    assert path == run.checkpoint_path(20)
    assert len(problems) == 1 and "step_000000030.ckpt" in problems[0]
    run.prune_checkpoints(keep=2)
    assert [p.name for p in run.checkpoint_paths()] == ["step_000000020.ckpt", "step_000000030.ckpt"]


def test_run_dir_metrics_are_truncated_past_a_step(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for step in (5, 10, 15):
        run.log({"step": step, "train/loss": float(step)})
    run.log({"step": 20, "train/loss": float("nan")})
    assert run.read_metrics()[-1]["train/loss"] == "nan"
    run.truncate_metrics(after_step=10)
    assert [r["step"] for r in run.read_metrics()] == [5, 10]
