"""The engine: the step as a value (`Step`, `SupervisedStep`), train states, the compiled fast path,
hooks, evaluation and `fit`.

Around it: `research.parallel` (where the arrays live: one device, pmap, a sharded mesh, FSDP,
several processes) and `research.services` (checkpoints, the run directory, signals, trackers),
both usable without the engine.

Here: what an experiment or a step of your own needs. The rest is in the sub-namespaces
`research.train.evaluation` (more evaluators, probes), `research.train.fine_tuning` (freezing, adapters),
`research.train.precision` (mixed precision) and `research.train.reduction` (the pieces of a global batch's
gradient).
"""

from ._batch_loss import AbstractBatchLoss, nt_xent
from ._compiled import compiled_trainer
from ._engine import Engine, FitResult, StepInfo
from ._evaluate import Evaluator, batch_evaluator, evaluate, model_evaluator
from ._fit import add_standard_hooks, fit
from ._global_batch import GlobalBatch
from ._hooks import Checkpoint, EarlyStopping, Evaluate, NonFiniteGuard, Profile, ShowProgress, Track
from ._keys import random_normal
from ._language import NextTokenLoss
from ._networks import AbstractNetworksState, Network
from ._rows import Metrics, across_global_batch, example_keys
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
    "AbstractNetworksState",
    "AbstractTrainState",
    "Checkpoint",
    "EarlyStopping",
    "Engine",
    "Evaluate",
    "Evaluator",
    "FitResult",
    "GlobalBatch",
    "Metrics",
    "Network",
    "NextTokenLoss",
    "NonFiniteGuard",
    "Profile",
    "ShowProgress",
    "Step",
    "StepInfo",
    "SupervisedStep",
    "Track",
    "TrainState",
    "across_global_batch",
    "add_standard_hooks",
    "batch_evaluator",
    "classification_loss",
    "classification_metrics",
    "compiled_trainer",
    "evaluate",
    "example_keys",
    "fit",
    "forward",
    "model_evaluator",
    "nt_xent",
    "random_normal",
    "take_step",
    "train_step",
]
