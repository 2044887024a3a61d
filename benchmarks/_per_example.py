"""Case (d): per-example gradients of the MNIST-1D CNN for a batch of 100 (every example's full
gradient materialised), ours vs `torch.func.vmap(torch.func.grad(...))` vs a per-example loop.

Memory bound: the result holds batch x parameters floats (100 x 5,210 x 4 B = 2.1 MB here); the
vmapped backward pass also keeps each example's activations, so peak memory grows linearly with the
batch. For a large model, compute them in chunks of the batch (or only their norms)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import torch

from ._cnn import CNN1d, data, torch_model
from ._frameworks import at_best_thread_count
from ._timing import interleave, timed

BATCH = 100

try:  # issue 4's library function, once it is on this branch
    from research.per_example import per_example_grads as _library_per_example_grads
except ImportError:
    _library_per_example_grads = None


def _loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x)[None], y[None])[0]


def ours(calls):
    """Partition once, then `jax.jit` over the parameter leaves of `vmap(grad(loss))`."""
    train, _ = data()
    model = CNN1d(key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])

    @jax.jit
    def grads(params, x, y):
        per_example = jax.vmap(jax.grad(lambda p, x, y: _loss(eqx.combine(p, static), x, y)), in_axes=(None, 0, 0))
        return per_example(params, x, y)

    def run():
        for _ in range(calls):
            out = grads(params, x, y)
        jax.block_until_ready(out)

    return run


def ours_filter(calls):
    """The Equinox idiom, `eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(loss)))`."""
    train, _ = data()
    model = CNN1d(key=jax.random.key(0))
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])
    grads = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(_loss), in_axes=(None, 0, 0)))

    def run():
        for _ in range(calls):
            out = grads(model, x, y)
        jax.block_until_ready(out)

    return run


def _torch_setup():
    train, _ = data()
    model = torch_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.from_numpy(train.inputs[:BATCH])[:, None, :]
    y = torch.from_numpy(train.labels[:BATCH]).long()
    return model, params, x, y


def torch_func(calls):
    model, params, x, y = _torch_setup()

    def loss(params, x, y):
        logits = torch.func.functional_call(model, params, (x[None],))
        return torch.nn.functional.cross_entropy(logits, y[None])

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))

    def run():
        for _ in range(calls):
            grads(params, x, y)

    return run


def torch_loop(calls):
    """One backward pass per example (what per-example gradients cost without vmap)."""
    model, _, x, y = _torch_setup()

    def run():
        for _ in range(calls):
            out = []
            for i in range(BATCH):
                model.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
                out.append([p.grad.clone() for p in model.parameters()])

    return run


def check_equal() -> float:
    """Largest absolute difference between our per-example gradients and torch.func's for the same weights."""
    model, params, x, y = _torch_setup()
    ours_model = CNN1d(key=jax.random.key(0))
    weights = [params[f"{i}.weight"].numpy() for i in (0, 2, 4)]
    biases = [params[f"{i}.bias"].numpy()[:, None] for i in (0, 2, 4)]
    ours_model = eqx.tree_at(
        lambda m: [c.weight for c in m.convs] + [c.bias for c in m.convs] + [m.head.weight, m.head.bias],
        ours_model,
        [
            *map(jnp.asarray, weights),
            *map(jnp.asarray, biases),
            jnp.asarray(params["7.weight"].numpy()),
            jnp.asarray(params["7.bias"].numpy()),
        ],
    )
    ours_grads = eqx.filter_vmap(eqx.filter_grad(_loss), in_axes=(None, 0, 0))(
        ours_model, jnp.asarray(x[:, 0].numpy()), jnp.asarray(y.numpy().astype("int32"))
    )

    def loss(params, x, y):
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (x[None],)), y[None])

    torch_grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return float(abs(ours_grads.head.weight - torch_grads["7.weight"].numpy()).max())


def run(quick: bool) -> dict:
    calls, repeats = (2, 2) if quick else (20, 9)
    makers = {
        "ours: jit(vmap(grad)) on partitioned params": ours,
        "eqx.filter_jit(filter_vmap(filter_grad))": ours_filter,
        "torch.func.vmap(grad)": torch_func,
        "PyTorch per-example loop": torch_loop,
    }
    candidates = {}
    for name, make in makers.items():
        n = max(calls // 10, 1) if "loop" in name else calls
        fn = make(n)
        fn()
        if "torch" in name.lower():
            name, fn = at_best_thread_count(name, fn)
        candidates[name] = functools.partial(timed, fn, n)
    timings = interleave(candidates, repeats)
    return {
        "calls": list(timings.values()),
        "max_abs_difference": check_equal(),
        "library": _library_per_example_grads is not None,
    }
