"""experiments/metalearn_lr.py: the unrolled inner run is plain SGD, its meta-gradient is the derivative
of the outer objective, and the outer optimisation moves the learning rate without touching the inner
initialisation."""

import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch
from research.errors import ConfigError
from research.experiment import load_experiment
from research.nn import build_model
from research.services import RunDir, load_checkpoint
from research.train import TrainState, train_step

metalearn = load_experiment("metalearn_lr")


def tiny_problem(getkey, steps=12, batch=8):
    """A 6-4-3 tanh MLP and one inner run of learnable data (labels: argmax of a linear map)."""
    mlp, _ = build_model("mlp", in_size=6, out_size=3, hidden=(4,), activation="tanh", key=getkey())
    inputs = jax.random.normal(getkey(), (steps, batch, 6))
    labels = jnp.argmax(inputs @ jax.random.normal(getkey(), (6, 3)), axis=-1)
    return mlp, inputs, labels


def test_inner_run_is_the_engines_sgd_step(getkey):
    mlp, inputs, labels = tiny_problem(getkey, steps=4)

    @eqx.filter_jit  # both in one compilation
    def unrolled_and_stepped(mlp, inputs, labels, key):
        trained, losses = metalearn.LearnedLearningRate(jnp.float32(0.7), mlp).inner_run(inputs, labels)
        state, step_losses = TrainState.create(mlp, optax.sgd(0.7), key=key), []
        for x, y in zip(inputs, labels, strict=True):
            state, metrics = train_step(state, Batch(x, y))
            step_losses.append(metrics["loss"])
        return trained, losses, state.model, jnp.stack(step_losses)

    trained, losses, stepped, step_losses = unrolled_and_stepped(mlp, inputs, labels, getkey())
    np.testing.assert_allclose(losses, step_losses, rtol=1e-5)  # each loss is taken before its update
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_meta_gradient_equals_a_finite_difference(getkey):
    mlp, inputs, labels = tiny_problem(getkey)
    batch = Batch(inputs[None], labels[None])  # a batch of one inner run, as the engine hands it over

    def objective(lr):
        return metalearn.meta_objective(metalearn.LearnedLearningRate(lr, mlp), None, batch, None)[0]

    value_and_grad = jax.jit(jax.value_and_grad(objective))  # one compilation for the values and the gradient
    slopes = []
    for lr in (0.05, 2.0):  # too small a rate: raising it helps; too large: lowering it does
        eps = 1e-3
        difference = (value_and_grad(jnp.float32(lr + eps))[0] - value_and_grad(jnp.float32(lr - eps))[0]) / (2 * eps)
        np.testing.assert_allclose(value_and_grad(jnp.float32(lr))[1], difference, rtol=1e-2)
        slopes.append(float(difference))
    assert slopes[0] < 0 < slopes[1]


@pytest.mark.slow
def test_the_notebooks_first_outer_steps_and_the_initialisation_kept(mnist1d_dir, tmp_path):
    """Seed 0 of the default recipe is the notebook's run (its MLP, its 8,000 training signals): after four
    outer steps it prints `step: 3, mean_inner_loss: 1.779e+00, inner_lr: 1.147e+00` from 1.5 and
    `1.722e+00`, `4.825e-01` from 0.15."""
    config = metalearn.Config.from_options(
        steps=4, data_dir=str(mnist1d_dir), run_dir=str(tmp_path / "run"), progress=False, eval_every=0
    )
    summary = metalearn.main(config)
    assert summary["start_lr"] == [1.5, 0.15]
    np.testing.assert_allclose(summary["learned_lr"], [1.147, 0.4825], atol=5e-4)
    fourth = [r for r in RunDir(tmp_path / "run").read_metrics() if r["step"] == 4][0]
    np.testing.assert_allclose(fourth["train/member_loss"], [1.779, 1.722], atol=5e-4)
    assert (tmp_path / "run" / "learned_lr.png").stat().st_size > 0
    skeleton = metalearn.build_state(config)
    trained, _ = load_checkpoint(sorted((tmp_path / "run" / "checkpoints").iterdir())[-1], skeleton)
    np.testing.assert_allclose(trained.model.lr, summary["learned_lr"])
    assert eqx.tree_equal(trained.model.initial, skeleton.model.initial)  # part of the problem, not trained


def test_torch_initialisation_is_torchs_linear_layers_and_leaves_torchs_generator_alone(getkey):
    import torch

    mlp, _ = build_model("mlp", in_size=5, out_size=3, hidden=(4,), activation="tanh", key=getkey())
    before = torch.random.get_rng_state()
    ours = metalearn.torch_initialised(mlp, 7)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(7)
    layers = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
    for layer, theirs in zip(ours.layers, layers, strict=True):
        np.testing.assert_array_equal(layer.weight, theirs.weight.detach().numpy())
        np.testing.assert_array_equal(layer.bias, theirs.bias.detach().numpy())


@pytest.mark.slow
def test_show_jaxpr_traces_one_outer_step_of_the_population(mnist1d_dir):
    from research.tools.show_jaxpr import show_jaxpr

    text = show_jaxpr("metalearn_lr", ["--inner-steps", "3", "--hidden", "4", "--data-dir", str(mnist1d_dir)])
    assert "state.model.lr float32[2]" in text  # one rate per starting point, a leading member axis


def test_device_options_it_cannot_honour_are_refused_before_any_work():
    refusals = [
        ({"devices": 4}, "pick a device count that divides 2"),
        ({"devices": 2, "parallel": "pmap"}, "pass --parallel sharded"),
        ({"devices": 2, "deterministic_reduction": True}, "no batch to split into micro-batches"),
        ({"num_processes": 2}, "runs in one process"),
    ]
    for options, message in refusals:
        with pytest.raises(ConfigError, match=message):
            metalearn.Config.from_options(**options)


@pytest.mark.slow
def test_members_on_two_devices_learn_the_rates_of_one_device(mnist1d_dir, tmp_path):
    """The --start-lrs members spread over a 2-device mesh: the same metrics as on one device, to float rounding."""
    histories = []
    for devices in (1, 2):
        run = tmp_path / f"devices{devices}"
        subprocess.run(
            [sys.executable, str(metalearn.__file__), "--steps", "3", "--inner-steps", "20", "--hidden", "8",
             "--num-samples", "5000", "--data-dir", str(mnist1d_dir), "--run-dir", str(run), "--no-progress",
             "--devices", str(devices), "--ema-decay", "0.5"],
            check=True,
            env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
            capture_output=True,
        )  # fmt: skip
        histories.append([r for r in RunDir(run).read_metrics() if "train/member_learned_lr" in r])
        summary = RunDir(run).read_summary()
        assert {"test_accuracy", "test_raw_accuracy"} <= summary.keys()  # the EMA's learned rate and the raw one
    assert len(histories[0]) == len(histories[1]) == 3
    for one, two in zip(*histories, strict=True):
        for name in ("train/member_learned_lr", "train/member_loss"):
            np.testing.assert_allclose(two[name], one[name], rtol=1e-5)
