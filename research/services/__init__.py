"""The services a run uses, for the engine and for a loop of your own (`docs/hand_written_loop.md`):
checkpoints of any pytree in the checksummed commit-marker format, the run directory, SIGTERM and
SIGINT as a request to stop, and the trackers (metrics.jsonl, TensorBoard, W&B, MLflow)."""

from ._checkpoint import CheckpointWriter, checkpoint_digest, load_checkpoint, read_header, save_checkpoint, tree_digest
from ._mlflow import MlflowTracker
from ._rundir import RUNS_ROOT, Headline, RunDir
from ._signals import StopSignals
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
    summary_metrics,
    tensorboard_problem,
    tracker_problem,
    trackers_problem,
)
from ._wandb import WandbTracker, read_wandb_runs

__all__ = [
    "RUNS_ROOT",
    "TRACKERS",
    "CheckpointWriter",
    "Ending",
    "Headline",
    "JsonlTracker",
    "MlflowTracker",
    "MultiTracker",
    "RunDir",
    "RunTracker",
    "StopSignals",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "checkpoint_digest",
    "load_checkpoint",
    "parse_trackers",
    "read_header",
    "read_tensorboard_scalars",
    "read_wandb_runs",
    "save_checkpoint",
    "scalars",
    "summary_metrics",
    "tensorboard_problem",
    "tracker_problem",
    "trackers_problem",
    "tree_digest",
]
