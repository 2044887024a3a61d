"""A loss over the whole global batch (`research.train.AbstractBatchLoss`, NT-Xent), its gradient on every
layout, and the pieces of self-supervised learning around it: the views' augmentations and the linear probe and
k-NN evaluation of a frozen encoder.

The layouts (1, 2 and 4 devices; none, pmap, sharded, fsdp; with and without `--grad-accum` and
`--deterministic-reduction`) run in subprocesses of `tests/_batch_loss_worker.py` (simulated devices must be set
before JAX starts): one with 1 device, one with 4.
"""

import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _batch_loss_worker import NoisyViews

from research.data import DeviceLoader, colour_jitter, random_resized_crop
from research.errors import ConfigError
from research.nn import MLP
from research.train import GlobalBatch, SupervisedStep, example_keys, nt_xent
from research.train._rows import rows_of_global_batch
from research.train.evaluation import encoded, knn_accuracy, linear_probe_accuracy

WORKER = Path(__file__).parent / "_batch_loss_worker.py"
MODES = ("plain", "accum", "det", "det-accum")
LAYOUTS = ("pmap:2", "pmap:4", "sharded:4")  # and fsdp:4 with --deterministic-reduction; none:1 is the reference


def nt_xent_reference(embeddings: np.ndarray, temperature: float) -> tuple[float, float]:
    """NT-Xent and the pair accuracy written out in float64, view by view."""
    examples, views, _ = embeddings.shape
    z = embeddings.reshape(examples * views, -1).astype(np.float64)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    similarity = z @ z.T / temperature
    losses, hits = [], []
    for i in range(len(z)):
        others = [j for j in range(len(z)) if j != i]
        positives = [j for j in others if j // views == i // views]
        log_normaliser = np.log(np.sum(np.exp(similarity[i, others])))
        losses.append(np.mean([log_normaliser - similarity[i, j] for j in positives]))
        hits.append(others[int(np.argmax(similarity[i, others]))] in positives)
    return float(np.mean(losses)), float(np.mean(hits))


@pytest.mark.parametrize("views", [2, 3])
def test_nt_xent_is_the_loss_written_out_view_by_view(views):
    embeddings = np.random.default_rng(0).normal(size=(6, views, 5)).astype(np.float32)
    loss, metrics = jax.jit(nt_xent, static_argnums=1)(jnp.asarray(embeddings), 0.3)
    expected_loss, expected_accuracy = nt_xent_reference(embeddings, 0.3)
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)
    assert float(metrics["pair_accuracy"]) == pytest.approx(expected_accuracy)
    # Two copies of each embedding: every view's nearest other view is its pair.
    twins = np.repeat(np.random.default_rng(1).normal(size=(6, 1, 5)), 2, axis=1).astype(np.float32)
    assert float(nt_xent(jnp.asarray(twins), 0.3)[1]["pair_accuracy"]) == 1.0
    with pytest.raises(ValueError, match="at least 2 a row, got 1"):
        nt_xent(jnp.asarray(embeddings[:, :1]), 0.3)


def _mlp_and_batch():
    model = MLP(4, 8, hidden=(16,), key=jax.random.key(0))
    return model, jnp.asarray(np.random.default_rng(0).normal(size=(32, 4)), jnp.float32)


