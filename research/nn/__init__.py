"""Typed `eqx.Module` models. Each takes ONE example; batch with `jax.vmap`.

Registered names (`build_model(name, key=..., **hparams)`): `logistic`, `mlp`, `cnn`, `gru`,
`resnet` (stateful: built with its `eqx.nn.State`), `transformer`, `lm` (a byte-level decoder-only
language model), `image_resnet` (a ResNet for 28-32 px images, stateful), `dcgan_generator` and
`dcgan_discriminator` (a DCGAN pair for 28-32 px images, with group norm: stateless), `unet` (a small
DDPM noise-prediction U-Net), and `linear_sigmoid`.
`generate(model, prompt, length, key=...)` samples from an `lm` with a key-value cache.
"""

from ._actor_critic import ActorCritic
from ._batch_norm import BatchNorm
from ._cnn import CNN1d
from ._conv import conv1d_as_matmul, conv2d_as_matmul
from ._generate import generate
from ._generative import Discriminator, Generator, TimeResidualBlock, UNet
from ._gru import GRUClassifier
from ._image_resnet import ImageBlock, ImageResNet
from ._lm import DecoderBlock, LanguageModel, LastTokenClassifier, cast_floating, causal_attention
from ._logistic import Logistic
from ._lora import Adapter, LoRA, linear_layers
from ._masked import Masked
from ._mlp import ACTIVATIONS, MLP, LinearSigmoid
from ._pretrained import load_gpt2, load_vit, save_gpt2, save_vit
from ._registry import build_model, model_names, register_model
from ._resnet import ResidualBlock, ResNet1d
from ._taps import LinearMapObserver, observed_linear_map, observing_linear_maps
from ._transformer import TransformerBlock, TransformerClassifier
from ._vit import EncoderBlock, VisionTransformer
from ._weights import array_names, is_array_leaf, load_weights, named_arrays, path_name, read_weights, save_weights

__all__ = [
    "ActorCritic",
    "ACTIVATIONS",
    "BatchNorm",
    "CNN1d",
    "Adapter",
    "DecoderBlock",
    "EncoderBlock",
    "Discriminator",
    "GRUClassifier",
    "Generator",
    "ImageBlock",
    "ImageResNet",
    "LanguageModel",
    "LastTokenClassifier",
    "Logistic",
    "MLP",
    "Masked",
    "LinearMapObserver",
    "LoRA",
    "LinearSigmoid",
    "ResNet1d",
    "ResidualBlock",
    "TimeResidualBlock",
    "TransformerBlock",
    "TransformerClassifier",
    "VisionTransformer",
    "UNet",
    "array_names",
    "is_array_leaf",
    "build_model",
    "cast_floating",
    "causal_attention",
    "conv1d_as_matmul",
    "conv2d_as_matmul",
    "generate",
    "linear_layers",
    "load_gpt2",
    "load_vit",
    "load_weights",
    "model_names",
    "named_arrays",
    "observed_linear_map",
    "observing_linear_maps",
    "path_name",
    "read_weights",
    "register_model",
    "save_gpt2",
    "save_vit",
    "save_weights",
]
