"""Per-example logic with vmap: losses, gradients, norms, clipping, and DP-SGD on top of them.

Write the loss of one example; `per_example_grads` maps it over the batch (model shared, examples
mapped). `DPSGDLoss` turns that into DP-SGD for the ordinary train step, `PoissonLoader` draws the
batches its privacy accounting (`dp_sgd_epsilon`, via `dp-accounting`) assumes.
"""

from ._dp_sgd import PADDING_LABEL, DPSGDLoss, add_gaussian_noise
from ._grads import (
    BatchMetrics,
    ExampleLossFn,
    ExampleMetrics,
    check_per_example_model,
    classification_example_loss,
    clip_per_example,
    clipped_gradient_sum,
    per_example_grad_norms,
    per_example_grads,
    per_example_losses,
)
from ._poisson import PoissonLoader, default_max_batch_size, dp_sgd_epsilon

__all__ = [
    "PADDING_LABEL",
    "BatchMetrics",
    "DPSGDLoss",
    "ExampleLossFn",
    "ExampleMetrics",
    "PoissonLoader",
    "add_gaussian_noise",
    "check_per_example_model",
    "classification_example_loss",
    "clip_per_example",
    "clipped_gradient_sum",
    "default_max_batch_size",
    "dp_sgd_epsilon",
    "per_example_grad_norms",
    "per_example_grads",
    "per_example_losses",
]
