"""The step as a value: a `Step` is how one training step changes a state, passed to the engine by the
experiment; an `AbstractTrainState` is what the engine needs of that state.

The engine owns what every state has: the step counter, the key and the EMA. `take_step` splits the
state's key into the next state's key and this step's key, calls the step with this step's key, counts
the step and moves the EMA (when the state keeps one) to the new model; the step changes everything else
(models, optimizer states, a rollout). So a step is a pure function of (state, batch, key), the single
source of truth for resume, and the engine can vmap it (a population), place it (one device, pmap, a
mesh, FSDP), skip it when it goes non-finite and checkpoint its state, whatever it holds.

Supervised training is one step (`research.train.SupervisedStep`); a GAN's alternating updates are
another (`experiments/gan.py`).
"""

import abc
import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from ..errors import ConfigError
from ..state import EMA
from ..typing import Array, Int, KeyData, PRNGKeyArray, PyTree
from ._global_batch import GlobalBatch
from ._keys import split_key_data
from ._rows import Metrics

State = TypeVar("State", bound="AbstractTrainState")


class AbstractTrainState(eqx.Module):
    """What the engine needs of a training state (an `eqx.Module`; subclass it with the fields a step
    carries: models, optimizer states, anything else; `research.train.AbstractNetworksState` derives all
    but the fields from named networks).

    **Fields every state has:**

    - `step`: the number of steps taken (`Int[Array, ""]`); the engine counts it.
    - `key`: raw PRNG key data (`jax.random.key_data`, so that it serialises), split by the engine once a step.
    - `ema`: `None`, or an `research.state.EMA` of `(model, model_state)`, which the engine moves after every
      step; what is evaluated, exported and sampled when it is there (`--ema-decay`).
    - `model`, `model_state`: the model the run trains for (evaluated, exported, sampled: a GAN's
      generator) and its `eqx.nn.State` (or `None`); a field or a property.

    **Methods:**

    - `with_ema(decay)`: this state with an EMA of `(model, model_state)` starting here.
    - `averaged()`: this state as evaluation sees it, the EMA's weights in place of the trained ones.
    - `networks()`: every trained network by name (`{"generator": ..., "discriminator": ...}`), whose
      parameters a run's config.json counts.
    """

    step: eqx.AbstractVar[Int[Array, ""]]
    key: eqx.AbstractVar[KeyData]
    ema: eqx.AbstractVar[EMA | None]
    model: eqx.AbstractVar[Any]
    model_state: eqx.AbstractVar[Any]

    def with_ema(self: State, decay: float, *, debias: bool = True) -> State:
        """This state with an EMA of `(model, model_state)` starting here (`decay` in [0, 1)).

        Debiased (the default), the average after `n` more steps is a weighted mean of those `n`
        models only, so it does not matter where it starts.
        """
        return dataclasses.replace(self, ema=EMA.init((self.model, self.model_state), decay, debias=debias))

    def averaged(self: State) -> State:
        """This state with the EMA's `(model, model_state)` in place of the trained ones: what evaluation,
        sampling and export see when the state keeps an EMA (itself when it keeps none)."""
        if self.ema is None:
            return self
        return eqx.tree_at(lambda s: (s.model, s.model_state), self, self.ema.average, is_leaf=_is_none)

    @abc.abstractmethod
    def networks(self) -> dict[str, eqx.Module]: ...


def _is_none(x: Any) -> bool:
    return x is None


