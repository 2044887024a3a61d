"""A state made of named networks (`AbstractNetworksState`, `Network`), the EMA the engine keeps whatever the
step, the whole state handed to evaluators (the EMA's weights, then the trained ones), and weakly typed leaves
strengthened before they can compile a step twice."""

import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import DeviceLoader
from research.errors import ConfigError
from research.experiment import network_parameters
from research.nn import MLP
from research.state import EMA
from research.train import (
    AbstractNetworksState,
    GlobalBatch,
    Network,
    Step,
    SupervisedStep,
    TrainState,
    compiled_trainer,
    fit,
)
from research.train.evaluation import averaged_and_raw


class PairState(AbstractNetworksState):
    """A GAN's state: two networks and a count the step carries beside them."""

    generator: Network
    critic: Network
    rounds: jax.Array


def fakes(generator, keys):
    return jax.vmap(lambda k: generator(jax.random.normal(k, (2,))))(keys)


class PairStep(Step):
    """A critic update, then a generator update; it never touches the EMA (the engine keeps it)."""

    finite_metrics: ClassVar[tuple[str, ...]] = ("d_loss", "g_loss")

    def __call__(self, state: PairState, points, key, global_batch: GlobalBatch):
        d_key, g_key = jax.random.split(key)
        generator = state.generator.model

        def critic_loss(critic, _, points, keys):
            fake = jax.vmap(critic)(fakes(generator, keys))[:, 0]
            loss = jnp.mean(jax.nn.softplus(-jax.vmap(critic)(points)[:, 0])) + jnp.mean(jax.nn.softplus(fake))
            return loss, ({"d_loss": loss}, None)

        (_, (d_metrics, _)), grads = global_batch.value_and_grad(critic_loss, state.critic.model, None, points, d_key)
        state = state.updated("critic", grads)
        critic = state.critic.model

        def generator_loss(generator, _, points, keys):
            loss = jnp.mean(jax.nn.softplus(-jax.vmap(critic)(fakes(generator, keys))[:, 0]))
            return loss, ({"g_loss": loss}, None)

        (_, (g_metrics, _)), grads = global_batch.value_and_grad(generator_loss, generator, None, points, g_key)
        new = eqx.tree_at(lambda s: s.rounds, state.updated("generator", grads), state.rounds + 1)
        return new, {**d_metrics, **g_metrics}


class SelfAveragingStep(Step):
    """`PairStep`, then the EMA moved by the step itself when it sees one, as steps did before the engine
    kept it."""

    finite_metrics: ClassVar[tuple[str, ...]] = ("d_loss", "g_loss")

    def __call__(self, state: PairState, points, key, global_batch: GlobalBatch):
        new, metrics = PairStep()(state, points, key, global_batch)
        ema = None if new.ema is None else new.ema.update((new.model, None))[0]
        return eqx.tree_at(lambda s: s.ema, new, ema, is_leaf=lambda x: x is None), metrics


OPTIMIZER = optax.adam(1e-2, b1=0.5)


def pair_state(seed: int = 0) -> PairState:
    g_key, c_key, key = jax.random.split(jax.random.key(seed), 3)
    return PairState.create(
        generator=Network.create(MLP(2, 2, hidden=(8,), key=g_key), OPTIMIZER),
        critic=Network.create(MLP(2, 1, hidden=(8,), key=c_key), OPTIMIZER),
        rounds=jnp.asarray(0),  # weakly typed, as a Python number makes it
        key=key,
    )


POINTS = np.random.default_rng(0).normal([2.0, -1.0], 0.5, size=(256, 2)).astype(np.float32)


def points(batch_size: int = 32) -> DeviceLoader:
    return DeviceLoader(POINTS, None, batch_size, seed=0)


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_identical(a, b):
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_state_of_named_networks_derives_what_the_engine_needs():
    state = pair_state()
    assert list(state.parts()) == ["generator", "critic"] and list(state.networks()) == ["generator", "critic"]
    assert state.model is state.generator.model and state.model_state is None  # the first network is the run's
    assert state.networks()["critic"] is state.critic.model
    assert int(state.step) == 0 and state.step.dtype == jnp.int32 and state.key.dtype == jnp.uint32
    counts = network_parameters(state)
    assert counts == {
        "total": (2 * 8 + 8 + 8 * 2 + 2) + (2 * 8 + 8 + 8 + 1),
        "by_field": {"generator": 42, "critic": 33},
    }

    averaged = state.with_ema(0.9)
    assert isinstance(averaged.ema, EMA) and averaged.ema.decay == 0.9 and int(averaged.ema.count) == 0
    assert_identical(averaged.ema.average, (state.generator.model, None))

    grads = jax.tree.map(jnp.ones_like, eqx.filter(state.critic.model, eqx.is_inexact_array))
    updated = state.updated("critic", grads)
    updates, opt_state = OPTIMIZER.update(grads, state.critic.opt_state, eqx.filter(state.critic.model, eqx.is_array))
    assert_identical(updated.critic.model, eqx.apply_updates(state.critic.model, updates))
    assert_identical(updated.critic.opt_state, opt_state)
    assert updated.generator is state.generator  # the other network as it was


def test_every_leaf_is_strongly_typed_from_creation():
    class Scaled(eqx.Module):
        mlp: MLP
        scale: jax.Array

    model = Scaled(MLP(2, 2, hidden=(4,), key=jax.random.key(0)), jnp.asarray(1.0))
    norm, norm_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
    weak = [x for x in jax.tree.leaves((model, norm_state, optax.adam(0.1).init(model))) if x.weak_type]
    assert weak  # what Python scalars and Equinox's BatchNorm counter make
    built = [
        pair_state(),
        TrainState.create(model, optax.adam(0.1), key=jax.random.key(1)),
        TrainState.create(norm, optax.adam(0.1), key=jax.random.key(1), model_state=norm_state),
    ]
    for state in built:
        leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
        assert not [x for x in leaves if x.weak_type], type(state).__name__


