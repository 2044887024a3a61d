"""Case (a): the tutorial's XOR MLP (2-8-1 tanh, SGD 0.1, batch 128, 2,500 points), one step and
100 epochs, in every framework. The per-step numbers are dispatch overhead: the model is tiny."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from research.data import Batch, DeviceLoader, XORDataset, make_dataloader
from research.nn import MLP
from research.train import SupervisedStep, TrainState, compiled_trainer, fit
from research.train._keys import split_key_data

from ._frameworks import FLAX_MISSING, have_flax, torch_threads
from ._timing import interleave, timed

LR, BATCH, TRAIN_SIZE, TEST_SIZE, EPOCHS = 0.1, 128, 2500, 500, 100


def _data():
    train, test = XORDataset(TRAIN_SIZE, seed=42), XORDataset(TEST_SIZE, seed=123)
    return train, test


# -- one step, each framework ------------------------------------------------------------------
def ours_step(train, steps):
    model = MLP(2, 1, hidden=(8,), key=jax.random.key(0))
    state = TrainState.create(model, optax.sgd(LR), key=jax.random.key(1))
    trainer = compiled_trainer(SupervisedStep(), state)
    batch = Batch(jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH]))
    carry = [trainer.leaves(state), None]
    carry[1] = trainer.init_stats(carry[0], batch)

    def run():
        leaves, sums = carry
        for _ in range(steps):
            leaves, sums = trainer.step(leaves, sums, batch)
        jax.block_until_ready(leaves)
        carry[:] = leaves, sums

    return run


def init_params(key):
    """The MLP's initialisation (uniform +-1/sqrt(fan_in), as eqx.nn.Linear)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def u(k, shape, fan_in):
        return jax.random.uniform(k, shape, minval=-(fan_in**-0.5), maxval=fan_in**-0.5)

    return {"w1": u(k1, (2, 8), 2), "b1": u(k2, (8,), 2), "w2": u(k3, (8, 1), 8), "b2": u(k4, (1,), 8)}


def pure_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logit = (h @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, y.astype(jnp.float32)))


@functools.partial(jax.jit, donate_argnums=0)
def pure_step(params, x, y):
    loss, grads = jax.value_and_grad(pure_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def pure_jax_step(train, steps):
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])
    carry = [init_params(jax.random.key(0))]

    def run():
        params = carry[0]
        for _ in range(steps):
            params, loss = pure_step(params, x, y)
        jax.block_until_ready(params)
        carry[0] = params

    return run


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def same_work_step(params, sums, key, x, y):
    """The pure step plus what ours does besides: a key split (threefry unrolled, as ours), metric
    sums (loss, accuracy, grad norm, weight) and a step counter kept on the device; leaves unpacked."""
    key, _ = split_key_data(key)

    def loss_acc(params):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        logit = (h @ params["w2"] + params["b2"])[:, 0]
        loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logit, y.astype(jnp.float32)))
        return loss, jnp.mean((logit > 0) == (y == 1))

    (loss, accuracy), grads = jax.value_and_grad(loss_acc, has_aux=True)(params)
    sums = sums + jnp.stack([loss, accuracy, optax.tree.norm(grads), 1.0])
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), sums, key


def same_work(train, steps):
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])
    carry = [init_params(jax.random.key(0)), jnp.zeros(4), jax.random.key_data(jax.random.key(1))]

    def run():
        params, sums, key = carry
        for _ in range(steps):
            params, sums, key = same_work_step(params, sums, key, x, y)
        jax.block_until_ready(params)
        carry[:] = params, sums, key

    return run


def eqx_step(train, steps):
    """`eqx.filter_jit` as the Equinox docs write a train step."""
    model = MLP(2, 1, hidden=(8,), key=jax.random.key(0))
    optim = optax.sgd(LR)
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])

    def loss_fn(model, x, y):
        logit = jax.vmap(model)(x)[:, 0]
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, y.astype(jnp.float32)))

    @eqx.filter_jit
    def make_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    carry = [model, optim.init(eqx.filter(model, eqx.is_array))]

    def run():
        model, opt_state = carry
        for _ in range(steps):
            model, opt_state, loss = make_step(model, opt_state, x, y)
        jax.block_until_ready(model)
        carry[:] = model, opt_state

    return run


