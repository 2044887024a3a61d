"""`research`: typed Equinox models, explicit state, and a fast, resumable training loop for JAX."""

from . import data, errors, nn, state, train, typing
from .data import DeviceLoader, TorchLoader, XORDataset, make_dataloader, numpy_collate
from .nn import MLP, LinearSigmoid, build_model
from .train import RunDir, TrainState, evaluate, fit, load_checkpoint, save_checkpoint, train_step
from .typing import typecheck

__all__ = [
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
    "make_dataloader",
    "nn",
    "numpy_collate",
    "save_checkpoint",
    "state",
    "train",
    "train_step",
    "typecheck",
    "typing",
]
