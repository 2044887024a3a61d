"""`lm --tokens FILE`: a token file larger than memory (nanoGPT's and llm.c's train.bin), memory-mapped, random
windows a step drawn from (seed, step): the windows against a reference, the refusals, resume, 1 and 4 devices,
a file larger than the memory the run may use, and `scripts/sweep --vmapped` refused."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from research.cli import main_entry
from research.data import TokenSpan, TokenWindows, open_tokens, window_starts
from research.experiment import load_experiment
from research.tools import sweep

ROOT = Path(__file__).resolve().parents[1]
TINY = "--context 16 --dim 16 --depth 1 --heads 2 --batch-size 8 --log-every 2 --eval-windows 8 --no-progress".split()


def write_tokens(path: Path, tokens: np.ndarray, *, llmc_version: int | None = None) -> Path:
    """`tokens` as nanoGPT writes them (raw), or after llm.c's header of `llmc_version`."""
    with open(path, "wb") as f:
        if llmc_version is not None:
            header = np.zeros(256, "<i4")
            header[:3] = 20240520, llmc_version, len(tokens)
            f.write(header.tobytes())
        f.write(tokens.tobytes())
    return path


def reference_batch(raw: np.ndarray, seed: int, step: int, batch: int, context: int) -> tuple[np.ndarray, ...]:
    """Step `step`'s windows as the docs define them, from the file's bytes read whole."""
    starts = np.random.default_rng([seed, step]).integers(0, len(raw) - context, size=batch)
    inputs = np.stack([raw[s : s + context] for s in starts])
    labels = np.stack([raw[s + 1 : s + context + 1] for s in starts])
    return inputs, labels


def test_the_windows_of_a_step_are_a_function_of_seed_and_step(tmp_path):
    """Step s reads the windows `default_rng([seed, s])` starts (checked against the file read whole, for raw
    uint16, llm.c's uint16 and uint32 files), a loader started at step s yields step s's batch first, and the
    seed is any int."""
    raw = np.random.default_rng(0).integers(0, 60_000, 5_000).astype(np.uint16)
    files = {
        "nanogpt": write_tokens(tmp_path / "raw.bin", raw),
        "llmc": write_tokens(tmp_path / "llmc.bin", raw, llmc_version=1),
        "llmc32": write_tokens(tmp_path / "llmc32.bin", raw.astype(np.uint32), llmc_version=2),
    }
    for name, path in files.items():
        tokens = open_tokens(path)
        assert tokens.tokens.dtype == (np.uint32 if name == "llmc32" else np.uint16), name
        loader = TokenWindows(TokenSpan(tokens, 0, len(tokens)), 16, 8, seed=3, vocab=60_000)
        for step in (0, 1, 7, 123_456):
            batch, (inputs, labels) = loader.read(step), reference_batch(raw, 3, step, 8, 16)
            assert batch.inputs.dtype == np.int32 and batch.inputs.shape == (8, 16), name
            np.testing.assert_array_equal(batch.inputs, inputs, err_msg=f"{name} step {step}")
            np.testing.assert_array_equal(batch.labels, labels, err_msg=f"{name} step {step}")
        resumed = loader.batches(7)
        for step in (7, 8, 9):
            np.testing.assert_array_equal(next(resumed).inputs, loader.read(step).inputs)
        resumed.close()  # its reading thread ends
    starts = window_starts(-1, 0, 8, len(raw), 16)  # a negative seed: its 64-bit two's complement
    np.testing.assert_array_equal(starts, np.random.default_rng([2**64 - 1, 0]).integers(0, len(raw) - 16, 8))


def run_lm(flags: list[str]) -> int:
    """`lm` run in this process: its exit status (0 when it returns)."""
    module = load_experiment("lm")
    try:
        main_entry(module.main, module.Config, flags)
    except SystemExit as exit_info:
        return int(exit_info.code or 0)
    return 0


BAD_TOKEN = 60  # in the training part only: the held-out tail is below --vocab 50


