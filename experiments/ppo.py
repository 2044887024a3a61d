"""PPO (Schulman et al. 2017) on a classic-control environment of gymnax, stepped inside the compiled
training step: a step collects a rollout of --rollout-steps from each of --num-envs environments, then
takes --epochs passes of --minibatches clipped-objective updates over it (GAE advantages, normalised over
the rollout; a clipped value loss; an entropy bonus; the learning rate annealed to 0), PureJaxRL's recipe.

The step makes its own data: its batch is the indices of its environments (which the placement splits
over the devices: each device steps its own environments), and the environments' states live in the train
state between steps, so `--resume` continues every episode where it stopped. A minibatch is every
environment's transitions at `rollout-steps / minibatches` time steps (the epoch's random order of time
steps), so the loss is a mean over the batch's rows (environments) like any other, and a gradient of the
global batch is the same whatever device holds which environment.

Metrics: `train/episode_return` and `train/episode_length`, the mean of the episodes that finished in each
step, averaged over the logged interval (`train/episodes`: how many finished a step); evaluation plays the
greedy policy for --eval-episodes episodes (`test/return`, the headline, and `test/length`).
`scripts/rollout RUN_DIR` plays a trained run's policy. Needs gymnax: `pip install 'research[rl]'`.

    ./scripts/run ppo --env CartPole-v1 --population 5
"""

import dataclasses
import functools
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import (
    ConfigError,
    TrainConfig,
    Training,
    closed_unit_interval,
    group,
    main_entry,
    non_negative,
    option,
    positive,
)
from research.data import DeviceLoader
from research.experiment import Setup, run_experiment
from research.install import require_extra
from research.nn import ActorCritic
from research.population import evaluate_members, stack_states
from research.services import Headline, RunDir
from research.train import AbstractNetworksState, GlobalBatch, Network, Step
from research.train.reduction import tree_sum
from research.typing import Array, Bool, Float, Int, PRNGKeyArray, PyTree, RowKeys

ENVIRONMENTS = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0", "Pendulum-v1", "MountainCarContinuous-v0")


