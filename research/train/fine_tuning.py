"""Training part of a model: freezing leaves (`Frozen`, `only_trainable`), which leaves train by pattern,
low-rank adapters (`with_adapters`), and the checks that a fine-tuning run trains what it says."""

from ._fine_tuning import check_fine_tuning, trained_pattern, with_adapters
from ._frozen import Frozen, check_trainable, only_trainable, trainable_pattern

__all__ = [
    "Frozen",
    "check_fine_tuning",
    "check_trainable",
    "only_trainable",
    "trainable_pattern",
    "trained_pattern",
    "with_adapters",
]
