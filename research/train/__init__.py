"""TrainState, the pure train step and its compiled fast path, evaluation, fit, checkpoints, run dirs."""

from ._checkpoint import CheckpointError, load_checkpoint, read_header, save_checkpoint
from ._compiled import CompiledTrainer, compiled_trainer
from ._evaluate import evaluate
from ..data import DataError
from ._fit import FitResult, NonFiniteError, fit
from ._rundir import RunDir
from ._state import (
    LossFn,
    Metrics,
    TrainState,
    classification_loss,
    classification_metrics,
    forward,
    train_step,
)

__all__ = [
    "CheckpointError",
    "CompiledTrainer",
    "DataError",
    "FitResult",
    "LossFn",
    "Metrics",
    "NonFiniteError",
    "RunDir",
    "TrainState",
    "classification_loss",
    "classification_metrics",
    "compiled_trainer",
    "evaluate",
    "fit",
    "forward",
    "load_checkpoint",
    "read_header",
    "save_checkpoint",
    "train_step",
]
