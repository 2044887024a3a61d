"""`research`: typed Equinox models, explicit state, and a fast, resumable training loop for JAX."""

from typing import TYPE_CHECKING

from . import data, errors, nn, state, train, typing
from .data import DeviceLoader, TorchLoader, XORDataset, make_dataloader, numpy_collate
from .nn import MLP, LinearSigmoid, build_model
from .services import RunDir, load_checkpoint, save_checkpoint
from .train import TrainState, evaluate, fit, train_step
from .typing import typecheck

if TYPE_CHECKING:  # what `__getattr__` below loads on first use
    from .calls import sweep_experiment, train_experiment
    from .experiment import LoadedRun, load_run


def __getattr__(name: str):
    # `research.experiment` (run directories around the engine) sits above the layers imported here;
    # loaded on first use so that `import research` stays light.
    if name in ("LoadedRun", "load_run"):
        from . import experiment

        return getattr(experiment, name)
    if name in ("train_experiment", "sweep_experiment"):
        from . import calls

        return getattr(calls, name)
    raise AttributeError(f"module 'research' has no attribute {name!r}")


__all__ = [
    "LoadedRun",
    "MLP",
    "DeviceLoader",
    "LinearSigmoid",
    "RunDir",
    "TorchLoader",
    "TrainState",
    "XORDataset",
    "build_model",
    "data",
    "errors",
    "evaluate",
    "fit",
    "load_checkpoint",
    "load_run",
    "make_dataloader",
    "nn",
    "numpy_collate",
    "save_checkpoint",
    "state",
    "sweep_experiment",
    "train",
    "train_experiment",
    "train_step",
    "typecheck",
    "typing",
]
