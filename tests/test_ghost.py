"""Ghost clipping (`method="ghost"`): per-example norms and clipped sums without per-example
gradients equal the vmap path's, on every model it covers; the rest falls back to vmap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from research.data import Batch
from research.nn import MLP, build_model
from research.per_example import (
    PADDING_LABEL,
    DPSGDLoss,
    clipped_gradient_sum,
    ghost_problem,
    per_example_grad_norms,
    per_example_grads,
    per_example_norms,
)
from research.typing import Array, Float, PRNGKeyArray, typecheck


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


class DropoutMLP(eqx.Module):
    """Dropout has no parameters: still covered, and each example must get its own key in both passes."""

    mlp: MLP
    dropout: eqx.nn.Dropout

    def __init__(self, *, key):
        self.mlp = MLP(40, 10, hidden=(16,), activation="relu", key=key)
        self.dropout = eqx.nn.Dropout(0.3)

    @typecheck
    def __call__(self, x: Float[Array, "40"], *, key: PRNGKeyArray | None = None) -> Float[Array, "10"]:
        return self.mlp(self.dropout(x, key=key, inference=key is None))


class SharedLinear(eqx.Module):
    """One Linear applied twice (and a bias-free one): two calls of a layer are two positions of it."""

    inner: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.inner = eqx.nn.Linear(40, 40, key=k1)
        self.head = eqx.nn.Linear(40, 10, use_bias=False, key=k2)

    def __call__(self, x, *, key=None):
        return self.head(jnp.tanh(self.inner(jnp.tanh(self.inner(x)))))


class PerPosition(eqx.Module):
    """A Linear under an inner vmap (as a transformer applies its MLP per token): not covered."""

    embed: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Linear(8, 4, key=k1)
        self.head = eqx.nn.Linear(4, 10, key=k2)

    def __call__(self, x, *, key=None):
        return self.head(jnp.mean(jax.vmap(self.embed)(x.reshape(5, 8)), axis=0))


class Scaled(eqx.Module):
    """A parameter outside any Linear/Conv1d layer: not covered."""

    mlp: MLP
    scale: Array

    def __init__(self, *, key):
        self.mlp = MLP(40, 10, hidden=(8,), key=key)
        self.scale = jnp.ones(())

    def __call__(self, x, *, key=None):
        return self.scale * self.mlp(x)


COVERED = {
    "mlp": lambda key: build_model("mlp", in_size=40, out_size=10, hidden=(16, 8), activation="relu", key=key)[0],
    "logistic": lambda key: build_model("logistic", key=key)[0],
    "linear_sigmoid": lambda key: build_model("linear_sigmoid", in_size=40, out_size=10, key=key)[0],
    "cnn": lambda key: build_model("cnn", channels=4, key=key)[0],  # both ways of a conv norm: Gram and direct
    "dropout_mlp": lambda key: DropoutMLP(key=key),
    "shared_linear": lambda key: SharedLinear(key=key),
}
FALLBACK = {
    "gru": lambda key: build_model("gru", hidden_size=8, chunk=4, key=key),
    "transformer": lambda key: build_model("transformer", patch=8, dim=8, depth=1, heads=2, mlp_dim=16, key=key),
    "resnet": lambda key: build_model("resnet", widths=(4,), key=key),
    "per_position": lambda key: (PerPosition(key=key), None),
    "scaled": lambda key: (Scaled(key=key), None),
}


def batch_of(key, size=13):
    k1, k2 = jax.random.split(key)
    return Batch(jax.random.normal(k1, (size, 40)), jax.random.randint(k2, (size,), 0, 10))


@eqx.filter_jit
def both_ways(model, model_state, batch, key, weights, clip_norm):
    out = {}
    for method in ("ghost", "vmap"):
        out[method] = dict(
            norms=per_example_norms(model, model_state, batch, key, method=method),
            chunked_norms=per_example_norms(model, model_state, batch, key, method=method, chunk_size=4)[0],
            summed=clipped_gradient_sum(
                model, model_state, batch, key, clip_norm=clip_norm, weights=weights, method=method
            ),
            chunked=clipped_gradient_sum(
                model, model_state, batch, key, clip_norm=clip_norm, weights=weights, method=method, chunk_size=5
            ),  # 5 does not divide 13
        )
    grads, _ = per_example_grads(model, model_state, batch, key)
    return out, per_example_grad_norms(grads)


def check_equal(model, model_state, batch, key):
    weights = jnp.asarray([1.0] * 9 + [0.0] * 4)  # the last 4 are padding
    norms = eqx.filter_jit(per_example_norms)(model, model_state, batch, key, method="vmap")[0]
    clip = float(np.median(norms[:9]))  # about half the real examples get clipped
    out, reference_norms = both_ways(model, model_state, batch, key, weights, clip)
    ghost, vmap = out["ghost"], out["vmap"]
    np.testing.assert_allclose(ghost["norms"][0], reference_norms, rtol=1e-5)
    np.testing.assert_allclose(vmap["norms"][0], reference_norms, rtol=1e-5)
    np.testing.assert_allclose(ghost["chunked_norms"], reference_norms, rtol=1e-5)
    np.testing.assert_allclose(ghost["norms"][1]["loss"], vmap["norms"][1]["loss"], rtol=1e-6)
    for name in ("summed", "chunked"):
        summed, norms, metrics = ghost[name]
        assert_trees_close(summed, vmap[name][0])
        np.testing.assert_allclose(norms[:9], vmap[name][1][:9], rtol=1e-5)
        np.testing.assert_allclose(metrics["loss"][:9], vmap[name][2]["loss"][:9], rtol=1e-6)
    assert_trees_close(ghost["chunked"][0], ghost["summed"][0])
    assert 0 < int(np.sum(np.asarray(reference_norms[:9]) > clip)) < 9
    return ghost


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COVERED))
def test_ghost_norms_and_clipped_sums_equal_the_vmap_path(name, getkey):
    model, batch = COVERED[name](getkey()), batch_of(getkey())
    assert ghost_problem(model, None, batch) is None
    check_equal(model, None, batch, getkey())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_uncovered_models_fall_back_to_vmap_with_the_same_result(name, getkey):
    model, state = FALLBACK[name](getkey())
    if state is not None:
        model = eqx.nn.inference_mode(model)
    batch, key = batch_of(getkey(), size=4), getkey()
    problem = ghost_problem(model, state, batch)
    assert problem, name
    expected = {
        "per_position": "inner transformation",
        "scaled": "outside eqx.nn.Linear",
        "gru": "outside eqx.nn.Linear",
        "transformer": "outside eqx.nn.Linear",
        "resnet": "outside eqx.nn.Linear",
    }[name]
    assert expected in problem
    with pytest.raises(ValueError, match="method='ghost' cannot"):
        clipped_gradient_sum(model, state, batch, key, clip_norm=1.0, method="ghost")

    @eqx.filter_jit
    def auto_and_vmap(model):
        return [clipped_gradient_sum(model, state, batch, key, clip_norm=0.1, method=m) for m in ("auto", "vmap")]

    (auto_sum, auto_norms, _), (vmap_sum, vmap_norms, _) = auto_and_vmap(model)
    assert_trees_close(auto_sum, vmap_sum, rtol=0, atol=0)  # the same program: identical
    np.testing.assert_array_equal(auto_norms, vmap_norms)


def test_a_conv1d_called_directly_is_not_covered(getkey):
    """ResNet1d-like: an eqx.nn.Conv1d run by its own `__call__` (lax.conv) is not observed."""

    class DirectConv(eqx.Module):
        conv: eqx.nn.Conv1d
        head: eqx.nn.Linear

        def __init__(self, *, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv1d(1, 2, 3, key=k1)
            self.head = eqx.nn.Linear(76, 10, key=k2)

        def __call__(self, x, *, key=None):
            return self.head(jnp.ravel(self.conv(x[None])))

    problem = ghost_problem(DirectConv(key=getkey()), None, batch_of(getkey()))
    assert "never pass through" in problem and "Conv1d" in problem


@pytest.mark.slow
def test_dp_sgd_loss_is_the_same_either_way_with_padding_and_noise(getkey):
    model = build_model("cnn", channels=4, key=getkey())[0]
    batch = batch_of(getkey(), size=12)
    batch = Batch(batch.inputs, batch.labels.at[9:].set(PADDING_LABEL))
    key = getkey()

    @eqx.filter_jit
    def steps(model):
        return [
            DPSGDLoss(0.5, 1.0, 10, method=m, chunk_size=c).value_and_grad(model, None, batch, key)
            for m, c in (("ghost", None), ("vmap", None), ("auto", 5))
        ]

    (ghost, ghost_grads), (vmap, vmap_grads), (auto, auto_grads) = steps(model)
    assert_trees_close(ghost_grads, vmap_grads)  # the same noise (same key) on the same clipped sum
    assert_trees_close(auto_grads, vmap_grads)
    for name, value in vmap[1][0].items():
        np.testing.assert_allclose(ghost[1][0][name], value, rtol=1e-5)
    assert float(ghost[1][0]["batch_size"]) == 9
    with pytest.raises((ValueError, TypeCheckError), match="method"):  # TypeCheckError: under the jaxtyping hook
        DPSGDLoss(1.0, 1.0, 10, method="fast")


def test_ghost_clipping_holds_no_per_example_gradients():
    """Compiled temporary memory of the clipped sum on a wide MLP: per-example gradients (batch x
    parameters) dominate the vmap path and are absent from the ghost path."""
    model = MLP(256, 10, hidden=(512, 512), activation="relu", key=jax.random.key(0))
    batch = Batch(jnp.zeros((64, 256)), jnp.zeros(64, jnp.int32))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    per_example_bytes = 64 * 4 * sum(p.size for p in jax.tree.leaves(params))

    def temp_bytes(method):
        def summed(params):
            return clipped_gradient_sum(eqx.combine(params, static), None, batch, None, clip_norm=1.0, method=method)[0]

        return jax.jit(summed).lower(params).compile().memory_analysis().temp_size_in_bytes

    ghost, vmap = temp_bytes("ghost"), temp_bytes("vmap")
    assert vmap > per_example_bytes / 2
    assert ghost < per_example_bytes / 20 and 5 * ghost < vmap


def test_the_experiment_exposes_the_method():
    import dataclasses
    import importlib.util
    from pathlib import Path

    from research.errors import ConfigError

    path = Path(__file__).resolve().parent.parent / "experiments" / "dp_sgd.py"
    spec = importlib.util.spec_from_file_location("dp_sgd_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fields = {f.name: f for f in dataclasses.fields(module.Config)}  # an option of its own, not of a group
    assert fields["clipping"].default == "auto" and fields["clipping"].metadata["resumable"]
    assert module.Config.from_options(clipping="vmap").clipping == "vmap"
    with pytest.raises(ConfigError, match="--clipping must be one of auto, ghost, vmap"):
        module.Config.from_options(clipping="fast")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 7, 5), (6, 30, 20), (3, 200, 150), (200, 150, 120)])
def test_every_way_to_a_layer_norm_gives_the_same_number(shape, getkey):
    """Products of norms (one position), g^T x (small layers, or cheaper) and Gram matrices (large
    layers, few positions) against the norm of the per-example gradient formed directly."""
    from research.per_example._ghost import _weight_gradient_square

    positions, a, b = shape
    x, g = jax.random.normal(getkey(), (positions, a)), jax.random.normal(getkey(), (positions, b))
    np.testing.assert_allclose(_weight_gradient_square(x, g), jnp.sum(jnp.square(g.T @ x)), rtol=1e-5)


@pytest.mark.parametrize("shape", [(), (5,), (1000, 7), (3, 1, 4)])
def test_the_noise_is_jax_random_normal_bit_for_bit(shape):
    """DP-SGD draws its noise with `research.train.random_normal` (threefry unrolled): the same bits."""
    from research.train import random_normal

    for seed in (0, 7):
        key = jax.random.key(seed)
        expected = jax.jit(lambda k: jax.random.normal(k, shape))(key)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda k: random_normal(k, shape))(key)), np.asarray(expected))
    assert random_normal(jax.random.key(1, impl="rbg"), (4,)).shape == (4,)  # other keys: jax.random.normal
