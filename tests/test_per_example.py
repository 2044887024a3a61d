import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from research.data import Batch, DeviceLoader, XORDataset
from research.errors import DeviceError
from research.nn import MLP, build_model
from research.per_example import (
    PADDING_LABEL,
    DPSGDLoss,
    PoissonLoader,
    classification_example_loss,
    clip_per_example,
    clipped_gradient_sum,
    dp_sgd_epsilon,
    per_example_grad_norms,
    per_example_grads,
    per_example_losses,
)
from research.train import SupervisedStep, TrainState, classification_loss, fit
from research.typing import Array, Float, PRNGKeyArray, typecheck


class DropoutMLP(eqx.Module):
    """A small classifier whose output depends on its key, to check that each example gets its own."""

    mlp: MLP
    dropout: eqx.nn.Dropout

    def __init__(self, *, key):
        self.mlp = MLP(2, 3, hidden=(16,), activation="relu", key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    @typecheck
    def __call__(self, x: Float[Array, "2"], *, key: PRNGKeyArray | None = None) -> Float[Array, "3"]:
        return self.mlp(self.dropout(x * 3.0, key=key, inference=key is None))


def xor_batch(size=12, seed=0):
    data = XORDataset(size, seed=seed)
    return Batch(jnp.asarray(data.inputs), jnp.asarray(data.labels))


def leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# Each check runs as ONE compiled function: compilation, not arithmetic, is what these tests cost.
clip_fn = eqx.filter_jit(clip_per_example)
norms_fn = eqx.filter_jit(per_example_grad_norms)


def loop_grads(model, model_state, batch, key):
    """The reference: one `filter_grad` per example (a Python loop), with forward's per-example keys."""
    keys = jax.random.split(key, len(batch.labels))
    grads = []
    for i in range(len(batch.labels)):
        loss = lambda m: classification_example_loss(m, model_state, batch.inputs[i], batch.labels[i], keys[i])[0]  # noqa: E731,B023
        grads.append(eqx.filter_grad(loss)(model))
    return jax.tree.map(lambda *g: jnp.stack(g), *grads)


@eqx.filter_jit
def vmapped_loop_and_batch(model, model_state, batch, key):
    grads, metrics = per_example_grads(model, model_state, batch, key)
    batch_loss = lambda m: classification_loss(m, model_state, batch, key)[0]  # noqa: E731
    return grads, metrics, loop_grads(model, model_state, batch, key), eqx.filter_value_and_grad(batch_loss)(model)


@pytest.mark.slow
def test_per_example_grads_equal_a_loop_and_average_to_the_batch_gradient(getkey):
    model, batch, key = DropoutMLP(key=getkey()), xor_batch(), getkey()  # dropout: every example its own key
    batch = Batch(batch.inputs, batch.labels % 3)
    grads, metrics, looped, (loss, batch_grad) = vmapped_loop_and_batch(model, None, batch, key)
    assert_trees_close(grads, looped)
    assert_trees_close(jax.tree.map(lambda g: jnp.mean(g, axis=0), grads), batch_grad)
    np.testing.assert_allclose(jnp.mean(metrics["loss"]), loss, rtol=1e-6)


def test_norms_and_clipping(getkey):
    model, batch = MLP(2, 1, hidden=(8,), key=getkey()), xor_batch(32)
    grads, _ = eqx.filter_jit(per_example_grads)(model, None, batch)
    norms = norms_fn(grads)
    by_hand = [np.sqrt(sum(np.sum(np.asarray(g[i]) ** 2) for g in leaves(grads))) for i in range(32)]
    np.testing.assert_allclose(norms, by_hand, rtol=1e-5)

    clip = float(np.median(norms))  # half the examples get clipped, half do not
    clipped, returned_norms = clip_fn(grads, clip)
    np.testing.assert_array_equal(returned_norms, norms)
    new_norms = np.asarray(norms_fn(clipped))
    assert np.all(new_norms <= clip * (1 + 1e-6))  # <= C up to float32 rounding
    inside = np.asarray(norms) <= clip
    assert 0 < inside.sum() < 32
    for g, c in zip(leaves(grads), leaves(clipped), strict=True):
        np.testing.assert_array_equal(np.asarray(c)[inside], np.asarray(g)[inside])  # unclipped: unchanged
        scale = (clip / np.asarray(norms)[~inside]).reshape((-1,) + (1,) * (g.ndim - 1))
        np.testing.assert_allclose(np.asarray(c)[~inside], np.asarray(g)[~inside] * scale, rtol=1e-5)
    np.testing.assert_allclose(new_norms[~inside], clip, rtol=1e-5)


@eqx.filter_jit
def direct_and_chunked(model, batch, key, weights):
    direct = per_example_grads(model, None, batch, key)
    chunked = per_example_grads(model, None, batch, key, chunk_size=7)  # 7 does not divide 30
    losses = per_example_losses(model, None, batch, key, chunk_size=4)
    summed = clipped_gradient_sum(model, None, batch, key, clip_norm=0.5, weights=weights)
    summed_chunked = clipped_gradient_sum(model, None, batch, key, clip_norm=0.5, weights=weights, chunk_size=8)
    return direct, chunked, losses, summed, summed_chunked


@pytest.mark.slow
def test_chunked_equals_direct(getkey):
    model, batch, key = DropoutMLP(key=getkey()), xor_batch(30), getkey()
    batch = Batch(batch.inputs, batch.labels % 3)
    weights = jnp.asarray(np.r_[np.ones(20), np.zeros(10)], jnp.float32)  # the last chunk is all padding
    (direct, direct_metrics), (chunked, chunked_metrics), losses, summed, summed_chunked = direct_and_chunked(
        model, batch, key, weights
    )
    assert_trees_close(chunked, direct)
    np.testing.assert_allclose(chunked_metrics["loss"], direct_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(losses, direct_metrics["loss"], rtol=1e-6)

    assert_trees_close(summed_chunked[0], summed[0])
    np.testing.assert_allclose(summed_chunked[1][:20], summed[1][:20], rtol=1e-5)
    clipped, _ = clip_fn(direct, 0.5)
    assert_trees_close(summed[0], jax.tree.map(lambda g: jnp.sum(g[:20], axis=0), clipped))


@eqx.filter_jit
def exact_noisy_and_reference(model, batch, key, clip, sigma):
    (_, (metrics, _)), exact = DPSGDLoss(clip, 0.0, 64).value_and_grad(model, None, batch, key)
    _, noisy = DPSGDLoss(clip, sigma, 64).value_and_grad(model, None, batch, key)
    example_key, _ = jax.random.split(key)
    clipped, norms = clip_per_example(per_example_grads(model, None, batch, example_key)[0], clip)
    return metrics, exact, noisy, clipped, norms


def test_dp_gradient_is_the_clipped_mean_plus_noise_of_the_promised_scale(getkey):
    model, batch, key = MLP(2, 1, hidden=(512,), key=getkey()), xor_batch(64), getkey()
    clip, sigma = 0.05, 2.0
    metrics, exact, noisy, clipped, norms = exact_noisy_and_reference(model, batch, key, clip, sigma)
    assert_trees_close(exact, jax.tree.map(lambda g: jnp.mean(g, axis=0), clipped))
    assert float(metrics["clipped_fraction"]) == pytest.approx(float(jnp.mean(norms > clip)))
    assert float(metrics["batch_size"]) == 64

    noise = np.concatenate([np.ravel(n - e) for n, e in zip(leaves(noisy), leaves(exact), strict=True)])
    assert noise.size > 2000
    assert np.std(noise) == pytest.approx(sigma * clip / 64, rel=0.05)
    assert abs(np.mean(noise)) < 4 * sigma * clip / 64 / np.sqrt(noise.size)


def test_padding_rows_change_nothing(getkey):
    model, batch, key = MLP(2, 1, hidden=(8,), key=getkey()), xor_batch(20), getkey()
    padded = Batch(
        jnp.concatenate([batch.inputs, jnp.zeros((12, 2))]),
        jnp.concatenate([batch.labels, jnp.full(12, PADDING_LABEL, batch.labels.dtype)]),
    )
    loss = DPSGDLoss(0.3, 0.0, 20, chunk_size=8)

    @eqx.filter_jit
    def both(model):
        return (
            loss.value_and_grad(model, None, batch, key),
            loss.value_and_grad(model, None, padded, key),
            loss(model, None, padded, key),
        )

    ((value, _), grads), ((padded_value, (padded_metrics, _)), padded_grads), (called, _) = both(model)
    assert_trees_close(padded_grads, grads, rtol=1e-4, atol=1e-6)  # keys differ by position: no dropout here
    assert float(padded_value) == pytest.approx(float(value), rel=1e-6)
    assert float(padded_metrics["batch_size"]) == 20
    assert float(called) == pytest.approx(float(value), rel=1e-6)


def test_without_clipping_or_noise_dp_training_is_ordinary_training():
    """The train step uses the loss's `value_and_grad`: with C huge and no noise, DP-SGD is SGD."""
    data = XORDataset(256, seed=1)
    loader = DeviceLoader.from_dataset(data, 32, seed=0)
    model_key, train_key = jax.random.split(jax.random.key(3))
    state = TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(0.3), key=train_key)
    ordinary = fit(state, loader, num_steps=40, steps_per_call=20, progress=False)
    private = fit(
        state,
        loader,
        num_steps=40,
        steps_per_call=20,
        progress=False,
        step=SupervisedStep(DPSGDLoss(clip_norm=1e6, noise_multiplier=0.0, expected_batch_size=32)),
    )
    assert_trees_close(private.state.model, ordinary.state.model, rtol=1e-5, atol=1e-6)


def test_poisson_loader_samples_each_example_with_probability_q_and_is_reproducible():
    size, expected = 1000, 50
    inputs, labels = np.arange(size, dtype=np.float32)[:, None], np.arange(size, dtype=np.int32) % 2
    loader = PoissonLoader(inputs, labels, expected, seed=7)
    rows = loader.step_indices(0, 400)
    assert rows.shape == (400, loader.max_batch_size) and loader.steps_per_epoch == 20
    real = rows < size
    counts = real.sum(axis=1)
    assert counts.mean() == pytest.approx(expected, rel=0.03)
    assert counts.std() == pytest.approx(np.sqrt(size * 0.05 * 0.95), rel=0.15)  # binomial spread
    assert np.all(np.diff(real.astype(int), axis=1) <= 0)  # real examples first, then padding
    frequency = np.bincount(rows[real], minlength=size) / 400
    assert frequency.mean() == pytest.approx(0.05, rel=0.03) and 0.01 < frequency.min() and frequency.max() < 0.12
    np.testing.assert_array_equal(loader.step_indices(123, 5), rows[123:128])  # a pure function of (seed, step)
    assert np.asarray(loader.arrays.labels)[size] == PADDING_LABEL

    tight = PoissonLoader(inputs, labels, expected, seed=7, max_batch_size=20)
    truncated = tight.step_indices(0, 50)
    assert np.all(truncated < size)  # every draw exceeds 20 and is cut down to a random subset
    assert np.all(np.isin(truncated[0], loader.step_indices(0, 1)[0]))


def test_epsilon_from_dp_accounting():
    import dp_accounting

    args = dict(dataset_size=60000, expected_batch_size=256, steps=300, delta=1e-5)
    eps = {sigma: dp_sgd_epsilon(noise_multiplier=sigma, max_batch_size=400, **args) for sigma in (0.8, 1.1, 2.0)}
    assert eps[0.8] > eps[1.1] > eps[2.0] > 0
    # A cap 9 standard deviations above the mean truncates (almost) never: plain Poisson sampling's epsilon.
    poisson = dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.1))
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    assert eps[1.1] == pytest.approx(pld.compose(poisson, 300).get_epsilon(1e-5), rel=1e-3)
    # ... and the (looser) RDP accountant bounds it from above.
    assert eps[1.1] <= dp_accounting.rdp.RdpAccountant().compose(poisson, 300).get_epsilon(1e-5)
    # A tight cap truncates often, which the accounting reflects.
    assert dp_sgd_epsilon(noise_multiplier=1.1, max_batch_size=250, **args) != pytest.approx(eps[1.1], rel=1e-3)
    assert dp_sgd_epsilon(noise_multiplier=0.0, max_batch_size=400, **args) == float("inf")