@dataclasses.dataclass(frozen=True)
class PPOTraining(Training):
    lr: float = option(
        2.5e-4, "Adam learning rate at the start (annealed linearly to 0)", check=positive, vmappable=True
    )
    batch_size: int = option(
        4, "environments stepped in parallel (the step's batch: their indices, split over --devices)", check=positive
    )
    steps_per_call: int = option(10, "training steps (rollouts and their updates) per compiled call", check=positive)
    log_every: int = option(10, "steps between logged training metrics", check=positive)
    eval_every: int = option(100, "steps between evaluations of the greedy policy", check=positive)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a PPO agent on a gymnax classic-control environment; --population K trains K seeds as one program."""

    headline: ClassVar[Headline] = Headline("return", goal="max", percent=False)
    training: PPOTraining = group(PPOTraining)
    env: Literal[ENVIRONMENTS] = option("CartPole-v1", "the gymnax environment")  # pyright: ignore[reportInvalidTypeForm]
    env_steps: int = option(
        500_000, "environment steps to train for, all environments together", check=positive, resumable=True
    )
    rollout_steps: int = option(128, "steps each environment takes a rollout", check=positive)
    epochs: int = option(4, "passes over each rollout", check=positive)
    minibatches: int = option(4, "updates a pass (each on every environment's share of time steps)", check=positive)
    gamma: float = option(0.99, "discount factor", check=closed_unit_interval)
    gae_lambda: float = option(0.95, "GAE's lambda", check=closed_unit_interval)
    clip: float = option(0.2, "the clipped objective's ratio range (and the value loss's)", check=positive)
    entropy_coef: float = option(0.01, "weight of the entropy bonus", check=non_negative)
    value_coef: float = option(0.5, "weight of the value loss", check=non_negative)
    max_grad_norm: float = option(0.5, "the gradient's global norm is clipped to this", check=positive)
    hidden: int = option(
        64, "units in each of the two hidden layers of the policy and the value network", check=positive
    )
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    eval_episodes: int = option(32, "episodes of the greedy policy an evaluation plays", check=positive)
    population: int = option(1, "K: agents trained as one program, with seeds --seed, --seed + 1, ...", check=positive)


@functools.cache
def environment(name: str) -> tuple[Any, Any]:
    """gymnax's `(env, params)` for `name`, one object per name (the step holds them as static fields, and equal
    steps share their compiled programs)."""
    require_extra("ppo", "gymnax", "six")
    import gymnax

    return gymnax.make(name)


class Live(eqx.Module):
    """The environments between two steps: gymnax's state of each, its last observation, and the return
    and length of its episode in progress (a leading axis: environments)."""

    env_state: PyTree
    observation: Float[Array, "envs observation"]
    episode_return: Float[Array, " envs"]
    episode_length: Int[Array, " envs"]


class PPOState(AbstractNetworksState):
    """PPO's train state: the policy (the run's model: evaluated, exported, played by scripts/rollout) with its
    optimizer, and the live environments."""

    policy: Network
    live: Live
    last_episode: Float[Array, "2"]  # the mean return and length of the last episodes to end


# -- the policy's distribution: categorical over logits, or a diagonal Gaussian around a mean ------------


def sample_action(policy: ActorCritic, output: Float[Array, " actions"], key: PRNGKeyArray) -> Array:
    if policy.log_std is None:
        return jax.random.categorical(key, output)
    return output + jnp.exp(policy.log_std) * jax.random.normal(key, output.shape)


def log_prob(policy: ActorCritic, output: Float[Array, " actions"], action: Array) -> Float[Array, ""]:
    if policy.log_std is None:
        return jax.nn.log_softmax(output)[action]
    z = (action - output) / jnp.exp(policy.log_std)
    return -0.5 * jnp.sum(z**2 + 2 * policy.log_std + jnp.log(2 * jnp.pi))


def entropy(policy: ActorCritic, output: Float[Array, " actions"]) -> Float[Array, ""]:
    if policy.log_std is None:
        log_p = jax.nn.log_softmax(output)
        return -jnp.sum(jnp.exp(log_p) * log_p)
    return jnp.sum(policy.log_std + 0.5 * jnp.log(2 * jnp.pi * jnp.e))


def greedy_action(policy: ActorCritic, output: Float[Array, " actions"]) -> Array:
    return output if policy.log_std is not None else jnp.argmax(output)


def env_action(env: Any, params: Any, action: Array) -> Array:
    """`action` as the environment takes it: a Gaussian's sample clipped to the action space's bounds."""
    space = env.action_space(params)
    return jnp.clip(action, space.low, space.high) if hasattr(space, "low") else action


# -- rollouts, advantages and the clipped objective -----------------------------------------------------


class Transitions(eqx.Module):
    """A rollout of each environment (leading axes: environments, time steps)."""

    observation: Float[Array, "envs time observation"]
    action: Array
    log_prob: Float[Array, "envs time"]
    value: Float[Array, "envs time"]
    reward: Float[Array, "envs time"]
    next_value: Float[Array, "envs time"]
    terminated: Bool[Array, "envs time"]
    done: Bool[Array, "envs time"]
    advantage: Float[Array, "envs time"]
    target: Float[Array, "envs time"]


def gae(
    rewards: Float[Array, " time"],
    values: Float[Array, " time"],
    next_values: Float[Array, " time"],
    terminated: Bool[Array, " time"],
    done: Bool[Array, " time"],
    gamma: float,
    lam: float,
) -> tuple[Float[Array, " time"], Float[Array, " time"]]:
    """Generalised advantage estimates of one environment's rollout and the value targets (advantage + value).
    `next_values` are the values of each step's true next observation (before an ended episode's reset): an
    episode cut by the time limit bootstraps from it, one that terminated does not, and no advantage flows
    back across the end of an episode."""

    def back(advantage, x):
        reward, value, next_value, terminal, end = x
        delta = reward + gamma * next_value * (1.0 - terminal) - value
        advantage = delta + gamma * lam * (1.0 - end) * advantage
        return advantage, advantage

    floats = (rewards, values, next_values, terminated.astype(jnp.float32), done.astype(jnp.float32))
    _, advantages = jax.lax.scan(back, jnp.zeros(()), floats, reverse=True)
    return advantages, advantages + values


class PPOLoss(eqx.Module):
    """The clipped surrogate objective, the clipped value loss and the entropy bonus on a minibatch (rows:
    environments, each with its share of time steps), a mean over its transitions."""

    clip: float
    value_coef: float
    entropy_coef: float

    def __call__(self, policy: ActorCritic, _: None, batch: Transitions, keys: RowKeys):
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
        outputs, values = jax.vmap(policy)(flat.observation)
        new_log_prob = jax.vmap(functools.partial(log_prob, policy))(outputs, flat.action)
        ratio = jnp.exp(new_log_prob - flat.log_prob)
        clipped_ratio = jnp.clip(ratio, 1 - self.clip, 1 + self.clip)
        policy_loss = -jnp.mean(jnp.minimum(ratio * flat.advantage, clipped_ratio * flat.advantage))
        clipped_values = flat.value + jnp.clip(values - flat.value, -self.clip, self.clip)
        value_loss = 0.5 * jnp.mean(jnp.maximum((values - flat.target) ** 2, (clipped_values - flat.target) ** 2))
        bonus = jnp.mean(jax.vmap(functools.partial(entropy, policy))(outputs))
        loss = policy_loss + self.value_coef * value_loss - self.entropy_coef * bonus
        metrics = {
            "loss": loss,
            "policy_loss": policy_loss,
            "value_loss": value_loss,
            "entropy": bonus,
            "approx_kl": jnp.mean((ratio - 1) - jnp.log(ratio)),
            "clip_fraction": jnp.mean((jnp.abs(ratio - 1) > self.clip).astype(jnp.float32)),
        }
        return loss, (metrics, None)


def global_mean_and_std(x: Float[Array, "envs time"]) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The mean and standard deviation of the global batch's values, summed in one fixed order (`tree_sum`), so
    that every placement's program rounds them alike (XLA's own reductions need not)."""
    count = x.size
    mean = tree_sum(x.reshape(-1)) / count
    return mean, jnp.sqrt(tree_sum(((x - mean) ** 2).reshape(-1)) / count)


