"""The generative image models (DCGAN generator and discriminator, DDPM U-Net): shapes, trace-time
checks, refused sizes, statelessness and independent examples, gradients, and the strided convs.

XLA's CPU compiler takes seconds over a U-Net's backward pass, so shapes are checked by tracing alone
(`eqx.filter_eval_shape`, which runs the type checks too) and each model is compiled once, at small
widths, into one program that gives its batched outputs, its outputs one example at a time and its
gradients.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from research.nn import BatchNorm, Discriminator, Generator, UNet, build_model, conv2d_as_matmul, model_names

NAMES = pytest.mark.parametrize("name", ["dcgan_generator", "dcgan_discriminator", "unet"])
# Small widths: group norm still has 2, 4 and 8 groups (4, 8 and 16 channels). The compiled U-Net has one
# level (fewer layers for XLA to compile); the traced ones have the default two.
SMALL = {"dcgan_generator": {"features": 4}, "dcgan_discriminator": {"features": 4}, "unet": {"features": 4}}
COMPILED = {**SMALL, "unet": {"features": 4, "levels": 1}}


def build(name, key, height=28, width=28, channels=1, hparams=SMALL):
    model, state = build_model(name, key=key, height=height, width=width, channels=channels, **hparams[name])
    assert state is None
    return model


def batch_of_inputs(model, rng, batch):
    """The model's arguments for `batch` examples, batched on the leading axis."""
    if isinstance(model, Generator):
        return (jnp.asarray(rng.normal(size=(batch, model.latent)), jnp.float32),)
    x = jnp.asarray(rng.uniform(-1.0, 1.0, (batch, model.height, model.width, model.channels)), jnp.float32)
    return (x,) if isinstance(model, Discriminator) else (x, jnp.asarray(rng.uniform(size=batch), jnp.float32))


def output_shape(model):
    return () if isinstance(model, Discriminator) else (model.height, model.width, model.channels)


@eqx.filter_jit
def outputs_and_gradients(model, args, target):
    """The batch through `vmap`, the same examples one at a time (`lax.map`), and the gradient of the
    squared distance of the batched outputs to `target`: one compilation for all three."""

    def loss(model):
        outputs = jax.vmap(model)(*args)
        return jnp.mean((outputs - target) ** 2), outputs

    (_, outputs), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    return outputs, jax.lax.map(lambda example: model(*example), args), grads


def compiled_run(name, getkey):
    """A small model with parameters drawn by numpy, three examples of its inputs and a target.

    Not the model's own initialisation: eager, it compiles one random draw for every parameter shape
    (seconds for a U-Net on CPU); these tests are about the forward and backward passes, and the
    initialisation is traced by `test_float32_outputs_of_the_right_shape`.
    """
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if leaf.ndim == 1 and path[-1].name == "weight":  # group norm's scale: near eqx's ones
            values = rng.uniform(0.9, 1.1, leaf.shape)
        else:  # +-1/sqrt(fan in) for linear and conv weights, as eqx draws them; small biases
            bound = 0.1 if path[-1].name == "bias" else 1 / math.sqrt(math.prod(leaf.shape[1:]))
            values = rng.uniform(-bound, bound, leaf.shape)
        return jnp.asarray(values, leaf.dtype)

    model = jax.tree_util.tree_map_with_path(draw, eqx.filter_eval_shape(build, name, getkey(), hparams=COMPILED))
    args = batch_of_inputs(model, rng, 3)
    return model, args, jnp.asarray(rng.normal(size=(3, *output_shape(model))), jnp.float32)


def message_and_notes(error: Exception) -> str:
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def traced(name, key, height=28, width=28, channels=1):
    """The model with shapes for arrays: traced but never compiled (nor initialised: XLA compiles the
    initialisation's random draws once for every parameter shape)."""
    return eqx.filter_eval_shape(build, name, key, height, width, channels)


def traced_inputs(model, batch=None):
    """`ShapeDtypeStruct`s of the model's arguments, batched on a leading axis of size `batch` if given."""
    lead = () if batch is None else (batch,)
    if isinstance(model, Generator):
        return (jax.ShapeDtypeStruct((*lead, model.latent), jnp.float32),)
    x = jax.ShapeDtypeStruct((*lead, model.height, model.width, model.channels), jnp.float32)
    return (x,) if isinstance(model, Discriminator) else (x, jax.ShapeDtypeStruct(lead, jnp.float32))


@NAMES
@pytest.mark.parametrize(("height", "width", "channels"), [(32, 32, 3), (28, 28, 1)])
def test_float32_outputs_of_the_right_shape(name, height, width, channels, getkey):
    model = traced(name, getkey(), height, width, channels)
    outputs = eqx.filter_eval_shape(lambda model, *args: jax.vmap(model)(*args), model, *traced_inputs(model, 5))
    assert outputs.shape == (5, *output_shape(model)) and outputs.dtype == jnp.float32


@NAMES
@pytest.mark.slow  # compiles a forward, a per-example map and the gradient of each model (35 s in all)
def test_examples_are_independent_and_gradients_reach_every_parameter(name, getkey):
    model, args, target = compiled_run(name, getkey)
    outputs, singles, grads = outputs_and_gradients(model, args, target)
    assert outputs.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(outputs)))
    np.testing.assert_allclose(singles, outputs, rtol=1e-5, atol=1e-5)  # vmap is one example at a time
    # Another first example leaves the others' outputs exactly as they were: no batch statistics.
    changed, _, _ = outputs_and_gradients(model, tuple(a.at[0].set(-a[0]) for a in args), target)
    assert not np.allclose(changed[0], outputs[0])
    np.testing.assert_array_equal(changed[1:], outputs[1:])

    named = jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_inexact_array))
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    assert [g.shape for _, g in named] == [p.shape for p in params]
    for path, g in named:
        assert bool(jnp.all(jnp.isfinite(g))), jax.tree_util.keystr(path)
        assert float(jnp.max(jnp.abs(g))) > 0, jax.tree_util.keystr(path)