class Step(eqx.Module):
    """One training step as a value: `step(state, batch, key, global_batch) -> (new state, metrics)`.

    Subclass it (an `eqx.Module`: the step's own settings are its fields, a loss function, a number of
    critic steps) and hand it to the engine (`Engine(step)`, `fit(step=...)`, `Setup(step=...)`).

    **What a step declares:**

    - `finite_metrics`: the names of the metrics that are all finite on a good step (say its losses and
      gradient norms). A step where one is not stops the run (`NonFiniteError`, naming it), or, with
      `--skip-nonfinite`, leaves the state as it was (the step counter and the key still advance).

    **`__call__(state, batch, key, global_batch)`:**

    - `state`: an `AbstractTrainState`, without its EMA (`ema` is `None`: the engine moves it after the step);
      return it with everything changed but `step` and `key` (the engine counts the step and advances the key).
    - `batch`: any pytree whose leaves have a leading row axis (this device's rows of the global batch
      when the placement splits it).
    - `key`: this step's key.
    - `global_batch`: a `GlobalBatch`; take every gradient (and the metrics with it) through
      `global_batch.value_and_grad`, so that the step gives the same numbers on every placement.

    Metrics are a dict of float32 scalars (one value per member in a population): the engine logs their
    running means as `train/<name>`.
    """

    finite_metrics: eqx.AbstractVar[tuple[str, ...]]

    def with_grad_accum(self, grad_accum: int) -> "Step":
        """This step with each gradient taken in `grad_accum` parts of the batch, one after another
        (`--grad-accum`; `GlobalBatch.value_and_grad(..., grad_accum=...)`). A step that does not say how
        refuses."""
        if grad_accum == 1:
            return self
        raise ConfigError(
            f"--grad-accum {grad_accum}: the step {type(self).__name__} does not take its gradients in parts"
        )

    def with_precision(self, precision: str) -> "Step":
        """This step computing its losses in `precision` (`--precision`; `research.train.precision.InPrecision`). A step
        that does not say how refuses."""
        if precision == "float32":
            return self
        raise ConfigError(f"--precision {precision}: the step {type(self).__name__} computes in float32 only")

    @abc.abstractmethod
    def __call__(
        self, state: Any, batch: PyTree, key: PRNGKeyArray, global_batch: GlobalBatch
    ) -> tuple[Any, Metrics]: ...


def split_key(key_data: KeyData) -> tuple[KeyData, PRNGKeyArray]:
    """`jax.random.split` of a state's key: (the next state's key data, this step's key)."""
    # (jax.config's options are attributes made at run time, which pyright cannot see.)
    impl = jax.config.jax_default_prng_impl  # pyright: ignore[reportAttributeAccessIssue]
    if key_data.shape == (2,) and impl == "threefry2x32":
        key, step_key = split_key_data(key_data)  # the same bits without XLA's CPU while loop
        return key, jax.random.wrap_key_data(step_key)
    key, step_key = jax.random.split(jax.random.wrap_key_data(key_data))
    return jax.random.key_data(key), step_key


def advanced(state: Any, new: Any, key: KeyData) -> Any:
    """`new` (what a step made of `state`) one step on from `state`: counted, with the next key, and `state`'s
    EMA (when it keeps one) moved to `new`'s `(model, model_state)`, whatever the step did to its own. The
    engine keeps the EMA so that no step can forget it (its evaluations would silently be of the first weights)
    or move it twice."""
    if state.ema is not None:
        new = eqx.tree_at(lambda s: s.ema, new, state.ema.update((new.model, new.model_state))[0], is_leaf=_is_none)
    return eqx.tree_at(lambda s: (s.step, s.key), new, (state.step + 1, key))


def take_step(step: Step, state: Any, batch: PyTree, global_batch: GlobalBatch) -> tuple[Any, Metrics]:
    """One step of `step` on `state`: the state's key split, the step taken with this step's key, the step
    counted and the EMA moved (`advanced`)."""
    key, step_key = split_key(state.key)
    new, metrics = step(state, batch, step_key, global_batch)
    check_metrics(type(step).__name__, metrics, step.finite_metrics)
    return advanced(state, new, key), metrics


def check_metrics(step: str, metrics: Any, finite: tuple[str, ...]) -> None:
    """Refuse, while the first step is traced (before any work), metrics the engine cannot keep as the step's
    numbers: a dict of float32 scalars by name (one member's, in a population) holding every name of `finite`."""
    if not isinstance(metrics, dict) or not all(isinstance(name, str) for name in metrics):
        raise ConfigError(f"the step {step} returned {type(metrics).__name__} metrics: return a dict of them by name")
    wrong = [
        f"{name} is {jnp.result_type(value)}{list(jnp.shape(value))}"
        for name, value in sorted(metrics.items())
        if jnp.result_type(value) != jnp.float32 or jnp.shape(value) != ()
    ]
    if wrong:
        raise ConfigError(f"the step {step}'s metrics must each be a float32 scalar: {', '.join(wrong)}")
    missing = [name for name in finite if name not in metrics]
    if missing:
        raise ConfigError(
            f"the step {step} declares finite_metrics {list(finite)}, but its metrics {sorted(metrics)} lack {missing}"
        )


def all_finite(metrics: dict[str, Array], names: tuple[str, ...]) -> Array:
    """Whether every metric in `names` is finite (one flag per member in a population)."""
    ok = jnp.isfinite(metrics[names[0]])
    for name in names[1:]:
        ok = ok & jnp.isfinite(metrics[name])
    return ok