def normalised_advantages(advantage: Float[Array, "envs time"], axis_name: str | None) -> Float[Array, "envs time"]:
    """This device's advantages less the global rollout's mean, over its standard deviation (+ 1e-8: a rollout
    of equal advantages)."""
    mean, std = global_mean_and_std(gathered(advantage, axis_name))
    return (advantage - mean) * (1 / (std + 1e-8))  # a multiply: XLA rewrites some divides


def gathered(x: Array, axis_name: str | None) -> Array:
    """`x` (this device's rows) with every device's rows, in the global batch's order."""
    return x if axis_name is None else jax.lax.all_gather(x, axis_name, tiled=True)


class PPOStep(Step):
    """One PPO iteration: a rollout of `rollout_steps` from each of the batch's environments (the batch is their
    indices), GAE, then `epochs` passes of `minibatches` updates of the clipped objective. Metrics: the
    updates' mean losses, entropy, approximate KL, clip fraction and gradient norm, and the episodes that
    finished in the rollout (`episodes`; their mean `episode_return` and `episode_length`, the last ones'
    when none did)."""

    env_name: str = eqx.field(static=True)
    rollout_steps: int = eqx.field(static=True)
    epochs: int = eqx.field(static=True)
    minibatches: int = eqx.field(static=True)
    gamma: float = eqx.field(static=True)
    gae_lambda: float = eqx.field(static=True)
    loss: PPOLoss = eqx.field(static=True)
    grad_accum: int = eqx.field(static=True, default=1)
    finite_metrics: ClassVar[tuple[str, ...]] = ("loss", "grad_norm")

    def with_grad_accum(self, grad_accum: int) -> "PPOStep":
        return dataclasses.replace(self, grad_accum=grad_accum)

    def __call__(self, state: PPOState, batch: Int[Array, " envs"], key: PRNGKeyArray, global_batch: GlobalBatch):
        axis = global_batch.axis_name
        rollout_key, update_key = jax.random.split(key)
        env_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rollout_key, batch)  # an environment's own
        live = jax.tree.map(lambda x: x[batch], state.live)
        invariant = global_batch.micro_batches is not None
        transitions, live, finished = self.rollout(state.model, live, env_keys, layout_invariant=invariant)
        policy, metrics = self.update(state.policy, transitions, update_key, global_batch)
        every = gathered(batch, axis)
        lives = jax.tree.map(lambda whole, rows: whole.at[every].set(gathered(rows, axis)), state.live, live)
        episodes = episode_metrics(*(gathered(x, axis) for x in finished), state.last_episode)
        last_episode = jnp.stack([episodes["episode_return"], episodes["episode_length"]])
        return dataclasses.replace(state, policy=policy, live=lives, last_episode=last_episode), {**metrics, **episodes}

    def rollout(
        self, policy: ActorCritic, live: Live, keys: PRNGKeyArray, *, layout_invariant: bool = False
    ) -> tuple[Transitions, Live, tuple[Array, Array, Array]]:
        """`rollout_steps` steps of every environment of `live` (one key each) under `policy`: the transitions
        (with their advantages and value targets), the environments after them, and the episodes that ended
        (a flag, the return and the length at each step). `layout_invariant` (`--deterministic-reduction`): one
        environment at a time (`lax.map`), so a device's share of them rounds as one device holding them all
        does (XLA's CPU code for a matmul, an exp or a cos over 2 rows and over 8 need not)."""
        env, params = environment(self.env_name)

        def transition(live: Live, key: PRNGKeyArray):
            """One step of one environment (its values come after the rollout, all at once)."""
            action_key, env_key = jax.random.split(key)
            output = policy.act(live.observation)
            action = sample_action(policy, output, action_key)
            observation, env_state, reward, terminated, truncated, info = env.step(
                env_key, live.env_state, env_action(env, params, action), params
            )
            done = terminated | truncated
            ret, length = live.episode_return + reward, live.episode_length + 1
            final = info["final_observation"].astype(jnp.float32)  # before an ended episode's reset
            row = (live.observation, action, log_prob(policy, output, action), reward.astype(jnp.float32), final)
            ended = (done, jnp.where(done, ret, 0.0), jnp.where(done, length, 0))
            after = Live(
                env_state, observation.astype(jnp.float32), jnp.where(done, 0.0, ret), jnp.where(done, 0, length)
            )
            return after, (row, (terminated, done), ended)

        each = (lambda fn: lambda *xs: jax.lax.map(lambda x: fn(*x), xs)) if layout_invariant else jax.vmap
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.rollout_steps))(keys)
        live, (rows, ends, ended) = jax.lax.scan(each(transition), live, jnp.swapaxes(step_keys, 0, 1))
        rows, ends, ended = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (rows, ends, ended))  # environments first
        observations, actions, log_probs, rewards, finals = rows
        values = each(jax.vmap(policy.value))(observations)  # one product over every step of the rollout
        next_values = each(jax.vmap(policy.value))(finals)
        terminated, done = ends
        advantage, target = jax.vmap(gae, in_axes=(0, 0, 0, 0, 0, None, None))(
            rewards, values, next_values, terminated, done, self.gamma, self.gae_lambda
        )
        rows = (observations, actions, log_probs, values, rewards, next_values, terminated, done)
        return Transitions(*rows, advantage, target), live, ended

    def update(
        self, policy: Network, transitions: Transitions, key: PRNGKeyArray, global_batch: GlobalBatch
    ) -> tuple[Network, dict[str, Array]]:
        """`epochs` x `minibatches` updates; advantages normalised over the global rollout. Minibatch `m` of an
        epoch is every environment's time steps `order[m * n : (m + 1) * n]` of the epoch's random order of time
        steps, so the global batch's minibatches do not depend on which device holds which environment."""
        normalised = normalised_advantages(transitions.advantage, global_batch.axis_name)
        transitions = dataclasses.replace(transitions, advantage=normalised)
        share = self.rollout_steps // self.minibatches
        orders = jax.vmap(lambda k: jax.random.permutation(k, self.rollout_steps))(jax.random.split(key, self.epochs))
        times = orders[:, : share * self.minibatches].reshape(self.epochs * self.minibatches, share)

        def one(policy: Network, time: Int[Array, " share"]):
            minibatch = jax.tree.map(lambda x: x[:, time], transitions)
            (_, (metrics, _)), grads = global_batch.value_and_grad(
                self.loss, policy.model, None, minibatch, key, grad_accum=self.grad_accum
            )
            return policy.updated(grads), {**metrics, "grad_norm": optax.tree.norm(grads)}

        policy, metrics = jax.lax.scan(one, policy, times)
        return policy, jax.tree.map(jnp.mean, metrics)


