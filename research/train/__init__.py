"""The engine: the step as a value (`Step`, `SupervisedStep`), train states, the compiled fast path,
hooks, evaluation and `fit`.

Around it: `research.parallel` (where the arrays live: one device, pmap, a sharded mesh, FSDP,
several processes) and `research.services` (checkpoints, the run directory, signals, trackers),
both usable without the engine.
"""

from ._batch_loss import AbstractBatchLoss, batch_loss_value_and_grad, nt_xent
from ._compiled import compiled_trainer
from ._engine import Engine, FitResult, StepInfo
from ._evaluate import (
    Evaluator,
    batch_evaluator,
    combined_evaluator,
    evaluate,
    evaluate_batches,
    evaluate_state,
    mean_of_sums,
    model_evaluator,
    padded_batches,
)
from ._fine_tuning import check_fine_tuning, trained_pattern, with_adapters
from ._fit import add_standard_hooks, fit
from ._frozen import Frozen, check_trainable, only_trainable, trainable_pattern
from ._global_batch import GlobalBatch
from ._hooks import Checkpoint, EarlyStopping, Evaluate, NonFiniteGuard, Profile, ShowProgress, Track
from ._keys import random_normal
from ._language import NextTokenLoss, evaluate_language_model
from ._micro import check_micro_batch_loss, tree_sum
from ._precision import InPrecision, LowPrecision, Precision
from ._probe import encoded, knn_accuracy, linear_probe_accuracy, probe_evaluator
from ._rows import Metrics, example_keys
from ._state import (
    SupervisedStep,
    TrainState,
    classification_loss,
    classification_metrics,
    forward,
    train_step,
)
from ._step import AbstractTrainState, Step, take_step

__all__ = [
    "AbstractBatchLoss",
    "AbstractTrainState",
    "Checkpoint",
    "EarlyStopping",
    "Engine",
    "Evaluate",
    "Evaluator",
    "FitResult",
    "Frozen",
    "GlobalBatch",
    "InPrecision",
    "LowPrecision",
    "Metrics",
    "NextTokenLoss",
    "NonFiniteGuard",
    "Precision",
    "Profile",
    "ShowProgress",
    "Step",
    "StepInfo",
    "SupervisedStep",
    "Track",
    "TrainState",
    "add_standard_hooks",
    "batch_evaluator",
    "batch_loss_value_and_grad",
    "check_fine_tuning",
    "check_micro_batch_loss",
    "check_trainable",
    "classification_loss",
    "classification_metrics",
    "combined_evaluator",
    "compiled_trainer",
    "encoded",
    "evaluate",
    "evaluate_batches",
    "evaluate_language_model",
    "evaluate_state",
    "example_keys",
    "fit",
    "forward",
    "knn_accuracy",
    "linear_probe_accuracy",
    "mean_of_sums",
    "model_evaluator",
    "nt_xent",
    "only_trainable",
    "padded_batches",
    "probe_evaluator",
    "random_normal",
    "take_step",
    "train_step",
    "tree_sum",
    "trainable_pattern",
    "trained_pattern",
    "with_adapters",
]
