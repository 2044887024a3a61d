"""Text: the Python standard library's own source (or any file or folder) as bytes, split and windowed; a
Hugging Face tokenizer between those bytes and token ids."""

import fnmatch
import hashlib
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..install import require_extra
from ._loaders import Batch

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _source_files(folder: Path, pattern: str) -> list[Path]:
    """Files under `folder` matching `pattern` in a fixed shuffled order: sorted by the SHA-256 of their
    relative paths, so that a cap on the bytes and the held-out tail sample the whole folder (sorted by
    name, the standard library's first 4 MB would end in codec tables: a held-out set unlike the rest).

    The files `folder.rglob(pattern)` finds (symbolic links to folders not followed), listed with
    `os.walk` and strings rather than a `Path` a file: the standard library holds thousands."""
    found = []
    for directory, folders, names in os.walk(folder):
        relative = os.path.relpath(directory, folder)
        parts = [] if relative == "." else relative.split(os.sep)
        if SKIPPED_DIRS.intersection(parts):
            folders.clear()
            continue
        for name in fnmatch.filter(names, pattern) if pattern != "*" else names:
            if name not in SKIPPED_DIRS and os.path.isfile(os.path.join(directory, name)):
                found.append("/".join([*parts, name]))
    return [folder / name for name in sorted(found, key=lambda name: hashlib.sha256(name.encode()).hexdigest())]


def read_text_bytes(path: str | Path | None = None, *, max_bytes: int = 4_000_000) -> np.ndarray:
    """The first `max_bytes` bytes (uint8) of a file, or of a folder's files concatenated in a fixed
    order (`_source_files`); `path=None` reads the `*.py` files of this Python's standard library
    (`sysconfig.get_paths()["stdlib"]`, without site-packages): deterministic for one Python version."""
    if path is None:
        folder, pattern = Path(sysconfig.get_paths()["stdlib"]), "*.py"
    else:
        folder, pattern = Path(path), "*"
        if not folder.exists():
            raise DataError(f"--text {path}: no such file or folder")
    files = [folder] if folder.is_file() else _source_files(folder, pattern)
    chunks, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        chunks.append(file.read_bytes()[: max_bytes - total])
        total += len(chunks[-1])
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if data.size == 0:
        raise DataError(f"no text found in {folder}")
    return data


def split_held_out(data: np.ndarray, fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """`(train, held_out)`: the held-out part is the last `fraction` of the bytes (no window spans both)."""
    cut = len(data) - int(len(data) * fraction)
    return data[:cut], data[cut:]


def next_byte_windows(data: np.ndarray, context: int) -> Batch:
    """Non-overlapping windows of `context` bytes (int32 `[windows, context]`) and, for each, the bytes
    that follow each position (`labels[i, t] = data[i * context + t + 1]`)."""
    count = (len(data) - 1) // context
    if count < 1:
        raise DataError(f"{len(data)} bytes hold no window of --context {context} plus one byte to predict")
    inputs = data[: count * context].reshape(count, context).astype(np.int32)
    labels = data[1 : count * context + 1].reshape(count, context).astype(np.int32)
    return Batch(inputs, labels)


def reference_bits_per_byte(train: np.ndarray, held_out: np.ndarray) -> dict[str, float]:
    """Two honest yardsticks for a model's held-out bits per byte, on the same bytes: the cross-entropy of
    the training set's byte frequencies (`unigram`, add-one smoothed) and `zlib -9` on the held-out bytes."""
    counts = np.bincount(train, minlength=256) + 1.0
    log_probs = np.log2(counts / counts.sum())
    unigram = -float(np.mean(log_probs[held_out]))
    return {"unigram": unigram, "zlib": 8 * len(zlib.compress(held_out.tobytes(), 9)) / len(held_out)}


class TextTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json`, as `save_pretrained` writes it beside a model)
    between text bytes and token ids: the language model's vocabulary when it reads tokens, not bytes.

    **Arguments:**

    - `path`: a `tokenizer.json`, or a directory holding one (a Hugging Face model directory).

    **Raises:** `MissingExtra` without the `tokenizers` package; `DataError` when there is no such file or it
    is not a tokenizer.
    """

    CHUNK_BYTES = 1 << 16  # text is encoded in pieces of about this size cut after a newline, in parallel

    def __init__(self, path: str | Path):
        require_extra(f"reading {path}", "tokenizers")
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise DataError(f"{path}: no tokenizer.json (a Hugging Face tokenizer, as save_pretrained writes it)")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 (the Rust library raises its own Exception for any bad file)
            raise DataError(f"{file} is not a tokenizer `tokenizers` reads: {str(e).splitlines()[0][:200]}") from None
        self.path = file
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, data: np.ndarray) -> np.ndarray:
        """The token ids (int32) of text bytes (uint8; UTF-8, a broken sequence read as U+FFFD)."""
        text = data.tobytes().decode("utf-8", errors="replace")
        pieces, start = [], 0
        while start < len(text):
            end = text.find("\n", start + self.CHUNK_BYTES)
            end = len(text) if end < 0 else end + 1
            pieces.append(text[start:end])
            start = end
        ids = [np.asarray(e.ids, np.int32) for e in self.tokenizer.encode_batch(pieces, add_special_tokens=False)]
        return np.concatenate(ids) if ids else np.zeros(0, np.int32)

    def decode(self, tokens: np.ndarray) -> bytes:
        return self.tokenizer.decode(np.asarray(tokens).tolist(), skip_special_tokens=False).encode("utf-8")
