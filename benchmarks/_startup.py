"""Case (m): how fast a small run starts (issue 58). The wall time of a *second* identical
`research run xor --epochs 3` (a fresh process, the compilation cache the first run filled), broken into
its phases, and of `research sample` on a finished language-model run. Each command runs in a process of
its own (`benchmarks/_startup_probe.py`, which notes when each phase ends), so the imports, JAX's start
and the interpreter's exit are in the times, as a user waits for them."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._timing import Timing

ROOT = Path(__file__).resolve().parent.parent
XOR = ["xor", "--epochs", "3", "--no-progress"]
# The language model `sample` reads: the lm defaults (width 64, 4 blocks, context 128), a few steps.
LM = ["lm", "--steps", "4", "--log-every", "2", "--steps-per-call", "2", "--no-progress"]
LM_QUICK = ["--dim", "32", "--depth", "1", "--context", "32", "--batch-size", "8"]

# (phase, the mark it starts at, the mark it ends at): each starts where the one before ends, so that they add up
# to the wall time; "spawn" and "exit" are the parent's clock.
RUN_PHASES = [
    ("Python starts", "spawn", "start"),
    ("imports", "start", "main_entry"),
    ("options, data", "main_entry", "run_experiment"),
    ("state, run directory", "run_experiment", "fit"),
    ("compilation (a cache hit: tracing, loading)", "fit", "compiled"),
    ("training, evaluation, checkpoints", "compiled", "fit_end"),
    ("summary, curves.png, trackers", "fit_end", "run_experiment_end"),
    ("exit", "run_experiment_end", "exit"),
]
SAMPLE_PHASES = [
    ("Python starts", "spawn", "start"),
    ("imports", "start", "main_entry"),
    ("the run loaded (options, data, state, checkpoint)", "main_entry", "load_end"),
    ("generation compiled (a cache hit: tracing, loading)", "load_end", "compiled"),
    ("generation, two calls of 256 bytes", "compiled", "generate_end"),
    ("exit", "generate_end", "exit"),
]


def _command(kind: str, argv: list[str], scratch: Path) -> dict[str, float]:
    """Run `research KIND ARGV` in a fresh process under the probe; the moment each phase ends."""
    marks_file = scratch / "marks.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(
        RESEARCH_COMPILATION_CACHE_DIR=str(scratch / "cache"),
        PYTHONPATH=str(ROOT),
        CI="true",
    )
    spawn = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks._startup_probe", str(marks_file), kind, *argv],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
    )
    exit_ = time.perf_counter()
    if done.returncode:
        raise RuntimeError(f"research {kind} {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    marks = json.loads(marks_file.read_text())
    marks.update(spawn=spawn, exit=exit_, compiled=marks[_compiling[kind]] + marks["compile_seconds"])
    return marks


_compiling = {"run": "fit", "sample": "generate"}


def _phases(runs: list[dict[str, float]], phases: list[tuple[str, str, str]]) -> list[Timing]:
    rows = [Timing(name, [m[end] - m[start] for m in runs]) for name, start, end in phases]
    return [*rows, Timing("wall time", [m["exit"] - m["spawn"] for m in runs])]


def run(quick: bool) -> dict:
    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        first = _command("run", [*XOR, "--run-dir", str(scratch / "xor0")], scratch)
        second = [
            _command("run", [*XOR, "--run-dir", str(scratch / f"xor{i}")], scratch) for i in range(1, repeats + 1)
        ]
        lm_dir = str(scratch / "lm")
        _command("run", [*LM, *(LM_QUICK if quick else []), "--run-dir", lm_dir], scratch)
        samples = [_command("sample", [lm_dir], scratch) for _ in range(1 + repeats)]
        summary = json.loads((scratch / "xor1" / "summary.json").read_text())
    return {
        "repeats": repeats,
        "steps": summary["step"],
        "run": _phases(second, RUN_PHASES),
        "first_run": _phases([first], RUN_PHASES),
        "sample": _phases(samples[1:], SAMPLE_PHASES),
        "first_sample": _phases(samples[:1], SAMPLE_PHASES),
        "lm": LM + (LM_QUICK if quick else []),
    }
