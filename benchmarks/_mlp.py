"""Case (b): a compute-bound MLP (784-1024-1024-10, ReLU, batch 512, Adam), as GFLOP/s and as a
fraction of the float32 matmul peak measured in the same run."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from research.data import Batch
from research.nn import MLP
from research.train import Step, SupervisedStep, TrainState, compiled_trainer

from ._frameworks import FLAX_MISSING, at_best_thread_count, have_flax
from ._timing import interleave, timed

SIZES, BATCH, LR = (784, 1024, 1024, 10), 512, 1e-3
PEAK = "float32 matmul (peak)"


def train_flops() -> float:
    """Matmul FLOPs of one step: forward (2BMN a layer), weight gradients (2BMN a layer) and input
    gradients (2BMN a layer but the first, whose input needs no gradient). Elementwise work is ignored."""
    layers = [2 * BATCH * m * n for m, n in zip(SIZES[:-1], SIZES[1:], strict=True)]
    return 3 * sum(layers) - layers[0]


def matmul_candidate(size: int):
    """A large jitted float32 matmul, timed alongside the candidates (same load): its FLOP rate is the peak."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    return lambda: timed(lambda: matmul(a, b).block_until_ready())


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], BATCH).astype(np.int32)


def ours_step(steps):
    x, y = _data()
    model = MLP(SIZES[0], SIZES[-1], hidden=SIZES[1:-1], activation="relu", key=jax.random.key(0))
    state = TrainState.create(model, optax.adam(LR), key=jax.random.key(1))
    trainer = compiled_trainer(SupervisedStep(), state)
    batch = Batch(jnp.asarray(x), jnp.asarray(y))
    leaves = trainer.leaves(state)
    carry = [leaves, trainer.init_stats(leaves, batch)]

    def run():
        leaves, sums = carry
        for _ in range(steps):
            leaves, sums = trainer.step(leaves, sums, batch)
        jax.block_until_ready(leaves)
        carry[:] = leaves, sums

    return run


def ours_run(steps):
    """`steps` steps in one compiled call (fori_loop over index rows of device-resident data)."""
    x, y = _data()
    model = MLP(SIZES[0], SIZES[-1], hidden=SIZES[1:-1], activation="relu", key=jax.random.key(0))
    state = TrainState.create(model, optax.adam(LR), key=jax.random.key(1))
    return compiled_run(SupervisedStep(), state, Batch(jnp.asarray(x), jnp.asarray(y)), steps)


def compiled_run(step: Step, state: TrainState, data: Batch, steps: int):
    """A call of `steps` training steps of `state` in one compiled call (the engine's `trainer.run`, a
    fori_loop over index rows), every step on the whole of `data`; each call continues the last one."""
    trainer = compiled_trainer(step, state)
    indices = np.tile(np.arange(len(data.labels), dtype=np.int32), (steps, 1))
    leaves = trainer.leaves(state)
    carry = [leaves, trainer.init_stats(leaves, data)]

    def run():
        leaves, sums = trainer.run(*carry, data, indices, steps)
        jax.block_until_ready(leaves)
        carry[:] = leaves, sums

    return run


