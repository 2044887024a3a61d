"""Per-example gradient norms without per-example gradients ("ghost clipping").

For a linear map applied to the rows of one example, `Y = X W^T (+ b)` with `X` [positions, in],
the example's weight gradient is `G^T X` (`G = dloss/dY`, [positions, out]), so its squared norm is
`||G^T X||^2 = sum_{t,t'} (x_t . x_t') (g_t . g_t')`: for one position `|x|^2 |g|^2` (Goodfellow
2015), for several (a convolution's output positions) the "ghost norm" of Li et al. 2022 from two
small Gram matrices, or `G^T X` itself when that is small (Bu et al. 2022, mixed ghost
clipping). The bias gradient is `sum_t g_t`.

`X` and `G` come from the forward pass and one backward pass that stops at the layer outputs:
every covered layer passes its rows through `research.nn.observed_linear_map`, where the observer
keeps `X` and adds a zero perturbation `Z` to `Y`; the gradient with respect to `Z` is `G`, for every
example at once under `vmap`, and no weight gradient is formed. The clipped sum
`sum_i w_i c_i grad_i` (`c_i = min(1, C / |g_i|)`) then follows from the same `X` and `G`, layer by
layer: `(s * G)^T X` over the batch with `s = w c`, the weight gradient a backward pass would form,
weighted (Bu et al. 2022, "book-keeping"). Ghost clipping as in Li et al. 2022 and Opacus pulls a
second backward pass through the whole model for it; this costs one forward pass, one backward pass
and the norms, with the memory of ordinary training.

Covered: `eqx.nn.Linear` (called on one vector per example) and `eqx.nn.Conv1d` computed by
`research.nn.conv1d_as_matmul`; so MLP, Logistic, LinearSigmoid and CNN1d. A model is covered when
every floating-point array in it belongs to such a layer and every such layer is seen by the observer,
on the example's own activations (not inside an inner `vmap`/`scan`); `ghost_problem` says why
not, and `method="auto"` then takes the vmap path. Contract of a covered layer: its parameters enter
the loss only through its call (no weight tying, no direct use of `layer.weight`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import observed_linear_map, observing_linear_maps
from ..typing import Array, Float, PRNGKeyArray, PyTree

_COVERED = (eqx.nn.Linear, eqx.nn.Conv1d)


class _NotCovered(Exception):
    pass


class _ObservedLinear(eqx.Module):
    """An `eqx.nn.Linear` that passes its input and output (as one row each) through the observer."""

    linear: eqx.nn.Linear

    @property
    def in_features(self):
        return self.linear.in_features

    @property
    def out_features(self):
        return self.linear.out_features

    @property
    def weight(self):
        return self.linear.weight

    @property
    def bias(self):
        return self.linear.bias

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        y = self.linear(x)
        return observed_linear_map(self.linear, jnp.reshape(x, (1, -1)), jnp.reshape(y, (1, -1))).reshape(y.shape)


def _is_covered_layer(node: object) -> bool:
    return isinstance(node, _COVERED)


@dataclasses.dataclass(frozen=True)
class GhostPlan:
    """How one model's per-example norms are taken (found at trace time by `ghost_plan`): whether
    each covered layer has a bias, and the layer index, output-row shape and dtype of each observed
    call, in call order (a layer called twice contributes the rows of both calls)."""

    has_bias: tuple[bool, ...]
    calls: tuple[tuple[int, tuple[int, ...], Any], ...]

    def _rows(self, index: int, inputs: list[Array], output_grads: list[Array], axis: int) -> tuple[Array, Array]:
        """Layer `index`'s input rows and output-row gradients over all its calls, joined along the
        positions `axis` (0 for one example, 1 with a leading batch axis)."""
        calls = [k for k, (layer, _, _) in enumerate(self.calls) if layer == index]
        return (
            jnp.concatenate([inputs[k] for k in calls], axis=axis),
            jnp.concatenate([output_grads[k] for k in calls], axis=axis),
        )

    def squared_norm(self, inputs: list[Array], output_grads: list[Array]) -> Float[Array, ""]:
        """One example's squared gradient norm from each call's input rows and output-row gradients."""
        total = jnp.zeros(())
        for index, has_bias in enumerate(self.has_bias):
            x, g = self._rows(index, inputs, output_grads, axis=0)  # [positions, in], [positions, out]
            total = total + _weight_gradient_square(x, g)
            if has_bias:
                total = total + jnp.sum(jnp.square(jnp.sum(g, axis=0)))
        return total

    def weighted_gradients(
        self, params: PyTree, inputs: list[Array], output_grads: list[Array], scales: Float[Array, " batch"]
    ) -> PyTree:
        """`sum_i scales_i grad_i` as a tree like `params`, from every example's input rows and
        output-row gradients: for each layer `(s * G)^T X` over the batch and its positions (the
        weight gradient a backward pass would form), and `sum s * G` for its bias."""
        layers = _covered_layers(params)
        weights, biases = [], []
        for index, (layer, has_bias) in enumerate(zip(layers, self.has_bias, strict=True)):
            x, g = self._rows(index, inputs, output_grads, axis=1)  # [batch, positions, in], [batch, positions, out]
            g = g * scales[:, None, None].astype(g.dtype)
            x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # one matmul over batch and positions
            weight = g.T @ x
            weights.append(weight.reshape(layer.weight.shape).astype(layer.weight.dtype))
            if has_bias:
                assert layer.bias is not None  # the plan's has_bias was read off these layers
                biases.append(jnp.sum(g, axis=0).reshape(layer.bias.shape).astype(layer.bias.dtype))

        def where(tree):
            covered = _covered_layers(tree)
            return [layer.weight for layer in covered] + [layer.bias for layer in covered if layer.bias is not None]

        return eqx.tree_at(where, params, weights + biases)


# A layer's per-example weight gradient of at most this many elements is formed directly (g^T x):
# XLA's CPU backend runs the small batched matmuls of the Gram matrices slower than that (CNN1d,
# batch 256: the norms took ~2.4 ms with Gram matrices for its 25-channel convolutions, ~1.8 ms
# direct; benchmarks/findings.md, case (e)), and memory is no concern at that size.
_DIRECT_MAX_ELEMENTS = 16384


def _weight_gradient_square(x: Float[Array, "positions a"], g: Float[Array, "positions b"]) -> Float[Array, ""]:
    """`||g^T x||_F^2`: products of norms for one position; for several, `g^T x` itself when it is
    small or cheaper (positions a b <= positions^2 (a + b)), else from the Gram matrices `x x^T` and
    `g g^T` (Li et al.'s ghost norm: positions^2 memory instead of a b)."""
    positions, a = x.shape
    b = g.shape[1]
    if positions == 1:
        return jnp.sum(jnp.square(x)) * jnp.sum(jnp.square(g))
    if a * b <= _DIRECT_MAX_ELEMENTS or a * b <= positions * (a + b):
        return jnp.sum(jnp.square(g.T @ x))
    return jnp.sum((x @ x.T) * (g @ g.T))


def _covered_layers(model: eqx.Module) -> list[eqx.nn.Linear | eqx.nn.Conv1d]:
    return [node for node in jax.tree.leaves(model, is_leaf=_is_covered_layer) if _is_covered_layer(node)]


def _parameter_problem(model: eqx.Module) -> str | None:
    layers = _covered_layers(model)
    owned = {id(leaf) for layer in layers for leaf in (layer.weight, layer.bias) if leaf is not None}
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    if not params:
        return "the model has no floating-point parameters"
    if len({id(layer.weight) for layer in layers}) != len(layers):
        return "two layers share one weight array"
    outside = [
        path
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_inexact_array))
        if id(leaf) not in owned
    ]
    if outside:
        return (
            f"{len(outside)} parameter array(s) outside eqx.nn.Linear / eqx.nn.Conv1d layers "
            f"(first: model{jax.tree_util.keystr(outside[0])})"
        )
    return None