# Small versions of the zoo's models; ResNet1d has BatchNorm, so it is checked in inference mode.
ZOO = {
    "cnn": dict(channels=4),
    "gru": dict(hidden_size=8, chunk=4),
    "resnet": dict(widths=(4,)),
    "transformer": dict(patch=8, dim=8, depth=1, heads=2, mlp_dim=16),
}


@eqx.filter_jit
def vmapped_and_loop(model, model_state, batch, key):
    return per_example_grads(model, model_state, batch, key)[0], loop_grads(model, model_state, batch, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_per_example_grads_equal_a_loop(name, getkey):
    model, state = build_model(name, key=getkey(), **ZOO[name])
    batch = Batch(jax.random.normal(getkey(), (2, 40)), jnp.asarray([3, 7], jnp.int32))
    if state is not None:
        with pytest.raises(ValueError, match="batch statistics.*BatchNorm in training mode.*inference_mode"):
            per_example_grads(model, state, batch)
        with pytest.raises(ValueError, match="BatchNorm in training mode"):
            DPSGDLoss(1.0, 1.0, 2).value_and_grad(model, state, batch, getkey())
        model = eqx.nn.inference_mode(model)  # running statistics: every example on its own again
    grads, looped = vmapped_and_loop(model, state, batch, getkey())
    assert_trees_close(grads, looped, atol=1e-6)


def test_the_default_poisson_batch_is_a_multiple_of_the_devices_that_share_it():
    """`./scripts/run dp_sgd --devices 4` used to end in a reshape traceback: its default compiled batch
    (expected 512 + 4 std + 4 = 601 rows) cannot be split over 4 devices. The default now rounds up."""
    from research.parallel import check_split
    from research.per_example import PoissonLoader, default_max_batch_size

    assert default_max_batch_size(4000, 512) == 601
    assert default_max_batch_size(4000, 512, multiple_of=4) == 604
    assert default_max_batch_size(10, 9, multiple_of=4) == 10  # never more rows than examples
    inputs, labels = np.zeros((4000, 3), np.float32), np.zeros(4000, np.int32)
    loader = PoissonLoader(inputs, labels, 512, seed=0, multiple_of=4)
    assert loader.batch_size == loader.max_batch_size == 604
    check_split(loader.batch_size, 4)
    with pytest.raises(DeviceError, match="a training batch of 601 rows cannot be split evenly over 4 devices"):
        check_split(PoissonLoader(inputs, labels, 512, seed=0, max_batch_size=601).batch_size, 4)
