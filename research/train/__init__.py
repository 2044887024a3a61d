"""TrainState, the pure train step and its compiled fast path, evaluation, fit, checkpoints (Orbax), run
dirs, trackers."""

from ._checkpoint import CheckpointWriter, checkpoint_digest, load_checkpoint, read_header, save_checkpoint, tree_digest
from ._compiled import CompiledTrainer, compiled_trainer
from ._evaluate import evaluate, evaluate_state, padded_batches
from ._placement import (Leaves, OneDevice, Placement, batch_norm_layers, bytes_on_first_device, check_batch_norm_axis,
                         copy_leaves, first_device)
from ..errors import CheckpointError, DataError, NonFiniteError
from ._engine import Engine, FitResult, StepInfo
from ._fit import fit
from ._language import NextTokenLoss, evaluate_language_model, next_token_sums
from ._hooks import Checkpoint, Evaluate, Evaluator, NonFiniteGuard, ShowProgress, Track
from ._rundir import RunDir
from ._tracking import (
    JsonlTracker,
    MultiTracker,
    TensorBoardTracker,
    Tracker,
    read_tensorboard_scalars,
    tensorboard_problem,
)
from ._keys import random_normal
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
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "CompiledTrainer",
    "DataError",
    "Engine",
    "Evaluate",
    "Evaluator",
    "FitResult",
    "JsonlTracker",
    "Leaves",
    "LossFn",
    "Metrics",
    "MultiTracker",
    "NextTokenLoss",
    "NonFiniteError",
    "NonFiniteGuard",
    "OneDevice",
    "Placement",
    "RunDir",
    "ShowProgress",
    "StepInfo",
    "TensorBoardTracker",
    "Track",
    "Tracker",
    "TrainState",
    "batch_norm_layers",
    "bytes_on_first_device",
    "check_batch_norm_axis",
    "classification_loss",
    "checkpoint_digest",
    "classification_metrics",
    "copy_leaves",
    "compiled_trainer",
    "evaluate",
    "evaluate_language_model",
    "evaluate_state",
    "example_keys",
    "first_device",
    "fit",
    "forward",
    "load_checkpoint",
    "padded_batches",
    "random_normal",
    "loss_value_and_grad",
    "next_token_sums",
    "read_header",
    "read_tensorboard_scalars",
    "save_checkpoint",
    "tensorboard_problem",
    "train_step",
    "tree_digest",
]
