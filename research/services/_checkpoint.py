"""Checkpoints: one directory per step, written by Orbax from every process, committed by our JSON file.

    step_000000038/
        _METADATA, manifest.ocdbt, ocdbt.process_N/, ...   Orbax's: the arrays of the state under their
                                                            names, each process writing the shards it holds
        checkpoint.json                                     ours, written last: the commit

The arrays are a tree of dictionaries named after the state's fields (`research.nn.array_names`:
`model.blocks.0.conv1.weight`, `opt_state.0.mu.blocks.0.conv1.weight`, ...), so that Orbax's own
restore, without this code, returns them named (`ocp.StandardCheckpointer().restore(path)`).
Checkpoints of the first directory format (an unnamed list of arrays) still load.

A save is asynchronous (`CheckpointWriter`): it returns once Orbax has copied the arrays off the
devices, and training goes on while they are written. Orbax writes into a temporary directory and
renames it once every process has written its part; then process 0 records the size and sha256 of
every file in `checkpoint.json` (with the header: config, step, metric window, evaluation, and the
path, shape and dtype of every leaf), written atomically. A directory without that file is a save
that was interrupted, not a checkpoint. Loading verifies every file against it before Orbax reads
anything, so damage is found and reported by name; Orbax's metadata is JSON and its arrays raw bytes:
nothing is unpickled. Arrays restore into a skeleton built from the config, each with the sharding
the caller asks for (a checkpoint saved on 8 devices restores onto 4 or 1).

Single-file checkpoints of the earlier format (`step_NNNNNNNNN.ckpt`) still load (`_single_file.py`).
"""

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np

from ..errors import CheckpointError
from ..nn import array_names, is_array_leaf
from . import _single_file

COMMIT_FILE = "checkpoint.json"
FORMAT = "research-orbax 2"  # arrays named; "research-orbax 1": an unnamed list
T = TypeVar("T")
ShardingFn = Callable[[tuple[int, ...]], jax.sharding.Sharding]


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
    """`[path, shape, dtype]` of every array leaf (abstract ones too): enough to say how two architectures differ."""
    arrays = eqx.filter(tree, is_array_leaf)
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
    differences += [
        f"{path} is in the checkpoint but not in the model" for path in saved_by_path if path not in wanted_by_path
    ]
    more = f" (and {len(differences) - limit} more)" if len(differences) > limit else ""
    return "; ".join(differences[:limit]) + more


def _arrays(tree: Any) -> list[Any]:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def is_committed(path: Path) -> bool:
    """Whether `path` is a checkpoint directory whose save was committed."""
    return (path / COMMIT_FILE).is_file()


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint; a directory loses its commit file first, so that a deletion cut short
    leaves an uncommitted directory (ignored), never a damaged checkpoint."""
    if path.is_dir():
        (path / COMMIT_FILE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _file_digests(path: Path) -> dict[str, list[Any]]:
    """`relative path -> [bytes, sha256]` of every file Orbax wrote under `path`."""
    digests = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != COMMIT_FILE):
        with open(file, "rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        digests[file.relative_to(path).as_posix()] = [file.stat().st_size, sha256]
    return digests


def _named(names: list[str], leaves: list[Any]) -> dict[str, Any]:
    """The nested dictionaries Orbax saves: `{"model": {"blocks": {"0": {...}}}}` for `model.blocks.0...`."""
    tree: dict[str, Any] = {}
    for name, leaf in zip(names, leaves, strict=True):
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree


def _in_order(tree: dict[str, Any], names: list[str]) -> list[Any]:
    def get(name: str) -> Any:
        node = tree
        for part in name.split("."):
            node = node[part]
        return node

    return [get(name) for name in names]


def _verify(path: Path) -> dict[str, Any]:
    """The header of a checkpoint directory, after checking every file against `checkpoint.json`."""
    return _verified_record(path)["header"]


def _verified_record(path: Path) -> dict[str, Any]:
    """`checkpoint.json` of a checkpoint directory, after checking every file against it."""
    try:
        record = json.loads((path / COMMIT_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} was not committed (its save was interrupted)") from None
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict) or "header" not in record:
        raise CheckpointError(f"checkpoint {path} has a damaged header")
    for name, (size, sha256) in record["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is truncated: {name} has {file.stat().st_size} of {size} bytes")
        with open(file, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != sha256:
                raise CheckpointError(f"checkpoint {path} is corrupted: checksum mismatch in {name}")
    return record


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header of a checkpoint (directory, or single file of the earlier format), after verifying
    its checksums."""
    path = Path(path)
    if path.is_file():
        return _single_file.read(path)[0]
    if not path.is_dir():
        raise CheckpointError(f"cannot read checkpoint {path}: No such file or directory")
    return _verify(path)


def _restore(path: Path, like: list[Any], sharding: ShardingFn | None, names: list[str] | None) -> list[Any]:
    """The arrays of a checkpoint directory, shaped like `like` and placed by `sharding`; `names`: those
    of a named checkpoint (None: the first format's list)."""
    import orbax.checkpoint as ocp  # imported on first use: a quarter of a second

    first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    targets = [
        jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding(np.shape(x)) if sharding else first) for x in like
    ]
    orbax = ocp.StandardCheckpointer()
    try:
        if names is None:
            restored = orbax.restore(path.absolute(), targets)
        else:
            restored = _in_order(orbax.restore(path.absolute(), _named(names, targets)), names)
    except Exception as e:  # Orbax's and TensorStore's errors have no common type
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} cannot be read: {message}") from None
    finally:
        orbax.close()
    return [np.asarray(r) if isinstance(x, np.ndarray) else r for r, x in zip(restored, like, strict=True)]


