"""Case (k): the training steps of `experiments/gan.py` and `experiments/diffusion.py` through the engine,
against a hand-written Equinox loop of the same model doing the same work.

Both train on scikit-learn's 8x8 digits as the experiments read them (uint8 images `[1437, 8, 8, 1]`,
the training split of `tests/_image_formats.native_digits`), with the experiments' default recipes:

- GAN: `GANState` from `gan.build_state` (generator and discriminator, latent 64, features 32, each with
  `inject_hyperparams(adam)(2e-4, b1=0.5)`), `GANStep(64, critic_steps=1)`, batch 64.
- Diffusion: `diffusion.build_state` (a UNet, features 32, levels 2; Adam 2e-4 after clipping the global
  norm at 1) with the EMA of the weights the default recipe keeps (`--ema-decay 0.999`),
  `SupervisedStep(DenoisingLoss(Schedule(1000)))`, batch 64.

"Ours" is the engine's compiled path as `run_experiment` drives it: `compiled_trainer(step, state)` and
`trainer.run` over a `DeviceLoader` of the images, `steps_per_call` (the experiments' default, 10) steps a
call, the batches gathered inside the compiled call. The hand-written loops follow Equinox's own examples
(`deep_convolutional_gan`, `score_based_diffusion`): `eqx.filter_jit` step functions taking the models and
optimizer states (and the optimizer), `eqx.filter_value_and_grad`, optax updates, the key split inside and
returned, and a Python loop calling them once per batch, each batch gathered from a device array with
numpy indices (an epoch's permutation). The GAN's loop calls a jitted discriminator update, then a jitted
generator update, per batch, as the example does. Same models and initial weights, same losses (softplus
forms; DDPM's noise MSE), latents, steps and noise drawn per example, same optimizers; the engine also
computes the experiments' metrics (gradient norms, D's mean probabilities) and accumulates them on the
device, which the hand-written loops leave out (they return their losses), and the hand-written EMA is the
textbook one (the engine's `EMA` also debiases: a few scalar operations). Keys are handled differently,
so the two do not produce equal numbers; both report the mean of their losses over the timed steps.
"""

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.data import DeviceLoader, take_rows
from research.train import SupervisedStep, compiled_trainer

from ._timing import interleave

TEST_SIZE = 360  # the digits' test split (tests/_image_formats.py): the rest trains


@functools.cache
def digits() -> np.ndarray:
    """The training images of scikit-learn's 8x8 digits, as `native_digits()` makes them: uint8
    `[1437, 8, 8, 1]`, its 17 grey levels scaled to 0-255."""
    from sklearn.datasets import load_digits

    found = load_digits()
    images = np.round(found.images * (255 / 16)).astype(np.uint8)[..., None]
    order = np.random.default_rng(0).permutation(len(images))
    return images[order[TEST_SIZE:]]


def _signed(images: jax.Array) -> jax.Array:
    return images.astype(jnp.float32) / 127.5 - 1


# -- ours: the engine's compiled path ------------------------------------------------------------------
def ours(step, state, loader: DeviceLoader, steps_per_call: int, steps: int):
    """`run(steps) -> seconds per step`: `steps` steps of `trainer.run` in calls of `steps_per_call`, as the
    engine's loop makes them (each call's indices from the loader, on the host; a last call of fewer steps
    runs the same program); fresh statistics each time, as at a logging stop. `losses()`: the mean metrics
    over the last run."""
    trainer = compiled_trainer(step, state)
    example = take_rows(loader.host, np.zeros(loader.index_shape, np.int32))
    device_data = trainer.placement.put_data(loader.host, loader.arrays)
    leaves = trainer.place(state)
    carry = {"leaves": leaves, "stats": trainer.init_stats(leaves, example), "step": 0}

    def run(steps: int = steps) -> float:
        start = time.perf_counter()
        leaves, position, end = carry["leaves"], carry["step"], carry["step"] + steps
        stats = trainer.init_stats(leaves, example)
        while position < end:
            n = min(steps_per_call, end - position)
            indices = np.zeros((steps_per_call, *loader.index_shape), np.int32)
            indices[:n] = loader.step_indices(position, n)
            leaves, stats = trainer.run(leaves, stats, device_data, trainer.placement.put_indices(indices), n)
            position += n
        jax.block_until_ready((leaves, stats.words))
        carry.update(leaves=leaves, stats=stats, step=position)
        return (time.perf_counter() - start) / steps

    def losses() -> dict[str, float]:
        return {k: float(v) for k, v in carry["stats"].fetch().means().items()}

    return run, losses


