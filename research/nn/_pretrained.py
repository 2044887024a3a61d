"""GPT-2 and ViT checkpoints as Hugging Face `transformers` saves them (`save_pretrained`: `config.json` and
`model.safetensors`), read into a `LanguageModel` or a `VisionTransformer` and written back from one.

A GPT-2 is this codebase's decoder (pre-norm blocks, learned positions, tanh-approximated GELU, LayerNorm
eps 1e-5, a head tied to the embedding) with biases on its attention projections (`attention_bias=True`),
so a loaded GPT-2 trains, samples and exports like any `LanguageModel`. The name map: GPT-2's `h.{i}.*`
tensors are the i-th slice of the stacked blocks; its Conv1D weights are `[in, out]`, an `eqx.nn.Linear`'s
`[out, in]`; its fused `c_attn` is the query, key and value projections side by side. Any `LanguageModel`
writes out as a GPT-2 (attention without biases: zero biases), which `transformers` loads.
"""

import json
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import CheckpointError
from ._lm import LanguageModel
from ._vit import VisionTransformer
from ._weights import named_arrays, path_name

Model = TypeVar("Model", LanguageModel, VisionTransformer)
# What a GPT-2 config must say for the LanguageModel to compute what `transformers` does: field, value.
FIXED = {
    "activation_function": "gelu_new",  # jax.nn.gelu's tanh approximation
    "layer_norm_epsilon": 1e-5,  # eqx.nn.LayerNorm's
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}
BLOCK_TENSORS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)
BUFFERS = (".attn.bias", ".attn.masked_bias")  # older checkpoints keep the causal mask: not parameters


def _config(directory: Path, model_type: str, fixed: dict[str, Any], sizes: tuple[str, ...]) -> dict[str, Any]:
    """`config.json` of `directory`, refused unless it is a `model_type` with the `fixed` settings and positive
    integer `sizes`."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is no Hugging Face model directory: it has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if config.get("model_type") != model_type:
        raise CheckpointError(f"{path}: model_type {config.get('model_type')!r} is not read here (only {model_type!r})")
    for field, value in fixed.items():
        if field in config and config[field] != value:
            raise CheckpointError(f"{path}: {field} {config[field]!r} is not read here (only {value!r})")
    for field in sizes:
        if not isinstance(config.get(field), int) or config[field] < 1:
            raise CheckpointError(f"{path}: {field} must be a positive integer, got {config.get(field)!r}")
    return config


def _checked(directory: Path, tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]]) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{directory}: the checkpoint has no tensor {name} (a model of this config needs it)")
        if tensors[name].shape != shape:
            raise CheckpointError(
                f"{directory}: tensor {name} has shape {list(tensors[name].shape)}, the config asks for {list(shape)}"
            )
    if unexpected := sorted(set(tensors) - set(expected)):
        raise CheckpointError(f"{directory}: unexpected tensor {unexpected[0]} ({len(unexpected)} not read here)")


def _tensors(directory: Path, prefix: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (one file, or the shards an index names) as float32 numpy arrays, under
    names without `prefix` (`transformer.`, which `GPT2LMHeadModel` gives them; `vit.`)."""
    from safetensors import SafetensorError, safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [directory / "model.safetensors"]
    tensors = {}
    for path in files:
        if not path.exists():
            raise CheckpointError(f"{directory} has no {path.name} (save_pretrained's weights, in safetensors)")
        try:
            with safe_open(str(path), "np") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    tensors[name.removeprefix(prefix)] = f.get_tensor(name).astype(np.float32)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return tensors


def _expected_shapes(config: dict[str, Any], tied: bool) -> dict[str, tuple[int, ...]]:
    dim, vocab, inner = config["n_embd"], config["vocab_size"], config.get("n_inner") or 4 * config["n_embd"]
    block = {
        "ln_1.weight": (dim,),
        "ln_1.bias": (dim,),
        "attn.c_attn.weight": (dim, 3 * dim),
        "attn.c_attn.bias": (3 * dim,),
        "attn.c_proj.weight": (dim, dim),
        "attn.c_proj.bias": (dim,),
        "ln_2.weight": (dim,),
        "ln_2.bias": (dim,),
        "mlp.c_fc.weight": (dim, inner),
        "mlp.c_fc.bias": (inner,),
        "mlp.c_proj.weight": (inner, dim),
        "mlp.c_proj.bias": (dim,),
    }
    shapes = {
        "wte.weight": (vocab, dim),
        "wpe.weight": (config["n_positions"], dim),
        "ln_f.weight": (dim,),
        "ln_f.bias": (dim,),
    }
    shapes |= {f"h.{i}.{name}": shape for i in range(config["n_layer"]) for name, shape in block.items()}
    return shapes if tied else shapes | {"lm_head.weight": (vocab, dim)}


