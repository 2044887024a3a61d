"""GPT-2 checkpoints as Hugging Face `transformers` saves them (`save_pretrained`: `config.json` and
`model.safetensors`), read into a `LanguageModel` and written back from one.

A GPT-2 is this codebase's decoder (pre-norm blocks, learned positions, tanh-approximated GELU, LayerNorm
eps 1e-5, a head tied to the embedding) with biases on its attention projections (`attention_bias=True`),
so a loaded GPT-2 trains, samples and exports like any `LanguageModel`. The name map: GPT-2's `h.{i}.*`
tensors are the i-th slice of the stacked blocks; its Conv1D weights are `[in, out]`, an `eqx.nn.Linear`'s
`[out, in]`; its fused `c_attn` is the query, key and value projections side by side. Any `LanguageModel`
writes out as a GPT-2 (attention without biases: zero biases), which `transformers` loads.
"""

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import CheckpointError
from ._lm import LanguageModel
from ._weights import _dotted, named_arrays

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


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is no Hugging Face model directory: it has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if config.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}: model_type {config.get('model_type')!r} is not read here (only 'gpt2')")
    for field, value in FIXED.items():
        if field in config and config[field] != value:
            raise CheckpointError(f"{path}: {field} {config[field]!r} is not read here (only {value!r})")
    for field in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"):
        if not isinstance(config.get(field), int) or config[field] < 1:
            raise CheckpointError(f"{path}: {field} must be a positive integer, got {config.get(field)!r}")
    if config["n_embd"] % config["n_head"]:
        raise CheckpointError(f"{path}: n_head {config['n_head']} does not divide n_embd {config['n_embd']}")
    return config


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (one file, or the shards an index names) as float32 numpy arrays, under
    names without the `transformer.` prefix that `GPT2LMHeadModel` gives them."""
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
                    tensors[name.removeprefix("transformer.")] = f.get_tensor(name).astype(np.float32)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return {name: t for name, t in tensors.items() if not name.endswith(BUFFERS)}


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
    config = _config(directory)
    tensors = _tensors(directory)
    tied = config.get("tie_word_embeddings", True) or "lm_head.weight" not in tensors
    if tied:
        tensors.pop("lm_head.weight", None)  # transformers >= 5 may write the tied head out as well
    expected = _expected_shapes(config, tied)
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{directory}: the checkpoint has no tensor {name} (a GPT-2 of this config needs it)")
        if tensors[name].shape != shape:
            raise CheckpointError(
                f"{directory}: tensor {name} has shape {list(tensors[name].shape)}, the config asks for {list(shape)}"
            )
    if unexpected := sorted(set(tensors) - set(expected)):
        raise CheckpointError(f"{directory}: unexpected tensor {unexpected[0]} ({len(unexpected)} not read here)")

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


def _with_arrays(skeleton: LanguageModel, arrays: dict[str, jax.Array]) -> LanguageModel:
    """`skeleton` (shapes only) with `arrays` in place, each under its `array_names` name."""
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    names = [".".join(_dotted(p)) for p, _ in jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=is_shape)[0]]
    if sorted(n for n in names if n in arrays) != sorted(arrays):  # a bug in the name map, not in the file
        raise AssertionError(f"the GPT-2 name map misses {sorted(set(arrays) - set(names))}")
    fill = lambda path, x: arrays[".".join(_dotted(path))] if is_shape(x) else x  # noqa: E731
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