def linen_parts():
    import flax.linen as nn
    from flax.training import train_state

    class SimpleClassifier(nn.Module):  # the tutorial's model
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))

    model = SimpleClassifier()
    params = model.init(jax.random.key(0), jnp.ones((BATCH, 2)))

    def make_state():
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(LR))

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch[0])[:, 0]
            loss = optax.sigmoid_binary_cross_entropy(logits, batch[1].astype(jnp.float32)).mean()
            return loss, ((logits > 0) == batch[1]).mean()

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss, acc

    @jax.jit
    def eval_step(state, batch):
        logits = state.apply_fn(state.params, batch[0])[:, 0]
        return ((logits > 0) == batch[1]).mean()

    return make_state, train_step, eval_step


def linen_step(train, steps):
    make_state, train_step, _ = linen_parts()
    batch = (jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH]))
    carry = [make_state()]

    def run():
        state = carry[0]
        for _ in range(steps):
            state, loss, acc = train_step(state, batch)
        jax.block_until_ready(state)
        carry[0] = state

    return run


def nnx_step(train, steps):
    from flax import nnx

    model = nnx.Sequential(nnx.Linear(2, 8, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    x, y = jnp.asarray(train.inputs[:BATCH]), jnp.asarray(train.labels[:BATCH])

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.sigmoid_binary_cross_entropy(model(x)[:, 0], y.astype(jnp.float32)).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def run():
        for _ in range(steps):
            loss = train_step(model, optimizer, x, y)
        jax.block_until_ready(loss)

    return run


def torch_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def torch_step(train, steps):
    model = torch_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.from_numpy(train.inputs[:BATCH])
    y = torch.from_numpy(train.labels[:BATCH]).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def run():
        with torch_threads(1):
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x)[:, 0], y)
                loss.backward()
                optimizer.step()

    return run


# -- 100 epochs ---------------------------------------------------------------------------------
def ours_fit(train, test, epochs):
    """The recipe of experiments/xor.py: device loader, 100 steps per compiled call, eval at the end."""
    model = MLP(2, 1, hidden=(8,), key=jax.random.key(0))
    state = TrainState.create(model, optax.sgd(LR), key=jax.random.key(1))
    train_data = DeviceLoader.from_dataset(train, BATCH, seed=0)
    test_data = DeviceLoader.from_dataset(test, BATCH, shuffle=False)
    out = {}

    def run():
        result = fit(
            state,
            train_data,
            num_steps=epochs * train_data.steps_per_epoch,
            eval_data=test_data,
            log_every=190,
            steps_per_call=100,
            progress=False,
        )
        out["accuracy"] = result.eval_metrics["accuracy"]

    return run, out


def tutorial_fit(train, test, epochs):
    """The "Introduction to JAX+Flax" recipe: torch DataLoader + numpy collate -> jitted linen step."""
    make_state, train_step, eval_step = linen_parts()
    out = {}

    def run():
        state = make_state()
        loader = make_dataloader(train, BATCH, shuffle=True, seed=0)
        for _ in range(epochs):
            for batch in loader:
                state, loss, acc = train_step(state, batch)
        accs = [(eval_step(state, batch), len(batch[1])) for batch in make_dataloader(test, BATCH, shuffle=False)]
        out["accuracy"] = float(sum(float(a) * n for a, n in accs) / len(test))

    return run, out


def pure_jax_fit(train, test, epochs):
    """Hand-written JAX at its best: all epochs in one jit (lax.scan over host-shuffled index rows)."""
    x, y = jnp.asarray(train.inputs), jnp.asarray(train.labels)
    steps_per_epoch = len(train) // BATCH

    @jax.jit
    def train_all(params, indices):
        def body(params, index):
            loss, grads = jax.value_and_grad(pure_loss)(params, x[index], y[index])
            return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

        return jax.lax.scan(body, params, indices)

    out = {}

    def run():
        rng = np.random.default_rng(0)
        indices = np.concatenate([rng.permutation(len(train))[: steps_per_epoch * BATCH] for _ in range(epochs)])
        params, _ = train_all(init_params(jax.random.key(0)), indices.reshape(-1, BATCH).astype(np.int32))
        h = jnp.tanh(test.inputs @ params["w1"] + params["b1"])
        out["accuracy"] = float(jnp.mean(((h @ params["w2"] + params["b2"])[:, 0] > 0) == test.labels))

    return run, out


