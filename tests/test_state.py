import jax
import jax.numpy as jnp
import numpy as np

from research.state import Counter, RunningMean, ema_update


def test_counter_counts_under_jit():
    counter = Counter.init()
    update = jax.jit(lambda c: c.update())
    seen = []
    for _ in range(3):
        counter, before = update(counter)
        seen.append(int(before))
    assert seen == [0, 1, 2] and int(counter.count) == 3


def test_running_mean_of_a_pytree_with_weights():
    mean = RunningMean.init({"a": 0.0, "b": jnp.zeros(2)})
    mean, current = mean.update({"a": 2.0, "b": jnp.array([1.0, 3.0])})
    assert float(current["a"]) == 2.0
    mean, current = mean.update({"a": 5.0, "b": jnp.array([4.0, 6.0])}, weight=2.0)
    np.testing.assert_allclose(current["a"], (2 + 2 * 5) / 3)
    np.testing.assert_allclose(current["b"], [(1 + 8) / 3, (3 + 12) / 3])


def test_ema_update_mixes_array_leaves():
    average = {"w": jnp.array([0.0, 10.0]), "name": "x"}
    value = {"w": jnp.array([1.0, 0.0]), "name": "x"}
    mixed = ema_update(average, value, 0.9)
    np.testing.assert_allclose(mixed["w"], [0.1, 9.0], rtol=1e-6)
    assert mixed["name"] == "x"
