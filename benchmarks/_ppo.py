"""Case (l): PPO through the engine (`experiments/ppo.py`) against rejax's PPO (issue 43), environment steps a
second for one agent and for a population of 16, training only (warm: after compilation).

Both train on gymnax's CartPole-v1 with the recipe they share (`RECIPE`): 4 environments, rollouts of 128
steps, 4 epochs of 4 minibatches, gamma 0.99, GAE lambda 0.95, clip 0.2 (the ratio's and the value loss's),
entropy 0.01, value 0.5, gradients clipped at 0.5, Adam at a constant 2.5e-4 (ours with `--anneal-lr false`:
rejax does not anneal), separate 64x64 tanh policy and value networks (rejax's `activation="tanh"`).

"Ours" is the engine's compiled path as `run_experiment` drives it: `ppo.setup(config)`'s step, state and
loader (the environments' indices), `compiled_trainer(step, state, population=...)` and `trainer.run`,
`steps_per_call` (the experiment's 10) PPO iterations a call; a population of 16 is the experiment's
`--population 16` (`stack_states` over `member_keys`: seeds 0..15, the engine's vmapped step). The statistics
stay on the device and are fetched once a sample (run_experiment fetches them at each logging stop, every
10 steps). rejax is `PPO.create(...).train` under `jax.jit` (its README's use), a population
`jax.jit(jax.vmap(train))` over 16 states from `jax.vmap(algo.init_state)` of 16 seeds: the whole sample
is one compiled call (a `fori_loop` of its iterations). Each sample continues from the state the last one
left (both sides), and both run the same number of iterations (`ITERATIONS`, 50: 25,600 environment steps
an agent).

What differs, beyond key handling (so the two do not produce equal numbers):

- rejax's evaluation is switched off: its `eval_callback` (128 greedy episodes after each `eval_freq`
  steps, and one before training) replaced by a no-op, `eval_freq` the sample's steps, and
  `skip_initial_evaluation`. The engine's evaluation is a hook, which this loop does not run.
- rejax 0.1.3 unpacks gymnax's old 5-tuple `step`; gymnax 1.0 returns `terminated` and `truncated`
  apart, so rejax's environment is wrapped to return `terminated | truncated` as its `done` (one `or`).
- Ours does more work: the values of the true next observations (gymnax's `final_observation`, one more
  critic product over the rollout), so an episode cut at 500 steps bootstraps from its value where rejax
  treats every end as terminal; and the episodes' returns and lengths, the updates' KL, clip fraction, entropy and
  gradient norm, accumulated on the device as metrics (rejax keeps none).
- Updates: ours takes one gradient of the joint loss through both networks with one optimizer (clipping
  the global norm, Adam eps 1e-5); rejax takes the policy's and the value network's gradients apart, each
  with its own Adam (eps 1e-8) after clipping each element at 0.5 (`optax.clip`). Ours normalises the
  advantages over the rollout, rejax over each minibatch; ours' minibatch is every environment's share of
  time steps, rejax's a random quarter of all 512 transitions. Initialisation: ours orthogonal, rejax's
  flax defaults.
"""

import importlib.util
import time
from typing import Any

import jax
import numpy as np

from research.data import take_rows
from research.experiment import load_experiment
from research.train import compiled_trainer

from ._timing import interleave

RECIPE: dict[str, Any] = dict(
    env="CartPole-v1",
    num_envs=4,
    num_steps=128,
    num_epochs=4,
    num_minibatches=4,
    gamma=0.99,
    gae_lambda=0.95,
    clip_eps=0.2,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.5,
    learning_rate=2.5e-4,
    hidden=64,
)
ITERATIONS = 50  # PPO iterations (rollouts and their updates) a timed sample: five of ours' calls
POPULATIONS = (1, 16)


def missing() -> str | None:
    """The package the case cannot run without, gymnax, where it is not installed (without rejax, the peer,
    ours is timed alone)."""
    return None if importlib.util.find_spec("gymnax") else "gymnax"


def have_rejax() -> bool:
    return importlib.util.find_spec("rejax") is not None


def env_steps(members: int, iterations: int) -> int:
    return members * iterations * RECIPE["num_envs"] * RECIPE["num_steps"]


# -- ours: experiments/ppo.py through the engine ---------------------------------------------------------
def ppo_config(members: int):
    """`experiments/ppo.py`'s config for `RECIPE` (a constant learning rate, as rejax's)."""
    r = RECIPE
    options = dict(env=r["env"], batch_size=r["num_envs"], rollout_steps=r["num_steps"], epochs=r["num_epochs"])
    options.update(minibatches=r["num_minibatches"], gamma=r["gamma"], gae_lambda=r["gae_lambda"], clip=r["clip_eps"])
    options.update(entropy_coef=r["ent_coef"], value_coef=r["vf_coef"], max_grad_norm=r["max_grad_norm"])
    options.update(lr=r["learning_rate"], hidden=r["hidden"], anneal_lr=False, population=members)
    return load_experiment("ppo").Config.from_options(**options)


