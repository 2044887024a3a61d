"""MNIST-1D (Greydanus, "Scaling Down Deep Learning"), generated locally and cached as `.npz`.

The `mnist1d` package builds the data set from ten 1-D templates with numpy's legacy global RNG
(`np.random.seed`, plus `random.seed`). We call its generator, never its download path, and put
both global RNG states back afterwards so that importing the data changes nothing else.
"""

import os
import random
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..typing import Float, Int, typecheck
from ._loaders import Batch

MNIST1D_LENGTH = 40
MNIST1D_CLASSES = 10
MNIST1D_TRAIN_SIZE = 4000
MNIST1D_TEST_SIZE = 1000
MNIST1D_SEED = 42  # the published data set's seed
MNIST1D_SAMPLES = 5000  # the mnist1d package's defaults: 4,000 training and 1,000 test signals
MNIST1D_TRAIN_SPLIT = 0.8
_ARRAYS = ("train_inputs", "train_labels", "test_inputs", "test_labels")
# A fixed timestamp for every zip member: `np.savez` stamps the current time, so its bytes differ per call.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _import_mnist1d_data():
    """The `mnist1d.data` module of the mnist1d package, even when a script's directory on `sys.path`
    holds a `mnist1d.py` (ours does: experiments/mnist1d.py) that would be imported in its place."""
    shadowed = [entry for entry in sys.path if (Path(entry or ".") / "mnist1d.py").is_file()]
    module = sys.modules.get("mnist1d")
    if module is not None and not hasattr(module, "__path__"):  # a shadowing script, not the package
        del sys.modules["mnist1d"]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if entry not in shadowed]
    try:
        import mnist1d.data
    finally:
        sys.path[:] = saved
    return mnist1d.data


def split_sizes(num_samples: int, train_split: float) -> tuple[int, int]:
    """The training and test sizes the `mnist1d` package makes of `num_samples` signals: whole rounds of
    the classes, the first `train_split` of them for training."""
    usable = num_samples // MNIST1D_CLASSES * MNIST1D_CLASSES
    train_size = int(usable * train_split)
    return train_size, usable - train_size


@typecheck
def generate_mnist1d(
    seed: int = MNIST1D_SEED, *, num_samples: int = MNIST1D_SAMPLES, train_split: float = MNIST1D_TRAIN_SPLIT
) -> tuple[Batch, Batch]:
    """Generate MNIST-1D with the `mnist1d` package's default arguments (as published) and `seed`;
    `num_samples` signals of which the first `int(num_samples * train_split)` are the training set
    (the package's defaults, 5,000 and 0.8, give the published 4,000 / 1,000).

    Returns `(train, test)` `Batch`es of numpy arrays: inputs `float32` of shape `(examples, 40)`,
    labels `int32`. Numpy's and Python's global RNG states are restored afterwards.
    """
    train_size, test_size = split_sizes(num_samples, train_split)
    if train_size < 1 or test_size < 1:
        raise DataError(
            f"MNIST-1D: {num_samples} signals at a training split of {train_split:g} leave {train_size} for "
            f"training and {test_size} for testing: each needs at least one"
        )
    mnist1d_data = _import_mnist1d_data()  # imported here: it pulls in matplotlib and scipy
    args = mnist1d_data.get_dataset_args()
    # mnist1d's ObjectView takes attributes; its annotation also says dict.
    args.seed, args.num_samples, args.train_split = seed, num_samples, train_split  # pyright: ignore[reportAttributeAccessIssue]
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        data = mnist1d_data.make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    train = Batch(data["x"].astype(np.float32), data["y"].astype(np.int32))
    test = Batch(data["x_test"].astype(np.float32), data["y_test"].astype(np.int32))
    return train, test


def cache_path(
    data_dir: str | os.PathLike,
    seed: int = MNIST1D_SEED,
    num_samples: int = MNIST1D_SAMPLES,
    train_split: float = MNIST1D_TRAIN_SPLIT,
) -> Path:
    size = (
        ""
        if (num_samples, train_split) == (MNIST1D_SAMPLES, MNIST1D_TRAIN_SPLIT)
        else f"-{num_samples}x{train_split:g}"
    )
    return Path(data_dir) / f"mnist1d-seed{seed}{size}.npz"


@typecheck
def load_mnist1d(
    data_dir: str | os.PathLike = "data",
    *,
    seed: int = MNIST1D_SEED,
    num_samples: int = MNIST1D_SAMPLES,
    train_split: float = MNIST1D_TRAIN_SPLIT,
) -> tuple[Batch, Batch]:
    """MNIST-1D's `(train, test)` numpy arrays, generated on first use and cached in `data_dir`.

    **Arguments:**

    - `data_dir`: directory of the cache file `mnist1d-seed<seed>.npz` (created if missing).
    - `seed`: the generator's seed; 42 is the published data set.
    - `num_samples`, `train_split`: how many signals to generate and the fraction of them (the first
      ones) that is the training set; other values than the published 5,000 and 0.8 are cached as
      `mnist1d-seed<seed>-<num_samples>x<train_split>.npz`.

    The cache is a plain `.npz` (no pickle), written atomically, byte-for-byte the same on every
    generation; a file that does not hold what is expected is refused with the path to delete.
    """
    path = cache_path(data_dir, seed, num_samples, train_split)
    if not path.exists():
        train, test = generate_mnist1d(seed, num_samples=num_samples, train_split=train_split)
        _write_npz(path, dict(zip(_ARRAYS, (*train, *test), strict=True)))
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:  # truncated, not a zip, or pickled objects
        raise DataError(f"{path}: not a readable MNIST-1D cache ({error}); delete the file to regenerate it") from None
    _check_arrays(path, arrays, *split_sizes(num_samples, train_split))
    return (
        _as_batch(arrays["train_inputs"], arrays["train_labels"]),
        _as_batch(arrays["test_inputs"], arrays["test_labels"]),
    )


@typecheck
def _as_batch(inputs: Float[np.ndarray, "examples 40"], labels: Int[np.ndarray, " examples"]) -> Batch:
    return Batch(inputs, labels)


def _check_arrays(path: Path, arrays: dict[str, np.ndarray], train_size: int, test_size: int) -> None:
    expected = {
        "train_inputs": ((train_size, MNIST1D_LENGTH), np.float32),
        "train_labels": ((train_size,), np.int32),
        "test_inputs": ((test_size, MNIST1D_LENGTH), np.float32),
        "test_labels": ((test_size,), np.int32),
    }
    for name, (shape, dtype) in expected.items():
        got = arrays.get(name)
        if got is None or got.shape != shape or got.dtype != dtype:
            found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            raise DataError(
                f"{path}: array {name!r} should be {np.dtype(dtype)}{list(shape)}, found {found}; "
                "delete the file to regenerate it"
            )
    for name in ("train_labels", "test_labels"):
        if arrays[name].min() < 0 or arrays[name].max() >= MNIST1D_CLASSES:
            raise DataError(f"{path}: {name} outside 0..{MNIST1D_CLASSES - 1}; delete the file to regenerate it")


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write an uncompressed `.npz` with fixed member timestamps: temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as archive:
                for name in sorted(arrays):
                    info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_TIME)
                    with archive.open(info, "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is ordinary data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