def _observe_linear(model: eqx.Module) -> eqx.Module:
    is_linear = lambda node: isinstance(node, eqx.nn.Linear)  # noqa: E731
    return jax.tree.map(lambda node: _ObservedLinear(node) if is_linear(node) else node, model, is_leaf=is_linear)


def _observer(observed: eqx.Module, on_call: Callable) -> Callable:
    """An observer for `research.nn.observing_linear_maps` that recognises `observed`'s covered
    layers by their weight arrays (by identity, within the trace that calls it) and hands
    `on_call(layer index, input rows, output rows)` the rest."""
    weights = [layer.weight for layer in _covered_layers(observed)]

    def observe(layer, inputs, outputs):
        weight = getattr(layer, "weight", None)
        index = next((i for i, w in enumerate(weights) if w is weight), None)
        if index is None:
            raise _NotCovered(f"a linear map of a {type(layer).__name__} that is not one of the model's own layers")
        return on_call(index, inputs, outputs)

    return observe


def _observed_loss(plan: GhostPlan, loss_fn: Callable, observed: eqx.Module, model_state, example, perturbations):
    """`loss_fn` on one example with the output rows of observed call k shifted by `perturbations[k]`;
    aux: the metrics and every call's input rows."""
    rows = []

    def on_call(index, inputs, outputs):
        k = len(rows)
        if k >= len(plan.calls) or plan.calls[k][0] != index:
            raise _NotCovered("the model calls its layers in another order on another trace")
        rows.append(inputs)
        return outputs + perturbations[k]

    inputs, label, key = example
    with observing_linear_maps(_observer(observed, on_call)):
        loss, metrics = loss_fn(observed, model_state, inputs, label, key)
    if len(rows) != len(plan.calls):
        raise _NotCovered("the model calls its layers a different number of times on another trace")
    return loss, (metrics, rows)