REFUSALS = {  # {id: (flags, what stderr's one line says)}
    "odd-size": (["--tokens", "odd.bin"], "odd.bin: 3 bytes are no whole number of 2-byte tokens (uint16)"),
    "empty": (["--tokens", "empty.bin"], "--tokens empty.bin is empty: it holds no tokens"),
    "short": (["--tokens", "short.bin"], "its training part holds 10 tokens, fewer than --context 16 plus one"),
    "missing": (["--tokens", "missing.bin"], "--tokens missing.bin: no such file"),
    "text": (["--tokens", "good.bin", "--text", "good.bin"], "trains on tokens, not on text: drop --text"),
    "tokenizer": (["--tokens", "good.bin", "--tokenizer", "t.json"], "not on text: drop --tokenizer"),
    "text-bytes": (["--tokens", "good.bin", "--text-bytes", "100"], "not on text: drop --text-bytes"),
    "held-out": (["--tokens", "good.bin", "--held-out-tokens", "good.bin", "--held-out", "0.1"], "drop --held-out"),
    "vocab-alone": (["--vocab", "100"], "--vocab, --eval-windows: only with --tokens FILE"),  # (TINY has the latter)
    "uint32-vocab": (["--tokens", "wide.bin"], "holds uint32 tokens: give their --vocab"),
    "llmc-dtype": (["--tokens", "llmc.bin", "--token-dtype", "uint32"], "llm.c header (version 1) says uint16 tokens"),
    "llmc-cut": (["--tokens", "cut.bin"], "its llm.c header counts 1,000 tokens (3,024 bytes), the file has 2,024"),
    "token-vocab": (["--tokens", "bad.bin", "--vocab", "50"], f"token {BAD_TOKEN} at position {{bad}} is not below"),
}


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "message"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_a_bad_token_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, message):
    """Each refusal: exit 2, one line on stderr naming the file and what is wrong, no checkpoint. A token not
    below --vocab is refused where it is read (step 0's first window), naming its position."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "empty.bin").write_bytes(b"")
    write_tokens(tmp_path / "short.bin", np.arange(10, dtype=np.uint16))
    write_tokens(tmp_path / "good.bin", np.arange(1_000, dtype=np.uint16) % 40)
    write_tokens(tmp_path / "wide.bin", np.arange(1_000, dtype=np.uint32) % 40, llmc_version=2)
    write_tokens(tmp_path / "llmc.bin", np.arange(1_000, dtype=np.uint16) % 40, llmc_version=1)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "llmc.bin").read_bytes()[:2_024])
    bad = np.full(2_000, BAD_TOKEN, np.uint16)
    bad[1_900:] = 7  # the held-out tail (5%): the evaluation windows read at setup pass
    write_tokens(tmp_path / "bad.bin", bad)
    first_window = int(window_starts(0, 0, 8, 1_900, 16)[0])
    code = run_lm([*flags, *TINY, "--steps", "2", "--run-dir", "r"])
    stderr = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(stderr) == 1, stderr
    assert message.format(bad=f"{first_window:,}") in stderr[0], stderr[0]
    assert not list(tmp_path.glob("r/checkpoints/*"))


@pytest.mark.slow
def test_a_resumed_run_logs_the_bits_of_an_unstopped_one(tmp_path, monkeypatch):
    """Killed after step 4's checkpoint and resumed, a run logs what the run that was never stopped logs:
    the windows of step 5 are read without replaying steps 1-4."""
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "train.bin", np.random.default_rng(1).integers(0, 64, 20_000).astype(np.uint16))
    flags = ["--tokens", "train.bin", "--vocab", "64", *TINY, "--steps", "8", "--checkpoint-every", "4"]
    assert run_lm([*flags, "--run-dir", "whole"]) == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut/checkpoints/step_000000008")  # as if killed between steps 4 and 8
    (tmp_path / "cut/summary.json").unlink()
    assert run_lm([*flags, "--run-dir", "cut", "--resume", "auto"]) == 0
    assert untimed(tmp_path / "cut") == untimed(tmp_path / "whole") and len(untimed(tmp_path / "whole")) == 4


def untimed(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records without the timings."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if "per_s" not in k} for record in records]


# Run with 4 simulated devices: steps 5, 6, 7 of a loader, each put on the devices as the engine puts it
# (`Placement.put_batch`), saved whole (`np.asarray` gathers the shards).
ON_FOUR_DEVICES = """
import sys
import numpy as np
from research.data import TokenSpan, TokenWindows, open_tokens
from research.parallel import make_placement

