"""Case (g): FSDP against data parallelism against one device on the language model (issue 15).

`experiments/lm.py` at one global batch (32 windows of 128 bytes), trained for a few hundred steps
on one device, on 4 simulated CPU devices with the state replicated (`--parallel sharded`, data
parallel) and with parameters and optimizer state sharded (`--parallel fsdp`). Each is its own
process (simulated devices must be set before JAX starts). Reported: the train state's bytes on one
device (`state_bytes_per_device`; one device holds it all), training throughput over the last
logging window (compilation left out), and the held-out bits per byte, which must agree.

Simulated devices share this machine's cores, so the step times say what the placements cost in
collectives and partitioning on one host, not what 4 accelerators would gain; the bytes are exact.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = {
    "one device": [],
    "data parallel, 4 devices (sharded)": ["--devices", "4", "--parallel", "sharded"],
    "FSDP, 4 devices": ["--devices", "4", "--parallel", "fsdp"],
}


def _run(flags: list[str], steps: int, run_dir: Path) -> dict:
    command = [
        sys.executable,
        str(ROOT / "experiments" / "lm.py"),
        "--steps",
        str(steps),
        "--log-every",
        str(steps // 2),
        "--steps-per-call",
        str(steps // 4),
        "--text-bytes",
        "400000",
        "--dim",
        "128",
        "--no-progress",
        "--no-compilation-cache",
        "--run-dir",
        str(run_dir),
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if "state_bytes_per_device" not in summary:  # one device: the whole state
        import numpy as np

        from research import load_run

        state = load_run(run_dir).state
        summary["state_bytes_per_device"] = sum(np.asarray(x).nbytes for x in _arrays(state))
    return summary


def _arrays(tree):
    import equinox as eqx
    import jax

    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def run(quick: bool) -> dict:
    steps = 8 if quick else 200
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, flags in PLACEMENTS.items():
            summary = _run(flags, steps, Path(scratch) / name.split(",")[0].replace(" ", "-"))
            rows[name] = {
                key: summary[key]
                for key in ("state_bytes_per_device", "bytes_per_s", "test_bits_per_byte", "wall_seconds")
            }
    return {"placements": rows, "steps": steps}
