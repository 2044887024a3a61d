"""Token files larger than memory: nanoGPT's and llm.c's `train.bin`/`val.bin`, memory-mapped read-only, and
random windows of them drawn per step from (seed, step), read ahead on a background thread.

A nanoGPT file is raw tokens (uint16, or uint32 for a vocabulary above 65,536), no header. An llm.c file starts
with 256 int32s: the magic 20240520, the version (1: uint16 tokens, 2: uint32), the token count; then the tokens.
"""

import dataclasses
import queue
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import DataError
from ._loaders import Batch
from ._text import next_byte_windows

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_VERSIONS = {1: "uint16", 2: "uint32"}  # llm.c's GPT-2 files, its LLaMA 3 files
TOKEN_DTYPES = ("uint16", "uint32")


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """The tokens of a file, memory-mapped read-only (nothing read until indexed).

    **Fields:**

    - `path`: the file; `option`: the flag that named it (for messages: `--tokens`).
    - `tokens`: the 1-D memory map of its tokens (after an llm.c header).
    - `header_bytes`: the bytes before the tokens (0, or llm.c's 1,024).
    """

    path: Path
    option: str
    tokens: np.ndarray
    header_bytes: int

    def __len__(self) -> int:
        return len(self.tokens)


def open_tokens(path: str | Path, dtype: str | None = None, *, option: str = "--tokens") -> TokenFile:
    """The tokens of `path` memory-mapped read-only: `dtype` (`uint16` when None) wide, or the width an llm.c
    header names (its magic is recognised and the header skipped).

    **Raises:** `DataError` in one line when there is no such file, its size is no whole number of tokens, it
    is empty, or an llm.c header contradicts `dtype` or the file's size.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{option} {path}: no such file (a token file: raw uint16 tokens, as nanoGPT's train.bin)")
    size = file.stat().st_size
    header = _llmc_header(file, size)
    if header is not None:
        return _llmc_tokens(file, option, size, dtype, *header)
    width = np.dtype(dtype or "uint16").itemsize
    if size == 0:
        raise DataError(f"{option} {path} is empty: it holds no tokens")
    if size % width:
        raise DataError(
            f"{option} {path}: {size:,} bytes are no whole number of {width}-byte tokens ({dtype or 'uint16'}): "
            "a truncated file, or give the width it was written with (--token-dtype)"
        )
    tokens = np.memmap(file, dtype=dtype or "uint16", mode="r")
    return TokenFile(file, option, tokens, 0)


def _llmc_header(file: Path, size: int) -> tuple[int, int] | None:
    """(version, token count) of an llm.c header, or None where the file does not start with its magic."""
    if size < LLMC_HEADER_BYTES:
        return None
    with open(file, "rb") as f:
        header = np.frombuffer(f.read(LLMC_HEADER_BYTES), dtype="<i4")
    return (int(header[1]), int(header[2])) if header[0] == LLMC_MAGIC else None


def _llmc_tokens(file: Path, option: str, size: int, dtype: str | None, version: int, count: int) -> TokenFile:
    if version not in LLMC_VERSIONS:
        raise DataError(f"{option} {file}: an llm.c header of version {version}; known: 1 (uint16), 2 (uint32)")
    named = LLMC_VERSIONS[version]
    if dtype is not None and dtype != named:
        raise DataError(f"{option} {file}: its llm.c header (version {version}) says {named} tokens, not {dtype}")
    expected = LLMC_HEADER_BYTES + count * np.dtype(named).itemsize
    if count <= 0 or size != expected:
        raise DataError(
            f"{option} {file}: its llm.c header counts {count:,} tokens ({expected:,} bytes), the file has "
            f"{size:,} bytes: a truncated or damaged file"
        )
    tokens = np.memmap(file, dtype=named, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
    return TokenFile(file, option, tokens, LLMC_HEADER_BYTES)


@dataclasses.dataclass(frozen=True)
class TokenSpan:
    """The tokens `start .. stop` of a `TokenFile` (a training part, a held-out tail), read only by windows."""

    file: TokenFile
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def check_windows(self, context: int, what: str) -> None:
        """`DataError` when the span holds no window of `context` tokens and the one after it."""
        if len(self) < context + 1:
            raise DataError(
                f"{self.file.option} {self.file.path}: {what} holds {len(self):,} tokens, fewer than "
                f"--context {context} plus one to predict"
            )

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The `length` tokens from each of `starts` (positions in the span), `[len(starts), length]`."""
        first = self.start + np.asarray(starts, np.int64)
        return np.stack([self.file.tokens[i : i + length] for i in first])  # slices: each a contiguous read

    def check_vocab(self, tokens: np.ndarray, starts: np.ndarray, vocab: int) -> None:
        """`DataError` naming the file and the position of the first token of `tokens` (read from `starts`)
        not below `vocab`."""
        bad = np.argwhere(tokens >= vocab)
        if len(bad):
            row, column = bad[0]
            position = self.start + int(starts[row]) + int(column)
            raise DataError(
                f"{self.file.option} {self.file.path}: token {int(tokens[row, column])} at position {position:,} "
                f"is not below --vocab {vocab} (a file of another tokenizer, or give its --vocab)"
            )

    def evaluation_windows(self, context: int, count: int, vocab: int, what: str = "its held-out part") -> Batch:
        """The first `count` (at most) non-overlapping windows of the span, in memory (`next_byte_windows`);
        `what` names the span in a refusal."""
        self.check_windows(context, what)
        windows = min(count, (len(self) - 1) // context)
        tokens = self.read(np.zeros(1, np.int64), windows * context + 1)
        self.check_vocab(tokens, np.zeros(1, np.int64), vocab)
        return next_byte_windows(tokens[0], context)


def window_starts(seed: int, step: int, batch_size: int, span_tokens: int, context: int) -> np.ndarray:
    """The starts (int64 `[batch]`) of step `step`'s windows in a span of `span_tokens` tokens: uniform over
    every window of `context` tokens and the one after it (nanoGPT's `randint(len - context)`), drawn by
    `default_rng([seed, step])` (the seed as its 64-bit two's complement): a pure function of (seed, step)."""
    rng = np.random.default_rng([seed % 2**64, step])
    return rng.integers(0, span_tokens - context, size=batch_size, dtype=np.int64)


class TokenWindows:
    """Training batches of random windows of a token span larger than memory: step `s` takes `batch_size`
    windows of `context` tokens (inputs) and the tokens after each (labels), their starts `window_starts(seed,
    s, ...)`: any step's batch is known without the ones before it, so a run resumes in O(1), and every device
    layout trains on the same batches. A host loader as `TorchLoader` and `GrainLoader` are: the engine copies
    its batches to the devices a few steps ahead (one compiled call a step); a thread reads the memory map
    `ahead` steps before that. With several processes each reads only its rows of every batch.

    **Arguments:**

    - `span`: the training tokens (`TokenSpan`); `context`: tokens a window; `batch_size`: windows a step.
    - `seed`: the windows' seed; `vocab`: the model's, a token not below it is refused (`DataError`) when read.
    - `ahead`: steps read before the engine asks for them.
    """

    def __init__(self, span: TokenSpan, context: int, batch_size: int, *, seed: int, vocab: int, ahead: int = 4):
        span.check_windows(context, "its training part")
        self.span, self.context, self.batch_size = span, context, batch_size
        self.seed, self.vocab, self.ahead = seed, vocab, ahead
        self.steps_per_epoch = max(1, len(span) // (context * batch_size))  # steps that read as many tokens

    def starts(self, step: int) -> np.ndarray:
        return window_starts(self.seed, step, self.batch_size, len(self.span), self.context)

    def read(self, step: int) -> Batch:
        """This process's rows of step `step`'s batch (int32 inputs and labels, `[rows, context]`)."""
        starts = self.starts(step).reshape(jax.process_count(), -1)[jax.process_index()]
        tokens = self.span.read(starts, self.context + 1)
        self.span.check_vocab(tokens, starts, self.vocab)
        tokens = tokens.astype(np.int32)
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def batches(self, start_step: int, state: Any = None) -> Generator[Batch, None, None]:
        """This process's rows of the batches of steps `start_step`, ... forever, read on a thread; `state`
        is ignored (the position is the step)."""
        del state
        ready: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        thread = threading.Thread(target=self._read_ahead, args=(start_step, ready, stop), daemon=True)
        thread.start()
        try:
            while True:
                batch = ready.get()
                if isinstance(batch, BaseException):
                    raise batch
                yield batch
        finally:  # the engine is done with the batches (or failed): the thread ends at its next put
            stop.set()

    def _read_ahead(self, step: int, ready: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item: Any = self.read(step)
            except Exception as error:  # noqa: BLE001 (handed to the training thread, which raises it)
                item = error
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step += 1

    def state(self) -> Any:
        """Nothing beyond the step: the windows of a step are a function of (seed, step)."""
        return None


def check_token_dtype(value: str | None) -> str | None:
    return None if value is None or value in TOKEN_DTYPES else f"must be one of {', '.join(TOKEN_DTYPES)}"


def token_spans(
    tokens: TokenFile, held_out_tokens: TokenFile | None, held_out: float, val_fraction: float
) -> tuple[TokenSpan, TokenSpan, TokenSpan | None]:
    """(training, held-out, validation or None) spans: the held-out part is `held_out_tokens` whole, else the
    last `held_out` of `tokens`; the validation part the last `val_fraction` of the rest (0: none)."""
    if held_out_tokens is not None:
        test, train_stop = TokenSpan(held_out_tokens, 0, len(held_out_tokens)), len(tokens)
    else:
        train_stop = len(tokens) - int(len(tokens) * held_out)
        test = TokenSpan(tokens, train_stop, len(tokens))
    if not val_fraction:
        return TokenSpan(tokens, 0, train_stop), test, None
    val_start = train_stop - int(train_stop * val_fraction)
    return TokenSpan(tokens, 0, val_start), test, TokenSpan(tokens, val_start, train_stop)
