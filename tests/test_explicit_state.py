"""Explicit state through the training stack: BatchNorm statistics, dropout keys and the EMA of weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch, DeviceLoader
from research.services import RunDir, checkpoint_digest, load_checkpoint
from research.train import SupervisedStep, TrainState, compiled_trainer, evaluate, fit, forward
from research.typing import Array, Float, PRNGKeyArray, typecheck


class BatchNormNet(eqx.Module):
    """Linear -> BatchNorm (mode="batch") -> relu -> dropout -> Linear, on one example."""

    stateful = True
    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    last: eqx.nn.Linear

    def __init__(
        self,
        in_size: int,
        hidden: int,
        classes: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.2,
        axis_name: str = "batch",
    ):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(in_size, hidden, key=k1)
        self.norm = eqx.nn.BatchNorm(hidden, axis_name, mode="batch")
        self.dropout = eqx.nn.Dropout(dropout)
        self.last = eqx.nn.Linear(hidden, classes, key=k2)

    @typecheck
    def __call__(
        self, x: Float[Array, " features"], state: eqx.nn.State, *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, " classes"], eqx.nn.State]:
        h, state = self.norm(self.first(x), state)
        return self.last(self.dropout(jax.nn.relu(h), key=key)), state


class DropoutLinear(eqx.Module):
    """Dropout on the input, then a linear layer: a dropped input leaves its weight column untouched."""

    dropout: eqx.nn.Dropout
    linear: eqx.nn.Linear

    def __init__(self, in_size: int, classes: int, *, key: PRNGKeyArray):
        self.dropout = eqx.nn.Dropout(0.5)
        self.linear = eqx.nn.Linear(in_size, classes, key=key)

    @typecheck
    def __call__(self, x: Float[Array, " features"], *, key: PRNGKeyArray | None = None) -> Float[Array, " classes"]:
        return self.linear(self.dropout(x, key=key))


FEATURES, CLASSES = 16, 3
OPTIMIZER = optax.adam(1e-2)  # one object, so every state shares one compiled trainer


@pytest.fixture(scope="module")
def blobs():
    """Gaussian points labelled by a random linear map (learnable), offset so BatchNorm has work to do."""
    rng = np.random.default_rng(0)
    inputs = (rng.normal(size=(256, FEATURES)) * 2 + 1).astype(np.float32)
    labels = np.argmax(inputs @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype(np.int32)
    return inputs, labels


def bn_state(seed=0, ema_decay=0.0):
    model_key, train_key = jax.random.split(jax.random.key(seed))
    model, model_state = eqx.nn.make_with_state(BatchNormNet)(FEATURES, 8, CLASSES, key=model_key)
    return TrainState.create(model, OPTIMIZER, key=train_key, model_state=model_state, ema_decay=ema_decay)


def train(state, loader, num_steps, **kwargs):
    return fit(state, loader, num_steps=num_steps, log_every=4, steps_per_call=4, progress=False, **kwargs)


@pytest.fixture(scope="module")
def loaders(blobs):
    return DeviceLoader(*blobs, 32, seed=0), DeviceLoader(*blobs, 64, shuffle=False)


@pytest.fixture(scope="module")
def trained(loaders):
    """12 steps of the BatchNorm net, no EMA."""
    return train(bn_state(), loaders[0], 12).state


def assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def running_statistics(model_state):
    counter, mean, var = jax.tree.leaves(model_state)
    return int(counter), np.asarray(mean), np.asarray(var)


def test_one_step_moves_the_running_statistics_by_the_batch_statistics(blobs, loaders):
    state = bn_state()
    first = train(state, loaders[0], 1).state
    batch = loaders[0].host.inputs[loaders[0].step_indices(0, 1)[0]]
    hidden = jax.vmap(state.model.first)(jnp.asarray(batch))  # BatchNorm's input, with the weights before the step
    counter, mean, var = running_statistics(first.model_state)
    momentum = state.model.norm.momentum
    assert counter == 1
    np.testing.assert_allclose(mean, (1 - momentum) * hidden.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(var, momentum + (1 - momentum) * hidden.var(0), rtol=1e-5)


@pytest.mark.slow
def test_inference_outputs_do_not_depend_on_batchmates_and_leave_the_state_alone(blobs, trained):
    inputs = jnp.asarray(blobs[0])
    with_friends = inputs[:8]
    with_strangers = jnp.concatenate([inputs[:1], 10 * inputs[100:107] - 3])  # example 0 among very different ones
    key = jax.random.key(1)

    model = eqx.nn.inference_mode(trained.model)
    a, state_a = forward(model, trained.model_state, with_friends, key=None)
    b, _ = forward(model, trained.model_state, with_strangers, key=None)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
    assert_identical(state_a, trained.model_state)  # evaluation reads the running statistics, never writes them
    # in training mode the same example's output does depend on its batch (batch statistics)
    a, _ = forward(trained.model, trained.model_state, with_friends, key=key)
    b, _ = forward(trained.model, trained.model_state, with_strangers, key=key)
    assert np.abs(np.asarray(a[0] - b[0])).max() > 0.1
    assert running_statistics(trained.model_state)[0] == 12  # forward() worked on a copy of the state

    # so evaluation gives the same numbers however the test set is cut into batches (100: a padded last batch)
    by_64 = evaluate(trained.model, trained.model_state, DeviceLoader(*blobs, 64, shuffle=False))
    by_100 = evaluate(trained.model, trained.model_state, DeviceLoader(*blobs, 100, shuffle=False))
    np.testing.assert_allclose(by_64["loss"], by_100["loss"], rtol=1e-5)
    assert by_64["accuracy"] == by_100["accuracy"]


def test_running_statistics_move_in_training_and_evaluation_does_not_disturb_training(loaders, trained):
    train_data, test_data = loaders
    evaluated = train(bn_state(), train_data, 12, eval_data=test_data, eval_every=4)
    assert_identical(evaluated.state, trained)  # three evaluations on the way changed nothing
    counter, mean, var = running_statistics(trained.model_state)
    assert counter == 12
    assert np.abs(mean).min() > 0 and np.abs(var - 1).min() > 0  # they started at 0 and 1


def test_a_restored_checkpoint_continues_bitwise_like_an_uninterrupted_run(loaders, tmp_path):
    """BatchNorm statistics, dropout key, optimizer state and EMA all come back from the checkpoint."""
    train_data, _ = loaders
    straight = train(bn_state(ema_decay=0.9), train_data, 16)

    run = RunDir(tmp_path / "run").create()
    train(bn_state(ema_decay=0.9), train_data, 8, run=run)
    skeleton = bn_state(seed=5, ema_decay=0.9)  # other values, same structure: everything must be overwritten
    restored, header = load_checkpoint(run.checkpoint_path(8), skeleton)
    assert header["step"] == 8 and int(restored.ema.count) == 8
    resumed = train(restored, train_data, 16)

    assert_identical(resumed.state, straight.state)
    assert running_statistics(resumed.state.model_state)[0] == 16


def test_ema_follows_training_without_changing_it_and_is_what_fit_evaluates(loaders, trained):
    train_data, test_data = loaders
    decay = 0.8
    state, models = bn_state(ema_decay=decay), []
    for step in range(1, 13):  # one step per fit, to see every model the EMA averages
        result = train(state, train_data, step, eval_data=test_data if step == 12 else None)
        state = result.state
        models.append(eqx.filter(state.model, eqx.is_array))
    assert_identical(state.model, trained.model)  # the EMA only watches
    assert_identical(state.model_state, trained.model_state)

    weights = decay ** np.arange(12)[::-1]  # debiased: the decay-weighted mean of the 12 models
    expected = jax.tree.map(
        lambda *w: sum(c * np.asarray(x, np.float64) for c, x in zip(weights, w, strict=True)) / weights.sum(), *models
    )
    averaged_model, averaged_state = state.averaged().model, state.averaged().model_state
    for x, y in zip(jax.tree.leaves(eqx.filter(averaged_model, eqx.is_array)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert running_statistics(averaged_state)[0] == 12  # the counter follows; the statistics are averaged
    assert not np.array_equal(running_statistics(averaged_state)[1], running_statistics(state.model_state)[1])

    assert result.eval_metrics == evaluate(averaged_model, averaged_state, test_data)
    assert result.raw_eval_metrics == evaluate(state.model, state.model_state, test_data)
    assert result.eval_metrics != result.raw_eval_metrics


def test_each_step_draws_a_new_dropout_mask(getkey):
    """Batch of one, SGD: the weight columns a step leaves unchanged are the inputs its mask dropped."""
    features = 32
    state = TrainState.create(DropoutLinear(features, CLASSES, key=getkey()), optax.sgd(0.1), key=getkey())
    batch = Batch(jnp.ones((1, features)), jnp.zeros(1, jnp.int32))
    trainer = compiled_trainer(SupervisedStep(), state)
    leaves = trainer.leaves(jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state))
    weights = [np.asarray(state.model.linear.weight)]
    for _ in range(6):
        leaves, _ = trainer.step(leaves, trainer.init_stats(leaves, batch), batch)
        weights.append(np.asarray(trainer.state(leaves).model.linear.weight))
    masks = [tuple((after != before).any(axis=0)) for before, after in zip(weights[:-1], weights[1:], strict=True)]
    assert len(set(masks)) == 6  # no two steps share a mask (a repeat has probability ~2^-32)
    assert all(4 <= sum(mask) <= 28 for mask in masks)  # about half the inputs kept, as p=0.5 says

    # within a step every example gets its own mask too
    outputs, _ = forward(state.model, None, jnp.ones((4, features)), key=getkey())
    assert len({tuple(np.asarray(row)) for row in outputs}) == 4


def test_evaluation_is_deterministic_and_without_dropout(getkey, blobs):
    model = DropoutLinear(FEATURES, CLASSES, key=getkey())
    data = DeviceLoader(*blobs, 64, shuffle=False)
    first, second = evaluate(model, None, data), evaluate(model, None, data)
    assert first == second
    logits = jax.vmap(model.linear)(jnp.asarray(blobs[0]))  # the model with dropout switched off
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=1) == blobs[1]))
    np.testing.assert_allclose(first["accuracy"], accuracy, rtol=1e-6)


def test_states_of_one_stateful_model_share_one_compiled_trainer(trained):
    # an eqx.nn.State hashes by identity; the trainer cache must still see these as the same structure
    assert compiled_trainer(SupervisedStep(), bn_state(seed=3)) is compiled_trainer(SupervisedStep(), trained)
    with_ema = compiled_trainer(SupervisedStep(), bn_state(ema_decay=0.5))
    assert with_ema is compiled_trainer(SupervisedStep(), bn_state(seed=4, ema_decay=0.5))
    assert with_ema is not compiled_trainer(SupervisedStep(), bn_state(ema_decay=0.9))  # decay is static


@pytest.mark.slow
def test_an_experiment_with_ema_reports_both_models_and_resumes_bitwise(tmp_path, monkeypatch):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("xor_ema", Path(__file__).parent.parent / "experiments" / "xor.py")
    xor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(xor)
    monkeypatch.chdir(tmp_path)
    options = dict(ema_decay=0.9, progress=False, log_every=19)
    summary = xor.main(xor.Config.from_options(run_dir="straight", epochs=4, **options))
    xor.main(xor.Config.from_options(run_dir="resumed", epochs=2, **options))
    xor.main(xor.Config.from_options(run_dir="resumed", epochs=4, resume=True, **options))
    a, b = (checkpoint_digest(tmp_path / name / "checkpoints/step_000000076") for name in ("straight", "resumed"))
    assert a == b  # identical states: EMA included

    last = json.loads((tmp_path / "straight/metrics.jsonl").read_text().splitlines()[-1])
    assert last["test/accuracy"] == summary["test_accuracy"]
    assert last["test_raw/accuracy"] == summary["test_raw_accuracy"]
    config = xor.Config.from_options(epochs=4, **options)
    restored, _ = load_checkpoint(
        tmp_path / "straight/checkpoints/step_000000076", xor.build_state(config).with_ema(config.ema.ema_decay)
    )
    test = DeviceLoader.from_dataset(xor.XORDataset(500, seed=123), 128, shuffle=False)
    assert evaluate(restored.averaged().model, restored.averaged().model_state, test) == {
        "loss": summary["test_loss"],
        "accuracy": summary["test_accuracy"],
    }
    assert evaluate(restored.model, None, test) == {
        "loss": summary["test_raw_loss"],
        "accuracy": summary["test_raw_accuracy"],
    }
    assert int(restored.ema.count) == 76
