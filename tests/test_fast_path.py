"""The pieces the fast path rewrote for speed compute exactly what the straightforward code does."""

import json
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch, DeviceLoader, XORDataset
from research.nn import MLP
from research.state import RunningMean
from research.train import Engine, SupervisedStep, TrainState, compiled_trainer, train_step
from research.train._compiled import CompiledTrainer
from research.train._keys import split_key_data
from research.train._packing import PACK_LIMIT, Packing
from research.train._stats import StepStats, layout_of

SUPERVISED = SupervisedStep.finite_metrics  # ("loss", "grad_norm")


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
    steps = [
        step_metrics(0.5, 0.25, 1.0),
        step_metrics(np.inf, 0.5, 2.0),
        step_metrics(0.25, 0.75, np.nan),
        step_metrics(0.125, 1.0, 3.0),
    ]
    stats = StepStats.init(layout_of(steps[0], SUPERVISED))
    reference = RunningMean.init(steps[0])
    for i, metrics in enumerate(steps):
        stats = jax.jit(StepStats.record)(stats, jnp.int32(10 + i), metrics)
        ok = all(np.isfinite(float(v)) for v in metrics.values())
        if ok:
            reference, _ = reference.update(metrics)
    view = stats.fetch()
    for name, value in reference.mean().items():
        assert float(view.total[name] / view.weight) == float(value)
        assert float(view.means()[name]) == float(value)
    assert view.weight == 2
    assert (view.first_bad_step, view.bad_metric, view.skipped) == (11, "loss", 2)
    gradient_first = jax.jit(StepStats.record)(StepStats.init(stats.layout), jnp.int32(7), steps[2]).fetch()
    assert (gradient_first.first_bad_step, gradient_first.bad_metric) == (7, "grad_norm")
    fresh = StepStats.init(stats.layout).fetch()
    assert (fresh.first_bad_step, fresh.bad_metric, fresh.skipped, fresh.weight) == (-1, None, 0, 0)


def test_a_logging_window_survives_the_checkpoint_header_exactly():
    stats = StepStats.init(layout_of(step_metrics(0, 0, 0), SUPERVISED))
    for i, value in enumerate([0.1, 0.7, 1 / 3]):
        stats = stats.record(jnp.int32(i), step_metrics(value, value / 2, value * 3))
    stats = stats.record(jnp.int32(3), step_metrics(np.nan, 0, 0))
    header = json.loads(json.dumps(stats.fetch().window()))
    restored, saved = StepStats.from_window(header, stats.layout).fetch(), stats.fetch()
    for name, total in saved.total.items():
        np.testing.assert_array_equal(restored.total[name], total)
    assert restored.weight == saved.weight
    assert restored.skipped == 1 and restored.first_bad_step == -1  # counters other than skipped restart


