"""`python -m benchmarks.checkpoint_save [--saves 10] [--dim 64] [--depth 4]`: what a checkpoint costs
the training loop.

Saves the `experiments/lm.py` train state (AdamW; 2.7 MB at the default width 64 and depth 4) as the
`Checkpoint` hook does:
the placement's fresh copy of the arrays, then `CheckpointWriter.save`, which returns once Orbax has
copied them off the devices (the part the training loop waits for), while Orbax writes, renames its
directory, and process 0 hashes the files and commits `checkpoint.json` in the background (the total).
Beside it: the earlier single-file format's synchronous save (serialise, sha256, write, fsync), and
a load (verify every file, restore). Prints median milliseconds; on a shared machine, read the load
average too.
"""

import argparse
import hashlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax

from research.cli import ema_of
from research.experiment import initial_state, load_experiment
from research.parallel import one_device
from research.services import CheckpointWriter, load_checkpoint


def lm_state(directory: Path, dim: int, depth: int):
    (directory / "text.txt").write_bytes(b"some text to learn. " * 500)  # the state does not depend on it
    module = load_experiment("lm")
    config = module.Config.from_options(text=str(directory / "text.txt"), progress=False, dim=dim, depth=depth)
    return initial_state(module.setup(config), ema_of(config))


def single_file_save(path: Path, state) -> None:
    """What the earlier format's writer did: serialise, hash, write a temporary file, fsync, rename."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    payload = buffer.getvalue()
    temporary = path.with_suffix(".tmp")
    with open(temporary, "wb") as f:
        f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_save", description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=10, help="timed saves of each kind (default: 10)")
    parser.add_argument("--dim", type=int, default=64, help="the model's width (default: 64, lm's)")
    parser.add_argument("--depth", type=int, default=4, help="the model's blocks (default: 4, lm's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        state = lm_state(directory, args.dim, args.depth)
        arrays, rest = eqx.partition(state, eqx.is_array)
        leaves, treedef = jax.tree.flatten(arrays)
        size = sum(x.nbytes for x in leaves)
        blocking, total, single, loads = [], [], [], []
        writer = CheckpointWriter()
        for i in range(args.saves + 1):  # the first save imports Orbax and starts its threads: not timed
            start = time.perf_counter()
            saved = eqx.combine(jax.tree.unflatten(treedef, one_device().to_save(leaves)), rest)
            writer.save(directory / f"step_{i}", saved, {"step": i})
            returned = time.perf_counter()
            writer.wait()
            if i:
                blocking.append(returned - start)
                total.append(time.perf_counter() - start)
            start = time.perf_counter()
            single_file_save(directory / f"step_{i}.ckpt", state)
            single.append(time.perf_counter() - start)
            start = time.perf_counter()
            load_checkpoint(directory / f"step_{i}", state)
            loads.append(time.perf_counter() - start)
        writer.close()
    ms = lambda xs: f"{1e3 * statistics.median(xs):.1f}"  # noqa: E731
    print(
        f"load average: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; lm state (dim {args.dim}, depth "
        f"{args.depth}) {size / 1e6:.2f} MB, {len(leaves)} arrays; median of {args.saves}\n"
    )
    print("| Orbax save: blocking ms | Orbax save: total ms | single-file save ms | load ms |")
    print("| --- | --- | --- | --- |")
    print(f"| {ms(blocking)} | {ms(total)} | {ms(single)} | {ms(loads[1:])} |")


if __name__ == "__main__":
    main()
