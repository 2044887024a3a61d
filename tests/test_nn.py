import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from research.nn import MLP, BatchNorm, LinearSigmoid, build_model, model_names


def test_mlp_maps_one_example(getkey):
    model = MLP(2, 3, hidden=(8, 8), activation="relu", key=getkey())
    assert model(jnp.ones(2)).shape == (3,)
    assert jax.vmap(model)(jnp.ones((5, 2))).shape == (5, 3)
    assert (model.in_size, model.out_size) == (2, 3)


def test_mlp_rejects_a_wrong_input_size_naming_the_dimension(getkey):
    model = MLP(2, 1, hidden=(4,), key=getkey())
    with pytest.raises(TypeCheckError) as info:
        model(jnp.ones(3))
    message = str(info.value)
    assert "x" in message and "self.in_size" in message and "3" in message


def test_mlp_rejects_a_batch_passed_as_one_example(getkey):
    model = MLP(2, 1, hidden=(4,), key=getkey())
    with pytest.raises(TypeCheckError):
        model(jnp.ones((5, 2)))


def test_unknown_activation_is_refused(getkey):
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        MLP(2, 1, activation="tanhh", key=getkey())


def _bce(p, y):
    return -(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))


def test_linear_sigmoid_gradient_is_the_model_tree_and_matches_the_hand_derived_one(getkey):
    model = LinearSigmoid(3, 1, key=getkey())
    x = jnp.array([0.5, -1.0, 2.0])
    y = 1.0

    grads = eqx.filter_grad(lambda m: _bce(m(x)[0], y))(model)

    assert jax.tree.structure(grads) == jax.tree.structure(model)
    p = model(x)[0]
    # d/dW BCE(sigmoid(Wx + b), y) = (p - y) x^T; d/db = p - y.
    np.testing.assert_allclose(grads.linear.weight, ((p - y) * x)[None, :], rtol=1e-5)
    np.testing.assert_allclose(grads.linear.bias, jnp.array([p - y]), rtol=1e-5)


@pytest.mark.slow
def test_mlp_gradient_matches_finite_differences(getkey):
    model = MLP(2, 1, hidden=(8,), key=getkey())
    x = jnp.array([0.3, -0.7])

    def loss(m):
        return jnp.sum(m(x) ** 2)

    grads = eqx.filter_grad(loss)(model)
    params, static = eqx.partition(model, eqx.is_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    eps = 1e-3
    numeric = []
    for i in range(flat.size):
        e = jnp.zeros_like(flat).at[i].set(eps)
        plus = loss(eqx.combine(unravel(flat + e), static))
        minus = loss(eqx.combine(unravel(flat - e), static))
        numeric.append((plus - minus) / (2 * eps))
    analytic, _ = jax.flatten_util.ravel_pytree(eqx.filter(grads, eqx.is_array))
    np.testing.assert_allclose(analytic, jnp.stack(numeric), rtol=2e-2, atol=2e-3)


def test_registry_builds_by_name_and_lists_names_on_a_typo(getkey):
    model, state = build_model("mlp", in_size=2, out_size=1, hidden=(8,), key=getkey())
    assert isinstance(model, MLP) and state is None
    assert "mlp" in model_names()
    with pytest.raises(ValueError, match="unknown model 'mpl'; valid names: .*mlp"):
        build_model("mpl", key=getkey())


def test_batch_norm_matches_equinox_to_rounding_with_the_same_state_in_training_and_inference():
    """`research.nn.BatchNorm` is `eqx.nn.BatchNorm(mode="batch")` rounding otherwise (a multiply by `rsqrt`,
    one product in the running averages): the same fields and state (checkpoints of either load into the
    other), running statistics and outputs equal to rounding, in training (batch statistics) and inference
    (debiased running ones)."""
    ours, ours_state = eqx.nn.make_with_state(BatchNorm)(3, axis_name="batch", momentum=0.9)
    theirs, theirs_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", momentum=0.9, mode="batch")
    assert jax.tree.structure(ours_state) == jax.tree.structure(theirs_state)
    x = jnp.asarray(np.random.default_rng(0).normal(2.0, 3.0, size=(3, 16, 3)), jnp.float32)  # 3 batches of 16
    for batch in x:
        out, ours_state = jax.vmap(ours, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(batch, ours_state)
        expected, theirs_state = jax.vmap(theirs, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            batch, theirs_state
        )
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out.mean(0), 0.0, atol=1e-6)  # normalised by the batch's own statistics
    for a, b in zip(jax.tree.leaves(ours_state), jax.tree.leaves(theirs_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # the counter exactly, the running statistics to rounding
    inference = jax.vmap(lambda r: ours(r, ours_state, inference=True)[0])(x[0])
    expected = jax.vmap(lambda r: theirs(r, theirs_state, inference=True)[0])(x[0])
    np.testing.assert_allclose(inference, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(inference, jax.vmap(lambda r: ours(r, ours_state)[0], axis_name="batch")(x[0]))


def test_the_vision_transformer_classifies_one_image_of_its_shape(getkey):
    """`VisionTransformer` (Hugging Face's ViT layout, `research.nn.load_vit`): one height x width x channels
    image in, class logits out, a token a patch plus the class token; another image shape fails when traced."""
    model, state = build_model("vit", key=getkey(), image_size=8, patch=4, channels=1, classes=3, dim=16, depth=2)
    assert state is None and model.positions.shape == (1 + 4, 16) and model.blocks.mlp_in.weight.shape == (2, 64, 16)
    logits = eqx.filter_jit(model)(jax.random.normal(getkey(), (8, 8, 1)))
    assert logits.shape == (3,) and bool(jnp.all(jnp.isfinite(logits)))
    with pytest.raises(TypeCheckError, match="self.channels"):
        model(jnp.zeros((8, 8, 3)))
    with pytest.raises(ValueError, match="patch 3 must divide image_size 8"):
        build_model("vit", key=getkey(), image_size=8, patch=3)
