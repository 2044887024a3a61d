"""Arrays under names: the dotted path of every array of a model (`blocks.0.conv1.weight`), which names the
arrays of checkpoints and of exported weights (safetensors, .npz), and loads such a file back into a model.

A name joins the attributes, dictionary keys and sequence indices on the way to an array with dots; the
entries of an `eqx.nn.State` (BatchNorm's running statistics) are named after the layer that owns them
(`ImageResNet.stem_norm.batch_state_index.0`).
"""

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np

from ..errors import CheckpointError

T = TypeVar("T")


def _key_text(key: Any) -> str:
    for attribute in ("name", "key", "idx"):  # GetAttrKey, DictKey / FlattenedIndexKey, SequenceKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _dotted(path: tuple[Any, ...]) -> list[str]:
    return [_key_text(key) for key in path]


def path_name(path: tuple[Any, ...]) -> str:
    """The name of the leaf at a `jax.tree_util` key path, as `array_names` gives it (`blocks.mlp_in.weight`)."""
    return ".".join(_dotted(path))


def is_array_leaf(leaf: Any) -> bool:
    """Whether `leaf` is an array or an array's shape and dtype (`jax.ShapeDtypeStruct`, as
    `eqx.filter_eval_shape` leaves them): what a checkpoint holds, or restores into."""
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def array_names(tree: Any) -> list[str]:
    """The name of every array leaf of `tree` (`is_array_leaf`: abstract ones too), in the order of
    `jax.tree.leaves(eqx.filter(tree, is_array_leaf))`."""
    arrays = eqx.filter(tree, is_array_leaf)
    names = []
    is_state = lambda node: isinstance(node, eqx.nn.State)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(arrays, is_leaf=is_state)[0]:
        if is_state(node):
            values, markers = node.tree_flatten()
            for marker, value in zip(markers, values, strict=True):
                owner = re.sub(r"\[(\w+)\]", r".\1", str(marker)).split(".")
                names += [
                    ".".join(_dotted(path) + owner + _dotted(sub))
                    for sub, _ in jax.tree_util.tree_flatten_with_path(value)[0]
                ]
        else:
            names.append(".".join(_dotted(path)))
    if len(set(names)) != len(names):
        twice = sorted(n for n in names if names.count(n) > 1)
        raise ValueError(f"two arrays of this tree have the same name: {twice[0]}")
    return names


def named_arrays(tree: Any) -> dict[str, Any]:
    """`{name: array}` of every array leaf of `tree` (see `array_names`), in order."""
    return dict(zip(array_names(tree), jax.tree.leaves(eqx.filter(tree, is_array_leaf)), strict=True))


def save_weights(
    path: str | Path, model: Any, state: eqx.nn.State | None = None, *, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write `model`'s arrays under their names (and `state`'s under `state.`) to `path`: a `.safetensors`
    file (any other suffix: numpy's `.npz`), with `metadata` (text) beside them; returns the path."""
    path = Path(path)
    arrays = {name: np.array(value, order="C") for name, value in named_arrays(model).items()}  # 0-d stays 0-d
    if state is not None:
        arrays.update({f"state.{name}": np.array(value, order="C") for name, value in named_arrays(state).items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file(arrays, str(path), metadata=dict(metadata or {}))
    else:
        with open(path, "wb") as f:  # a file object: np.savez would add .npz to a name without it
            # (numpy's stub reads **arrays as maybe holding `allow_pickle`; the names are dotted paths.)
            np.savez(f, **arrays, __metadata__=np.array(json.dumps(dict(metadata or {}))))  # pyright: ignore[reportArgumentType]
    return path


def read_weights(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The arrays and the metadata of a file of `save_weights` (`scripts/export`)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files if k != "__metadata__"}
            metadata = json.loads(str(npz["__metadata__"])) if "__metadata__" in npz.files else {}
        return arrays, metadata
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def load_weights(path: str | Path, model: T, state: eqx.nn.State | None = None) -> tuple[T, eqx.nn.State | None]:
    """`(model, state)` with their arrays read from a file of `scripts/export` (safetensors or .npz): the
    model's under their names, the state's (BatchNorm statistics) under `state.` and theirs. `model` and
    `state` are a skeleton of the same architecture (say `build_model` with the run's config); a missing
    array, one of another shape or dtype, or one the model does not have is a `CheckpointError`."""
    arrays, _ = read_weights(path)
    loaded_model = _fill(path, model, arrays, "")
    loaded_state = None if state is None else _fill(path, state, arrays, "state.")
    unused = sorted(set(arrays) - set(array_names(model)) - {f"state.{n}" for n in array_names(state)})
    if unused:
        raise CheckpointError(
            f"{path} holds {unused[0]}, which the model does not have"
            + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
        )
    return loaded_model, loaded_state


def _fill(path: str | Path, tree: T, arrays: Mapping[str, np.ndarray], prefix: str) -> T:
    dynamic, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    filled = []
    for name, leaf in zip(array_names(tree), leaves, strict=True):
        found = arrays.get(prefix + name)
        if found is None:
            raise CheckpointError(f"{path} has no {prefix + name} ({list(leaf.shape)} {leaf.dtype})")
        if found.shape != leaf.shape or found.dtype != leaf.dtype:
            raise CheckpointError(
                f"{path}: {prefix + name} is {list(found.shape)} {found.dtype}, the model's "
                f"{list(leaf.shape)} {leaf.dtype}"
            )
        filled.append(jax.numpy.asarray(found))
    return eqx.combine(jax.tree.unflatten(treedef, filled), static)
