"""Optional frameworks: Flax lives in the `bench` extra, so every Flax case checks for it first."""

import contextlib
import functools
import importlib.util


def have_flax() -> bool:
    return importlib.util.find_spec("flax") is not None


def have_mnist1d() -> bool:
    return importlib.util.find_spec("mnist1d") is not None


FLAX_MISSING = "skipped: flax is not installed (install the `bench` extra: pip install -e '.[bench]')"


_torch_threads = {"note": "PyTorch threads: default"}


def calibrate_torch_threads(quick: bool) -> str:
    """Run PyTorch with whichever of its default thread count and one thread is faster here.

    On a loaded machine PyTorch's OpenMP threads wait for each other at every op (ten times slower
    with two threads than with one, measured); on a quiet one two threads win. Comparing against
    PyTorch at its best is the fair comparison, so measure both on a short CNN run and keep the faster.
    """
    import time

    import torch

    from . import _cnn

    default = torch.get_num_threads()
    run = functools.partial(_cnn.torch_eager(), 10 if quick else 60)
    times = {}
    for threads in dict.fromkeys([default, 1]):
        torch.set_num_threads(threads)
        run()
        start = time.perf_counter()
        run()
        times[threads] = time.perf_counter() - start
    best = min(times, key=times.get)
    torch.set_num_threads(best)
    detail = ", ".join(f"{t} thread{'s' * (t > 1)}: {1e3 * s / (10 if quick else 60):.2f} ms a CNN step"
                       for t, s in times.items())
    _torch_threads["note"] = f"PyTorch threads: {best} (default {default}; calibration {detail})"
    return _torch_threads["note"]


def torch_threads_note() -> str:
    return _torch_threads["note"]


@contextlib.contextmanager
def torch_threads(count: int):
    """PyTorch with `count` threads inside the block. The XOR candidates run PyTorch on one thread:
    its ops on a 2-8-1 MLP never use a second one (same step time, measured), while its idle OpenMP
    workers spin on the other core after each run and slow whichever JAX candidate runs next."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