def ours(members: int, iterations: int):
    """`run() -> seconds an environment step` (all members'): `iterations` steps of `trainer.run`, in calls of
    `steps_per_call`, continuing from the last sample; `returns()`: the members' mean episode return over it."""
    config = ppo_config(members)
    setup = load_experiment("ppo").setup(config)
    loader, per_call = setup.train_data, config.training.steps_per_call
    state = setup.build_state()
    trainer = compiled_trainer(setup.step, state, population=setup.population)
    device_data = trainer.placement.put_data(loader.host, loader.arrays)
    carry: dict[str, Any] = {"leaves": trainer.place(state), "step": 0, "stats": None}
    example = take_rows(loader.host, np.zeros(loader.index_shape, np.int32))

    def run() -> float:
        start = time.perf_counter()
        leaves, position, end = carry["leaves"], carry["step"], carry["step"] + iterations
        stats = trainer.init_stats(leaves, example)
        while position < end:
            n = min(per_call, end - position)
            indices = np.zeros((per_call, *loader.index_shape), np.int32)
            indices[:n] = loader.step_indices(position, n)
            leaves, stats = trainer.run(leaves, stats, device_data, trainer.placement.put_indices(indices), n)
            position += n
        jax.block_until_ready((leaves, stats.words))
        carry.update(leaves=leaves, stats=stats, step=position)
        return (time.perf_counter() - start) / env_steps(members, iterations)

    def returns() -> float:
        return float(np.mean(carry["stats"].fetch().means()["episode_return"]))

    return run, returns


# -- rejax's PPO -----------------------------------------------------------------------------------------
class DoneStep:
    """A gymnax 1.0 environment whose `step` returns gymnax 0.0's 5-tuple, `done = terminated | truncated`
    (rejax 0.1.3 unpacks five values); the rest is the environment's."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name: str):  # (not `env` itself: a copy has none until its __dict__ is set)
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def step(self, key, state, action, params):
        observation, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        return observation, state, reward, terminated | truncated, info


def rejax_ppo(iterations: int):
    """rejax's PPO for `RECIPE`, `iterations` iterations a `train` call, its evaluation a no-op."""
    import gymnax
    from rejax import PPO

    env, params = gymnax.make(RECIPE["env"])
    steps = iterations * RECIPE["num_envs"] * RECIPE["num_steps"]
    shared = {k: v for k, v in RECIPE.items() if k not in ("env", "hidden")}
    algo = PPO.create(
        env=DoneStep(env),
        env_params=params,
        **shared,
        total_timesteps=steps,
        eval_freq=steps,
        skip_initial_evaluation=True,
        agent_kwargs={"activation": "tanh", "hidden_layer_sizes": (RECIPE["hidden"],) * 2},
    )
    return algo.replace(eval_callback=lambda algo, ts, rng: ())


def rejax(members: int, iterations: int):
    """`run() -> seconds an environment step` (all members'): one jitted `train` of `iterations` iterations
    (vmapped over the members), continuing from the last sample's states."""
    algo = rejax_ppo(iterations)
    keys = jax.random.split(jax.random.key(0), members)
    train = lambda ts: algo.train(train_state=ts)[0]  # noqa: E731
    if members == 1:
        train, states = jax.jit(train), algo.init_state(keys[0])
    else:
        train, states = jax.jit(jax.vmap(train)), jax.vmap(algo.init_state)(keys)
    carry = {"states": states}

    def run() -> float:
        start = time.perf_counter()
        carry["states"] = jax.block_until_ready(train(carry["states"]))
        return (time.perf_counter() - start) / env_steps(members, iterations)

    return run


# -- the case --------------------------------------------------------------------------------------------
def run(quick: bool) -> dict:
    iterations, repeats = (2, 2) if quick else (ITERATIONS, 7)
    start = time.perf_counter()
    populations, compile_seconds = {}, 0.0
    for members in POPULATIONS:
        ours_run, returns = ours(members, iterations)
        vmapped = "" if members == 1 else f"{members} members vmapped, "
        candidates = {f"ours: trainer.run, {vmapped}10 steps a call": ours_run}
        if have_rejax():
            peer = f"rejax: jit({'vmap(train)' if vmapped else 'train'}), {iterations} iterations a call"
            candidates[peer] = rejax(members, iterations)
        warm = time.perf_counter()
        for candidate in candidates.values():
            candidate()  # compile, and a first sample
        compile_seconds += time.perf_counter() - warm
        timings = interleave(candidates, repeats)
        next(iter(timings.values())).extra["episode_return"] = returns()
        label = "1 agent" if members == 1 else f"{members} agents"
        populations[label] = list(timings.values())
    seconds = {"compile": compile_seconds, "total": time.perf_counter() - start}
    peer = None if have_rejax() else "rejax is not installed (the `bench` extra): ours is timed alone"
    return {"populations": populations, "recipe": RECIPE, "iterations": iterations, "seconds": seconds, "peer": peer}