path, parallel, out = sys.argv[1:]
tokens = open_tokens(path)
loader = TokenWindows(TokenSpan(tokens, 0, len(tokens)), 16, 8, seed=3, vocab=64)
placement = make_placement(parallel, 4)
for step, batch in zip((5, 6, 7), loader.batches(5)):
    placed = placement.put_batch(batch)
    assert len(placed.inputs.sharding.device_set) == 4, placed.inputs.sharding
    np.save(f"{out}/{parallel}-{step}.npy", np.stack([np.asarray(x).reshape(8, 16) for x in placed]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["sharded", "pmap"])
def test_four_devices_take_the_windows_of_one(tmp_path, parallel):
    """On 4 simulated devices (XLA_FLAGS, in a process of its own) each step's batch, split over the devices by
    the placement, is the batch of one device. (Training on them to the same bits: tests/test_combinations.py's
    lm_tokens on sharded4 with --deterministic-reduction.)"""
    path = write_tokens(tmp_path / "train.bin", np.random.default_rng(2).integers(0, 64, 20_000).astype(np.uint16))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    command = [sys.executable, "-c", ON_FOUR_DEVICES, str(path), parallel, str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    raw = np.fromfile(path, np.uint16)
    for step in (5, 6, 7):
        np.testing.assert_array_equal(
            np.load(tmp_path / f"{parallel}-{step}.npy"), reference_batch(raw, 3, step, 8, 16)
        )


MEMORY_LIMIT = 2 * 2**30
# Sets the limit, then runs the script: in the child, not in a `preexec_fn` (which runs Python in a fork of this
# multithreaded JAX process, which may deadlock).
LIMITED = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_DATA, ({0}, {0})); sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.slow
def test_a_token_file_larger_than_the_memory_limit_trains(tmp_path):
    """An 8 GiB file (sparse: zeros but a few real tokens at its start and in its held-out tail) trains and
    evaluates in a process whose data may not exceed 2 GiB. The limit is RLIMIT_DATA: it counts the process's
    private writable memory (heap, anonymous maps: what reading the file whole into an array needs, refused
    with a MemoryError) and not a read-only shared map of a file (`np.memmap(mode="r")`), while RLIMIT_AS
    would count the map of the file itself (8 GiB of address space: refused however it is read) and
    RLIMIT_RSS is not enforced by Linux. JAX trains a tiny model within 2 GiB of data."""
    path = tmp_path / "huge.bin"
    size = 8 * 2**30
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(np.arange(1, 2_000, dtype=np.uint16).tobytes())
        f.seek(size - 4_000)
        f.write(np.arange(1, 2_001, dtype=np.uint16).tobytes())
    if os.stat(path).st_blocks * 512 > 2**30:
        pytest.skip(f"{tmp_path}'s file system keeps no sparse files")
    command = [sys.executable, "-c", LIMITED.format(MEMORY_LIMIT), str(ROOT / "experiments/lm.py"), "--tokens"]
    command += [str(path), "--vocab", "2001", *TINY, "--steps", "4", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["step"] == 4 and np.isfinite(summary["test_loss"]) and summary["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_vmapped_sweep_of_a_token_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A population gathers its members' batches on the device; --tokens reads them from a file on the host."""
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "train.bin", np.arange(2_000, dtype=np.uint16) % 64)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["lm", "seed=0,1", "--vmapped", "--sweep-dir", "s", "--", "--tokens", "train.bin", *TINY[:-1]])
    stderr = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(stderr) == 1 and "sweep without --vmapped" in stderr[0], stderr
    assert not (tmp_path / "s").exists()
