"""TrainState, the pure train step and its compiled fast path, evaluation, fit, checkpoints (Orbax), run
dirs, trackers."""

from ..errors import CheckpointError, DataError, NonFiniteError
from ._checkpoint import CheckpointWriter, checkpoint_digest, load_checkpoint, read_header, save_checkpoint, tree_digest
from ._compiled import CompiledTrainer, compiled_trainer
from ._engine import Engine, FitResult, StepInfo
from ._evaluate import evaluate, evaluate_state, padded_batches
from ._fit import fit
from ._hooks import Checkpoint, Evaluate, Evaluator, NonFiniteGuard, Profile, ShowProgress, Track
from ._keys import random_normal
from ._language import NextTokenLoss, evaluate_language_model, next_token_sums
from ._micro import check_micro_batch_loss, micro_batch_value_and_grad, tree_sum
from ._mlflow import MlflowTracker
from ._placement import (
    Leaves,
    OneDevice,
    Placement,
    batch_norm_layers,
    bytes_on_first_device,
    check_batch_norm_axis,
    check_micro_batches,
    copy_leaves,
    first_device,
)
from ._rundir import RunDir
from ._state import (
    LossFn,
    Metrics,
    TrainState,
    classification_loss,
    classification_metrics,
    example_keys,
    forward,
    loss_value_and_grad,
    rows_of_global_batch,
    train_step,
)
from ._tracking import (
    TRACKERS,
    Ending,
    JsonlTracker,
    MultiTracker,
    RunTracker,
    TensorBoardTracker,
    Tracker,
    parse_trackers,
    read_tensorboard_scalars,
    scalars,
    tensorboard_problem,
    tracker_problem,
    trackers_problem,
)
from ._wandb import WandbTracker, read_wandb_runs

__all__ = [
    "TRACKERS",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriter",
    "CompiledTrainer",
    "DataError",
    "Ending",
    "Engine",
    "Evaluate",
    "Evaluator",
    "FitResult",
    "JsonlTracker",
    "Leaves",
    "LossFn",
    "Metrics",
    "MlflowTracker",
    "MultiTracker",
    "NextTokenLoss",
    "NonFiniteError",
    "NonFiniteGuard",
    "OneDevice",
    "Placement",
    "Profile",
    "RunDir",
    "RunTracker",
    "ShowProgress",
    "StepInfo",
    "TensorBoardTracker",
    "Track",
    "Tracker",
    "TrainState",
    "WandbTracker",
    "batch_norm_layers",
    "bytes_on_first_device",
    "check_batch_norm_axis",
    "check_micro_batch_loss",
    "check_micro_batches",
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
    "micro_batch_value_and_grad",
    "rows_of_global_batch",
    "next_token_sums",
    "read_header",
    "parse_trackers",
    "read_tensorboard_scalars",
    "read_wandb_runs",
    "save_checkpoint",
    "scalars",
    "tensorboard_problem",
    "tracker_problem",
    "trackers_problem",
    "train_step",
    "tree_sum",
    "tree_digest",
]
