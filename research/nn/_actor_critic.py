import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck
from ._mlp import MLP


def _orthogonal(mlp: MLP, last_scale: float, *, key: PRNGKeyArray) -> MLP:
    """`mlp` with orthogonal weights (scale sqrt(2) in the hidden layers, `last_scale` in the last) and zero
    biases: the initialisation PPO's reference implementations use, under which the first policy is near
    uniform and the first value estimates near zero."""
    keys = jax.random.split(key, len(mlp.layers))
    scales = [jnp.sqrt(2.0)] * (len(mlp.layers) - 1) + [last_scale]
    weights = tuple(
        jax.nn.initializers.orthogonal(scale)(k, layer.weight.shape)
        for layer, scale, k in zip(mlp.layers, scales, keys, strict=True)
    )
    biases = tuple(jnp.zeros(layer.out_features) for layer in mlp.layers)
    mlp = eqx.tree_at(lambda m: tuple(layer.weight for layer in m.layers), mlp, weights)
    return eqx.tree_at(lambda m: tuple(layer.bias for layer in m.layers), mlp, biases)


class ActorCritic(eqx.Module):
    """A policy and a value function on one observation, as two separate MLPs (PPO's usual network).

    The policy's output is the logits of a categorical distribution over `actions` (`continuous=False`), or
    the mean of a diagonal Gaussian over an `actions`-dimensional action, whose log standard deviations are
    the state-independent parameter `log_std` (`continuous=True`).

    **Arguments:**

    - `observation_size`: the length of an observation vector.
    - `actions`: the number of discrete actions, or the dimension of a continuous action.
    - `continuous`: whether actions are continuous (Gaussian) rather than discrete (categorical).
    - `hidden`: the width of each hidden layer of both networks.
    - `activation`: an `ACTIVATIONS` name, after every hidden layer.
    - `key`: initialisation key (orthogonal weights, zero biases; the policy's last layer scaled by 0.01).
    """

    actor: MLP
    critic: MLP
    log_std: Float[Array, " actions"] | None
    continuous: bool = eqx.field(static=True)

    def __init__(
        self,
        observation_size: int,
        actions: int,
        *,
        continuous: bool = False,
        hidden: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
        key: PRNGKeyArray,
    ):
        actor_key, critic_key, init_actor, init_critic = jax.random.split(key, 4)
        actor = MLP(observation_size, actions, hidden, activation, key=actor_key)
        critic = MLP(observation_size, 1, hidden, activation, key=critic_key)
        self.actor = _orthogonal(actor, 0.01, key=init_actor)
        self.critic = _orthogonal(critic, 1.0, key=init_critic)
        self.log_std = jnp.zeros(actions) if continuous else None
        self.continuous = continuous

    @typecheck
    def __call__(
        self, observation: Float[Array, " observation"], *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, " actions"], Float[Array, ""]]:
        """`(logits or the Gaussian's mean, value)` of one observation."""
        return self.actor(observation), self.critic(observation)[0]

    @typecheck
    def act(self, observation: Float[Array, " observation"]) -> Float[Array, " actions"]:
        """The policy's output alone (logits, or the Gaussian's mean): what acting needs."""
        return self.actor(observation)

    @typecheck
    def value(self, observation: Float[Array, " observation"]) -> Float[Array, ""]:
        """The value estimate alone."""
        return self.critic(observation)[0]
