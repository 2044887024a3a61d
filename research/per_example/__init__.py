"""Per-example logic with vmap: losses, gradients, norms, clipping, and DP-SGD on top of them.

Write the loss of one example; `per_example_grads` maps it over the batch (model shared, examples
mapped). Norms and clipped sums can also be taken without any per-example gradient ("ghost
clipping", `method="ghost"`, the default where the model is covered; see `ghost_problem`).
`DPSGDLoss` turns that into DP-SGD for the ordinary train step, `PoissonLoader` draws the batches
its privacy accounting (`dp_sgd_epsilon`, via `dp-accounting`) assumes.
"""

from ._dp_sgd import PADDING_LABEL, DPSGDLoss, add_gaussian_noise
from ._grads import (
    CLIPPING_METHODS,
    BatchMetrics,
    ClippingMethod,
    ExampleLossFn,
    ExampleMetrics,
    check_per_example_model,
    classification_example_loss,
    clip_per_example,
    clipped_gradient_sum,
    ghost_problem,
    per_example_grad_norms,
    per_example_grads,
    per_example_losses,
    per_example_norms,
)
from ._poisson import PoissonLoader, default_max_batch_size, dp_sgd_epsilon

__all__ = [
    "CLIPPING_METHODS",
    "PADDING_LABEL",
    "BatchMetrics",
    "ClippingMethod",
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
    "ghost_problem",
    "per_example_grad_norms",
    "per_example_grads",
    "per_example_losses",
    "per_example_norms",
]
