"""JAX's sharp bits: retraces explain what changed (once), and --debug-nans names the op that made a NaN."""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch, DeviceLoader, XORDataset
from research.debug import RetraceLog, explain_retraces, signature, signature_changes
from research.errors import NonFiniteError
from research.nn import MLP
from research.train import SupervisedStep, TrainState, classification_loss, compiled_trainer, fit


def make_state(seed=0):
    model_key, train_key = jax.random.split(jax.random.key(seed))
    return TrainState.create(MLP(2, 1, hidden=(4,), key=model_key), optax.sgd(0.1), key=train_key)


def test_signature_names_each_leaf_and_the_changes_between_two():
    before = signature({"batch": Batch(jnp.ones((8, 2)), jnp.ones(8, jnp.int32)), "lr": 0.1, "n": jnp.float32(1)})
    assert before == {"batch.inputs": "float32[8,2]", "batch.labels": "int32[8]", "lr": "static 0.1", "n": "float32[]"}
    after = signature({"batch": Batch(jnp.ones((4, 2)), jnp.ones(8, jnp.int32)), "lr": 0.2})
    assert signature_changes(before, after) == [
        "batch.inputs: float32[8,2] -> float32[4,2]",
        "lr: static 0.1 -> static 0.2",
        "n disappeared (was float32[])",
    ]
    # A Python scalar turned into an array is *weakly* typed: a different signature, a retrace.
    weak = signature({"step": jnp.asarray(1)})
    assert signature_changes(signature({"step": jnp.int32(1)}), weak) == ["step: int32[] -> ~int32[]"]


def test_a_retrace_of_the_train_step_logs_once_which_argument_changed(caplog):
    state = make_state(seed=1)  # a fresh optimizer object: a trainer of its own
    trainer = compiled_trainer(SupervisedStep(), state)
    data = XORDataset(64, seed=0)
    leaves = trainer.leaves(state)
    with caplog.at_level(logging.WARNING, logger="research"):
        for size in (32, 32, 16):
            batch = Batch(jnp.asarray(data.inputs[:size]), jnp.asarray(data.labels[:size]))
            leaves, _ = trainer.step(leaves, trainer.init_stats(leaves, batch), batch)
    assert trainer.num_traces["step"] == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "research"]
    assert messages == [
        "train step function traced again (trace 2), which recompiles; changed: "
        "batch.inputs: float32[32,2] -> float32[16,2]; batch.labels: int32[32] -> int32[16]"
    ]
    assert trainer.traces.explanations["train step function"] == messages[0]


def test_explain_retraces_decorates_any_jitted_function_and_sees_static_values(caplog):
    log = RetraceLog()

    @eqx.filter_jit
    @explain_retraces("scale", log=log)
    def scale(x, factor):
        return x * factor

    with caplog.at_level(logging.WARNING, logger="research"):
        scale(jnp.ones(3), 2)
        scale(jnp.ones(3), 2)
        scale(jnp.ones(3), 3)  # a new static value retraces
        scale(jnp.ones(4), 3)  # so does a new shape, but only the first retrace is logged
    assert len(log.signatures["scale"]) == 3
    assert log.explanations["scale"] == (
        "scale traced again (trace 2), which recompiles; changed: factor: static 2 -> static 3"
    )
    assert [r.getMessage() for r in caplog.records if r.name == "research"] == [log.explanations["scale"]]


def poisoned_loss(model, model_state, batch, key):
    loss, (metrics, model_state) = classification_loss(model, model_state, batch, key)
    # An input below -1 poisons the loss with sqrt of a negative number: the NaN --debug-nans must find.
    loss = loss * jnp.mean(jnp.sqrt(batch.inputs[:, 0] + 1.0))
    return loss, ({**metrics, "loss": loss}, model_state)


POISON_LINE = "loss = loss * jnp.mean(jnp.sqrt(batch.inputs[:, 0] + 1.0))"


@pytest.fixture(scope="module")
def poisoned_data():
    data = XORDataset(256, seed=0)
    inputs = data.inputs.copy()
    inputs[200, 0] = -5.0
    loader = DeviceLoader(inputs, data.labels, 32, seed=0)
    first = next(step for step in range(8) if 200 in loader.step_indices(step, 1)[0])
    return loader, first + 1  # the first step (counting from 1) whose batch holds the poisoned example


@pytest.mark.slow
def test_debug_nans_names_the_first_op_that_made_a_nan_and_its_source_line(poisoned_data):
    loader, bad_step = poisoned_data
    with pytest.raises(NonFiniteError) as info:
        fit(
            make_state(),
            loader,
            num_steps=8,
            log_every=8,
            step=SupervisedStep(poisoned_loss),
            debug_nans=True,
            progress=False,
        )
    message = str(info.value)
    lineno = next(i for i, line in enumerate(open(__file__).read().splitlines(), 1) if POISON_LINE in line)
    assert message.startswith(f"NaN first produced by `sqrt` at tests/test_debug.py:{lineno} in poisoned_loss")
    assert f"during training step {bad_step}" in message and "\n" not in message
    assert not jax.config.jax_debug_nans  # switched off again


def test_without_debug_nans_the_error_says_to_use_it(poisoned_data):
    loader, bad_step = poisoned_data
    with pytest.raises(NonFiniteError, match=f"non-finite loss at step {bad_step};.*rerun with --debug-nans"):
        fit(
            make_state(),
            loader,
            num_steps=8,
            log_every=8,
            step=SupervisedStep(poisoned_loss),
            steps_per_call=8,
            progress=False,
        )
    assert np.isfinite(loader.host.inputs[:200]).all()