def read_by_position(words, layout):
    """The statistics as the packed words hold them, read by position (the documented layout: float32
    metric sums in layout order, the weight, then int32 first-bad code and skipped count)."""
    words = np.asarray(words)
    sums, (code, skipped) = words[:-2].view(np.float32), words[-2:].view(np.int32)
    finite = layout.finite
    first_bad = (-1, None) if code == np.iinfo(np.int32).max else (code // len(finite), finite[code % len(finite)])
    return (
        dict(zip(layout.names, sums[:-1].tolist(), strict=True)),
        float(sums[-1]),
        int(skipped),
        first_bad,
    )


def test_the_host_view_names_what_real_steps_left_in_the_packed_words():
    # Two finite steps, a step with a NaN input (non-finite loss: skipped), then a finite one.
    state = xor_state()
    trainer = compiled_trainer(SupervisedStep(), state, skip_nonfinite=True)
    data = XORDataset(32, seed=0)
    good = Batch(jnp.asarray(data.inputs), jnp.asarray(data.labels))
    bad = Batch(good.inputs.at[0].set(jnp.nan), good.labels)
    leaves = trainer.place(state)
    stats = trainer.init_stats(leaves, good)
    for batch in (good, good, bad, good):
        leaves, stats = trainer.step(leaves, stats, batch)
    total, weight, skipped, first_bad = read_by_position(stats.words, stats.layout)
    view = stats.fetch()
    assert {name: float(value) for name, value in view.total.items()} == total
    assert (view.weight, view.skipped, (view.first_bad_step, view.bad_metric)) == (weight, skipped, first_bad)
    assert (weight, skipped, first_bad) == (3, 1, (2, "loss"))
    assert {name: float(value) for name, value in view.means().items()} == {
        name: float(np.float32(value) / weight) for name, value in total.items()
    }
    assert view.window() == {"total": total, "weight": weight, "skipped": skipped}


def test_hooks_see_the_statistics_of_their_stop_by_name():
    data = XORDataset(256, seed=0)
    inputs = np.array(data.inputs, np.float32)
    inputs[7] = np.nan  # the steps whose batch holds example 7 are skipped
    loader = DeviceLoader(inputs, np.asarray(data.labels), 32, seed=0)
    seen = []

    def look(info):
        by_position = read_by_position(info.stats.words, info.stats.layout)
        seen.append((info.step, info.logged, dict(info.record), info.host_stats, by_position, info.window()))

    Engine(log_every=4, steps_per_call=3, skip_nonfinite=True).add_hook(look, every=2).fit(xor_state(), loader, 12)
    assert [(step, logged) for step, logged, *_ in seen] == [
        (2, False),
        (4, True),
        (6, False),
        (8, True),
        (10, False),
        (12, True),
    ]
    assert sum(view.skipped for _, logged, _, view, *_ in seen if logged) >= 1
    for _, logged, record, view, (total, weight, skipped, first_bad), window in seen:
        assert ({k: float(v) for k, v in view.total.items()}, view.weight, view.skipped) == (total, weight, skipped)
        assert (view.first_bad_step, view.bad_metric) == first_bad
        if logged:  # the record took the window's metrics; the next steps start a new window
            assert record["train/loss"] == float(np.float32(total["loss"]) / max(weight, 1e-30))
            assert record["train/skipped"] == skipped
            assert window == {"total": {name: 0.0 for name in total}, "weight": 0.0, "skipped": 0}
        else:
            assert window == {"total": total, "weight": weight, "skipped": skipped}


def test_statistics_refuse_metrics_they_were_not_laid_out_for():
    stats = StepStats.init(layout_of(step_metrics(0, 0, 0), SUPERVISED))
    with pytest.raises(ValueError, match="init_stats"):
        stats.record(jnp.int32(0), {**step_metrics(0, 0, 0), "extra": jnp.float32(1)})


def test_packing_round_trips_every_leaf_bitwise_and_leaves_other_dtypes_out_of_the_buffer():
    leaves = [
        jnp.float32(-0.0),
        jnp.asarray([[1.5, np.nan], [np.inf, -2.0]], jnp.float32),
        jnp.int32(-7),
        jnp.asarray([3, 2**32 - 1], jnp.uint32),
        jnp.asarray([1, 2], jnp.bfloat16),
        jnp.asarray([True, False]),
    ]
    packing = Packing.of(leaves)
    packed = jax.jit(packing.pack)(leaves)
    assert packed[0].dtype == jnp.uint32 and packed[0].shape == (1 + 4 + 1 + 2,)
    assert [x.dtype for x in packed[1:]] == [jnp.bfloat16, jnp.bool_]
    for before, after in zip(leaves, jax.jit(packing.unpack)(packed), strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        np.testing.assert_array_equal(np.atleast_1d(after).view(np.uint8), np.atleast_1d(before).view(np.uint8))


def compiled_programs(fn) -> list[str]:
    """The programs `fn()` compiles in a process that has compiled nothing yet (its in-memory caches cleared)."""
    jax.clear_caches()
    logger, records = logging.getLogger("jax"), []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            fn()
    finally:
        logger.removeHandler(handler)
    return [m.split(" ")[1] for m in records if m.startswith("Compiling ")]


def test_the_host_side_of_packing_and_an_evaluations_batches_compile_one_program_at_most():
    """What runs outside the compiled step runs as few programs as it can: every program a process traces,
    lowers and compiles (or loads from the cache) again, each op run by itself one more; the host packing
    compiles none, the evaluation batches of a device loader one gather."""
    leaves = [jnp.float32(-0.5), jnp.asarray([[1.5, np.nan]], jnp.float32), jnp.int32(-7), jnp.asarray([1], jnp.uint16)]
    packing = Packing.of(leaves)
    assert compiled_programs(lambda: packing.unpack_on_host(packing.pack_on_host(leaves))) == []
    for before, after in zip(leaves, packing.unpack_on_host(packing.pack_on_host(leaves)), strict=True):
        np.testing.assert_array_equal(np.atleast_1d(after).view(np.uint8), np.atleast_1d(before).view(np.uint8))
    data = DeviceLoader.from_dataset(XORDataset(100, seed=2), 32, shuffle=False)
    assert compiled_programs(lambda: list(data.padded_batches())) == ["jit(take_rows)"]
    (inputs, labels), mask = list(data.padded_batches())[-1]
    np.testing.assert_array_equal(inputs, np.asarray(data.arrays[0])[[96, 97, 98, 99] + [0] * 28])
    assert mask.tolist() == [1.0] * 4 + [0.0] * 28


def test_only_small_states_with_several_32_bit_leaves_are_packed():
    assert Packing.of([jnp.zeros(3), jnp.zeros((), jnp.int32)]) is not None
    assert Packing.of([jnp.zeros(3), jnp.zeros(3, jnp.bfloat16)]) is None  # one 32-bit leaf: nothing to gain
    assert Packing.of([jnp.zeros(PACK_LIMIT), jnp.zeros((), jnp.int32)]) is None


def xor_state(optimizer=None):
    model = MLP(2, 1, hidden=(8,), key=jax.random.key(0))
    return TrainState.create(model, optimizer or optax.adam(1e-2), key=jax.random.key(1))


@pytest.mark.slow
def test_a_packed_trainer_runs_bitwise_like_an_unpacked_one():
    data = XORDataset(256, seed=0)
    arrays = Batch(jnp.asarray(data.inputs), jnp.asarray(data.labels))
    indices = np.random.default_rng(0).integers(0, 256, (12, 32)).astype(np.int32)
    state = xor_state()
    packed = compiled_trainer(SupervisedStep(), state)
    assert packed.packing is not None and len(packed.leaves(state)) == 1
    dynamic, static = eqx.partition(state, eqx.is_array)
    plain = CompiledTrainer(SupervisedStep(), static, jax.tree.structure(dynamic))
    after_run, after_steps = [], []
    for trainer in (packed, plain):
        leaves = trainer.place(state)
        stats = trainer.init_stats(leaves, Batch(arrays.inputs[:32], arrays.labels[:32]))
        leaves, stats = trainer.run(leaves, stats, arrays, indices[:10], 10)  # ten steps in one loop
        model = jax.tree.leaves(eqx.filter(trainer.state(leaves), eqx.is_array))
        after_run.append([np.asarray(x) for x in [*model, stats.words]])
        for index in indices[10:]:  # then two one call each
            leaves, stats = trainer.step(leaves, stats, Batch(arrays.inputs[index], arrays.labels[index]))
        after_steps.append(jax.tree.leaves(eqx.filter(trainer.state(leaves), eqx.is_array)))
    # The loop body sees the same leaves, so XLA compiles it alike: the same bits.
    for a, b in zip(*after_run, strict=True):  # the state's leaves, the statistics (metric sums and counters)
        np.testing.assert_array_equal(a, b)
    # A single step is one straight-line program, which XLA fuses differently around the packing.
    for a, b in zip(*after_steps, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_a_loop_of_static_trip_count_drops_its_tail_and_gives_the_bits_of_a_counted_one(monkeypatch):
    """On a GPU a call's loop runs every row of its indices and drops the steps past its count (XLA then knows
    the trip count); a call of 7 steps in 10 rows so ends where the loop that runs 7 (the CPU's) does: the same
    step count and statistics, the parameters and Adam's moments to float rounding (XLA fuses the update with
    the select after it: some move by one float32 step)."""
    from research.train import _compiled

    assert not _compiled.static_trip_count()  # on this CPU
    data = XORDataset(256, seed=0)
    arrays = Batch(jnp.asarray(data.inputs), jnp.asarray(data.labels))
    indices = np.random.default_rng(1).integers(0, 256, (10, 32)).astype(np.int32)
    state = xor_state()
    dynamic, static = eqx.partition(state, eqx.is_array)
    results = []
    for static_count in (False, True):
        monkeypatch.setattr(_compiled, "static_trip_count", lambda static_count=static_count: static_count)
        trainer = CompiledTrainer(SupervisedStep(), static, jax.tree.structure(dynamic))  # traced afresh
        leaves = trainer.place(state)
        stats = trainer.init_stats(leaves, Batch(arrays.inputs[:32], arrays.labels[:32]))
        leaves, stats = trainer.run(leaves, stats, arrays, indices, 7)
        results.append([np.asarray(x) for x in [*jax.tree.leaves(trainer.state(leaves)), stats.words]])
        assert int(trainer.state(leaves).step) == 7
    np.testing.assert_array_equal(results[0][-1], results[1][-1])  # the statistics of the 7 steps
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def test_a_packed_trainer_names_the_leaf_whose_shape_or_dtype_does_not_fit():
    state = xor_state()
    trainer = compiled_trainer(SupervisedStep(), state)
    packs = r"differ from the ones the trainer packs: state\.step: int32\[\] -> float32\[\]"
    with pytest.raises(ValueError, match=packs):
        trainer.leaves(eqx.tree_at(lambda s: s.step, state, jnp.float32(0)))

    def grow(_, opt_state, params=None):  # an optimizer whose state changes shape: a broken step
        return jax.tree.map(jnp.zeros_like, _), jnp.zeros(2)

    broken = xor_state(optimizer=optax.GradientTransformation(lambda params: jnp.zeros(1), grow))
    trainer = compiled_trainer(SupervisedStep(), broken)
    leaves = trainer.leaves(broken)
    batch = Batch(jnp.zeros((4, 2)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"changed the shape or dtype.*state\.opt_state: float32\[1\] -> float32\[2\]"):
        trainer.step(leaves, trainer.init_stats(leaves, batch), batch)


def test_packing_on_the_host_gives_the_traced_packing_bit_for_bit():
    leaves = [
        jnp.float32(-0.0),
        jnp.asarray([[1.5, np.nan], [np.inf, -2.0]], jnp.float32),
        jnp.int32(-7),
        jnp.asarray([3, 2**32 - 1], jnp.uint32),
        jnp.asarray([1, 2], jnp.bfloat16),
    ]
    packing = Packing.of(leaves)
    on_host, traced = packing.pack_on_host(leaves), jax.jit(packing.pack)(leaves)
    for a, b in zip(on_host, traced, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for before, after in zip(leaves, packing.unpack_on_host(traced), strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        np.testing.assert_array_equal(np.atleast_1d(after).view(np.uint8), np.atleast_1d(before).view(np.uint8))