def test_the_generator_draws_images_in_minus_one_to_one(getkey):
    model, args, target = compiled_run("dcgan_generator", getkey)
    # The projection's group norm undoes any scale of z; a large last conv saturates the tanh instead.
    model = eqx.tree_at(lambda m: m.out.weight, model, 100.0 * model.out.weight)
    images, _, _ = outputs_and_gradients(model, args, target)
    assert float(jnp.min(images)) >= -1.0 and float(jnp.max(images)) <= 1.0
    assert float(jnp.max(jnp.abs(images))) > 0.99


def test_the_unet_prediction_depends_on_the_time(getkey):
    model, args, target = compiled_run("unet", getkey)
    x = jnp.broadcast_to(args[0][:1], args[0].shape)  # one image at three times
    outputs, _, _ = outputs_and_gradients(model, (x, jnp.array([0.1, 0.5, 0.501])), target)
    assert float(jnp.max(jnp.abs(outputs[0] - outputs[1]))) > 1e-2
    assert float(jnp.max(jnp.abs(outputs[1] - outputs[2]))) > 1e-3  # one DDPM step apart in 1000


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("dcgan_generator", (jnp.zeros(63),), ["parameter 'z'", "f32[63]", "self.latent = 64"]),
        ("dcgan_discriminator", (jnp.zeros((28, 28, 3)),), ["parameter 'x'", "f32[28,28,3]", "self.channels = 1"]),
        ("unet", (jnp.zeros((32, 32, 1)), jnp.array(0.5)), ["parameter 'x'", "f32[32,32,1]", "self.height = 28"]),
        ("unet", (jnp.zeros((28, 28, 1)), jnp.array([0.5])), ["parameter 't'", "f32[1]"]),
        ("unet", (jnp.zeros((28, 28, 1), jnp.int32), jnp.array(0.5)), ["parameter 'x'", "i32[28,28,1]"]),
    ],
)
def test_a_wrong_shape_or_dtype_fails_at_trace_time_naming_the_dimension(name, args, expected, getkey):
    with pytest.raises(TypeCheckError) as info:
        eqx.filter_eval_shape(lambda model, *args: model(*args), traced(name, getkey()), *args)
    message = message_and_notes(info.value)
    assert all(part in message for part in expected), message


def test_sizes_the_models_cannot_halve_are_refused_naming_them(getkey):
    with pytest.raises(ValueError, match=r"Generator .* divisible by 4 .* got 30x32"):
        Generator(height=30, key=getkey())
    with pytest.raises(ValueError, match=r"UNet .* divisible by 8 .* got 28x28"):
        UNet(height=28, width=28, levels=3, key=getkey())
    with pytest.raises(ValueError, match=r"at least 4x4 .* got 3x32"):
        Discriminator(height=3, key=getkey())
    with pytest.raises(ValueError, match="time_features must be even"):
        UNet(time_features=7, key=getkey())
    with pytest.raises(ValueError, match="features=0"):
        Generator(features=0, key=getkey())


@NAMES
def test_registered_stateless_and_free_of_batch_norm(name, getkey):
    assert name in model_names()
    model, state = eqx.filter_eval_shape(build_model, name, key=getkey())  # the structure, not the arrays
    assert state is None
    layers = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, eqx.Module))
    assert not any(isinstance(layer, BatchNorm | eqx.nn.BatchNorm) for layer in layers)


def test_parameter_counts_at_the_defaults(getkey):
    def count(name):
        model, _ = eqx.filter_eval_shape(build_model, name, key=getkey())  # shapes only: nothing to compile
        return sum(math.prod(x.shape) for x in jax.tree.leaves(model) if jnp.issubdtype(x.dtype, jnp.inexact))

    # generator: 64 -> 128*8*8 linear, 3x3 convs 128->64->32 without bias (group norm follows), 32->3;
    # discriminator: 4x4 convs 3->32, 32->64 (no bias), group norm, 64*8*8 -> 1.
    assert count("dcgan_generator") == 64 * 8192 + 8192 + 256 + 9 * (128 * 64 + 64 * 32) + 128 + 64 + 9 * 32 * 3 + 3
    assert count("dcgan_discriminator") == 16 * 3 * 32 + 32 + 16 * 32 * 64 + 128 + 64 * 64 + 1
    # A regression pin, not a count by hand: the default UNet's parameters as they were when it was written, so that
    # an accidental change of its architecture is noticed (a deliberate one updates the number).
    assert count("unet") == 753_315, "the default UNet's parameter count changed: was its architecture meant to?"


@eqx.filter_jit
def both_convs(conv, x):
    return conv2d_as_matmul(conv, x), conv(x)


@pytest.mark.parametrize(("kernel", "size"), [(4, 28), (4, 7), (3, 7)])
def test_strided_conv2d_as_matmul_equals_eqx_conv2d(kernel, size, getkey):
    conv = eqx.nn.Conv2d(3, 5, kernel, stride=2, padding=1, key=getkey())
    x = jnp.asarray(np.random.default_rng(size).normal(size=(3, size, size)), jnp.float32)
    ours, theirs = both_convs(conv, x)
    assert ours.shape == theirs.shape == (5, (size + 2 - kernel) // 2 + 1, (size + 2 - kernel) // 2 + 1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