def eqx_fit(train, test, epochs):
    """`eqx.filter_jit` step in a Python loop over numpy-shuffled device batches."""
    optim = optax.sgd(LR)
    x, y = jnp.asarray(train.inputs), jnp.asarray(train.labels)

    @eqx.filter_jit
    def make_step(model, opt_state, x, y):
        def loss_fn(model):
            logit = jax.vmap(model)(x)[:, 0]
            return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, y.astype(jnp.float32)))

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    out = {}

    def run():
        model = MLP(2, 1, hidden=(8,), key=jax.random.key(0))
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        rng = np.random.default_rng(0)
        for _ in range(epochs):
            order = rng.permutation(len(train))
            for s in range(len(train) // BATCH):
                index = order[s * BATCH : (s + 1) * BATCH]
                model, opt_state, loss = make_step(model, opt_state, x[index], y[index])
        logit = jax.vmap(model)(jnp.asarray(test.inputs))[:, 0]
        out["accuracy"] = float(jnp.mean((logit > 0) == test.labels))

    return run, out


def torch_fit(train, test, epochs):
    x, y = torch.from_numpy(train.inputs), torch.from_numpy(train.labels).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    out = {}

    def run():
        model = torch_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(0)
        with torch_threads(1):
            for _ in range(epochs):
                order = torch.randperm(len(train), generator=generator)
                for s in range(len(train) // BATCH):
                    index = order[s * BATCH : (s + 1) * BATCH]
                    optimizer.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x[index])[:, 0], y[index])
                    loss.backward()
                    optimizer.step()
        with torch.no_grad():
            out["accuracy"] = float(((model(torch.from_numpy(test.inputs))[:, 0] > 0).numpy() == test.labels).mean())

    return run, out


def run(quick: bool) -> dict:
    train, test = _data()
    steps, repeats = (20, 3) if quick else (1000, 15)  # ~15-20 ms a sample for the fast steps
    flax = have_flax()
    makers = {
        "ours: CompiledTrainer.step": ours_step,
        "pure JAX (jit, donated)": pure_jax_step,
        "hand-written JAX doing our step's work": same_work,
        "eqx.filter_jit": eqx_step,
        "flax linen TrainState": linen_step,
        "flax nnx.jit": nnx_step,
        "PyTorch eager": torch_step,
    }
    slow = {"flax nnx.jit", "PyTorch eager", "eqx.filter_jit"}
    notes = {}
    candidates = {}
    for name, make in makers.items():
        if name.startswith("flax") and not flax:
            notes[name] = FLAX_MISSING
            continue
        n = max(steps // 4, 5) if name in slow else steps
        fn = make(train, n)
        fn()  # compile and warm up
        candidates[name] = functools.partial(timed, fn, n)
    step_timings = interleave(candidates, repeats)

    epochs = 2 if quick else EPOCHS
    run_makers = {
        "ours: fit": ours_fit,
        "pure JAX (one jit)": pure_jax_fit,
        "tutorial (DataLoader + linen)": tutorial_fit,
        "eqx.filter_jit loop": eqx_fit,
        "PyTorch eager": torch_fit,
    }
    outs, run_candidates = {}, {}
    for name, make in run_makers.items():
        if name.startswith("tutorial") and not flax:
            notes[name] = FLAX_MISSING
            continue
        fn, outs[name] = make(train, test, epochs)
        fn()  # warm: the second call in the process is the one measured
        run_candidates[name] = functools.partial(timed, fn)
    run_timings = interleave(run_candidates, 2 if quick else 5)
    for name, timing in run_timings.items():
        timing.extra["accuracy"] = outs[name]["accuracy"]
    return {
        "step": list(step_timings.values()),
        "fit": list(run_timings.values()),
        "notes": notes,
        "steps_per_epoch": len(train) // BATCH,
        "epochs": epochs,
    }
