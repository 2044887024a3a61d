from collections.abc import Callable
from typing import Any

import equinox as eqx

from ..typing import PRNGKeyArray
from ._cnn import CNN1d
from ._generative import Discriminator, Generator, UNet
from ._gru import GRUClassifier
from ._image_resnet import ImageResNet
from ._lm import LanguageModel
from ._logistic import Logistic
from ._mlp import MLP, LinearSigmoid
from ._resnet import ResNet1d
from ._transformer import TransformerClassifier
from ._vit import VisionTransformer

ModelAndState = tuple[eqx.Module, eqx.nn.State | None]

_REGISTRY: dict[str, Callable[..., eqx.Module]] = {}


def register_model(name: str, constructor: Callable[..., eqx.Module]) -> None:
    """Make `constructor(**hparams, key=key)` buildable by name (e.g. from a checkpoint header).

    A constructor whose class sets `stateful = True` is built with `eqx.nn.make_with_state`.
    """
    if name in _REGISTRY and _REGISTRY[name] is not constructor:
        raise ValueError(f"model name {name!r} is already registered to {_REGISTRY[name]}")
    _REGISTRY[name] = constructor


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def build_model(name: str, *, key: PRNGKeyArray, **hparams: Any) -> ModelAndState:
    """Build a registered model; returns `(model, state)`, with `state=None` for stateless models."""
    try:
        constructor = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(model_names())}") from None
    if getattr(constructor, "stateful", False):
        return eqx.nn.make_with_state(constructor)(**hparams, key=key)
    return constructor(**hparams, key=key), None


register_model("mlp", MLP)
register_model("linear_sigmoid", LinearSigmoid)
register_model("logistic", Logistic)
register_model("cnn", CNN1d)
register_model("gru", GRUClassifier)
register_model("resnet", ResNet1d)
register_model("transformer", TransformerClassifier)
register_model("lm", LanguageModel)
register_model("image_resnet", ImageResNet)
register_model("dcgan_generator", Generator)
register_model("dcgan_discriminator", Discriminator)
register_model("unet", UNet)
register_model("vit", VisionTransformer)
