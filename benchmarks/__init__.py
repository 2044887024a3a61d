"""Side-by-side benchmarks of the `research` training loop against pure JAX, Equinox, Flax and PyTorch.

Run `scripts/bench` (or `scripts/bench --quick` for a smoke run); results go to `docs/benchmarks.md`
and `docs/benchmarks.png`.
"""
