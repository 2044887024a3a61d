"""A train state made of named networks: each a `Network` (a model, its `eqx.nn.State`, the optimizer that
trains it and that optimizer's state); `AbstractNetworksState` derives the rest of what the engine needs from
them, the first network being the run's model (what is evaluated, exported, sampled and averaged)."""

import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ..errors import ConfigError
from ..state import EMA
from ..typing import Array, Int, KeyData, PRNGKeyArray, PyTree
from ._step import AbstractTrainState


def strong(tree: PyTree) -> PyTree:
    """`tree` with weakly typed arrays made strong (same values and dtypes). Equinox and Python scalars make
    some leaves weakly typed (BatchNorm's counter, `jnp.asarray(0.0)`), but a checkpoint restores them strong
    and an update may return them strong: either way the step would compile again."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype) if eqx.is_array(x) and x.weak_type else x, tree)


def apply_gradient(
    optimizer: optax.GradientTransformation, model: Any, grads: PyTree, opt_state: PyTree
) -> tuple[Any, PyTree]:
    """`(model, opt_state)` after one update of `optimizer` with `grads` (the gradient of the model's
    floating-point arrays)."""
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state


_KEEP: Any = object()  # `Network.updated`'s default: the model state as it was


class Network(eqx.Module):
    """One trained network of a state: the model, its `eqx.nn.State` (`None` for a stateless model), the
    optimizer that trains it (a static field) and that optimizer's state. Build it with `Network.create`."""

    model: Any
    model_state: eqx.nn.State | None
    opt_state: PyTree
    optimizer: optax.GradientTransformation = eqx.field(static=True)

    @staticmethod
    def create(
        model: Any, optimizer: optax.GradientTransformation, *, model_state: eqx.nn.State | None = None
    ) -> "Network":
        """The network before its first update: the optimizer initialised on the model's floating-point
        arrays, every array strongly typed (`strong`)."""
        model, model_state, opt_state = strong(
            (model, model_state, optimizer.init(eqx.filter(model, eqx.is_inexact_array)))
        )
        return Network(model, model_state, opt_state, optimizer)

    def updated(self, grads: PyTree, *, model_state: Any = _KEEP) -> "Network":
        """The network after one optimizer update with `grads`, with `model_state` (the loss's new one; by
        default the state as it was)."""
        model, opt_state = apply_gradient(self.optimizer, self.model, grads, self.opt_state)
        return Network(model, self.model_state if model_state is _KEEP else model_state, opt_state, self.optimizer)


State = TypeVar("State", bound="AbstractNetworksState")


class AbstractNetworksState(AbstractTrainState):
    """A train state made of named networks: subclass it with a `Network` field for each (the first is the
    run's model: what is evaluated, exported, sampled and averaged by the EMA) and any other fields the step
    carries (PPO's live environments), and build it with `create`. A GAN's:

        class GANState(AbstractNetworksState):
            generator: Network
            discriminator: Network

        state = GANState.create(generator=Network.create(g, adam), discriminator=Network.create(d, adam), key=key)

    **Derived:** `model`, `model_state` (the first network's), `networks()` (every network's model by its
    field's name: config.json counts their parameters), `with_ema`, `averaged` (`AbstractTrainState`), and
    `updated(name, grads)`, the state after one update of a network. The engine counts `step`, splits `key`
    and moves `ema`.
    """

    step: Int[Array, ""]
    key: KeyData
    ema: EMA | None = eqx.field(default=None, kw_only=True)

    @classmethod
    def create(cls: type[State], *, key: PRNGKeyArray | KeyData, **fields: Any) -> State:
        """The state at step 0: `fields` by name (its networks and anything else), every array strongly typed."""
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        state = cls(step=jnp.zeros((), jnp.int32), key=jnp.asarray(key, jnp.uint32), **strong(fields))
        if not state.parts():
            raise ConfigError(f"{cls.__name__} has no Network field: it trains nothing")
        return state

    def parts(self) -> dict[str, Network]:
        """Every network of the state by its field's name, in the order of the fields."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Network)
        }

    def _lead(self) -> Network:
        return next(iter(self.parts().values()))

    @property
    def model(self) -> Any:
        return self._lead().model

    @property
    def model_state(self) -> Any:
        return self._lead().model_state

    def networks(self) -> dict[str, eqx.Module]:
        return {name: part.model for name, part in self.parts().items()}

    def updated(self: State, name: str, grads: PyTree, *, model_state: Any = _KEEP) -> State:
        """This state after one optimizer update of its network `name` with `grads` (`Network.updated`)."""
        return dataclasses.replace(self, **{name: getattr(self, name).updated(grads, model_state=model_state)})
