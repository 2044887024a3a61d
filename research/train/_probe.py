"""How good a frozen encoder's features are for a labelled task: a linear probe (multinomial logistic regression
on the training split's features, its accuracy on the test split's) and a k-nearest-neighbour classifier beside
it, as self-supervised learning is judged (SimCLR's linear evaluation; the weighted k-NN of Wu et al. 2018)."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data import DeviceLoader, HostLoader
from ..typing import Array, Float, Int, typecheck
from ._evaluate import Evaluator, evaluate_batches, model_evaluator

# features(model, model_state, inputs) -> one feature vector an input: the frozen encoder (in inference mode)
FeaturesFn = Callable[[Any, Any, Any], Float[Array, "batch features"]]


class _Encoded(eqx.Module):
    """One evaluation batch's `(features, labels, mask)`. (A module, not a closure: evaluations with the same
    `features` share their compiled program.)"""

    features: FeaturesFn = eqx.field(static=True)

    def __call__(self, model: Any, model_state: Any, batch: Any, mask: Array, key: Any) -> tuple[Array, Array, Array]:
        return self.features(model, model_state, batch.inputs), batch.labels, mask


@eqx.filter_jit
def _encode(per_batch: _Encoded, *args: Any) -> tuple[Array, Array, Array]:
    return per_batch(*args)


def encoded(
    features: FeaturesFn, model: Any, model_state: Any, data: DeviceLoader | HostLoader
) -> tuple[np.ndarray, np.ndarray]:
    """`(features, labels)` of every example of `data` (labelled batches), in order, on the host: `features`
    of the model in inference mode, compiled once per `features` and model structure."""
    per_batch = functools.partial(_encode, _Encoded(features))
    results, _ = evaluate_batches(per_batch, eqx.nn.inference_mode(model), model_state, data)
    rows = np.concatenate([mask for _, _, mask in results]) > 0
    return np.concatenate([f for f, _, _ in results])[rows], np.concatenate([y for _, y, _ in results])[rows]


@eqx.filter_jit
@typecheck
def linear_probe_accuracy(
    train_features: Float[Array, "train features"],
    train_labels: Int[Array, " train"],
    test_features: Float[Array, "test features"],
    test_labels: Int[Array, " test"],
    *,
    classes: int,
    steps: int = 300,
    weight_decay: float = 1e-4,
) -> Float[Array, ""]:
    """The test accuracy of a multinomial logistic regression fitted to the training features (each feature
    standardised by the training set's mean and standard deviation) by `steps` iterations of L-BFGS on the
    mean cross-entropy plus `weight_decay / 2` times the squared weights: deterministic, no learning rate."""
    mean = jnp.mean(train_features, axis=0, keepdims=True)
    scale = jax.lax.rsqrt(jnp.var(train_features, axis=0, keepdims=True) + 1e-6)
    x_train, x_test = (train_features - mean) * scale, (test_features - mean) * scale

    def objective(params: tuple[Array, Array]) -> Array:
        weights, bias = params
        logits = x_train @ weights + bias[None]
        cross_entropy = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, train_labels))
        return cross_entropy + 0.5 * weight_decay * jnp.sum(weights**2)

    solver = optax.lbfgs()
    params = (jnp.zeros((x_train.shape[1], classes)), jnp.zeros(classes))
    value_and_grad = optax.value_and_grad_from_state(objective)

    def iterate(_: Array, carry: tuple) -> tuple:
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = solver.update(grad, state, params, value=value, grad=grad, value_fn=objective)
        return optax.apply_updates(params, updates), state

    (weights, bias), _ = jax.lax.fori_loop(0, steps, iterate, (params, solver.init(params)))
    return jnp.mean((jnp.argmax(x_test @ weights + bias[None], axis=1) == test_labels).astype(jnp.float32))


@eqx.filter_jit
@typecheck
def knn_accuracy(
    train_features: Float[Array, "train features"],
    train_labels: Int[Array, " train"],
    test_features: Float[Array, "test features"],
    test_labels: Int[Array, " test"],
    *,
    classes: int,
    k: int = 20,
    temperature: float = 0.07,
) -> Float[Array, ""]:
    """The test accuracy of a weighted k-nearest-neighbour vote in cosine similarity (Wu et al. 2018): each
    test example's `k` most similar training examples vote for their class with weight
    `exp(similarity / temperature)`."""

    def unit(x: Array) -> Array:
        return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=1, keepdims=True), 1e-12))

    similarity, nearest = jax.lax.top_k(unit(test_features) @ unit(train_features).T, min(k, train_labels.shape[0]))
    votes = jnp.exp(similarity / temperature)[:, :, None] * jax.nn.one_hot(train_labels[nearest], classes)
    return jnp.mean((jnp.argmax(jnp.sum(votes, axis=1), axis=1) == test_labels).astype(jnp.float32))


def probe_evaluator(
    features: FeaturesFn, train_data: DeviceLoader | HostLoader, *, classes: int, k: int = 20
) -> Evaluator:
    """An evaluator of train states (`model_evaluator`) whose metrics are `probe_accuracy`
    (`linear_probe_accuracy` fitted on the features of every example of `train_data`, measured on those of
    the evaluation data) and `knn_accuracy` (`knn_accuracy` with `k` neighbours among the same training
    features). `features(model, model_state, inputs)`: the frozen
    encoder's features of a batch of inputs; `train_data` and the evaluation data are labelled batches."""

    def evaluate_model(model: Any, model_state: Any, data: DeviceLoader | HostLoader, *, progress: bool = False):
        train = encoded(features, model, model_state, train_data)
        test = encoded(features, model, model_state, data)
        arrays = [jnp.asarray(a) for a in (*train, *test)]
        return {
            "probe_accuracy": float(linear_probe_accuracy(*arrays, classes=classes)),
            "knn_accuracy": float(knn_accuracy(*arrays, classes=classes, k=k)),
        }

    return model_evaluator(evaluate_model)
