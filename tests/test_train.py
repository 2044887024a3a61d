import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch, DeviceLoader, TorchLoader, XORDataset
from research.nn import MLP
from research.train import (
    SupervisedStep,
    TrainState,
    compiled_trainer,
    evaluate,
    fit,
    forward,
    train_step,
)


def make_state(seed=0, hidden=8, lr=0.1, optimizer=None):
    model_key, train_key = jax.random.split(jax.random.key(seed))
    model = MLP(2, 1, hidden=(hidden,), key=model_key)
    return TrainState.create(model, optimizer or optax.sgd(lr), key=train_key)


def params(state):
    return jax.tree.leaves(eqx.filter(state.model, eqx.is_array))


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def xor():
    train = XORDataset(512, seed=42)
    return train, DeviceLoader.from_dataset(train, 64, seed=0)


def test_train_state_stores_key_data_and_starts_at_step_zero():
    state = make_state()
    assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
    assert int(state.step) == 0
    assert state.optimizer is not None and state.optimizer not in jax.tree.leaves(state)


def test_train_step_takes_a_fresh_key_each_step(xor):
    _, loader = xor
    batch = Batch(*[a[:64] for a in loader.arrays])
    state = make_state()
    s1, metrics = eqx.filter_jit(train_step)(state, batch)
    s2, _ = eqx.filter_jit(train_step)(s1, batch)
    assert int(s2.step) == 2
    assert len({tuple(np.asarray(k)) for k in (state.key, s1.key, s2.key)}) == 3
    assert set(metrics) == {"loss", "accuracy", "grad_norm"}


def test_fast_path_equals_the_filter_jit_step_and_never_retraces(xor):
    _, loader = xor
    optimizer = optax.adam(1e-2)
    batches = [Batch(loader.arrays.inputs[i], loader.arrays.labels[i]) for i in loader.step_indices(0, 12)]

    reference = make_state(optimizer=optimizer)
    reference_losses = []
    for batch in batches:
        reference, metrics = eqx.filter_jit(train_step)(reference, batch)
        reference_losses.append(float(metrics["loss"]))

    state = make_state(optimizer=optimizer)
    trainer = compiled_trainer(SupervisedStep(), state)
    traces = trainer.num_traces["step"]
    leaves = trainer.leaves(state)
    losses = []
    for batch in batches:
        sums = trainer.init_stats(leaves, batch)
        leaves, sums = trainer.step(leaves, sums, batch)
        losses.append(float(sums.fetch().means()["loss"]))
    assert trainer.num_traces["step"] - traces <= 1
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-6)
    assert_trees_close(trainer.state(leaves), reference)


def test_compiled_run_of_many_steps_equals_single_steps(xor):
    _, loader = xor
    indices = loader.step_indices(0, 10)
    optimizer = optax.sgd(0.1)
    one = make_state(optimizer=optimizer)
    trainer = compiled_trainer(SupervisedStep(), one)
    leaves = trainer.leaves(one)
    sums = trainer.init_stats(leaves, Batch(loader.arrays.inputs[:64], loader.arrays.labels[:64]))
    for index in indices:
        leaves, sums = trainer.step(leaves, sums, Batch(loader.arrays.inputs[index], loader.arrays.labels[index]))
    many = make_state(optimizer=optimizer)
    many_leaves = trainer.leaves(many)
    padded = np.zeros((16, 64), np.int32)
    padded[:10] = indices
    many_sums = trainer.init_stats(many_leaves, Batch(loader.arrays.inputs[:64], loader.arrays.labels[:64]))
    many_leaves, many_sums = trainer.run(many_leaves, many_sums, loader.arrays, padded, 10)
    assert_trees_close(trainer.state(many_leaves), trainer.state(leaves))
    assert_trees_close(many_sums.fetch().means(), sums.fetch().means())
    assert many_sums.fetch().weight == 10