def ghost_plan(
    model: eqx.Module, model_state: eqx.nn.State | None, loss_fn: Callable, example: tuple
) -> GhostPlan | str:
    """The plan for `model` (traced on one `example` = `(inputs, label, key)`), or why ghost norms
    cannot be taken for it (a string). Tracing only: nothing runs."""
    problem = _parameter_problem(model)
    if problem:
        return problem
    layers = _covered_layers(model)
    observed = _observe_linear(model)
    calls = []

    def record(index, inputs, outputs):
        calls.append((index, outputs.shape, outputs.dtype))
        return outputs

    def forward(example):
        inputs, label, key = example
        with observing_linear_maps(_observer(observed, record)):
            return loss_fn(observed, model_state, inputs, label, key)

    try:
        jax.eval_shape(forward, example)
        unseen = sorted(set(range(len(layers))) - {index for index, _, _ in calls})
        if unseen:
            return (
                f"{len(unseen)} layer(s) never pass through research.nn.observed_linear_map (first: a "
                f"{type(layers[unseen[0]]).__name__}; an eqx.nn.Conv1d must be computed by conv1d_as_matmul)"
            )
        plan = GhostPlan(tuple(layer.bias is not None for layer in layers), tuple(calls))
        jax.eval_shape(ghost_norm_of_one(plan, loss_fn, model, model_state), example)  # an inner vmap/scan leaks
    except _NotCovered as error:
        return str(error)
    except jax.errors.UnexpectedTracerError:
        return "a covered layer is called inside an inner transformation (vmap, scan, ...) of the model"
    return plan


def ghost_norm_of_one(plan: GhostPlan, loss_fn: Callable, model: eqx.Module, model_state: eqx.nn.State | None):
    """example -> (its gradient norm, its metrics): a forward pass and a backward pass to the layer
    outputs only (no weight gradient)."""
    observed = _observe_linear(model)

    def one(example):
        zeros = [jnp.zeros(shape, dtype) for _, shape, dtype in plan.calls]
        loss_of = lambda z: _observed_loss(plan, loss_fn, observed, model_state, example, z)  # noqa: E731
        (loss, (metrics, inputs)), output_grads = jax.value_and_grad(loss_of, has_aux=True)(zeros)
        return jnp.sqrt(plan.squared_norm(inputs, output_grads)), {**metrics, "loss": loss}

    return one


def ghost_clipped_sum(
    plan: GhostPlan,
    loss_fn: Callable,
    model: eqx.Module,
    model_state: eqx.nn.State | None,
    examples: tuple,
    scale_of: Callable[[Float[Array, " batch"]], Float[Array, " batch"]],
) -> tuple[PyTree, Float[Array, " batch"], dict[str, Array]]:
    """`(sum_i s_i grad_i, norms, metrics)` with `s = scale_of(norms)` (weights times clip factors),
    from one forward pass and one backward pass of the batch to the layer outputs (cotangent 1 for
    every example; the weight gradients it would form are dead code XLA drops). The layer inputs and
    output gradients give the norms, then the weighted clipped sum directly, layer by layer (Bu et
    al. 2022's book-keeping: no second backward pass)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    batch_size = jax.tree.leaves(examples)[0].shape[0]

    def losses(params, perturbations):
        observed = _observe_linear(eqx.combine(params, static))
        one = lambda example, z: _observed_loss(plan, loss_fn, observed, model_state, example, z)  # noqa: E731
        return eqx.filter_vmap(one, axis_name="batch")(examples, perturbations)

    zeros = [jnp.zeros((batch_size, *shape), dtype) for _, shape, dtype in plan.calls]
    values, pullback, (metrics, inputs) = jax.vjp(losses, params, zeros, has_aux=True)
    _, output_grads = pullback(jnp.ones_like(values))  # each example's perturbation reaches only its own loss
    norms = jnp.sqrt(jax.vmap(plan.squared_norm)(inputs, output_grads))
    scales = jax.lax.stop_gradient(scale_of(norms))
    return plan.weighted_gradients(params, inputs, output_grads, scales), norms, {**metrics, "loss": values}