@pytest.mark.parametrize(
    "global_batch, grad_accum",
    [(GlobalBatch(), 1), (GlobalBatch(), 4), (GlobalBatch(None, 4), 1), (GlobalBatch(None, 4), 2)],
    ids=["whole", "accum4", "micro4", "micro4-accum2"],
)
def test_every_split_of_one_device_gives_the_gradient_of_the_whole_batch(global_batch, grad_accum):
    """Parts and micro-batches are embedded one at a time and their embeddings gathered: the loss is still the
    whole batch's (a stateless model: nothing but the split changes)."""
    model, batch = _mlp_and_batch()
    key, loss_fn = jax.random.key(1), NoisyViews()
    (loss, (metrics, _)), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(
        model, None, batch, jax.random.split(key, len(batch))
    )

    @eqx.filter_jit
    def split(model, batch, key):
        return global_batch.value_and_grad(loss_fn, model, None, batch, key, grad_accum=grad_accum)

    (s_loss, (s_metrics, _)), s_grads = split(model, batch, key)
    np.testing.assert_allclose(s_loss, loss, rtol=1e-6)
    assert float(s_metrics["pair_accuracy"]) == float(metrics["pair_accuracy"])
    for a, b in zip(jax.tree.leaves(s_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_with_batch_norm_each_micro_batch_is_normalised_on_its_own():
    """Under micro-batches BatchNorm sees each micro-batch alone (as under any loss): the gradient is that of
    the loss of the micro-batches' embeddings, each embedded on its own, put together; the new statistics are
    the mean of the micro-batches'."""
    from _batch_loss_worker import state

    start, batch, key, loss_fn = state("none", True), _mlp_and_batch()[1], jax.random.key(2), NoisyViews()

    def by_hand(model):
        parts = []
        for i in range(4):
            with rows_of_global_batch(32, 8 * i):
                parts.append(loss_fn.embed(model, start.model_state, batch[8 * i : 8 * (i + 1)], example_keys(key, 8)))
        loss, metrics = loss_fn.loss(jnp.concatenate([embedded for embedded, _ in parts]))
        return loss, [s for _, s in parts]

    (loss, states), grads = eqx.filter_jit(eqx.filter_value_and_grad(by_hand, has_aux=True))(start.model)
    (m_loss, (_, m_state)), m_grads = eqx.filter_jit(
        lambda m: GlobalBatch(None, 4).value_and_grad(loss_fn, m, start.model_state, batch, key)
    )(start.model)
    np.testing.assert_allclose(m_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(m_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    mean_state = jax.tree.map(lambda *s: sum(s) / 4, *[jax.tree.leaves(s) for s in states])
    for a, b in zip(jax.tree.leaves(m_state), mean_state, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_batch_loss_refuses_bf16_in_one_line():
    with pytest.raises(ConfigError, match="takes its gradients its own way") as info:
        SupervisedStep(NoisyViews(), precision="bf16")
    assert "\n" not in str(info.value)


def _layouts(tmp_path: Path, devices: int, layouts: list[str]) -> dict[str, dict[str, np.ndarray]]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    out = tmp_path / f"devices{devices}.npz"
    subprocess.run([sys.executable, str(WORKER), str(out), *layouts], env=env, check=True, timeout=600)
    found: dict[str, dict[str, np.ndarray]] = {}
    with np.load(out) as saved:
        for name in saved.files:
            layout, what = name.split("/", 1)
            found.setdefault(layout, {})[what] = saved[name]
    return found


@pytest.fixture(scope="module")
def layout_steps(tmp_path_factory):
    """One step on one device (a process of its own) and on each layout of a process with 4 devices."""
    tmp_path = tmp_path_factory.mktemp("layouts")
    one = _layouts(tmp_path, 1, [f"none:1:{mode}" for mode in MODES])
    four = _layouts(tmp_path, 4, [f"{layout}:{mode}" for layout in LAYOUTS for mode in MODES] + ["fsdp:4:det"])
    return one, four


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_layout_gives_the_loss_and_gradient_of_one_device(layout_steps, mode):
    """The same function of the global batch on 1, 2 and 4 devices: to the bit with --deterministic-reduction
    (its micro-batches, and their parts), to float rounding without (BatchNorm over the global batch under
    pmap too); on one device, with neither, the loss of the whole batch taken at once."""
    one, four = layout_steps
    reference = one[f"none:1:{mode}"]
    assert set(reference) >= {"metric/loss", "metric/pair_accuracy", "metric/grad_norm", "grad/0", "state/0"}
    if mode == "plain":
        whole = one["reference"]
        np.testing.assert_allclose(reference["metric/loss"], whole["metric/loss"], rtol=1e-6)
        for i in range(sum(k.startswith("grad/") for k in whole)):
            np.testing.assert_allclose(reference[f"grad/{i}"], whole[f"grad/{i}"], rtol=1e-5, atol=1e-7)
    layouts = [name for name in four if name.endswith(f":{mode}")]
    assert len(layouts) == len(LAYOUTS) + (mode == "det")
    for name in layouts:
        for what, value in reference.items():
            if mode.startswith("det"):
                assert four[name][what].tobytes() == value.tobytes(), f"{name}: {what} differs from one device's"
            else:
                np.testing.assert_allclose(four[name][what], value, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {what}")


# -- the views and the evaluation ------------------------------------------------------------------------------


def test_random_resized_crops_keep_the_image_at_full_scale_and_differ_by_key():
    images = jnp.asarray(np.random.default_rng(0).uniform(size=(6, 8, 8, 3)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 6)
    whole = random_resized_crop(images, keys, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    np.testing.assert_allclose(whole, images, atol=1e-6)
    crop = jax.jit(lambda x, k: random_resized_crop(x, k, scale=(0.3, 0.6)))
    crops = crop(images, keys)
    assert crops.shape == images.shape and float(crops.min()) >= 0.0 and float(crops.max()) <= 1.0
    assert not np.allclose(crops, images, atol=0.05)
    again = crop(images[::-1], keys[::-1])
    np.testing.assert_array_equal(again[::-1], crops)  # an image's crop depends on its key alone


def test_colour_jitter_of_zero_strength_changes_nothing_and_grey_views_are_grey():
    images = jnp.asarray(np.random.default_rng(0).uniform(size=(16, 4, 4, 3)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 16)
    np.testing.assert_allclose(colour_jitter(images, keys, brightness=0.0, contrast=0.0), images, atol=1e-6)
    grey = colour_jitter(images, keys, brightness=0.4, contrast=0.4, saturation=0.4, grey_probability=1.0)
    np.testing.assert_allclose(grey[..., 0], grey[..., 2], atol=1e-6)
    jittered = colour_jitter(images, keys, brightness=0.4, contrast=0.4, saturation=0.4)
    assert float(jnp.min(jittered)) >= 0.0 and float(jnp.max(jittered)) <= 1.0
    assert float(jnp.mean(jnp.abs(jittered - images))) > 0.02
    one_channel = colour_jitter(images[..., :1], keys, brightness=0.4, contrast=0.4, saturation=0.4)
    assert one_channel.shape == (16, 4, 4, 1)


def _clusters(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes, each a cluster around its own centre in 6 dimensions."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows).astype(np.int32)
    centres = np.random.default_rng(99).normal(size=(3, 6)) * 3
    return (centres[labels] + rng.normal(size=(rows, 6))).astype(np.float32), labels


def test_the_probe_and_the_neighbours_tell_separable_classes_apart_and_random_labels_not():
    train, test = _clusters(300, 0), _clusters(200, 1)
    arrays = [jnp.asarray(a) for a in (*train, *test)]
    assert float(linear_probe_accuracy(*arrays, classes=3)) > 0.97
    assert float(knn_accuracy(*arrays, classes=3, k=10)) > 0.97
    shuffled = np.random.default_rng(2).permutation(test[1])
    assert float(linear_probe_accuracy(*arrays[:3], jnp.asarray(shuffled), classes=3)) < 0.5
    nearest = knn_accuracy(arrays[0], arrays[1], arrays[0], arrays[1], classes=3, k=1)  # each its own neighbour
    assert float(nearest) == 1.0


def test_encoded_gives_every_example_once_in_order():
    inputs, labels = _clusters(7, 0)
    data = DeviceLoader(inputs, labels, 4, shuffle=False)  # a padded last batch of 3
    features, found = encoded(lambda model, state, x: x * model, jnp.float32(2.0), None, data)
    np.testing.assert_array_equal(found, labels)
    np.testing.assert_allclose(features, inputs * 2)
