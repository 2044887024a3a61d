"""`research`: typed Equinox models, explicit state, and a fast, resumable training loop for JAX."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what `__getattr__` below loads on first use
    from . import data, errors, nn, state, train, typing
    from .calls import sweep_experiment, train_experiment
    from .data import DeviceLoader, TorchLoader, XORDataset, make_dataloader, numpy_collate
    from .experiment import LoadedRun, load_run
    from .nn import MLP, LinearSigmoid, build_model
    from .services import RunDir, load_checkpoint, save_checkpoint
    from .train import TrainState, evaluate, fit, train_step
    from .typing import typecheck

# Each public name and the submodule it comes from, imported on first use: `import research` (and the
# `research` command's --help) imports no JAX, and `research.experiment` sits above the layers below it.
_SUBMODULES = ("data", "errors", "nn", "state", "train", "typing")
_FROM = {
    "sweep_experiment": "calls",
    "train_experiment": "calls",
    "DeviceLoader": "data",
    "TorchLoader": "data",
    "XORDataset": "data",
    "make_dataloader": "data",
    "numpy_collate": "data",
    "LoadedRun": "experiment",
    "load_run": "experiment",
    "MLP": "nn",
    "LinearSigmoid": "nn",
    "build_model": "nn",
    "RunDir": "services",
    "load_checkpoint": "services",
    "save_checkpoint": "services",
    "TrainState": "train",
    "evaluate": "train",
    "fit": "train",
    "train_step": "train",
    "typecheck": "typing",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _FROM:
        value = getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
        globals()[name] = value  # found here from now on, without this function
        return value
    raise AttributeError(f"module 'research' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
