"""DP-SGD (Abadi et al. 2016) as a loss whose gradient is privatised, for the ordinary train step.

`DPSGDLoss` plugs into `research.train` unchanged: `train_step` (and so `fit`, the compiled
trainer and `run_experiment`) calls its `value_and_grad`, which clips every example's gradient to
`clip_norm`, sums, adds Gaussian noise of standard deviation `noise_multiplier * clip_norm` and
divides by the expected batch size; i.e. the noisy mean has noise std
`noise_multiplier * clip_norm / expected_batch_size`. The noise key is split from the step key, which
comes from the TrainState's key (no global RNG). The result goes to the TrainState's Optax
optimizer like any gradient: `optax.sgd` gives DP-SGD, `optax.adam` DP-Adam.

Padding: examples labelled `PADDING_LABEL` (what `PoissonLoader` fills its fixed-size batches
with) get weight 0; they contribute nothing to the sum, the metrics or the batch size.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from ..data import Batch
from ..train import Metrics, random_normal
from ..typing import Array, Float, PRNGKeyArray, PyTree, typecheck
from ._grads import (
    CLIPPING_METHODS,
    ClippingMethod,
    ExampleLossFn,
    classification_example_loss,
    clipped_gradient_sum,
    per_example_losses,
)

PADDING_LABEL = -1


@typecheck
def add_gaussian_noise(tree: PyTree, key: PRNGKeyArray, std: float | Float[Array, ""]) -> PyTree:
    """`tree + std * N(0, I)`, an independent draw for every array leaf (each leaf its own key).
    A Python `std` of 0 draws nothing (on a large model the draw costs about a gradient computation)."""
    if isinstance(std, (int, float)) and std == 0:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))

    # random_normal: jax.random.normal's bits with the threefry rounds unrolled (several times faster on CPU).
    # Drawn inside a conditional, which no fusion crosses, so the noise is computed once into a buffer:
    # XLA's CPU pipeline drops optimization barriers before it fuses, and then copied the (integer, so
    # "cheap") hash into each fusion that reads the noise (Adam has three), drawing it 3-4 times
    # (benchmarks/findings.md, case (e)). Both branches draw the same noise: the predicate, which
    # XLA cannot fold, changes nothing. (Under vmap with a batched key the conditional becomes a select
    # of two equal values, which XLA folds back: the draw is then fused as before.)
    def draw(keys: Array) -> list[Array]:  # not strict: a tree without leaves still has a key (for the predicate)
        return [random_normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=False)]

    noise = jax.lax.cond(jax.random.key_data(keys[0])[0] > 0, draw, draw, keys)
    noisy = [x + std * n for x, n in zip(leaves, noise, strict=True)]
    return jax.tree.unflatten(treedef, noisy)


def _real_examples(batch: Batch) -> tuple[Batch, Float[Array, " batch"]]:
    """The batch with padding labels replaced by a valid class (so their gradients stay finite) and
    the 0/1 weights that drop them."""
    real = batch.labels != PADDING_LABEL
    return Batch(batch.inputs, jnp.where(real, batch.labels, 0)), real.astype(jnp.float32)


def _weighted_means(values: dict[str, Array], weights: Float[Array, " batch"]) -> Metrics:
    count = jnp.maximum(jnp.sum(weights), 1.0)
    return {k: jnp.sum(v.astype(jnp.float32) * weights) / count for k, v in values.items()}


@dataclasses.dataclass(frozen=True)
class DPSGDLoss:
    """The loss of a DP-SGD run: pass it as `loss_fn` to `fit` / `run_experiment` / `train_step`.

    **Arguments:**

    - `clip_norm`: C, the bound every per-example gradient is clipped to.
    - `noise_multiplier`: sigma; the noise added to the clipped sum has standard deviation sigma * C.
    - `expected_batch_size`: the divisor of the noisy sum: the expected number of real examples per
      step (`PoissonLoader.expected_batch_size`); with fixed-size batches, the batch size.
    - `example_loss`: the loss of one example (default: classification cross-entropy).
    - `chunk_size`: accumulate the clipped sum this many examples at a time (bounds memory; chunks
      that are all padding are skipped); `None`: the whole batch in one vmap.
    - `method`: how the per-example gradients are clipped: `"vmap"` materialises each of them;
      `"ghost"` takes their norms and the clipped sum from each layer's inputs and output gradients
      (one backward pass; no per-example gradient: the memory of ordinary training; models
      of `eqx.nn.Linear` layers and `conv1d_as_matmul` convolutions); `"auto"`: ghost where it covers
      the model (`ghost_problem`), else vmap. The same update up to float rounding.

    Calling it gives the (non-private) mean loss over the real examples, like any `LossFn`. The
    training metrics it reports (loss, accuracy, `clipped_fraction`, `example_grad_norm`,
    `batch_size`) are computed from the private batch and are not themselves privatised.
    """

    clip_norm: float | int
    noise_multiplier: float | int
    expected_batch_size: float | int
    example_loss: ExampleLossFn = classification_example_loss
    chunk_size: int | None = None
    method: ClippingMethod = "auto"

    def __post_init__(self) -> None:
        if self.method not in CLIPPING_METHODS:
            raise ValueError(f"DPSGDLoss: method must be one of {', '.join(CLIPPING_METHODS)}, got {self.method!r}")
        if not self.clip_norm > 0:
            raise ValueError(f"DPSGDLoss: clip_norm must be positive, got {self.clip_norm}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"DPSGDLoss: noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"DPSGDLoss: expected_batch_size must be positive, got {self.expected_batch_size}")

    def __call__(
        self, model: eqx.Module, model_state: eqx.nn.State | None, batch: Batch, key: PRNGKeyArray
    ) -> tuple[Float[Array, ""], tuple[Metrics, eqx.nn.State | None]]:
        example_key, _ = jax.random.split(key)
        batch, weights = _real_examples(batch)
        losses = per_example_losses(
            model, model_state, batch, example_key, loss_fn=self.example_loss, chunk_size=self.chunk_size
        )
        loss = _weighted_means({"loss": losses}, weights)["loss"]
        return loss, ({"loss": loss}, model_state)

    def micro_batch_sums(
        self, model: eqx.Module, model_state: eqx.nn.State | None, batch: Batch, key: PRNGKeyArray
    ) -> tuple[tuple[PyTree, dict[str, Array], Array], eqx.nn.State | None]:
        """`((clipped gradient sum, metric sums, real examples), model state)` of `batch`: what
        `from_micro_batch_sums` privatises once they are summed over the whole batch (over devices, or
        over `--deterministic-reduction`'s micro-batches)."""
        example_key, _ = jax.random.split(key)
        batch, weights = _real_examples(batch)
        summed, norms, example_metrics = clipped_gradient_sum(
            model,
            model_state,
            batch,
            example_key,
            clip_norm=self.clip_norm,
            weights=weights,
            loss_fn=self.example_loss,
            chunk_size=self.chunk_size,
            method=self.method,
        )
        values = {**example_metrics, "clipped_fraction": norms > self.clip_norm, "example_grad_norm": norms}
        sums = {k: jnp.sum(v.astype(jnp.float32) * weights) for k, v in values.items()}
        # The model state is returned unchanged: per-example gradients need a model without batch statistics.
        return (summed, sums, jnp.sum(weights)), model_state

    def from_micro_batch_sums(
        self, total: tuple[PyTree, dict[str, Array], Array], key: PRNGKeyArray
    ) -> tuple[Float[Array, ""], Metrics, PyTree]:
        """`(loss, metrics, privatised gradient)` from the sums of the whole batch: the noise, drawn
        from the step key (the same on every device), is added once."""
        summed, sums, count = total
        _, noise_key = jax.random.split(key)
        noisy = add_gaussian_noise(summed, noise_key, self.noise_multiplier * self.clip_norm)
        grads = jax.tree.map(lambda g: g / self.expected_batch_size, noisy)
        metrics = {k: v / jnp.maximum(count, 1.0) for k, v in sums.items()}
        metrics["batch_size"] = count
        return metrics["loss"], metrics, grads

    def value_and_grad(
        self,
        model: eqx.Module,
        model_state: eqx.nn.State | None,
        batch: Batch,
        key: PRNGKeyArray,
        *,
        axis_name: str | None = None,
    ) -> tuple[tuple[Float[Array, ""], tuple[Metrics, eqx.nn.State | None]], PyTree]:
        """The privatised gradient `(sum_i clip(g_i) + N(0, (sigma C)^2 I)) / expected_batch_size`,
        in the output format of `eqx.filter_value_and_grad(loss, has_aux=True)`.

        With `axis_name` (`batch` is one device's slice of the global batch) the clipped sums and the
        metric sums are summed over the devices first and the noise, drawn from the same key on every
        device, is added once: the same update as on one device."""
        total, model_state = self.micro_batch_sums(model, model_state, batch, key)
        if axis_name is not None:
            total = jax.lax.psum(total, axis_name)
        loss, metrics, grads = self.from_micro_batch_sums(total, key)
        return (loss, (metrics, model_state)), grads
