"""Typed `eqx.Module` models. Each takes ONE example; batch with `jax.vmap`."""

from ._mlp import ACTIVATIONS, MLP, LinearSigmoid
from ._registry import build_model, model_names, register_model

__all__ = ["ACTIVATIONS", "MLP", "LinearSigmoid", "build_model", "model_names", "register_model"]
