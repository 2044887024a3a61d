import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from research.data import DeviceLoader, XORDataset
from research.ensemble import evaluate_ensemble, fit_ensemble, member, num_members, stack_states
from research.nn import MLP
from research.train import TrainState, evaluate, fit

OPTIMIZER = optax.adam(1e-2)  # one object: members and single runs share the compiled code


def build_state(key):
    model_key, train_key = jax.random.split(key)
    return TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), OPTIMIZER, key=train_key)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@pytest.fixture(scope="module")
def xor():
    train = DeviceLoader.from_dataset(XORDataset(512, seed=42), 64, seed=0)
    test = DeviceLoader.from_dataset(XORDataset(200, seed=1), 64, shuffle=False)
    return train, test


def test_stacked_members_are_the_states_built_alone():
    keys = jax.random.split(jax.random.key(0), 3)
    states = stack_states(build_state, keys)
    assert num_members(states) == 3 and states.step.shape == (3,) and states.key.shape == (3, 2)
    build_alone = eqx.filter_jit(build_state)
    for k in range(3):
        for a, b in zip(arrays(member(states, k)), arrays(build_alone(keys[k])), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not np.allclose(arrays(member(states, 0).model)[0], arrays(member(states, 1).model)[0])


def test_training_members_vmapped_equals_training_each_alone(xor):
    train, test = xor
    states = stack_states(build_state, jax.random.split(jax.random.key(1), 3))
    together = fit_ensemble(states, train, num_steps=60, steps_per_call=25, progress=False)
    assert np.all(np.asarray(together.states.step) == 60)
    results = evaluate_ensemble(together.states.model, together.states.model_state, test)
    probabilities = []
    predict = eqx.filter_jit(lambda model, x: jax.nn.sigmoid(jax.vmap(model)(x)[:, 0]))
    for k in range(3):
        alone = fit(member(states, k), train, num_steps=60, steps_per_call=25, progress=False)
        for a, b in zip(arrays(member(together.states, k)), arrays(alone.state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        single = evaluate(alone.state.model, None, test)
        assert results["member_accuracy"][k] == pytest.approx(single["accuracy"], abs=1e-6)
        assert results["member_loss"][k] == pytest.approx(single["loss"], rel=1e-5)
        probabilities.append(predict(alone.state.model, test.arrays.inputs))

    # The ensemble predicts from the mean of the members' probabilities.
    mean = np.mean(np.stack(probabilities), axis=0)
    labels = np.asarray(test.arrays.labels)
    assert results["accuracy"] == pytest.approx(np.mean((mean > 0.5) == (labels == 1)), abs=1e-6)
    nll = -np.mean(np.log(np.where(labels == 1, mean, 1 - mean)))
    assert results["loss"] == pytest.approx(nll, rel=1e-4)
    assert together.train_metrics["loss"].shape == (3,)