def _epochs(size: int, batch: int, seed: int):
    """Numpy index arrays of each batch, an epoch's permutation at a time (the last partial batch dropped)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(size)
        for i in range(size // batch):
            yield order[i * batch : (i + 1) * batch]


def _python_loop(step_once, carry: dict, images: np.ndarray, batch: int, steps: int):
    """`run(steps) -> seconds per step` of `steps` calls of `step_once(carry, batch)` on batches gathered from
    a device array with numpy indices; `losses()`: the mean of each loss over the last run."""
    data = jnp.asarray(images)
    indices = _epochs(len(images), batch, seed=0)
    last: dict[str, float] = {}

    def run(steps: int = steps) -> float:
        start = time.perf_counter()
        totals = []
        for _ in range(steps):
            totals.append(step_once(carry, data[next(indices)]))
        jax.block_until_ready((carry, totals))
        last.update({k: float(np.mean([t[k] for t in totals])) for k in totals[0]})
        return (time.perf_counter() - start) / steps

    return run, lambda: dict(last)


# -- the GAN, by hand (Equinox's deep_convolutional_gan example) -------------------------------------------
def _fakes(generator, rows: int, key):
    latents = jax.vmap(lambda k: jax.random.normal(k, (generator.latent,)))(jax.random.split(key, rows))
    return jax.vmap(generator)(latents)


@eqx.filter_value_and_grad
def discriminator_loss(discriminator, generator, real, key):
    fake = _fakes(generator, real.shape[0], key)
    real_logits, fake_logits = jax.vmap(discriminator)(_signed(real)), jax.vmap(discriminator)(fake)
    return jnp.mean(jax.nn.softplus(-real_logits)) + jnp.mean(jax.nn.softplus(fake_logits))


@eqx.filter_value_and_grad
def generator_loss(generator, discriminator, real, key):
    return jnp.mean(jax.nn.softplus(-jax.vmap(discriminator)(_fakes(generator, real.shape[0], key))))


@eqx.filter_jit
def step_discriminator(discriminator, generator, real, optimizer, opt_state, key):
    key, subkey = jax.random.split(key)
    loss, grads = discriminator_loss(discriminator, generator, real, subkey)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(discriminator, eqx.is_inexact_array))
    return loss, eqx.apply_updates(discriminator, updates), opt_state, key


@eqx.filter_jit
def step_generator(generator, discriminator, real, optimizer, opt_state, key):
    key, subkey = jax.random.split(key)
    loss, grads = generator_loss(generator, discriminator, real, subkey)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(generator, eqx.is_inexact_array))
    return loss, eqx.apply_updates(generator, updates), opt_state, key


def handwritten_gan(state, lr: float, beta1: float, images: np.ndarray, batch: int, steps: int):
    """The GAN's loop by hand, from the same initial networks as `state`."""
    g_optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=beta1)
    d_optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=beta1)
    carry = {
        "generator": state.generator.model,
        "discriminator": state.discriminator.model,
        "g_opt_state": g_optimizer.init(eqx.filter(state.generator.model, eqx.is_inexact_array)),
        "d_opt_state": d_optimizer.init(eqx.filter(state.discriminator.model, eqx.is_inexact_array)),
        "key": jax.random.key(1),
    }

    def step_once(c: dict, real: jax.Array) -> dict:
        d_loss, c["discriminator"], c["d_opt_state"], c["key"] = step_discriminator(
            c["discriminator"], c["generator"], real, d_optimizer, c["d_opt_state"], c["key"]
        )
        g_loss, c["generator"], c["g_opt_state"], c["key"] = step_generator(
            c["generator"], c["discriminator"], real, g_optimizer, c["g_opt_state"], c["key"]
        )
        return {"d_loss": d_loss, "g_loss": g_loss}

    return _python_loop(step_once, carry, images, batch, steps)


# -- the diffusion model, by hand (Equinox's score_based_diffusion example) ---------------------------------
def denoising_loss(model, images, key, alpha_bars):
    def one(image, key):
        step_key, noise_key = jax.random.split(key)
        t = jax.random.randint(step_key, (), 0, alpha_bars.shape[0])
        noise = jax.random.normal(noise_key, image.shape)
        noisy = jnp.sqrt(alpha_bars[t]) * image + jnp.sqrt(1 - alpha_bars[t]) * noise
        return jnp.mean((model(noisy, t.astype(jnp.float32) / alpha_bars.shape[0]) - noise) ** 2)

    return jnp.mean(jax.vmap(one)(_signed(images), jax.random.split(key, images.shape[0])))


@eqx.filter_jit
def make_step(model, ema, images, alpha_bars, key, opt_state, optimizer, decay):
    loss, grads = eqx.filter_value_and_grad(denoising_loss)(model, images, key, alpha_bars)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)
    ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, eqx.filter(model, eqx.is_inexact_array))
    key = jax.random.split(key, 1)[0]
    return loss, model, ema, key, opt_state


