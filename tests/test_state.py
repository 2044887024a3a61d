import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.state import EMA, Counter, RunningMean, ema_update


def test_counter_counts_under_jit():
    counter = Counter.init()
    update = jax.jit(lambda c: c.update())
    seen = []
    for _ in range(3):
        counter, before = update(counter)
        seen.append(int(before))
    assert seen == [0, 1, 2] and int(counter.count) == 3


def test_counter_and_running_mean_are_scan_bodies():
    counter, before = jax.lax.scan(Counter.update, Counter.init(), jnp.ones(5, jnp.int32))
    assert before.tolist() == [0, 1, 2, 3, 4] and int(counter.count) == 5
    mean, means = jax.lax.scan(RunningMean.update, RunningMean.init(0.0), jnp.array([2.0, 4.0, 6.0, 8.0, 10.0]))
    assert means.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert float(mean.weight) == 5 and float(mean.total) == 30


def test_running_mean_of_a_pytree_with_weights():
    mean = RunningMean.init({"a": 0.0, "b": jnp.zeros(2)})
    np.testing.assert_array_equal(mean.mean()["b"], [0.0, 0.0])  # no 0 / 0 before the first value
    mean, current = mean.update({"a": 2.0, "b": jnp.array([1.0, 3.0])})
    assert float(current["a"]) == 2.0
    mean, current = mean.update({"a": 5.0, "b": jnp.array([4.0, 6.0])}, weight=2.0)
    np.testing.assert_allclose(current["a"], (2 + 2 * 5) / 3)
    np.testing.assert_allclose(current["b"], [(1 + 8) / 3, (3 + 12) / 3])


def test_ema_update_mixes_float_leaves_in_their_dtype_and_takes_the_rest_from_value():
    average = {"w": jnp.array([0.0, 10.0]), "half": jnp.ones(2, jnp.bfloat16), "n": jnp.array(1), "name": "x"}
    value = {"w": jnp.array([1.0, 0.0]), "half": jnp.zeros(2, jnp.bfloat16), "n": jnp.array(7), "name": "x"}
    mixed = ema_update(average, value, jnp.asarray(0.75))
    np.testing.assert_allclose(mixed["w"], [0.25, 7.5], rtol=1e-6)
    assert mixed["half"].dtype == jnp.bfloat16 and mixed["half"].tolist() == [0.75, 0.75]
    assert int(mixed["n"]) == 7 and mixed["name"] == "x"


def weighted_reference(values, decay):
    """The debiased EMA of `values` computed directly: sum_i decay^(n-i) v_i / sum_i decay^(n-i), in float64."""
    weights = decay ** np.arange(len(values))[::-1]
    return np.tensordot(weights, np.asarray(values, np.float64), axes=1) / weights.sum()


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9, 0.9999])
def test_debiased_ema_is_the_decay_weighted_mean_of_the_values_seen(decay):
    values = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    ema = EMA.init(jnp.full(3, 100.0), decay)  # the starting value gets no weight once debiased
    traces = []
    update = jax.jit(lambda ema, value: traces.append(1) or ema.update(value))
    for n in range(1, len(values) + 1):
        ema, average = update(ema, jnp.asarray(values[n - 1]))
        np.testing.assert_allclose(average, weighted_reference(values[:n], decay), rtol=2e-5, atol=1e-6)
    assert int(ema.count) == 6 and len(traces) == 1  # decay is static, count an array: one trace


def test_plain_ema_is_the_textbook_recursion_from_its_start():
    ema = EMA.init({"w": jnp.array(10.0)}, 0.5, debias=False)
    seen = []
    for value in [0.0, 0.0, 4.0]:
        ema, average = ema.update({"w": jnp.asarray(value)})
        seen.append(float(average["w"]))
    assert seen == [5.0, 2.5, 3.25]


def test_ema_of_a_model_keeps_its_structure_and_refuses_a_bad_decay(getkey):
    model = eqx.nn.MLP(2, 1, 4, 1, key=getkey())
    ema = EMA.init(model, 0.99)
    new, averaged = ema.update(model)
    assert jax.tree.structure(averaged) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(averaged), jax.tree.leaves(model), strict=True):
        assert jnp.array_equal(a, b) if eqx.is_array(b) else a is b  # the first debiased update: the model
    with pytest.raises(ValueError, match=r"EMA decay must be in \[0, 1\), got 1.0"):
        EMA.init(model, 1.0)
