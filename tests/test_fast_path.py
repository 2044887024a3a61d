"""The pieces the fast path rewrote for speed compute exactly what the straightforward code does."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch
from research.nn import MLP
from research.state import RunningMean
from research.train import TrainState, train_step
from research.train._compiled import NONFINITE_LOSS, StepStats, host_means, layout_of
from research.train._fit import _window_from_header, window_to_header
from research.train._keys import split_key_data


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1])
def test_unrolled_key_split_gives_the_bits_of_jax_random_split(seed):
    key = jax.random.key(seed)
    for _ in range(3):
        first, second = jax.random.split(key)
        mine = jax.jit(split_key_data)(jax.random.key_data(key))
        np.testing.assert_array_equal(mine[0], jax.random.key_data(first))
        np.testing.assert_array_equal(mine[1], jax.random.key_data(second))
        key = first


def test_train_step_advances_the_key_as_jax_random_split(getkey):
    state = TrainState.create(MLP(2, 1, hidden=(3,), key=getkey()), optax.sgd(0.1), key=jax.random.key(7))
    batch = Batch(jnp.zeros((4, 2)), jnp.zeros(4, jnp.int32))
    new, _ = jax.jit(train_step)(state, batch)
    expected, _ = jax.random.split(jax.random.wrap_key_data(state.key))
    np.testing.assert_array_equal(new.key, jax.random.key_data(expected))


def step_metrics(loss, accuracy, grad_norm):
    return {"loss": jnp.float32(loss), "accuracy": jnp.float32(accuracy), "grad_norm": jnp.float32(grad_norm)}


def test_packed_statistics_are_the_running_mean_of_the_finite_steps_and_flag_the_first_bad_one():
    steps = [step_metrics(0.5, 0.25, 1.0), step_metrics(np.inf, 0.5, 2.0), step_metrics(0.25, 0.75, np.nan),
             step_metrics(0.125, 1.0, 3.0)]
    stats = StepStats.init(layout_of(steps[0]))
    reference = RunningMean.init(steps[0])
    for i, metrics in enumerate(steps):
        stats = jax.jit(StepStats.record)(stats, jnp.int32(10 + i), metrics)
        ok = all(np.isfinite(float(v)) for v in metrics.values())
        if ok:
            reference, _ = reference.update(metrics)
    for name, value in reference.mean().items():
        assert float(stats.metrics.mean()[name]) == float(value)
        assert float(host_means(np.asarray(stats.sums), stats.layout)[name]) == float(value)
    assert float(stats.metrics.weight) == 2
    assert (int(stats.first_bad_step), int(stats.bad_quantity), int(stats.skipped)) == (11, NONFINITE_LOSS, 2)


def test_a_logging_window_survives_the_checkpoint_header_exactly():
    stats = StepStats.init(layout_of(step_metrics(0, 0, 0)))
    for i, value in enumerate([0.1, 0.7, 1 / 3]):
        stats = stats.record(jnp.int32(i), step_metrics(value, value / 2, value * 3))
    stats = stats.record(jnp.int32(3), step_metrics(np.nan, 0, 0))
    header = json.loads(json.dumps(window_to_header(stats)))
    restored = _window_from_header(header, StepStats.init(stats.layout))
    np.testing.assert_array_equal(restored.sums, stats.sums)
    assert int(restored.skipped) == 1 and int(restored.first_bad_step) == -1  # counters other than skipped restart


def test_statistics_refuse_metrics_they_were_not_laid_out_for():
    stats = StepStats.init(layout_of(step_metrics(0, 0, 0)))
    with pytest.raises(ValueError, match="init_stats"):
        stats.record(jnp.int32(0), {**step_metrics(0, 0, 0), "extra": jnp.float32(1)})