def test_a_one_row_run_is_one_step_without_a_loop_and_zero_steps_change_nothing(xor):
    _, loader = xor
    state = make_state()
    trainer = compiled_trainer(SupervisedStep(), state)
    example = Batch(loader.arrays.inputs[:64], loader.arrays.labels[:64])
    index = loader.step_indices(0, 1)

    def fresh():  # the compiled calls donate their inputs
        leaves = [x.copy() for x in trainer.leaves(state)]
        return leaves, trainer.init_stats(leaves, example)

    leaves, sums = trainer.step(*fresh(), Batch(loader.arrays.inputs[index[0]], loader.arrays.labels[index[0]]))
    run_leaves, run_sums = trainer.run(*fresh(), loader.arrays, index, 1)
    assert_trees_close(trainer.state(run_leaves), trainer.state(leaves))
    assert_trees_close(run_sums.fetch().means(), sums.fetch().means())
    idle_leaves, idle_sums = trainer.run(*fresh(), loader.arrays, index, 0)
    assert_trees_close(trainer.state(idle_leaves), state)
    assert idle_sums.fetch().weight == 0


def test_fit_is_independent_of_steps_per_call_and_leaves_the_input_state_usable(xor):
    _, loader = xor
    state = make_state()
    a = fit(state, loader, num_steps=40, log_every=40, steps_per_call=1, progress=False)
    b = fit(state, loader, num_steps=40, log_every=13, steps_per_call=7, progress=False)
    assert int(a.state.step) == int(b.state.step) == 40
    assert_trees_close(a.state, b.state)
    assert int(state.step) == 0 and np.isfinite(params(state)[0]).all()  # not donated away


def test_fit_learns_xor_with_the_torch_loader(xor):
    train, _ = xor
    loader = TorchLoader(train, 64, seed=0)
    result = fit(
        make_state(lr=0.5),
        loader,
        num_steps=400,
        log_every=100,
        eval_data=DeviceLoader.from_dataset(train, 100, shuffle=False),
        progress=False,
    )
    assert result.eval_metrics["accuracy"] > 0.95
    assert result.train_metrics["loss"] < 0.3


def test_evaluate_weights_batches_by_size(xor):
    train, _ = xor
    state = make_state()
    loader = DeviceLoader.from_dataset(train, 100, shuffle=False)  # 512 = 5 x 100 + 12
    metrics = evaluate(state.model, None, loader)
    logits, _ = forward(state.model, None, jnp.asarray(train.inputs), key=None)
    losses = optax.sigmoid_binary_cross_entropy(logits[:, 0], jnp.asarray(train.labels, jnp.float32))
    accuracy = jnp.mean((logits[:, 0] > 0) == (train.labels == 1))
    np.testing.assert_allclose(metrics["loss"], float(jnp.mean(losses)), rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], float(accuracy), rtol=1e-6)


def test_fit_evaluates_and_checkpoints_at_its_cadences_and_at_the_end_only(tmp_path):
    """Without `eval_every` / `checkpoint_every` the engine's hooks run once, at the end; with them, on
    their multiples (and at the end), never at the other stops (`log_every` makes a stop every 10 steps)."""
    from research.services import RunDir

    train = DeviceLoader.from_dataset(XORDataset(256, seed=0), 32, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(64, seed=1), 32, shuffle=False)
    state = TrainState.create(MLP(2, 1, hidden=(4,), key=jax.random.key(0)), optax.sgd(0.1), key=jax.random.key(1))
    for eval_every, checkpoint_every, evaluated, saved in ((None, None, [50], [50]), (20, 25, [20, 40, 50], [25, 50])):
        run = RunDir(tmp_path / f"run{eval_every}").create()
        fit(
            state,
            train,
            num_steps=50,
            eval_data=test,
            eval_every=eval_every,
            log_every=10,
            run=run,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=10,
            progress=False,
        )
        records = run.read_metrics()
        assert [r["step"] for r in records] == [10, 20, 30, 40, 50]
        assert [r["step"] for r in records if "test/accuracy" in r] == evaluated
        assert [int(p.stem.split("_")[1]) for p in run.checkpoint_paths()] == saved
