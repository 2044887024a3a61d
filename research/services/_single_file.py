"""The earlier checkpoint format, still read: one file `step_NNNNNNNNN.ckpt` per checkpoint,

    RESEARCH-CHECKPOINT 1\\n
    {"sha256": ..., "payload_bytes": ..., "leaves": ..., ...header...}\\n
    <eqx.tree_serialise_leaves bytes>

written atomically by process 0. Reading checks the checksum before deserialising into a skeleton
and never unpickles anything. New checkpoints are Orbax directories (`_checkpoint.py`).
"""

import hashlib
import io
import json
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx

from ..errors import CheckpointError

MAGIC = b"RESEARCH-CHECKPOINT 1\n"
SUFFIX = ".ckpt"
T = TypeVar("T")


def read(path: Path) -> tuple[dict[str, Any], bytes]:
    """The verified header and payload of a single-file checkpoint."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if not raw.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a checkpoint file (bad magic line)")
    header_line, sep, payload = raw[len(MAGIC) :].partition(b"\n")
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


def deserialise(path: Path, payload: bytes, skeleton: T) -> T:
    """The leaves of a verified payload (`read`) in `skeleton` (whose architecture the caller checked)."""
    try:
        return eqx.tree_deserialise_leaves(io.BytesIO(payload), skeleton)
    except Exception as e:  # equinox raises plain exceptions on a shape or structure mismatch
        raise CheckpointError(f"checkpoint {path} does not fit the model being restored: {e}") from None