def handwritten_diffusion(state, lr: float, decay: float, steps_of_schedule: int, images, batch: int, steps: int):
    """The diffusion model's loop by hand, from the same initial UNet as `state`, with an EMA of its weights."""
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=lr))
    betas = np.linspace(1e-4, 0.02, steps_of_schedule, dtype=np.float64)
    carry = {
        "model": state.model,
        "ema": eqx.filter(state.model, eqx.is_inexact_array),
        "alpha_bars": jnp.asarray(np.cumprod(1 - betas).astype(np.float32)),
        "opt_state": optimizer.init(eqx.filter(state.model, eqx.is_inexact_array)),
        "key": jax.random.key(1),
    }

    def step_once(c: dict, images: jax.Array) -> dict:
        loss, c["model"], c["ema"], c["key"], c["opt_state"] = make_step(
            c["model"], c["ema"], images, c["alpha_bars"], c["key"], c["opt_state"], optimizer, decay
        )
        return {"loss": loss}

    return _python_loop(step_once, carry, images, batch, steps)


# -- the case --------------------------------------------------------------------------------------------
def _trainable(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)))


# --quick: smaller networks, which compile faster (a smoke run, not a measurement)
QUICK = {"GAN": {"features": 8, "latent": 16}, "diffusion": {"features": 8, "levels": 1}}


def _gan(steps: int, quick: bool):
    """The GAN's recipe, parameter counts and candidates (`name: (run, losses)`), `steps` steps a sample."""
    import experiments.gan as gan

    config = gan.Config.from_options(**(QUICK["GAN"] if quick else {}))
    images = digits()
    state = gan.build_state(config, images.shape[1:])
    batch, per_call = config.training.batch_size, config.training.steps_per_call
    loader = DeviceLoader(images, None, batch * config.critic_steps, seed=config.training.seed)
    recipe: dict[str, Any] = dict(latent=config.latent, features=config.features, batch=batch, steps_per_call=per_call)
    recipe.update(lr=config.training.lr, beta1=config.beta1)
    recipe["parameters"] = {name: _trainable(model) for name, model in state.networks().items()}
    step = gan.GANStep(config.latent, config.critic_steps)
    return recipe, {
        f"ours: trainer.run, {per_call} steps a call": ours(step, state, loader, per_call, steps),
        "hand-written Equinox: D, then G step a batch": handwritten_gan(
            state, config.training.lr, config.beta1, images, batch, steps
        ),
    }


def _diffusion(steps: int, quick: bool):
    """The diffusion model's recipe, parameter count and candidates (`name: (run, losses)`)."""
    import experiments.diffusion as diffusion

    config = diffusion.Config.from_options(**(QUICK["diffusion"] if quick else {}))
    images = digits()
    decay = config.ema.ema_decay
    state = diffusion.build_state(config, images.shape[1:])
    state = state.with_ema(decay) if decay else state  # as `run_experiment` starts it (`initial_state`)
    batch, per_call = config.training.batch_size, config.training.steps_per_call
    loader = DeviceLoader(images, None, batch, seed=config.training.seed)
    step = SupervisedStep(diffusion.DenoisingLoss(diffusion.Schedule(config.diffusion_steps)))
    recipe: dict[str, Any] = dict(features=config.features, levels=config.levels, batch=batch, steps_per_call=per_call)
    recipe.update(lr=config.training.lr, ema_decay=decay, parameters={"unet": _trainable(state.model)})
    return recipe, {
        f"ours: trainer.run, {per_call} steps a call": ours(step, state, loader, per_call, steps),
        "hand-written Equinox: make_step a batch": handwritten_diffusion(
            state, config.training.lr, decay, config.diffusion_steps, images, batch, steps
        ),
    }


def run(quick: bool) -> dict:
    steps, repeats = 10, 2 if quick else 5  # a sample: one compiled call of ours (the recipes' 10 steps)
    start = time.perf_counter()
    digits()
    # Building the states and compiling the four candidates take most of the case's time: they run two at a
    # time, to keep both cores busy where XLA's compilation would not (the timed samples run alone, interleaved).
    with ThreadPoolExecutor(2) as pool:
        made = pool.map(lambda make: make(steps, quick), (_gan, _diffusion))
        setups = dict(zip(("GAN", "diffusion"), made, strict=True))
        built = time.perf_counter()
        warm_ups = [run_ for _, made in reversed(setups.values()) for run_, _ in made.values()]
        list(pool.map(lambda run_: run_(1), warm_ups))  # compile, and one step: the longest (diffusion's) first
    warm = time.perf_counter()
    models = {}
    for label, (recipe, made) in setups.items():
        timings = interleave({name: run_ for name, (run_, _) in made.items()}, repeats)
        for name, (_, losses) in made.items():
            timings[name].extra["losses"] = losses()
        models[label] = {"step": list(timings.values()), "recipe": recipe}
    seconds = {"build": built - start, "compile": warm - built, "timed": time.perf_counter() - warm}
    return {"models": models, "steps": steps, "seconds": seconds}
