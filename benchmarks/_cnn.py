"""Case (c): MNIST-1D's reference CNN recipe (Conv1d 1->25 k5 s2 p1, 25->25 k3 s2 p1, 25->25 k3 s2
p1, ReLU each, flatten 125, Linear 10; Adam 1e-2, batch 100, 8,000 steps): time to train and test
accuracy, ours vs pure JAX vs PyTorch eager."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from research.data import DeviceLoader, generate_mnist1d
from research.nn import CNN1d
from research.train import TrainState, fit

from ._frameworks import at_best_thread_count
from ._timing import Timing

BATCH, LR, STEPS = 100, 1e-2, 8000

SOURCE = "research.nn.CNN1d (convolutions as patches @ weight), research.data.generate_mnist1d"


@functools.cache
def data():
    return generate_mnist1d()


def ours(steps_per_call: int = 100):
    train, test = data()
    model = CNN1d(key=jax.random.key(0))
    state = TrainState.create(model, optax.adam(LR), key=jax.random.key(1))
    train_data = DeviceLoader(train.inputs, train.labels, BATCH, seed=0)
    test_data = DeviceLoader(test.inputs, test.labels, 500, shuffle=False)

    def run(steps):
        result = fit(
            state,
            train_data,
            num_steps=steps,
            eval_data=test_data,
            log_every=min(steps, 1000),
            steps_per_call=steps_per_call,
            progress=False,
        )
        return result.eval_metrics["accuracy"]

    return run


# -- pure JAX: a params dict, lax.conv, a jitted step with donation in a Python loop ---------------
_CONVS = ((1, 5, 2), (25, 3, 2), (25, 3, 2))  # (in channels, kernel, stride); 25 out channels, padding 1


def init_params(key):
    params, keys = {}, jax.random.split(key, 8)
    for i, (c, k, _) in enumerate(_CONVS):
        bound = (c * k) ** -0.5
        params[f"conv{i}"] = jax.random.uniform(keys[2 * i], (25, c, k), minval=-bound, maxval=bound)
        params[f"bias{i}"] = jax.random.uniform(keys[2 * i + 1], (25, 1), minval=-bound, maxval=bound)
    params["head"] = jax.random.uniform(keys[6], (125, 10), minval=-(125**-0.5), maxval=125**-0.5)
    params["head_bias"] = jax.random.uniform(keys[7], (10,), minval=-(125**-0.5), maxval=125**-0.5)
    return params


def pure_logits(params, x):
    h = x[:, None, :]  # NCL
    for i, (_, _, stride) in enumerate(_CONVS):
        h = jax.lax.conv_general_dilated(h, params[f"conv{i}"], (stride,), [(1, 1)])
        h = jax.nn.relu(h + params[f"bias{i}"])
    return h.reshape(len(x), -1) @ params["head"] + params["head_bias"]


_optim = optax.adam(LR)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def pure_step(params, opt_state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(pure_logits(params, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def pure_jax():
    train, test = data()

    def run(steps):
        params = init_params(jax.random.key(0))
        opt_state = _optim.init(params)
        rng, per_epoch = np.random.default_rng(0), len(train.labels) // BATCH
        for step in range(steps):
            if step % per_epoch == 0:
                order = rng.permutation(len(train.labels))
            index = order[(step % per_epoch) * BATCH : (step % per_epoch + 1) * BATCH]
            params, opt_state, loss = pure_step(params, opt_state, train.inputs[index], train.labels[index])
        return float(jnp.mean(jnp.argmax(pure_logits(params, test.inputs), 1) == test.labels))

    return run


# -- PyTorch eager: the reference ConvBase ------------------------------------------------------
def torch_model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv1d(1, 25, 5, 2, 1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, 2, 1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, 2, 1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(125, 10),
    )


def torch_eager():
    train, test = data()
    x, y = torch.from_numpy(train.inputs)[:, None, :], torch.from_numpy(train.labels).long()

    def run(steps):
        model = torch_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        generator, per_epoch = torch.Generator().manual_seed(0), len(y) // BATCH
        for step in range(steps):
            if step % per_epoch == 0:
                order = torch.randperm(len(y), generator=generator)
            index = order[(step % per_epoch) * BATCH : (step % per_epoch + 1) * BATCH]
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        with torch.no_grad():
            logits = model(torch.from_numpy(test.inputs)[:, None, :])
        return float((logits.argmax(1).numpy() == test.labels).mean())

    return run


def run(quick: bool) -> dict:
    steps, repeats = (200, 1) if quick else (STEPS, 2)
    makers = {
        "ours: fit (100 steps a call)": functools.partial(ours, steps_per_call=100),
        "ours: fit (1 step a call)": functools.partial(ours, steps_per_call=1),
        "pure JAX (jit, donated, Python loop)": pure_jax,
        "PyTorch eager": torch_eager,
    }
    runs = {}
    for name, make in makers.items():
        run_ = make()
        run_(min(steps, 200))  # compile: a short run of the same function and shapes
        if name.startswith("PyTorch"):
            name, run_ = at_best_thread_count(name, run_, min(steps, 200))
        runs[name] = functools.partial(run_, steps)
    timings = {name: Timing(name, []) for name in runs}
    for r in range(repeats):
        for i in range(len(runs)):
            name = list(runs)[(i + r) % len(runs)]
            start = time.perf_counter()
            accuracy = runs[name]()
            timings[name].seconds.append(time.perf_counter() - start)
            timings[name].extra.setdefault("accuracies", []).append(accuracy)
    for timing in timings.values():
        timing.extra["accuracy"] = float(np.mean(timing.extra.pop("accuracies")))
    return {"runs": list(timings.values()), "steps": steps, "source": SOURCE}
