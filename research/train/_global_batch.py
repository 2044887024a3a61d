"""Where the batch a step sees sits in the global batch, and how its values combine into the global batch's.

A step runs on the global batch (one device, or `jax.jit` over a mesh), on one device's equal slice of it
(`jax.pmap`, or a mesh under `--deterministic-reduction`), or on one micro-batch of it. `GlobalBatch` is
what the engine hands a `Step` to say which: its `value_and_grad` is the gradient of a loss over the
GLOBAL batch whatever the step sees, and `example_keys` gives each example the key it has in the global
batch (what a loss gets as its `keys`), so a run's numbers do not depend on the devices it runs on.

`GlobalBatch.value_and_grad` chooses among the ways to take that gradient, each in a module below this one:
a mean loss over device slices (`_rows.py`, where `example_keys` lives too), over micro-batches or parts
(`_micro.py`), a loss of the whole batch (`_batch_loss.py`).
"""

import dataclasses
from typing import Any

import equinox as eqx

from ..typing import Array, Float, PRNGKeyArray, PyTree
from ._batch_loss import AbstractBatchLoss, batch_loss_value_and_grad
from ._micro import accumulated_value_and_grad, micro_batch_value_and_grad
from ._rows import LossFn, Metrics, loss_value_and_grad


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """What a step's batch is of the global batch, handed to a `Step` by the engine: `axis_name` names the
    device axis the batch is split over (`None`: the step sees the whole global batch, or XLA splits it),
    `micro_batches` the fixed number of micro-batches of a layout-invariant step
    (`--deterministic-reduction`, `_micro.py`; `None`: none).

    A step takes every gradient and every metric of the global batch through `value_and_grad`, so that
    its numbers are the same on any placement (and, with micro-batches, the same bits)."""

    axis_name: str | None = None
    micro_batches: int | None = None

    def value_and_grad(
        self,
        loss_fn: LossFn,
        model: eqx.Module,
        model_state: Any,
        batch: PyTree,
        key: PRNGKeyArray,
        *,
        grad_accum: int = 1,
    ) -> tuple[tuple[Float[Array, ""], tuple[Metrics, Any]], PyTree]:
        """`eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, model_state, batch, keys)` of the global
        batch: `loss_fn` is a mean over its batch (`(loss, (metrics, new model state))`), and the result is
        that of the global batch, its metrics included, however the batch is split.

        `keys` holds one key a row of the batch the loss sees, that row's key in the global batch (`key`
        split by `example_keys`), so per-row draws do not depend on the split. A loss that asks for the one
        key instead (`takes_batch_key = True`) gets `key`; its draws across the batch change with the split,
        so it is refused where it sees part of the global batch unless it also sets `layout_free = True` (it
        splits the key with `example_keys`, or draws with `across_global_batch`). A loss with its own
        `value_and_grad` or `micro_batch_sums` (DP-SGD's) gets `key` and splits it itself.

        `grad_accum`: take it in that many parts of the batch this step sees (of each micro-batch, under
        micro-batches), one after another in a `jax.lax.scan`: the same gradient (to float rounding) with the
        activation memory of one part. Part `k` holds rows `k, k + grad_accum, ...`, which keeps the rows
        where a sharded batch has them; each example keeps its key in the global batch.

        A loss over the whole batch (`research.train.AbstractBatchLoss`: a contrastive loss, no mean of
        per-example terms) is the loss of the whole global batch too: its embeddings are gathered from every
        device (and micro-batch, and part) and its gradient pulled back through each one's rows (`_batch_loss.py`)."""
        if isinstance(loss_fn, AbstractBatchLoss):
            return batch_loss_value_and_grad(
                loss_fn,
                model,
                model_state,
                batch,
                key,
                axis_name=self.axis_name,
                micro_batches=self.micro_batches,
                grad_accum=grad_accum,
            )
        if self.micro_batches is None and grad_accum > 1:
            return accumulated_value_and_grad(
                loss_fn, model, model_state, batch, key, grad_accum=grad_accum, axis_name=self.axis_name
            )
        if self.micro_batches is None:
            return loss_value_and_grad(loss_fn, model, model_state, batch, key, axis_name=self.axis_name)
        return micro_batch_value_and_grad(
            loss_fn,
            model,
            model_state,
            batch,
            key,
            micro_batches=self.micro_batches,
            axis_name=self.axis_name,
            grad_accum=grad_accum,
        )