def episode_metrics(
    done: Bool[Array, "envs time"],
    returns: Float[Array, "envs time"],
    lengths: Int[Array, "envs time"],
    last: Float[Array, "2"],
) -> dict[str, Float[Array, ""]]:
    """The episodes that ended in a rollout: how many, and their mean return and length (`last`, the previous
    means, when none did)."""
    count = jnp.sum(done)
    some = count > 0
    mean = lambda x, previous: jnp.where(some, jnp.sum(x) / jnp.maximum(count, 1), previous)  # noqa: E731
    return {
        "episodes": count.astype(jnp.float32),
        "episode_return": mean(returns, last[0]).astype(jnp.float32),
        "episode_length": mean(lengths.astype(jnp.float32), last[1]).astype(jnp.float32),
    }


# -- evaluation: the greedy policy's episodes ------------------------------------------------------------

EVALUATION_KEY = 2**31 - 1  # the evaluation's episodes: the same ones for every run and every evaluation


@eqx.filter_jit
def play(policy: ActorCritic, env_name: str, keys: PRNGKeyArray, greedy: bool = True) -> tuple[Array, Array]:
    """The return and the length of one episode a key (the environment's longest: gymnax's limit), acting
    greedily (the most probable action, the Gaussian's mean) or by sampling the policy."""
    env, params = environment(env_name)

    def episode(key: PRNGKeyArray) -> tuple[Array, Array]:
        reset_key, key = jax.random.split(key)
        observation, env_state = env.reset(reset_key, params)

        def one(carry, key: PRNGKeyArray):
            observation, env_state, ret, length, alive = carry
            action_key, env_key = jax.random.split(key)
            output, _ = policy(observation.astype(jnp.float32))
            action = greedy_action(policy, output) if greedy else sample_action(policy, output, action_key)
            observation, env_state, reward, terminated, truncated, _ = env.step(
                env_key, env_state, env_action(env, params, action), params
            )
            done = terminated | truncated
            ret, length = ret + alive * reward, length + alive
            return (observation, env_state, ret, length, alive * (1 - done.astype(jnp.float32))), None

        start = (observation, env_state, jnp.zeros(()), jnp.zeros(()), jnp.ones(()))
        (_, _, ret, length, _), _ = jax.lax.scan(one, start, jax.random.split(key, params.max_steps_in_episode))
        return ret, length

    return jax.vmap(episode)(keys)


