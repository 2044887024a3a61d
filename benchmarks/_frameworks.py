"""Optional frameworks: Flax and Opacus live in the `bench` extra, so every case using them checks first."""

import contextlib
import importlib.util
from collections.abc import Callable


def have_flax() -> bool:
    return importlib.util.find_spec("flax") is not None


def have_mnist1d() -> bool:
    return importlib.util.find_spec("mnist1d") is not None


def have_sklearn() -> bool:
    return importlib.util.find_spec("sklearn") is not None


def have_opacus() -> bool:
    return importlib.util.find_spec("opacus") is not None


FLAX_MISSING = "skipped: flax is not installed (install the `bench` extra: pip install -e '.[bench]')"
OPACUS_MISSING = "skipped: opacus is not installed (install the `bench` extra: pip install -e '.[bench]')"


def at_best_thread_count(name: str, run: Callable[..., object], *args: object) -> tuple[str, Callable[..., object]]:
    """A PyTorch candidate at whichever of its default thread count and one thread is faster for IT here
    (timing `run(*args)`): `(name with the count, run with that count)`. Measured per case (one warm call each
    way), since the answer differs by workload: a compute-bound MLP wants every core, while a small CNN's ops
    are too short for OpenMP threads to pay for their synchronisation, and on a loaded machine two
    threads can be ten times slower than one."""
    import time

    import torch

    default = torch.get_num_threads()
    seconds = {}
    for threads in dict.fromkeys([default, 1]):
        with torch_threads(threads):
            run(*args)
            start = time.perf_counter()
            run(*args)
            seconds[threads] = time.perf_counter() - start
    best = min(seconds, key=seconds.get)
    other = ", ".join(f"{t}: {s / seconds[best]:.2f}x" for t, s in seconds.items() if t != best)
    label = f"{name} [{best} thread{'s' * (best > 1)}; {other or 'the only count'}]"

    def at_best(*arguments: object) -> object:
        with torch_threads(best):
            return run(*arguments)

    return label, at_best


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
