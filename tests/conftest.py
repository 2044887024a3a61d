import importlib.util
import itertools
import os
import re
import shutil
import tempfile

# On a GPU machine (a CUDA plugin installed): the pytest workers and the runs they start share the GPUs, so none
# takes JAX's default 75% of the memory up front, and float32 matmuls run in float32, not TF32, so that the
# tolerances this suite compares with (1e-5 across layouts) hold on a GPU as on the CPU. Set before JAX starts,
# in the environment, so that the subprocesses get them too.
if any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402

# The experiments this suite runs (in subprocesses, and in this process through main_entry) share one
# persistent compilation cache (research.cli.use_compilation_cache) for the session: a program one test
# compiles, the next loads (the slow tests spend about a third less CPU). A temporary directory, never
# the user's cache; RESEARCH_COMPILATION_CACHE=0 in the environment runs the suite without it.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="research-tests-jax-cache-")
os.environ.setdefault("RESEARCH_COMPILATION_CACHE_DIR", _COMPILATION_CACHE)
# Trackers stay on this machine whatever the developer's environment says: W&B offline, MLflow in each run's folder.
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("MLFLOW_TRACKING_URI", None)


def pytest_collection_modifyitems(config, items):
    """Tests marked `reproduction` (whole recipes over several seeds, tens of minutes each) run only when a
    `-m` expression names them (`scripts/test --reproductions`), never in the ordinary or the quick suite."""
    if "reproduction" in (config.option.markexpr or ""):
        return
    reproductions = [item for item in items if item.get_closest_marker("reproduction")]
    if reproductions:
        config.hook.pytest_deselected(items=reproductions)
        items[:] = [item for item in items if not item.get_closest_marker("reproduction")]


# A test skipped for a missing package (`pytest.importorskip`, or the grid's runs that need an extra) fails instead
# under scripts/test, whose tiers install every extra but the modules RESEARCH_TIER_LACKS names: a tier that lost a
# dependency says which, rather than passing with a file fewer. A plain `pytest` in a smaller venv still skips.
_MISSING = re.compile(r"could not import '(?P<module>[\w.]+)'|needs (?P<needed>[\w.]+), which is not installed")


def _unexpectedly_missing(report) -> str | None:
    if not report.skipped or "RESEARCH_TIER_LACKS" not in os.environ or not isinstance(report.longrepr, tuple):
        return None
    found = _MISSING.search(report.longrepr[2])
    module = found and (found["module"] or found["needed"])
    return module if module and module not in os.environ["RESEARCH_TIER_LACKS"].split(",") else None


def _fail_for_missing(report) -> None:
    module = _unexpectedly_missing(report)
    if module:
        report.outcome = "failed"
        report.longrepr = f"{module} is missing, and this tier installs it (scripts/setup): {report.longrepr[2]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_for_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_for_missing(outcome.get_result())


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


# Implicit rank promotion hides shape bugs (a (batch,) array silently broadcast against (batch, 1)).
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_after_each_file():
    """Each compiled program keeps memory maps of its code until it is freed, and a process may hold 65,530 maps
    (Linux's vm.max_map_count): a pytest worker that ran hundreds of tests' programs hit it (an abort inside
    XLA, "Cannot allocate memory"). JAX's caches are emptied after each test file; the persistent compilation
    cache above still spares the next file most of the recompiling."""
    yield
    jax.clear_caches()


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key on every call, deterministic per test."""
    counter = itertools.count()
    root = jax.random.key(0)
    return lambda: jax.random.fold_in(root, next(counter))


@pytest.fixture(scope="session")
def mnist1d_dir(tmp_path_factory):
    """A data directory holding the generated MNIST-1D cache (generated once per test session)."""
    from research.data import load_mnist1d

    path = tmp_path_factory.mktemp("mnist1d")
    load_mnist1d(path)
    return path


@pytest.fixture(scope="session")
def digits_formats(tmp_path_factory):
    """scikit-learn's digits as 32x32 RGB images in every format `research.data` reads: {format: path}."""
    from _image_formats import digits, write_formats

    return write_formats(tmp_path_factory.mktemp("digits"), *digits())