def load_gpt2(directory: str | Path) -> LanguageModel:
    """The GPT-2 that `transformers` saved in `directory` (`GPT2LMHeadModel.save_pretrained`: `config.json`
    and `model.safetensors`, or its shards and their index) as a float32 `LanguageModel` with attention biases:
    the same logits as `transformers` computes, to float rounding.

    **Raises:** `CheckpointError` in one line naming the file and the field or tensor: no config or weights, a
    model type or setting this model does not compute (`FIXED`), a missing, unexpected or misshapen tensor.
    """
    directory = Path(directory)
    config = _config(directory, "gpt2", FIXED, ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"))
    if config["n_embd"] % config["n_head"]:
        raise CheckpointError(f"{directory}: n_head {config['n_head']} does not divide n_embd {config['n_embd']}")
    tensors = {n: t for n, t in _tensors(directory, "transformer.").items() if not n.endswith(BUFFERS)}
    tied = config.get("tie_word_embeddings", True) or "lm_head.weight" not in tensors
    if tied:
        tensors.pop("lm_head.weight", None)  # transformers >= 5 may write the tied head out as well
    _checked(directory, tensors, _expected_shapes(config, tied))

    dim, depth = config["n_embd"], config["n_layer"]
    block = lambda name: np.stack([tensors[f"h.{i}.{name}"] for i in range(depth)])  # noqa: E731
    qkv_weight, qkv_bias = block("attn.c_attn.weight"), block("attn.c_attn.bias")
    arrays = {  # ours, in LanguageModel's field paths, from GPT-2's (Conv1D `[in, out]` -> Linear `[out, in]`)
        "token_embedding.weight": tensors["wte.weight"],
        "positions": tensors["wpe.weight"],
        "norm.weight": tensors["ln_f.weight"],
        "norm.bias": tensors["ln_f.bias"],
        "blocks.attention_norm.weight": block("ln_1.weight"),
        "blocks.attention_norm.bias": block("ln_1.bias"),
        "blocks.mlp_norm.weight": block("ln_2.weight"),
        "blocks.mlp_norm.bias": block("ln_2.bias"),
        "blocks.attention.output_proj.weight": block("attn.c_proj.weight").transpose(0, 2, 1),
        "blocks.attention.output_proj.bias": block("attn.c_proj.bias"),
        "blocks.mlp_in.weight": block("mlp.c_fc.weight").transpose(0, 2, 1),
        "blocks.mlp_in.bias": block("mlp.c_fc.bias"),
        "blocks.mlp_out.weight": block("mlp.c_proj.weight").transpose(0, 2, 1),
        "blocks.mlp_out.bias": block("mlp.c_proj.bias"),
    }
    for k, projection in enumerate(("query_proj", "key_proj", "value_proj")):
        arrays[f"blocks.attention.{projection}.weight"] = qkv_weight[:, :, k * dim : (k + 1) * dim].transpose(0, 2, 1)
        arrays[f"blocks.attention.{projection}.bias"] = qkv_bias[:, k * dim : (k + 1) * dim]
    if not tied:
        arrays["head.weight"] = tensors["lm_head.weight"]

    def build() -> LanguageModel:
        return LanguageModel(
            context=config["n_positions"],
            vocab=config["vocab_size"],
            dim=dim,
            depth=depth,
            heads=config["n_head"],
            mlp_dim=config.get("n_inner") or 4 * dim,
            tied=tied,
            attention_bias=True,
            key=jax.random.key(0),
        )

    skeleton = eqx.filter_eval_shape(build)  # the structure, no random weights drawn
    return _with_arrays(skeleton, {name: jnp.asarray(a) for name, a in arrays.items()})


def _with_arrays(skeleton: Model, arrays: dict[str, jax.Array]) -> Model:
    """`skeleton` (shapes only) with `arrays` in place, each under its `array_names` name."""
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=is_shape)[0]]
    if sorted(n for n in names if n in arrays) != sorted(arrays):  # a bug in the name map, not in the file
        raise AssertionError(f"the name map misses {sorted(set(arrays) - set(names))}")
    fill = lambda path, x: arrays[path_name(path)] if is_shape(x) else x  # noqa: E731
    return jax.tree_util.tree_map_with_path(fill, skeleton, is_leaf=is_shape)


