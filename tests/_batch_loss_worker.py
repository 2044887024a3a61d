"""One training step of a loss over the whole batch (NT-Xent over two noisy views of each row, through a
BatchNorm network) on every layout this process's devices allow, for tests/test_batch_loss.py: simulated
devices must be set before JAX starts, so it runs in a subprocess.

    python tests/_batch_loss_worker.py OUT.npz LAYOUT [LAYOUT ...]

A layout is `placement:devices:mode` (`pmap:4:det`); the modes are `plain`, `accum` (`--grad-accum 2`), `det`
(`--deterministic-reduction` with 4 micro-batches) and `det-accum` (both). Each step goes through the engine's
compiled trainer on that placement; its optimizer keeps the gradient as its state, so OUT.npz holds, per layout,
the gradient's leaves (`LAYOUT/grad/i`), the new BatchNorm state's (`LAYOUT/state/i`) and the step's metrics
(`LAYOUT/metric/NAME`); `reference/...` is the loss of the whole batch taken by `eqx.filter_value_and_grad`.
"""

import sys

from jaxtyping import install_import_hook

with install_import_hook("research", "beartype.beartype"):  # the same shape checks as the test suite
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from research.nn import BatchNorm
    from research.parallel import batch_axis_name, make_placement
    from research.train import (
        AbstractBatchLoss,
        SupervisedStep,
        TrainState,
        compiled_trainer,
        forward,
        nt_xent,
    )
    from research.typing import Array, Float, PRNGKeyArray

jax.config.update("jax_numpy_rank_promotion", "raise")
ROWS, MICRO_BATCHES = 32, 4


class Encoder(eqx.Module):
    """Linear -> BatchNorm (batch statistics over `axis_name`) -> tanh -> Linear."""

    first: eqx.nn.Linear
    norm: BatchNorm
    last: eqx.nn.Linear
    stateful = True

    def __init__(self, axis_name: str | tuple[str, ...], *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(4, 16, use_bias=False, key=k1)
        self.norm = BatchNorm(16, axis_name=axis_name)
        self.last = eqx.nn.Linear(16, 8, key=k2)

    def __call__(self, x: Float[Array, "4"], state: eqx.nn.State) -> tuple[Float[Array, "8"], eqx.nn.State]:
        h, state = self.norm(self.first(x), state)
        return self.last(jnp.tanh(h)), state


class NoisyViews(AbstractBatchLoss):
    """NT-Xent (temperature 0.5) over two views of each row: the row plus noise drawn from its own key."""

    def embed(self, model, model_state, batch, keys):
        rows = batch.shape[0]
        noise = jax.vmap(lambda k: jax.random.normal(k, (2, 4)))(keys)
        views = (batch[:, None] + 0.3 * noise).reshape(2 * rows, 4)
        embeddings, model_state = forward(model, model_state, views, key=None)
        return embeddings.reshape(rows, 2, -1), model_state

    def loss(self, embeddings):
        return nt_xent(embeddings, 0.5)


def keep_gradient() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient it was given (and which changes nothing)."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), updates),
    )


def batch() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(ROWS, 4)), jnp.float32)


def state(parallel: str, deterministic: bool) -> TrainState:
    model, model_state = eqx.nn.make_with_state(Encoder)(
        batch_axis_name(parallel, deterministic), key=jax.random.key(0)
    )
    return TrainState.create(model, keep_gradient(), key=jax.random.key(1), model_state=model_state)


def one_step(parallel: str, devices: int, mode: str) -> dict[str, np.ndarray]:
    deterministic = mode.startswith("det")
    placement = make_placement(parallel, devices, MICRO_BATCHES if deterministic else None)  # pyright: ignore
    step = SupervisedStep(NoisyViews(), grad_accum=2 if mode.endswith("accum") else 1)
    start = state(parallel, deterministic)
    trainer = compiled_trainer(step, start, placement=placement)
    leaves, rows = trainer.place(start), np.asarray(batch())
    leaves, stats = trainer.step(leaves, trainer.init_stats(leaves, rows), placement.put_batch(rows))
    new = trainer.state(leaves)
    out = {f"grad/{i}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(new.opt_state))}
    out |= {f"state/{i}": np.asarray(s) for i, s in enumerate(jax.tree.leaves(new.model_state))}
    return out | {f"metric/{k}": np.asarray(v) for k, v in trainer.host(stats).fetch().means().items()}


def reference() -> dict[str, np.ndarray]:
    start, rows = state("none", False), batch()
    step_key = jax.random.split(jax.random.wrap_key_data(start.key))[1]
    (loss, (metrics, _)), grads = eqx.filter_value_and_grad(NoisyViews(), has_aux=True)(
        start.model,
        start.model_state,
        rows,
        jax.random.split(step_key, len(rows)),  # the loss's keys: one a row
    )
    out = {f"grad/{i}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))}
    return out | {f"metric/{k}": np.asarray(v) for k, v in metrics.items()}


if __name__ == "__main__":
    results = {f"reference/{k}": v for k, v in reference().items()}
    for layout in sys.argv[2:]:
        parallel, devices, mode = layout.split(":")
        results |= {f"{layout}/{k}": v for k, v in one_step(parallel, int(devices), mode).items()}
    np.savez(sys.argv[1], **results)
