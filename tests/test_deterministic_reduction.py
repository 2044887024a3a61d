"""`--deterministic-reduction`: the gradient of a global batch as a fixed number of micro-batches summed in
one fixed order, so that a run gives the same bits whatever the devices, placement and processes, and a run
resumed on another device count continues it exactly.

What holds, measured here: the MLP, the FSDP-sized MLP, DP-SGD (noise on), a BatchNorm model, MNIST-1D's CNN
and the LM give the same bits on every layout (1, 2, 4, 8 devices; none, pmap, sharded, fsdp; 2 processes x 2
devices) and across resumes from one device count to another.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _entry import run_entry
from test_parallel import LAUNCH_TWO, group, losses, run_worker, worker_args

from research.data import Batch
from research.errors import ConfigError
from research.nn import MLP
from research.per_example import DPSGDLoss
from research.population import stack_states
from research.services import checkpoint_digest
from research.train import NextTokenLoss, TrainState, classification_loss, example_keys, train_step
from research.train._micro import micro_batch_value_and_grad, tree_sum
from research.train._rows import loss_value_and_grad, rows_of_global_batch
from research.train.reduction import check_micro_batch_loss

ROOT = Path(__file__).parent.parent
STEPS = "50"
# Each placement once, and 1, 2, 4 and 8 devices (8: one micro-batch a device). The CNN's test below adds
# (sharded, 4) and (pmap, 8) for another model.
LAYOUTS = [("none", 1), ("pmap", 2), ("fsdp", 4), ("sharded", 8)]
MODELS = ("mlp", "wide", "dpsgd", "batchnorm")


# -- the pieces, on one device ---------------------------------------------------------------------------------


def test_tree_sum_adds_in_one_fixed_pairwise_order():
    # Values whose sum depends on the order: left to right gives 0 + 1 = 1.0 for the first four, pairwise 0.
    x = np.array([1e8, 1.0, -1e8, 1.0, 3.0, 5.0, 7.0, 11.0], np.float32)
    pairwise = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
    assert np.asarray(tree_sum(jnp.asarray(x))).tobytes() == np.float32(pairwise).tobytes()
    assert float(tree_sum(jnp.asarray(x))) != float(np.cumsum(x, dtype=np.float32)[-1])
    odd = x[:5]  # an odd element waits for the next level: ((x0 + x1) + (x2 + x3)) + x4
    assert float(tree_sum(jnp.asarray(odd))) == float(((odd[0] + odd[1]) + (odd[2] + odd[3])) + odd[4])
    tree = {"a": jnp.ones((3, 2)), "b": jnp.arange(6.0).reshape(3, 2)}
    np.testing.assert_array_equal(tree_sum(tree)["b"], [6.0, 9.0])


def test_inside_a_micro_batch_every_example_keeps_its_key_in_the_global_batch():
    key = jax.random.key(0)
    with rows_of_global_batch(12, 4):
        keys = example_keys(key, 4)
    expected = jax.random.split(key, 12)[4:8]
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(expected))


def _mlp_batch():
    model = MLP(4, 3, hidden=(16,), key=jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = Batch(jnp.asarray(rng.normal(size=(32, 4)), jnp.float32), jnp.asarray(rng.integers(0, 3, 32), jnp.int32))
    return model, batch


def test_micro_batches_give_the_gradient_and_metrics_of_the_whole_batch():
    model, batch = _mlp_batch()
    key = jax.random.key(1)
    (loss, (metrics, _)), grads = eqx.filter_jit(loss_value_and_grad)(classification_loss, model, None, batch, key)
    (m_loss, (m_metrics, _)), m_grads = eqx.filter_jit(micro_batch_value_and_grad)(
        classification_loss, model, None, batch, key, micro_batches=8
    )
    np.testing.assert_allclose(m_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(m_metrics["accuracy"], metrics["accuracy"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(m_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dp_sgd_micro_batches_sum_clipped_gradients_and_add_the_noise_once():
    """The noisy gradient of 8 micro-batches is the one of the whole batch: the clipped sums add up, and
    the noise (the same key) is added once to their total, not once per micro-batch."""
    model, batch = _mlp_batch()
    loss = DPSGDLoss(clip_norm=0.5, noise_multiplier=1.0, expected_batch_size=32)
    key = jax.random.key(2)
    (_, (metrics, _)), grads = eqx.filter_jit(loss.value_and_grad)(model, None, batch, key)
    (_, (m_metrics, _)), m_grads = eqx.filter_jit(micro_batch_value_and_grad)(
        loss, model, None, batch, key, micro_batches=8
    )
    assert float(m_metrics["batch_size"]) == float(metrics["batch_size"]) == 32.0
    np.testing.assert_allclose(m_metrics["clipped_fraction"], metrics["clipped_fraction"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(m_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _SummingLoss:
    """A loss with its own value_and_grad that says nothing of how micro-batches combine."""

    def __call__(self, model, model_state, batch, key):
        return classification_loss(model, model_state, batch, key)

    def value_and_grad(self, model, model_state, batch, key, *, axis_name=None):
        return eqx.filter_value_and_grad(self, has_aux=True)(model, model_state, batch, key)


def test_a_loss_that_does_not_say_how_micro_batches_combine_is_refused():
    with pytest.raises(ConfigError, match="does not say how micro-batches combine"):
        check_micro_batch_loss(_SummingLoss())
    for loss in (classification_loss, NextTokenLoss(), DPSGDLoss(1.0, 1.0, 32)):
        check_micro_batch_loss(loss)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--micro-batches", "6"], "--batch-size 32 is not divisible by --micro-batches 6"),
        (["--micro-batches", "2", "--devices", "4"], "--micro-batches 2 is not divisible by the 4 devices"),
    ],
)
def test_micro_batches_the_batch_or_the_devices_cannot_share_are_refused_in_one_line(argv, message, capsys):
    status = run_entry(["--model", "mlp", "--batch-size", "32", "--deterministic-reduction", *argv], "mnist1d")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err


# -- whole runs on simulated devices --------------------------------------------------------------------------


def _digest(run: Path) -> str:
    return checkpoint_digest(sorted((run / "checkpoints").iterdir())[-1])


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """In one process with 8 simulated devices, 50 steps of each worker model on every layout, and runs
    moved between device counts through their checkpoints: FSDP on 8 devices to step 20, on 4 to step 35,
    on 1 to the end; BatchNorm on 4 devices to step 20, then on 2."""
    root = tmp_path_factory.mktemp("deterministic")
    det = ("--deterministic-reduction", "--steps", STEPS)
    groups = [
        group(model, parallel, devices, root / f"{model}-{parallel}-{devices}", *det)
        for model in MODELS
        for parallel, devices in LAYOUTS
    ]
    groups += [
        group("wide", "fsdp", 8, root / "wide-8-4-1", *det[:1], "--steps", "20"),
        group("wide", "fsdp", 4, root / "wide-8-4-1", *det[:1], "--steps", "35", "--resume"),
        group("wide", "none", 1, root / "wide-8-4-1", *det, "--resume"),
        group("batchnorm", "sharded", 4, root / "batchnorm-4-2", *det[:1], "--steps", "20"),
        group("batchnorm", "pmap", 2, root / "batchnorm-4-2", *det, "--resume"),
    ]
    run_worker(root, *groups)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_layout_gives_the_same_bits(layout_runs, model):
    reference = layout_runs / f"{model}-none-1"
    for parallel, devices in LAYOUTS[1:]:
        run = layout_runs / f"{model}-{parallel}-{devices}"
        assert losses(run) == losses(reference), run.name
        assert _digest(run) == _digest(reference), run.name


@pytest.mark.slow
def test_a_run_resumed_on_other_device_counts_continues_to_the_same_bits(layout_runs):
    for chain, reference in (("wide-8-4-1", "wide-none-1"), ("batchnorm-4-2", "batchnorm-none-1")):
        assert losses(layout_runs / chain) == losses(layout_runs / reference), chain
        assert _digest(layout_runs / chain) == _digest(layout_runs / reference), chain


@pytest.mark.slow
def test_two_processes_of_two_devices_give_the_bits_of_one_device(layout_runs, tmp_path):
    det = ("--deterministic-reduction", "--steps", STEPS)
    groups = [
        group("mlp", "pmap", 2, tmp_path / "mlp", *det),  # host batches: each process reads its rows
        group("wide", "fsdp", 2, tmp_path / "wide", *det),  # each process saves its shards
        group("dpsgd", "sharded", 2, tmp_path / "dpsgd", *det),
    ]
    launched = subprocess.run(
        [*LAUNCH_TWO, *worker_args(*groups)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    for model in ("mlp", "wide", "dpsgd"):
        assert losses(tmp_path / model) == losses(layout_runs / f"{model}-none-1"), model
        assert _digest(tmp_path / model) == _digest(layout_runs / f"{model}-none-1"), model


CNN = ["--model", "cnn", "--schedule", "constant", "--steps", STEPS, "--deterministic-reduction", "--no-progress"]
RESNET = [*CNN[2:], "--model", "resnet", "--batch-size", "64"]  # BatchNorm in every block
ENSEMBLE = ["--num-members", "4", "--hidden", "8", "--epochs", "2", "--batch-size", "1000", "--no-progress"]
ENSEMBLE += ["--deterministic-reduction", "--micro-batches", "4"]  # a population: 4 MLPs vmapped
LM = ["--steps", STEPS, "--dim", "32", "--context", "32", "--batch-size", "16", "--steps-per-call", "10"]
LM += ["--text-bytes", "40000", "--deterministic-reduction", "--no-progress"]


@pytest.mark.slow
def test_the_cnn_the_resnet_the_lm_and_a_population_print_the_same_test_loss_on_every_layout(tmp_path, mnist1d_dir):
    """The issue's command: `mnist1d --model cnn --deterministic-reduction` on (1, none), (4, fsdp), (8, pmap),
    and a run saved on 8 devices and resumed on 4 (sharded): the same test loss to the last digit and the same
    checkpoint bits; the LM (layer norms, attention's softmax) on (1, none), (2, sharded), (8, fsdp); the ResNet
    (BatchNorm) on (1, none) and on (8, pmap), where each device normalises its one micro-batch; a population of
    4 MLPs (`ensemble`) on (1, none), (4, pmap) and (2, fsdp), its batches split over the devices. (The MLPs
    above take every placement on every device count.)"""
    cnn_layouts = [("none", 1), ("fsdp", 4), ("pmap", 8)]
    runs = [
        {"id": f"cnn-{p}-{d}", "script": "mnist1d", "argv": [*CNN, "--parallel", p, "--devices", str(d)]}
        for p, d in cnn_layouts
    ]
    saved_on_8 = {"id": "cnn-8-4", "script": "mnist1d", "argv": [*CNN, "--parallel", "pmap", "--devices", "8"]}
    saved_on_8["argv"][saved_on_8["argv"].index(STEPS)] = "25"
    runs += [
        saved_on_8,
        {"id": "cnn-8-4", "script": "mnist1d", "argv": [*CNN, "--parallel", "sharded", "--devices", "4", "--resume"]},
    ]
    runs += [
        {"id": f"lm-{p}-{d}", "script": "lm", "argv": [*LM, "--parallel", p, "--devices", str(d)]}
        for p, d in (("none", 1), ("sharded", 2), ("fsdp", 8))
    ]
    runs += [
        {"id": f"resnet-{p}-{d}", "script": "mnist1d", "argv": [*RESNET, "--parallel", p, "--devices", str(d)]}
        for p, d in (("none", 1), ("pmap", 8))
    ]
    runs += [
        {"id": f"ensemble-{p}-{d}", "script": "ensemble", "argv": [*ENSEMBLE, "--parallel", p, "--devices", str(d)]}
        for p, d in (("none", 1), ("pmap", 4), ("fsdp", 2))
    ]
    for run in runs:
        run["argv"] += ["--run-dir", str(tmp_path / run["id"])]
        if run["script"] in ("mnist1d", "ensemble"):
            run["argv"] += ["--data-dir", str(mnist1d_dir)]
    spec, out = tmp_path / "runs.json", tmp_path / "results.jsonl"
    spec.write_text(json.dumps([{**r, "id": f"{r['id']}#{i}"} for i, r in enumerate(runs)]))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    worker = ROOT / "tests" / "_combination_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(spec), str(out)], cwd=tmp_path, env=env, timeout=900)
    assert done.returncode == 0
    ends = [json.loads(line) for line in out.read_text().splitlines() if '"end"' in line]
    assert [e["status"] for e in ends] == [0] * len(runs), [e["stderr"][-3:] for e in ends if e["status"]]
    summary = {e["id"].split("#")[0]: e["summary"] for e in ends}
    for model in ("cnn", "lm", "resnet", "ensemble"):
        loss = {name: summary[name]["test_loss"] for name in summary if name.startswith(model)}
        assert len(set(loss.values())) == 1, loss
        assert len({_digest(tmp_path / name) for name in loss}) == 1, model


@pytest.mark.slow
def test_separate_processes_with_other_device_counts_give_the_same_bits(tmp_path):
    """The tests above run every layout in one process. Here each device count is its own process, as a user
    runs them: the CPU client's thread count (which decides how XLA splits some dots, such as grokking's
    full-batch weight gradients) comes from the micro-batches, not the devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    argv = ["--steps", "2", "--deterministic-reduction", "--micro-batches", "2", "--no-progress"]
    for devices in (1, 2):
        done = subprocess.run(
            [str(ROOT / "scripts" / "run"), "grokking", *argv, "--devices", str(devices), "--run-dir", f"d{devices}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert _digest(tmp_path / "d1") == _digest(tmp_path / "d2")


def test_a_population_member_trains_with_micro_batches_as_its_own_run_would():
    """Populations keep their semantics: a vmapped member takes its own run's step (to rounding)."""
    _, batch = _mlp_batch()

    def build(key):
        return TrainState.create(MLP(4, 3, hidden=(16,), key=key), optax.sgd(0.1), key=key)

    keys = jax.random.split(jax.random.key(3), 2)
    population = stack_states(build, keys)
    step = lambda s: train_step(s, batch, micro_batches=4)[0]  # noqa: E731
    stepped = eqx.filter_jit(eqx.filter_vmap(step))(population)  # compiled, as the engine runs it
    alone = eqx.filter_jit(step)(build(keys[1]))
    members, own = (jax.tree.leaves(eqx.filter(s.model, eqx.is_array)) for s in (stepped, alone))
    for a, b in zip(members, own, strict=True):
        np.testing.assert_allclose(a[1], b, rtol=1e-5, atol=1e-6)
