"""A population (today's ensemble of seeds) is one vmapped train state run by the ordinary engine:
each member equals its own run, and the engine's hooks (evaluation, metrics, checkpoints, resume,
EMA, skipping non-finite steps) work on it without code of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from research.data import DeviceLoader, XORDataset
from research.errors import ConfigError, DeviceError
from research.nn import MLP
from research.parallel import Pmap, fsdp, one_device, population_mesh, population_placement, sharded
from research.population import evaluate_ensemble, evaluate_population, member, num_members, stack_states, with_ema
from research.services import RunDir, load_checkpoint, read_header
from research.train import TrainState, evaluate, fit
from research.train.evaluation import evaluate_state

ROOT = Path(__file__).parent.parent
OPTIMIZER = optax.adam(1e-2)  # one object: members and single runs share the compiled code


def build_state(key):
    model_key, train_key = jax.random.split(key)
    return TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), OPTIMIZER, key=train_key)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def population_fit(states, train, test, num_steps, **kwargs):
    return fit(
        states,
        train,
        num_steps=num_steps,
        steps_per_call=25,
        progress=False,
        population=True,
        eval_data=test,
        evaluator=evaluate_population,
        **kwargs,
    )


@pytest.fixture(scope="module")
def xor():
    train = DeviceLoader.from_dataset(XORDataset(512, seed=42), 64, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(200, seed=1), 64, shuffle=False)
    return train, test


@pytest.mark.slow
def test_stacked_members_are_the_states_built_alone():
    keys = jax.random.split(jax.random.key(0), 3)
    states = stack_states(build_state, keys)
    assert num_members(states) == 3 and states.step.shape == (3,) and states.key.shape == (3, 2)
    build_alone = eqx.filter_jit(build_state)
    for k in range(3):
        for a, b in zip(arrays(member(states, k)), arrays(build_alone(keys[k])), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not np.allclose(arrays(member(states, 0).model)[0], arrays(member(states, 1).model)[0])


@pytest.mark.slow
def test_a_population_through_the_engine_equals_each_member_trained_alone(xor):
    train, test = xor
    states = stack_states(build_state, jax.random.split(jax.random.key(1), 3))
    together = population_fit(states, train, test, 60)
    assert np.all(np.asarray(together.state.step) == 60)
    results = evaluate_ensemble(together.state.model, together.state.model_state, test)
    probabilities = []
    predict = eqx.filter_jit(lambda model, x: jax.nn.sigmoid(jax.vmap(model)(x)[:, 0]))
    for k in range(3):
        alone = fit(member(states, k), train, num_steps=60, steps_per_call=25, progress=False)
        for a, b in zip(arrays(member(together.state, k)), arrays(alone.state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        single = evaluate(alone.state.model, None, test)
        assert results["member_accuracy"][k] == pytest.approx(single["accuracy"], abs=1e-6)
        assert together.eval_metrics["member_loss"][k] == pytest.approx(single["loss"], rel=1e-5)
        probabilities.append(predict(alone.state.model, test.arrays.inputs))

    # The ensemble predicts from the mean of the members' probabilities.
    mean = np.mean(np.stack(probabilities), axis=0)
    labels = np.asarray(test.arrays.labels)
    assert together.eval_metrics["ensemble_accuracy"] == pytest.approx(np.mean((mean > 0.5) == (labels == 1)), abs=1e-6)
    nll = -np.mean(np.log(np.where(labels == 1, mean, 1 - mean)))
    assert together.eval_metrics["ensemble_loss"] == pytest.approx(nll, rel=1e-4)
    assert together.eval_metrics["accuracy"] == pytest.approx(np.mean(results["member_accuracy"]), abs=1e-6)
    assert len(together.train_metrics["member_loss"]) == 3
    assert together.train_metrics["loss"] == pytest.approx(np.mean(together.train_metrics["member_loss"]), rel=1e-6)


@pytest.mark.slow
def test_a_population_keeps_an_ema_per_member_and_resumes_from_its_checkpoint(xor, tmp_path):
    train, test = xor
    states = with_ema(stack_states(build_state, jax.random.split(jax.random.key(2), 2)), 0.9)
    whole = population_fit(states, train, test, 50)
    run = RunDir(tmp_path / "run").create()
    population_fit(states, train, test, 25, run=run, checkpoint_header={"step": 25})
    saved, header = load_checkpoint(run.checkpoint_path(25), states)
    resumed = population_fit(saved, train, test, 50, resume_window=header["window"])
    for a, b in zip(arrays(resumed.state), arrays(whole.state), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: resume continues exactly
    for k in range(2):
        alone = fit(member(states, k), train, num_steps=50, steps_per_call=25, progress=False)
        for a, b in zip(arrays(member(whole.state, k).ema), arrays(alone.state.ema), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        ema_metrics = evaluate_state(alone.state.averaged(), test)
        assert whole.eval_metrics["member_accuracy"][k] == pytest.approx(ema_metrics["accuracy"], abs=1e-6)
    assert whole.raw_eval_metrics is not None and len(whole.raw_eval_metrics["member_accuracy"]) == 2
    record = run.read_metrics()[-1]
    assert record["step"] == 25 and len(record["test/member_accuracy"]) == len(record["train/member_loss"]) == 2


def test_a_population_skips_a_non_finite_member_step_member_by_member(xor):
    train, _ = xor
    states = stack_states(build_state, jax.random.split(jax.random.key(3), 2))
    poisoned = eqx.tree_at(
        lambda s: s.model.layers[0].weight, states, states.model.layers[0].weight.at[1, 0, 0].set(np.nan)
    )
    result = fit(poisoned, train, num_steps=4, progress=False, population=True, skip_nonfinite=True, log_every=4)
    assert result.train_metrics["skipped"] == 4
    healthy = fit(member(states, 0), train, num_steps=4, progress=False)
    for a, b in zip(arrays(member(result.state, 0).model), arrays(healthy.state.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # member 0 trained as if alone
    for a, b in zip(arrays(member(result.state, 1).model), arrays(member(poisoned, 1).model), strict=True):
        np.testing.assert_array_equal(a, b)  # member 1 never changed


def test_a_population_on_several_devices_splits_its_members_when_they_divide_else_the_batch_rows():
    own = {"member_batches": True}
    assert population_placement(sharded(2), members=4, rows=32, **own) == population_mesh(2, "members", True)
    assert population_placement(sharded(8), members=4, rows=32, **own) == population_mesh(8, "batch", True)
    shared = {"member_batches": False}  # every member on the same batches (experiments/ensemble.py)
    assert population_placement(sharded(4), members=8, rows=100, **shared) == population_mesh(4, "members", False)
    assert population_placement(sharded(4), members=2, rows=100, **shared) == population_mesh(4, "batch", False)
    for kept in (one_device(), Pmap(2), fsdp(2)):
        assert population_placement(kept, members=4, rows=32, **shared) is kept
    with pytest.raises(ConfigError, match="^--parallel pmap cannot train a population whose members take their own"):
        population_placement(Pmap(2), members=4, rows=32, **own)
    with pytest.raises(DeviceError, match="^a population of 3 members with batches of 9 rows cannot be split over 2"):
        population_placement(sharded(2), members=3, rows=9, **own)
    # --deterministic-reduction: each batch's rows, whether or not the devices divide the members (each device
    # runs its micro-batches: tests/test_deterministic_reduction.py checks the bits against one device).
    micro = sharded(2, micro_batches=8)
    for members in (4, 3):
        expected = population_mesh(2, "batch", True, micro_batches=8)
        assert population_placement(micro, members=members, rows=32, **own) == expected


def ensemble_summary(run_dir, devices, data_dir):
    """experiments/ensemble.py, 4 members of 8 hidden units for 2 epochs, in a process with `devices` CPU devices."""
    flags = ["--num-members", "4", "--hidden", "8", "--epochs", "2", "--batch-size", "200", "--devices", str(devices)]
    result = subprocess.run(
        [sys.executable, "experiments/ensemble.py", *flags, "--data-dir", str(data_dir), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # --devices simulates them
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_an_ensemble_split_over_two_devices_by_its_members_equals_it_on_one(tmp_path, mnist1d_dir):
    """Every member on the same batches, each device training two of the four: the same numbers as on one
    device, to the tolerance of tests/test_parallel.py (the members' arithmetic is vectorised over a member
    axis of another length, which can move the last bits), and half the state on each device."""
    one, two = (ensemble_summary(tmp_path / f"d{d}", d, mnist1d_dir) for d in (1, 2))
    compared = [key for key in one if key.startswith(("test_", "train_")) and "seconds" not in key]
    assert {"test_member_loss", "test_ensemble_accuracy", "train_loss"} <= set(compared)
    for key in compared:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, err_msg=key)
    leaves = read_header(next((tmp_path / "d1" / "checkpoints").iterdir()))["leaves"]  # [path, shape, dtype]
    state_bytes = sum(np.prod(shape, dtype=int) * np.dtype(dtype).itemsize for _, shape, dtype in leaves)
    assert two["state_bytes_per_device"] == state_bytes // 2