def episode_keys(episodes: Array, seed: int = EVALUATION_KEY) -> PRNGKeyArray:
    """The keys of the episodes numbered `episodes` of `seed` (the evaluation's: `EVALUATION_KEY`)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.asarray(episodes))


def play_episodes(
    policy: ActorCritic, env_name: str, episodes: int, *, seed: int = 0, greedy: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The returns and lengths of `episodes` episodes of `seed` played by `policy` (`scripts/rollout`)."""
    returns, lengths = play(policy, env_name, episode_keys(jnp.arange(episodes), seed), greedy)
    return np.asarray(returns), np.asarray(lengths)


def greedy_evaluator(config: Config):
    """`return` and `length`: the means over the evaluation set's episodes (its rows: episode indices) of the
    greedy policy."""

    def evaluate(state: PPOState, data: DeviceLoader, *, progress: bool = False) -> dict[str, float]:
        returns, lengths = play(state.model, config.env, episode_keys(data.host))
        return {"return": float(jnp.mean(returns)), "length": float(jnp.mean(lengths))}

    return evaluate


# -- the run ---------------------------------------------------------------------------------------------


@functools.cache
def ppo_optimizer(lr: float, max_grad_norm: float, updates_a_step: int, anneal_steps: int | None):
    """Adam (eps 1e-5) after clipping the gradient's global norm, its rate in its state (`inject_hyperparams`:
    seeds and rates train as one population), annealed linearly to 0 over `anneal_steps` steps of
    `updates_a_step` updates. One object per setting: equal states share their compiled step."""
    parts = [optax.clip_by_global_norm(max_grad_norm), optax.inject_hyperparams(optax.adam)(learning_rate=lr, eps=1e-5)]
    if anneal_steps is not None:
        parts.append(optax.scale_by_schedule(lambda count: 1.0 - (count // updates_a_step) / anneal_steps))
    return optax.flatten(optax.chain(*parts))  # one vector: a few operations an update, not a few a leaf


def num_steps(config: Config) -> int:
    return config.env_steps // (config.training.batch_size * config.rollout_steps)


def build_agent(config: Config, key: PRNGKeyArray) -> PPOState:
    """The step-0 state of one agent: its policy, its optimizer and its environments, reset, all from `key`."""
    env, params = environment(config.env)
    policy_key, env_key, train_key = jax.random.split(key, 3)
    space = env.action_space(params)
    continuous = hasattr(space, "low")
    policy = ActorCritic(
        env.observation_space(params).shape[0],
        space.shape[0] if continuous else space.n,
        continuous=continuous,
        hidden=(config.hidden, config.hidden),
        key=policy_key,
    )
    envs = config.training.batch_size
    observation, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(env_key, envs), params)
    live = Live(env_state, observation.astype(jnp.float32), jnp.zeros(envs), jnp.zeros(envs, jnp.int32))
    updates = config.epochs * config.minibatches
    optimizer = ppo_optimizer(
        config.training.lr, config.max_grad_norm, updates, num_steps(config) if config.anneal_lr else None
    )
    return PPOState.create(
        policy=Network.create(policy, optimizer), live=live, last_episode=jnp.zeros(2), key=train_key
    )


LAST_EPISODES = 100  # the summary's `last_100_return`: the mean return of the last training episodes


def last_returns(records: list[dict[str, Any]], prefix: str = "train/") -> float | None:
    """The mean return of the last `LAST_EPISODES` training episodes (at least: whole logged intervals, each
    weighted by the episodes that ended in it), from metrics.jsonl's records; `None` before that many ended."""
    logged = [r for r in records if f"{prefix}episodes" in r]
    total = weighted = 0.0
    for previous, record in reversed(list(zip([{"step": 0}, *logged[:-1]], logged, strict=True))):
        count = record[f"{prefix}episodes"] * (record["step"] - previous["step"])
        total, weighted = total + count, weighted + count * record[f"{prefix}episode_return"]
        if total >= LAST_EPISODES:
            return weighted / total
    return None


def draw_returns(axes: Any, records: list[dict[str, Any]], config: Config, title: str) -> None:
    """The training episodes' mean return (each agent's) and the greedy policy's at each evaluation, against
    environment steps, on `axes` (a matplotlib `Axes`)."""
    steps_a_step = config.training.batch_size * config.rollout_steps
    for name, style in (("train/", "-"), ("test/", "o")):
        key = f"{name}member_episode_return" if name == "train/" else f"{name}member_return"
        key = key if config.population > 1 else key.replace("member_", "")
        rows = [r for r in records if key in r]
        values = np.asarray([r[key] for r in rows], dtype=float).reshape(len(rows), -1)
        label = "training episodes" if name == "train/" else "greedy policy"
        for k in range(values.shape[1]):
            x = np.asarray([r["step"] for r in rows]) * steps_a_step
            axes.plot(x, values[:, k], style, color=f"C{k}", alpha=0.8, markersize=3, label=None if k else label)
    axes.set(title=title, xlabel="environment steps", ylabel="episode return")
    axes.legend(loc="lower right", fontsize=8)


def summarize(config: Config, run: RunDir, summary: dict[str, Any]) -> dict[str, Any]:
    """`last_100_return` (each member's as `member_last_100_return`), and `returns.png` (`draw_returns`)."""
    from matplotlib.figure import Figure  # imported here: only needed at the end of a run

    records = run.read_metrics()
    figure = Figure(figsize=(6, 4), layout="constrained", dpi=110)
    draw_returns(figure.subplots(), records, config, config.env)
    figure.savefig(run.path / "returns.png")
    if config.population == 1:
        return {f"last_{LAST_EPISODES}_return": last_returns(records)}
    members = [
        [
            {"step": r["step"], **{k.replace("member_", ""): v[m] for k, v in r.items() if "member_" in k}}
            for r in records
        ]
        for m in range(config.population)
    ]
    each = [last_returns(rows) for rows in members]
    mean = None if None in each else float(np.mean(each))  # pyright: ignore[reportArgumentType]
    return {f"last_{LAST_EPISODES}_return": mean, f"member_last_{LAST_EPISODES}_return": each}


def member_keys(config: Config) -> PRNGKeyArray:
    """Agent k's key: that of a run with --seed seed + k (so member k is that run)."""
    return jnp.stack([jax.random.key(config.training.seed + k) for k in range(config.population)])


def check(config: Config) -> None:
    if config.rollout_steps % config.minibatches:
        raise ConfigError(
            f"--minibatches {config.minibatches} must divide --rollout-steps {config.rollout_steps} (each minibatch "
            "takes an equal share of every environment's time steps)"
        )
    if num_steps(config) < 1:
        raise ConfigError(
            f"--env-steps {config.env_steps} is less than one rollout (--batch-size {config.training.batch_size} "
            f"environments x --rollout-steps {config.rollout_steps})"
        )


def setup(config: Config) -> Setup:
    """The agent(s), the environments and the evaluation episodes of a run, without training."""
    check(config)
    environment(config.env)  # gymnax installed, before any work
    train_data = DeviceLoader(
        np.arange(config.training.batch_size, dtype=np.int32), None, config.training.batch_size, shuffle=False
    )
    eval_data = DeviceLoader(np.arange(config.eval_episodes, dtype=np.int32), None, config.eval_episodes, shuffle=False)
    loss = PPOLoss(config.clip, config.value_coef, config.entropy_coef)
    step = PPOStep(
        config.env, config.rollout_steps, config.epochs, config.minibatches, config.gamma, config.gae_lambda, loss
    )
    population = config.population > 1
    evaluator = greedy_evaluator(config)
    if population:
        build = lambda: stack_states(lambda key: build_agent(config, key), member_keys(config))  # noqa: E731
    else:
        build = lambda: build_agent(config, jax.random.key(config.training.seed))  # noqa: E731
    return Setup(
        build_state=build,
        train_data=train_data,
        num_steps=num_steps(config),
        eval_data=eval_data,
        step=step,
        population=population,
        evaluator=evaluate_members(evaluator) if population else evaluator,
        summarize_run=functools.partial(summarize, config),
    )


def main(config: Config) -> dict:
    return run_experiment("ppo", config, setup(config))


if __name__ == "__main__":
    main_entry(main, Config)