def load_checkpoint(
    path: str | os.PathLike, skeleton: T, *, sharding: ShardingFn | None = None
) -> tuple[T, dict[str, Any]]:
    """Restore the leaves saved in `path` into `skeleton`, a tree of the same structure and shapes
    (typically built from the header's hyperparameters; its arrays may be `jax.ShapeDtypeStruct`s, as
    `eqx.filter_eval_shape` of the function that builds it gives them, which costs no computation); returns
    it and the header.

    `sharding(shape)` says where each restored array goes (a placement's `restore_sharding`; by
    default this process's first device): Orbax reads what each device needs, whatever the devices
    the checkpoint was saved from."""
    path = Path(path)
    single_file = path.is_file()
    if single_file:
        (header, payload), named = _single_file.read(path), False
    elif path.is_dir():
        record = _verified_record(path)
        header, payload, named = record["header"], b"", record.get("format") == FORMAT
    else:
        raise CheckpointError(f"cannot read checkpoint {path}: No such file or directory")
    if "leaves" in header:
        differences = _describe_differences(header["leaves"], leaf_summary(skeleton))
        if differences:
            raise CheckpointError(f"checkpoint {path} is of a different architecture: {differences}")
    # Concrete arrays even when called while JAX traces (a skeleton traced for its shapes, `load_run`'s, whose
    # model starts from another run's checkpoint: `--init-from RUN_DIR`).
    with jax.ensure_compile_time_eval():
        if single_file:
            return _single_file.deserialise(path, payload, skeleton), header
        arrays, rest = eqx.partition(skeleton, is_array_leaf)
        leaves, treedef = jax.tree.flatten(arrays)
        restored = _restore(path, leaves, sharding, array_names(skeleton) if named else None)
        return eqx.combine(jax.tree.unflatten(treedef, restored), rest), header


def tree_digest(tree: Any) -> str:
    """The sha256 of the dtype, shape and bytes of every array leaf of `tree`: two states are the same
    bit for bit exactly when their digests are (arrays on other processes' devices excepted)."""
    digest = hashlib.sha256()
    for leaf in _arrays(tree):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype}{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def checkpoint_digest(path: str | os.PathLike) -> str:
    """`tree_digest` of the state saved in a checkpoint directory (verified, restored on one device)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"{path} is a single-file checkpoint; restore it with load_checkpoint to compare it")
    record = _verified_record(path)
    header = record["header"]
    like = [np.zeros(shape, dtype) for _, shape, dtype in header["leaves"]]
    names = header.get("names") if record.get("format") == FORMAT else None
    return tree_digest(_restore(path, like, None, names))


class CheckpointWriter:
    """Saves checkpoints in the background.

    `save(path, tree, header)` waits for the previous save, then returns once Orbax has copied the
    arrays off the devices; Orbax writes them while training goes on and, once every process has
    written its part, renames its temporary directory to `path`; then process 0 writes
    `checkpoint.json` (the commit) and calls `on_commit(path)` (pruning older checkpoints, say).
    Every process of a run calls `save` at the same steps with the same path. `wait()` blocks until
    the save in flight is committed and raises its error if it failed; `close()` also lets go of
    Orbax's threads.

    Hand `save` arrays that nothing else will donate or delete (fresh copies): Orbax may still read
    them after `save` returns.
    """

    def __init__(self, on_commit: Callable[[Path], None] | None = None):
        self.on_commit = on_commit
        self._orbax: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: str | os.PathLike, tree: Any, header: dict[str, Any]) -> None:
        self.wait()
        if self._orbax is None:
            import orbax.checkpoint as ocp

            self._orbax = ocp.StandardCheckpointer()
        path = Path(path).absolute()
        names = array_names(tree)
        full_header = {**header, "leaves": leaf_summary(tree), "names": names}
        # force: replaces a damaged checkpoint of the same step
        self._orbax.save(path, _named(names, _arrays(tree)), force=True)
        self._thread = threading.Thread(target=self._commit, args=(path, full_header), name="checkpoint-commit")
        self._thread.start()

    def _commit(self, path: Path, header: dict[str, Any]) -> None:
        try:
            self._orbax.wait_until_finished()
            if jax.process_index() == 0:
                record = {"format": FORMAT, "header": header, "files": _file_digests(path)}
                write_atomic(path / COMMIT_FILE, json.dumps(record).encode())
                if self.on_commit is not None:
                    self.on_commit(path)
        except BaseException as error:  # raised in the main thread by `wait`
            self._error = error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._orbax is not None:
                self._orbax.close()
                self._orbax = None


def save_checkpoint(path: str | os.PathLike, tree: Any, header: dict[str, Any]) -> None:
    """Write `tree`'s array leaves under their names with a JSON `header` (which must not use the keys
    `leaves` and `names`) into the checkpoint directory `path`, and return once it is committed."""
    writer = CheckpointWriter()
    try:
        writer.save(path, tree, header)
    finally:
        writer.close()
