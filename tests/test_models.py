"""The MNIST-1D model zoo: shapes, dtypes, trace-time checks, gradients, batch norm and dropout."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jaxtyping import TypeCheckError

from research.nn import (
    MLP,
    CNN1d,
    GRUClassifier,
    Logistic,
    ResNet1d,
    TransformerClassifier,
    build_model,
    conv1d_as_matmul,
    model_names,
)
from research.train import forward as eager_forward

# Compiled: eager op-by-op dispatch of the larger models costs seconds per call.
forward = eqx.filter_jit(eager_forward)

# name -> (class, constructor arguments, the dimension named in a wrong-length error). Small sizes,
# and no dropout in the shared tests: on XLA CPU each random draw adds about a second of compilation
# (dropout has its own test below).
MODELS = {
    "logistic": (Logistic, {}, "self.length"),
    "mlp": (MLP, {"in_size": 40, "out_size": 10, "hidden": (100, 100), "activation": "relu"}, "self.in_size"),
    "cnn": (CNN1d, {}, "self.length"),
    "gru": (GRUClassifier, {"hidden_size": 16}, "self.length"),
    "resnet": (ResNet1d, {"widths": (8, 16)}, "self.length"),
    "transformer": (TransformerClassifier, {"dim": 16, "heads": 2, "mlp_dim": 32, "dropout": 0.0}, "self.length"),
}
names = pytest.mark.parametrize("name", list(MODELS))


def build(name, key):
    cls, hparams, _ = MODELS[name]
    model, state = build_model(name, key=key, **hparams)
    assert type(model) is cls
    assert (state is not None) == (name == "resnet")
    return model, state


def eager_call_one(model, state, x, key=None):
    """One example through the model: a stateful model in inference mode (no batch axis to reduce over)."""
    if state is None:
        return model(x, key=key)
    return eqx.nn.inference_mode(model)(x, state, key=key)[0]


call_one = eqx.filter_jit(eager_call_one)


def message_and_notes(error: Exception) -> str:
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


def num_params(model):
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


@names
def test_one_example_in_float32_logits_out_traced_once_and_equal_to_the_batched_forward(name, getkey):
    model, state = build(name, getkey())
    traces = []

    @eqx.filter_jit
    def apply(model, state, x):
        traces.append(1)  # runs only while tracing: the checks run then, and never again
        return eager_call_one(model, state, x)

    xs = jax.random.normal(getkey(), (7, 40))
    outputs = [apply(model, state, x) for x in xs]
    assert len(traces) == 1
    assert all(o.shape == (10,) and o.dtype == jnp.float32 for o in outputs)
    inference = state is not None  # single examples ran on the running statistics
    batch, new_state = forward(eqx.nn.inference_mode(model, inference), state, xs, key=None)
    assert batch.shape == (7, 10) and batch.dtype == jnp.float32 and (new_state is None) == (state is None)
    np.testing.assert_allclose(jnp.stack(outputs), batch, rtol=1e-5, atol=1e-5)


@names
def test_a_wrong_length_fails_at_trace_time_naming_the_argument_and_size(name, getkey):
    model, state = build(name, getkey())
    with pytest.raises(TypeCheckError) as info:
        call_one(model, state, jnp.ones(39))
    message = message_and_notes(info.value)
    size = MODELS[name][2]
    assert "parameter 'x'" in message and "f32[39]" in message
    assert f"'{{{size}}}'" in message and f"{size} = 40" in message  # the expected dimension and its size
    with pytest.raises(TypeCheckError):
        call_one(model, state, jnp.ones((5, 40)))  # a batch passed as one example


@names
def test_a_wrong_dtype_fails_at_trace_time(name, getkey):
    model, state = build(name, getkey())
    with pytest.raises(TypeCheckError) as info:
        call_one(model, state, jnp.ones(40, jnp.int32))
    assert "parameter 'x'" in str(info.value) and "i32[40]" in str(info.value)


@names
def test_gradients_are_finite_and_have_the_model_structure(name, getkey):
    model, state = build(name, getkey())
    inputs, labels = jax.random.normal(getkey(), (6, 40)), jnp.arange(6) % 10
    key = getkey()

    def loss(model):
        logits, _ = forward(model, state, inputs, key=key)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(6), labels])

    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    assert jax.tree.structure(grads) == jax.tree.structure(eqx.filter(model, eqx.is_inexact_array))
    leaves = jax.tree.leaves(grads)
    assert sum(g.size for g in leaves) == num_params(model)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert sum(float(jnp.sum(g**2)) for g in leaves) > 0


def test_registry_knows_every_model_and_lists_the_names_on_a_typo(getkey):
    assert set(MODELS) <= set(model_names())
    with pytest.raises(ValueError) as info:
        build_model("cnnn", key=getkey())
    assert all(name in str(info.value) for name in MODELS)


def test_parameter_counts(getkey):
    counts = {name: num_params(build(name, getkey())[0]) for name in MODELS}
    # The CNN is MNIST-1D's ConvBase: 25*1*5+25 + 2*(25*25*3+25) + 125*10+10; logistic 40*10+10;
    # the MLP 40-100-100-10; the GRU 3*16*(1+16+1) + 16 + 16*10+10 (like torch's GRU, a separate bias
    # inside the reset gate's product).
    derived = {"logistic": 410, "mlp": 15_210, "cnn": 5_210, "gru": 1_050}
    assert {name: counts[name] for name in derived} == derived
    # Regression pins, not counts by hand: the small ResNet1d's and transformer's parameters as they were when they
    # were written, so that an accidental change of either architecture is noticed (a deliberate one updates them).
    pinned = {"resnet": 2_002, "transformer": 4_762}
    assert {name: counts[name] for name in pinned} == pinned, (
        "a parameter count changed: was the architecture's change meant?"
    )
    assert set(counts) == set(derived) | set(pinned)  # a new model gets its count here too


def test_cnn_equals_the_torch_reference_convbase(getkey):
    model = CNN1d(key=getkey())
    convs = [
        torch.nn.Conv1d(1, 25, 5, stride=2, padding=1),
        torch.nn.Conv1d(25, 25, 3, stride=2, padding=1),
        torch.nn.Conv1d(25, 25, 3, stride=2, padding=1),
    ]
    linear = torch.nn.Linear(125, 10)
    with torch.no_grad():
        for ours, theirs in zip(model.convs, convs, strict=True):
            theirs.weight.copy_(torch.from_numpy(np.array(ours.weight)))
            theirs.bias.copy_(torch.from_numpy(np.array(ours.bias)[:, 0]))
        linear.weight.copy_(torch.from_numpy(np.array(model.head.weight)))
        linear.bias.copy_(torch.from_numpy(np.array(model.head.bias)))
        x = np.array(jax.random.normal(getkey(), (4, 40)))
        h = torch.from_numpy(x).view(-1, 1, 40)
        for conv in convs:
            h = conv(h).relu()
        expected = linear(h.view(4, -1)).numpy()
    np.testing.assert_allclose(jax.vmap(model)(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("channels", "out", "kernel", "stride", "padding", "length"),
    [(1, 25, 5, 2, 1, 40), (25, 25, 3, 2, 1, 19), (3, 4, 3, 1, 0, 10), (2, 3, 4, 3, 2, 11)],
)
def test_conv1d_as_matmul_equals_eqx_conv1d_and_its_gradient(getkey, channels, out, kernel, stride, padding, length):
    conv = eqx.nn.Conv1d(channels, out, kernel, stride=stride, padding=padding, key=getkey())
    x = jax.random.normal(getkey(), (channels, length))
    np.testing.assert_allclose(conv1d_as_matmul(conv, x), conv(x), rtol=1e-5, atol=1e-5)
    # compiled: op by op, under the test session's type checks, each gradient took seconds
    ours = eqx.filter_jit(jax.grad(lambda c, x: jnp.sum(jnp.sin(conv1d_as_matmul(c, x))), argnums=(0, 1)))(conv, x)
    reference = eqx.filter_jit(jax.grad(lambda c, x: jnp.sum(jnp.sin(c(x))), argnums=(0, 1)))(conv, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_conv1d_as_matmul_refuses_what_it_does_not_compute(getkey):
    conv = eqx.nn.Conv1d(2, 3, 3, dilation=2, key=getkey())
    with pytest.raises(ValueError, match="dilation"):
        conv1d_as_matmul(conv, jnp.zeros((2, 10)))


def test_cnn_initialisation_has_torch_bounds(getkey):
    model = CNN1d(key=getkey())
    for layer, fan_in in zip([*model.convs, model.head], [5, 75, 75, 125], strict=True):
        bound = 1 / np.sqrt(fan_in)
        assert float(jnp.max(jnp.abs(layer.weight))) <= bound
        assert float(jnp.max(jnp.abs(layer.weight))) > 0.9 * bound  # uniform over the whole interval


def test_constructor_arguments_that_cannot_fit_the_signal_are_refused(getkey):
    with pytest.raises(ValueError, match="longer signal"):
        CNN1d(length=2, key=getkey())
    with pytest.raises(ValueError, match="chunk 3 must divide the signal length 40"):
        GRUClassifier(chunk=3, key=getkey())
    with pytest.raises(ValueError, match="patch 3 must divide"):
        TransformerClassifier(patch=3, key=getkey())
    with pytest.raises(ValueError, match="heads 3 must divide dim 32"):
        TransformerClassifier(heads=3, key=getkey())


def test_gru_readouts_and_directions_size_the_head(getkey):
    reference = GRUClassifier(hidden_size=6, bidirectional=True, readout="all", key=getkey())
    assert reference.head.in_features == 2 * 6 * 40 and reference.bidirectional
    chunked = GRUClassifier(hidden_size=8, chunk=4, key=getkey())
    assert chunked.head.in_features == 8 and chunked.cells[0].input_size == 4
    for model in (reference, chunked):
        assert call_one(model, None, jnp.ones(40)).shape == (10,)


def test_resnet_batch_statistics_update_the_state_and_inference_uses_them(getkey):
    model, state = build("resnet", getkey())
    inputs = jax.random.normal(getkey(), (16, 40)) * 3 + 1
    logits, trained = forward(model, state, inputs, key=None)
    before = jax.tree.leaves(state)
    after = jax.tree.leaves(trained)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    counter = trained.get(model.stem_norm.batch_counter)
    assert int(counter) == 1

    # Training mode: an example's output depends on the rest of its batch.
    other = inputs.at[1:].set(jax.random.normal(getkey(), (15, 40)))
    assert not np.allclose(forward(model, trained, other, key=None)[0][0], logits[0], atol=1e-4)
    # Inference mode: running statistics; the same example gives the same output in any batch,
    # and the state is left as it was.
    frozen = eqx.nn.inference_mode(model)
    a, state_a = forward(frozen, trained, inputs, key=None)
    b, _ = forward(frozen, trained, other, key=None)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a[0], call_one(frozen, trained, inputs[0]), rtol=1e-5, atol=1e-6)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state_a), after, strict=True))


def test_resnet_reduces_batch_statistics_over_several_named_axes(getkey):
    key = getkey()
    model, state = build_model("resnet", widths=(4,), axis_name=("devices", "batch"), key=key)
    inputs = jax.random.normal(getkey(), (2, 3, 40))
    per_device = jax.vmap(lambda x, s: model(x, s), in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    logits, _ = jax.jit(jax.vmap(per_device, in_axes=(0, None), out_axes=(0, None), axis_name="devices"))(inputs, state)
    # Statistics over all 6 examples: the same as one vmap over a flat batch with a single-name model.
    flat_model, flat_state = build_model("resnet", widths=(4,), key=key)  # the same parameters
    flat, _ = forward(flat_model, flat_state, inputs.reshape(6, 40), key=None)
    np.testing.assert_allclose(logits.reshape(6, 10), flat, rtol=1e-5, atol=1e-5)


def test_transformer_dropout_follows_the_key_in_training_and_is_off_in_inference(getkey):
    init_key = getkey()
    model = TransformerClassifier(dim=16, heads=2, mlp_dim=32, dropout=0.1, key=init_key)
    x = jax.random.normal(getkey(), (40,))
    k1, k2 = getkey(), getkey()
    apply = eqx.filter_jit(lambda model, x, key: model(x, key=key))
    assert np.array_equal(apply(model, x, k1), apply(model, x, k1))
    assert not np.allclose(apply(model, x, k1), apply(model, x, k2))
    frozen = eqx.nn.inference_mode(model)
    np.testing.assert_array_equal(apply(frozen, x, k1), apply(frozen, x, k2))
    np.testing.assert_array_equal(apply(frozen, x, k1), apply(frozen, x, None))
    no_dropout = TransformerClassifier(dim=16, heads=2, mlp_dim=32, dropout=0.0, key=init_key)  # same weights
    np.testing.assert_allclose(apply(frozen, x, None), apply(no_dropout, x, k1), rtol=1e-5, atol=1e-6)
