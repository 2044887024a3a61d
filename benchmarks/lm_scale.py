"""`python -m benchmarks.lm_scale [--depths 2,16] [--steps 20]`: the language model's scale numbers.

For `experiments/lm.py`'s default model (dim 128, context 128, batch 32, 4 heads, AdamW): the compile
time of one train step at each depth (lax.scan over stacked layers: about flat), XLA's temporary
memory of the step with and without `--remat`, and steps/s (bytes/s) of the compiled step with
float32 and bf16 compute. Prints a markdown table; on a shared machine, read the load average too.
"""

import argparse
import os
import time

import equinox as eqx
import jax
import numpy as np
import optax

from research.data import Batch
from research.nn import build_model
from research.train import NextTokenLoss, TrainState, train_step

DIM, CONTEXT, BATCH, HEADS = 128, 128, 32, 4


def compiled_step(
    depth: int,
    dim: int = DIM,
    context: int = CONTEXT,
    batch: int = BATCH,
    heads: int = HEADS,
    donate: bool = False,
    **hparams,
):
    """`(compiled, leaves, batch, seconds to compile)` of one train step of the LM (the default model's shape unless
    given); `donate`: the step reuses the state's buffers, as the engine's does (the leaves passed in are spent)."""
    model, _ = build_model("lm", key=jax.random.key(0), context=context, dim=dim, depth=depth, heads=heads, **hparams)
    state = TrainState.create(model, optax.adamw(1e-3), key=jax.random.key(1))
    leaves, static = eqx.partition(state, eqx.is_array)
    tokens = np.random.default_rng(0).integers(0, 256, (batch, context + 1)).astype(np.int32)
    batch_arrays = Batch(jax.numpy.asarray(tokens[:, :-1]), jax.numpy.asarray(tokens[:, 1:]))

    def step(leaves, batch):
        new_state, metrics = train_step(eqx.combine(leaves, static), batch, NextTokenLoss())
        return eqx.filter(new_state, eqx.is_array), metrics["loss"]

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0 if donate else ()).lower(leaves, batch_arrays).compile()
    return compiled, leaves, batch_arrays, time.perf_counter() - start


def steps_per_s(compiled, leaves, batch, steps: int) -> tuple[float, float]:
    """Steps a second of `compiled` over `steps` steps after one to warm up, and the last loss."""
    leaves, loss = compiled(leaves, batch)  # warm up
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        leaves, loss = compiled(leaves, batch)
    jax.block_until_ready(loss)
    return steps / (time.perf_counter() - start), float(loss)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="2,16", help="comma-separated depths to compile (default: 2,16)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default: 20)")
    args = parser.parse_args(argv)
    print(
        f"load average before: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; dim {DIM}, context {CONTEXT}, "
        f"batch {BATCH}\n"
    )
    print("| depth | compute | remat | compile s | temp MB | steps/s | bytes/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for depth in [int(d) for d in args.depths.split(",")]:
        for dtype, remat in (("float32", False), ("float32", True), ("bfloat16", False)):
            compiled, leaves, batch, seconds = compiled_step(depth, remat=remat, compute_dtype=dtype)
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            rate, _ = steps_per_s(compiled, leaves, batch, args.steps)
            print(
                f"| {depth} | {dtype} | {remat} | {seconds:.2f} | {temp:.1f} | {rate:.2f} | "
                f"{rate * BATCH * CONTEXT:,.0f} |",
                flush=True,
            )
    print(f"\nload average after: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
