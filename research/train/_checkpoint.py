"""Checkpoint files: a JSON header line, then the `eqx.tree_serialise_leaves` bytes.

    RESEARCH-CHECKPOINT 1\\n
    {"sha256": ..., "payload_bytes": ..., ...user header...}\\n
    <payload>

Written atomically (temporary file in the same directory, fsync, rename, fsync of the directory),
so a reader sees either the old file or the complete new one. Loading checks the checksum before
deserialising into a skeleton, and never unpickles anything.
"""

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax

from ..errors import CheckpointError

MAGIC = b"RESEARCH-CHECKPOINT 1\n"
T = TypeVar("T")


def write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def leaf_summary(tree: Any) -> list[list[Any]]:
    """`[path, shape, dtype]` of every array leaf: enough to say how two architectures differ."""
    arrays = eqx.filter(tree, eqx.is_array)
    return [
        [jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]
    ]


def _describe_differences(saved: list[list[Any]], wanted: list[list[Any]], limit: int = 3) -> str:
    saved_by_path = {p: (tuple(s), d) for p, s, d in saved}
    wanted_by_path = {p: (tuple(s), d) for p, s, d in wanted}
    differences = []
    for path, (shape, dtype) in wanted_by_path.items():
        if path not in saved_by_path:
            differences.append(f"{path} is missing from the checkpoint")
        elif saved_by_path[path] != (shape, dtype):
            saved_shape, saved_dtype = saved_by_path[path]
            differences.append(f"{path}: saved {saved_shape} {saved_dtype}, expected {shape} {dtype}")
    differences += [f"{path} is in the checkpoint but not in the model" for path in saved_by_path
                    if path not in wanted_by_path]
    more = f" (and {len(differences) - limit} more)" if len(differences) > limit else ""
    return "; ".join(differences[:limit]) + more


def save_checkpoint(path: str | os.PathLike, tree: Any, header: dict[str, Any]) -> None:
    """Write `tree`'s array leaves with a JSON `header` (which must not use the keys `sha256`,
    `payload_bytes`, `leaves`)."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, tree)
    payload = buffer.getvalue()
    full_header = {**header, "leaves": leaf_summary(tree), "sha256": hashlib.sha256(payload).hexdigest(),
                   "payload_bytes": len(payload)}
    write_atomic(Path(path), MAGIC + json.dumps(full_header).encode() + b"\n" + payload)


def _read(path: Path) -> tuple[dict[str, Any], bytes]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if not raw.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a checkpoint file (bad magic line)")
    header_line, sep, payload = raw[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(header_line) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or "sha256" not in header:
        raise CheckpointError(f"checkpoint {path} has a damaged header")
    if len(payload) != header["payload_bytes"]:
        raise CheckpointError(
            f"checkpoint {path} is truncated: {len(payload)} of {header['payload_bytes']} payload bytes"
        )
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted: checksum mismatch")
    return header, payload


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header of a checkpoint, after verifying the file's checksum."""
    return _read(Path(path))[0]


def load_checkpoint(path: str | os.PathLike, skeleton: T) -> tuple[T, dict[str, Any]]:
    """Restore the leaves saved in `path` into `skeleton`, a tree of the same structure and shapes
    (typically built from the header's hyperparameters)."""
    header, payload = _read(Path(path))
    if "leaves" in header:
        differences = _describe_differences(header["leaves"], leaf_summary(skeleton))
        if differences:
            raise CheckpointError(f"checkpoint {path} is of a different architecture: {differences}")
    try:
        tree = eqx.tree_deserialise_leaves(io.BytesIO(payload), skeleton)
    except Exception as e:  # equinox raises plain exceptions on a shape or structure mismatch
        raise CheckpointError(f"checkpoint {path} does not fit the model being restored: {e}") from None
    return tree, header
