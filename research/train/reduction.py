"""How a gradient of the global batch is put together, for a step or a loss of your own: the gradient of a
loss of the whole batch (`batch_loss_value_and_grad`), the check that a loss's micro-batches combine
(`check_micro_batch_loss`, `--deterministic-reduction`) and the fixed-order sum they combine by (`tree_sum`)."""

from ._batch_loss import batch_loss_value_and_grad
from ._micro import check_micro_batch_loss, tree_sum

__all__ = ["batch_loss_value_and_grad", "check_micro_batch_loss", "tree_sum"]