def init_params(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    params = {}
    for i, (k, m, n) in enumerate(zip(keys, SIZES[:-1], SIZES[1:], strict=True)):
        kw, kb = jax.random.split(k)
        params[f"w{i}"] = jax.random.uniform(kw, (m, n), minval=-(m**-0.5), maxval=m**-0.5)
        params[f"b{i}"] = jax.random.uniform(kb, (n,), minval=-(m**-0.5), maxval=m**-0.5)
    return params


def pure_loss(params, x, y):
    n = len(SIZES) - 1
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


_optim = optax.adam(LR)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def pure_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(pure_loss)(params, x, y)
    updates, opt_state = _optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def pure_jax_step(steps):
    x, y = map(jnp.asarray, _data())
    params = init_params(jax.random.key(0))
    carry = [params, _optim.init(params)]

    def run():
        params, opt_state = carry
        for _ in range(steps):
            params, opt_state, loss = pure_step(params, opt_state, x, y)
        jax.block_until_ready(params)
        carry[:] = params, opt_state

    return run


def eqx_step(steps):
    x, y = map(jnp.asarray, _data())
    model = MLP(SIZES[0], SIZES[-1], hidden=SIZES[1:-1], activation="relu", key=jax.random.key(0))

    @eqx.filter_jit
    def make_step(model, opt_state, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = _optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    carry = [model, _optim.init(eqx.filter(model, eqx.is_array))]

    def run():
        model, opt_state = carry
        for _ in range(steps):
            model, opt_state, loss = make_step(model, opt_state, x, y)
        jax.block_until_ready(model)
        carry[:] = model, opt_state

    return run


def linen_step(steps):
    import flax.linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in SIZES[1:-1]:
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(SIZES[-1])(x)

    x, y = map(jnp.asarray, _data())
    model = Net()
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=_optim)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        def loss_fn(params):
            return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn(params, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    carry = [state]

    def run():
        state = carry[0]
        for _ in range(steps):
            state, loss = train_step(state, x, y)
        jax.block_until_ready(state)
        carry[0] = state

    return run


def nnx_step(steps):
    from flax import nnx

    rngs = nnx.Rngs(0)
    layers = []
    for m, n in zip(SIZES[:-2], SIZES[1:-1], strict=True):
        layers += [nnx.Linear(m, n, rngs=rngs), nnx.relu]
    model = nnx.Sequential(*layers, nnx.Linear(SIZES[-2], SIZES[-1], rngs=rngs))
    optimizer = nnx.Optimizer(model, _optim, wrt=nnx.Param)
    x, y = map(jnp.asarray, _data())

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(
            model
        )
        optimizer.update(model, grads)
        return loss

    def run():
        for _ in range(steps):
            loss = train_step(model, optimizer, x, y)
        jax.block_until_ready(loss)

    return run


def torch_step(steps):
    torch.manual_seed(0)
    layers = []
    for m, n in zip(SIZES[:-2], SIZES[1:-1], strict=True):
        layers += [torch.nn.Linear(m, n), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(SIZES[-2], SIZES[-1]))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    x, y = (torch.from_numpy(a) for a in _data())
    y = y.long()

    def run():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    return run


def run(quick: bool) -> dict:
    steps, repeats = (1, 2) if quick else (5, 9)
    flax = have_flax()
    makers = {
        "ours: CompiledTrainer.step": ours_step,
        f"ours: run ({steps} steps a call)": ours_run,
        "pure JAX (jit, donated)": pure_jax_step,
        "eqx.filter_jit": eqx_step,
        "flax linen TrainState": linen_step,
        "flax nnx.jit": nnx_step,
        "PyTorch eager (fused Adam)": torch_step,
    }
    notes, candidates = {}, {}
    for name, make in makers.items():
        if name.startswith("flax") and not flax:
            notes[name] = FLAX_MISSING
            continue
        fn = make(steps)
        fn()
        if name.startswith("PyTorch"):
            name, fn = at_best_thread_count(name, fn)
        candidates[name] = functools.partial(timed, fn, steps)
    size = 512 if quick else 2048
    candidates[PEAK] = matmul_candidate(size)
    timings = interleave(candidates, repeats)
    peaks = [2 * size**3 / s / 1e9 for s in timings.pop(PEAK).seconds]
    peak = float(np.median(peaks))
    flops = train_flops()
    for timing in timings.values():
        timing.extra["gflops"] = flops / timing.median / 1e9
        timing.extra["fraction_of_peak"] = timing.extra["gflops"] / peak
    return {
        "step": list(timings.values()),
        "peak_gflops": peak,
        "peak_spread": (min(peaks), max(peaks)),
        "peak_size": size,
        "flops": flops,
        "notes": notes,
    }