class Scaled(eqx.Module):
    """An MLP whose output a learnt scale multiplies (weakly typed when made from a Python number)."""

    mlp: MLP
    scale: jax.Array

    def __call__(self, x, *, key=None):
        return self.scale * self.mlp(x)


def test_a_hand_built_state_with_weak_leaves_compiles_its_step_once():
    """A state too big to travel packed, built by hand around a weak leaf: Adam's update makes that leaf
    strong, which compiled the step three times before the engine strengthened what it is given."""
    model = Scaled(MLP(2, 2, hidden=(300, 300), key=jax.random.key(0)), jnp.asarray(1.0))
    optimizer = optax.adam(0.1)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        model=model,
        model_state=None,
        opt_state=optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
        key=jax.random.key_data(jax.random.key(1)),
        optimizer=optimizer,
    )
    assert state.model.scale.weak_type
    labels = (POINTS[:, 0] > 2).astype(np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a retrace warns
        fit(state, DeviceLoader(POINTS, labels, 32), num_steps=4, log_every=2, progress=False)
    assert compiled_trainer(SupervisedStep(), state).num_traces == {"step": 0, "run": 1}


def test_the_engine_moves_the_ema_of_a_step_that_never_touches_it():
    """The debiased average of the generators after each of 6 steps, though `PairStep` has no EMA code."""
    decay = 0.5
    trained = [pair_state().generator.model]
    for steps in range(1, 7):  # the same run, stopped after 1, 2, ... 6 steps
        trained.append(fit(pair_state(), points(), num_steps=steps, step=PairStep(), progress=False).state.model)
    result = fit(pair_state().with_ema(decay), points(), num_steps=6, step=PairStep(), steps_per_call=3, progress=False)
    assert int(result.state.ema.count) == 6 and int(result.state.rounds) == 6
    assert_identical(result.state.model, trained[-1])  # the EMA only watches
    expected = EMA.init((trained[0], None), decay)
    for model in trained[1:]:
        expected = expected.update((model, None))[0]
    for x, y in zip(arrays(result.state.ema.average), arrays(expected.average), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert not np.allclose(arrays(result.state.ema.average)[0], arrays(trained[-1])[0])


def test_a_step_that_moves_the_ema_itself_changes_nothing_the_engine_moves_it_once():
    """A step that moves the EMA itself (as steps did before the engine kept it) changes nothing: the engine's
    average of the step's new weights replaces the step's, counted once a step, the same as `PairStep`'s."""
    run = {"num_steps": 4, "steps_per_call": 2, "progress": False}
    moved = fit(pair_state().with_ema(0.5), points(), step=SelfAveragingStep(), **run).state
    plain = fit(pair_state().with_ema(0.5), points(), step=PairStep(), **run).state
    assert int(moved.ema.count) == 4
    for x, y in zip(arrays(moved.ema.average), arrays(plain.ema.average), strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_evaluator_gets_the_state_with_the_emas_weights_then_the_trained_one():
    seen = []

    def evaluator(state, data, *, progress=False):
        seen.append(state)
        return {
            "scale": float(jnp.sum(state.model.layers[0].weight)),
            "critic": float(jnp.sum(state.critic.model.layers[0].weight)),
        }

    result = fit(
        pair_state().with_ema(0.5),
        points(),
        num_steps=4,
        step=PairStep(),
        eval_data=points(64),
        evaluator=evaluator,
        progress=False,
    )
    final = result.state
    averaged, trained = seen[-2:]
    assert_identical(averaged.model, final.ema.average[0])  # the generator the EMA covers...
    assert_identical(averaged.critic.model, final.critic.model)  # ...and the networks it does not, as trained
    assert_identical(trained.model, final.model)
    assert result.eval_metrics == evaluator(final.averaged(), None) and result.raw_eval_metrics == evaluator(
        final, None
    )
    assert result.eval_metrics["scale"] != result.raw_eval_metrics["scale"]
    assert result.eval_metrics["critic"] == result.raw_eval_metrics["critic"]

    calls = len(seen)
    assert averaged_and_raw(evaluator, pair_state(), points(64)) == (evaluator(pair_state(), None), None)
    assert len(seen) == calls + 2  # without an EMA: one evaluation, of the trained state


@pytest.mark.parametrize(
    ("metrics", "finite", "message"),
    [
        (
            lambda m: {**m, "d_loss": jnp.stack([m["d_loss"]] * 3)},
            None,
            r"must each be a float32 scalar: d_loss is float32\[3\]",
        ),
        (lambda m: {**m, "rounds": jnp.int32(1)}, None, r"must each be a float32 scalar: rounds is int32\[\]"),
        (lambda m: list(m.values()), None, "returned list metrics: return a dict of them by name"),
        (lambda m: m, ("d_loss", "g_loss", "grad_norm"), r"declares finite_metrics .* lack \['grad_norm'\]"),
    ],
    ids=["vector", "integer", "list", "missing finite"],
)
def test_metrics_that_do_not_fit_are_refused_before_the_first_step(metrics, finite, message):
    class Broken(Step):
        finite_metrics: tuple[str, ...] = eqx.field(static=True, default=("d_loss", "g_loss"))

        def __call__(self, state, batch, key, global_batch):
            new, produced = PairStep()(state, batch, key, global_batch)
            return new, metrics(produced)

    step = Broken() if finite is None else Broken(finite)
    with pytest.raises(ConfigError, match=message):
        fit(pair_state(), points(), num_steps=2, step=step, progress=False)