def save_gpt2(model: LanguageModel, directory: str | Path) -> None:
    """Write `model` to `directory` as `transformers` saves a GPT-2 (`config.json`, `model.safetensors`), so that
    `GPT2LMHeadModel.from_pretrained(directory)` computes its logits. A model without attention biases gets zero
    biases; the weights are written in float32."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(a, np.float32) for name, a in named_arrays(model).items()}
    dim, depth = arrays["token_embedding.weight"].shape[1], model.depth
    zeros = np.zeros((depth, dim), np.float32)
    linear = lambda name: arrays[f"blocks.{name}.weight"].transpose(0, 2, 1)  # noqa: E731  [out, in] -> [in, out]
    bias = lambda name: arrays.get(f"blocks.{name}.bias", zeros)  # noqa: E731
    projections = ("attention.query_proj", "attention.key_proj", "attention.value_proj")
    per_block = {
        "ln_1.weight": arrays["blocks.attention_norm.weight"],
        "ln_1.bias": arrays["blocks.attention_norm.bias"],
        "attn.c_attn.weight": np.concatenate([linear(p) for p in projections], axis=2),
        "attn.c_attn.bias": np.concatenate([bias(p) for p in projections], axis=1),
        "attn.c_proj.weight": linear("attention.output_proj"),
        "attn.c_proj.bias": bias("attention.output_proj"),
        "ln_2.weight": arrays["blocks.mlp_norm.weight"],
        "ln_2.bias": arrays["blocks.mlp_norm.bias"],
        "mlp.c_fc.weight": linear("mlp_in"),
        "mlp.c_fc.bias": arrays["blocks.mlp_in.bias"],
        "mlp.c_proj.weight": linear("mlp_out"),
        "mlp.c_proj.bias": arrays["blocks.mlp_out.bias"],
    }
    tensors = {
        "transformer.wte.weight": arrays["token_embedding.weight"],
        "transformer.wpe.weight": arrays["positions"],
        "transformer.ln_f.weight": arrays["norm.weight"],
        "transformer.ln_f.bias": arrays["norm.bias"],
    }
    tensors |= {f"transformer.h.{i}.{name}": t[i] for name, t in per_block.items() for i in range(depth)}
    if model.head is not None:
        tensors["lm_head.weight"] = arrays["head.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": dim,
        "n_layer": depth,
        "n_head": model.blocks.attention.num_heads,
        "n_positions": model.context,
        "n_inner": arrays["blocks.mlp_in.weight"].shape[1],
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.head is None,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
        **FIXED,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


VIT_FIXED = {"hidden_act": "gelu", "qkv_bias": True}  # exact GELU, as EncoderBlock computes it
VIT_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "image_size",
    "patch_size",
    "num_channels",
)
VIT_BLOCK = {  # GPT-2's `h.{i}` is ViT's `encoder.layer.{i}`: its tensor -> our stacked array (torch's Linear is ours)
    "layernorm_before": "attention_norm",
    "attention.attention.query": "attention.query_proj",
    "attention.attention.key": "attention.key_proj",
    "attention.attention.value": "attention.value_proj",
    "attention.output.dense": "attention.output_proj",
    "layernorm_after": "mlp_norm",
    "intermediate.dense": "mlp_in",
    "output.dense": "mlp_out",
}


def _image_statistics(directory: Path, channels: int) -> tuple[list[float], list[float]]:
    """The per-channel mean and std of the image processor saved beside the model (`preprocessor_config.json`;
    without one, `ViTImageProcessor`'s defaults: 0.5 and 0.5), refused unless it rescales 0-255 to 0-1."""
    path = directory / "preprocessor_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return [0.5] * channels, [0.5] * channels
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not config.get("do_rescale", True) or abs(config.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-9:
        raise CheckpointError(f"{path}: only an image processor that rescales by 1/255 is read here")
    if not config.get("do_normalize", True):
        return [0.0] * channels, [1.0] * channels
    statistics = []
    for field in ("image_mean", "image_std"):
        value = config.get(field, 0.5)
        values = [value] * channels if isinstance(value, int | float) else value
        numbers = isinstance(values, list) and all(isinstance(v, int | float) for v in values)
        if not numbers or len(values) != channels:
            raise CheckpointError(f"{path}: {field} must be a number or {channels} numbers, got {value!r}")
        statistics.append([float(v) for v in values])
    if min(statistics[1]) <= 0:
        raise CheckpointError(f"{path}: image_std must be positive, got {statistics[1]}")
    return statistics[0], statistics[1]


def load_vit(directory: str | Path) -> VisionTransformer:
    """The image classifier that `transformers` saved in `directory` (`ViTForImageClassification.save_pretrained`)
    as a float32 `VisionTransformer`: the logits `transformers` computes of `pixel_values`, given the same
    images height x width x channels, to float rounding. A `uint8` image is preprocessed as the image processor
    saved beside it does (`preprocessor_config.json`'s `image_mean` and `image_std`; without one,
    `ViTImageProcessor`'s 0.5 and 0.5), resized to nothing: its size must be the model's.

    **Raises:** `CheckpointError` in one line, as `load_gpt2`'s.
    """
    directory = Path(directory)
    config = _config(directory, "vit", VIT_FIXED, VIT_SIZES)
    dim, depth, inner = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    image, patch, channels = config["image_size"], config["patch_size"], config["num_channels"]
    if dim % config["num_attention_heads"] or image % patch:
        raise CheckpointError(f"{directory}: num_attention_heads must divide hidden_size, patch_size image_size")
    classes = len(config.get("id2label") or {}) or config.get("num_labels") or 2
    mean, std = _image_statistics(directory, channels)
    tensors = _tensors(directory, "vit.")
    shapes = {"layernorm_before": (dim,), "layernorm_after": (dim,), "intermediate.dense": (inner, dim)}
    shapes |= {"output.dense": (dim, inner)}
    expected = {
        "embeddings.cls_token": (1, 1, dim),
        "embeddings.position_embeddings": (1, 1 + (image // patch) ** 2, dim),
        "embeddings.patch_embeddings.projection.weight": (dim, channels, patch, patch),
        "embeddings.patch_embeddings.projection.bias": (dim,),
        "layernorm.weight": (dim,),
        "layernorm.bias": (dim,),
        "classifier.weight": (classes, dim),
        "classifier.bias": (classes,),
    }
    for i in range(depth):
        for theirs in VIT_BLOCK:
            weight = shapes.get(theirs, (dim, dim))
            expected[f"encoder.layer.{i}.{theirs}.weight"] = weight
            expected[f"encoder.layer.{i}.{theirs}.bias"] = weight[:1]
    _checked(directory, tensors, expected)

    arrays = {
        "patch_embedding.weight": tensors["embeddings.patch_embeddings.projection.weight"].reshape(dim, -1),
        "patch_embedding.bias": tensors["embeddings.patch_embeddings.projection.bias"],
        "class_token": tensors["embeddings.cls_token"].reshape(dim),
        "positions": tensors["embeddings.position_embeddings"][0],
        "norm.weight": tensors["layernorm.weight"],
        "norm.bias": tensors["layernorm.bias"],
        "head.weight": tensors["classifier.weight"],
        "head.bias": tensors["classifier.bias"],
    }
    for theirs, ours in VIT_BLOCK.items():
        for part in ("weight", "bias"):
            layers = [tensors[f"encoder.layer.{i}.{theirs}.{part}"] for i in range(depth)]
            arrays[f"blocks.{ours}.{part}"] = np.stack(layers)

    def build() -> VisionTransformer:
        return VisionTransformer(
            image, patch, channels, classes, dim, depth, config["num_attention_heads"], inner,
            config.get("layer_norm_eps", 1e-12), mean, std, key=jax.random.key(0),
        )  # fmt: skip

    return _with_arrays(eqx.filter_eval_shape(build), {name: jnp.asarray(a) for name, a in arrays.items()})


def save_vit(model: VisionTransformer, directory: str | Path) -> None:
    """Write `model` to `directory` as `transformers` saves a ViT image classifier, so that
    `ViTForImageClassification.from_pretrained(directory)` computes its logits, with the image processor that
    makes its `pixel_values` of `uint8` images as the model does (`preprocessor_config.json`:
    `ViTImageProcessor.from_pretrained(directory)`)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(a, np.float32) for name, a in named_arrays(model).items()}
    dim, depth = model.class_token.shape[0], model.blocks.mlp_in.weight.shape[0]
    tensors = {
        "vit.embeddings.cls_token": arrays["class_token"].reshape(1, 1, dim),
        "vit.embeddings.position_embeddings": arrays["positions"][None],
        "vit.embeddings.patch_embeddings.projection.weight": arrays["patch_embedding.weight"].reshape(
            dim, model.channels, model.patch, model.patch
        ),
        "vit.embeddings.patch_embeddings.projection.bias": arrays["patch_embedding.bias"],
        "vit.layernorm.weight": arrays["norm.weight"],
        "vit.layernorm.bias": arrays["norm.bias"],
        "classifier.weight": arrays["head.weight"],
        "classifier.bias": arrays["head.bias"],
    }
    for theirs, ours in VIT_BLOCK.items():
        for part in ("weight", "bias"):
            for i in range(depth):
                tensors[f"vit.encoder.layer.{i}.{theirs}.{part}"] = arrays[f"blocks.{ours}.{part}"][i]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": dim,
        "num_hidden_layers": depth,
        "num_attention_heads": model.blocks.attention.num_heads,
        "intermediate_size": arrays["blocks.mlp_in.weight"].shape[1],
        "image_size": model.image_size,
        "patch_size": model.patch,
        "num_channels": model.channels,
        "layer_norm_eps": model.norm.eps,
        "id2label": {str(i): f"LABEL_{i}" for i in range(model.classes)},
        "label2id": {f"LABEL_{i}": i for i in range(model.classes)},
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "dtype": "float32",
        **VIT_FIXED,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": model.image_size, "width": model.image_size},
        "resample": 2,  # bilinear
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(model.mean),
        "image_std": list(model.std),
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
