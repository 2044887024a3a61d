"""TrainState, the pure train step and its compiled fast path, evaluation, fit, checkpoints, run dirs,
trackers."""

from ._checkpoint import load_checkpoint, read_header, save_checkpoint
from ._compiled import CompiledTrainer, compiled_trainer
from ._evaluate import evaluate, evaluate_state
from ..errors import CheckpointError, DataError, NonFiniteError
from ._fit import FitResult, fit
from ._rundir import RunDir
from ._tracking import (
    JsonlTracker,
    MultiTracker,
    TensorBoardTracker,
    Tracker,
    read_tensorboard_scalars,
    tensorboard_problem,
)
from ._state import (
    LossFn,
    Metrics,
    TrainState,
    classification_loss,
    classification_metrics,
    example_keys,
    forward,
    loss_value_and_grad,
    train_step,
)

__all__ = [
    "CheckpointError",
    "CompiledTrainer",
    "DataError",
    "FitResult",
    "JsonlTracker",
    "LossFn",
    "Metrics",
    "MultiTracker",
    "NonFiniteError",
    "RunDir",
    "TensorBoardTracker",
    "Tracker",
    "TrainState",
    "classification_loss",
    "classification_metrics",
    "compiled_trainer",
    "evaluate",
    "evaluate_state",
    "example_keys",
    "fit",
    "forward",
    "load_checkpoint",
    "loss_value_and_grad",
    "read_header",
    "read_tensorboard_scalars",
    "save_checkpoint",
    "tensorboard_problem",
    "train_step",
]
