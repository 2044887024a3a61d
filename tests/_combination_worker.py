"""Runs many experiment invocations in one process for tests/test_combinations.py.

    python tests/_combination_worker.py RUNS_JSON RESULTS_JSONL

RUNS_JSON holds a list of `{"id": ..., "script": "xor", "argv": [...]}` (a script of experiments/, or
a path to one); each is run in this
process, one after the other, through the script's own entry point,
`research.cli.main_entry(module.main, module.Config, argv)`, so imports and compilation caches are
shared. Simulated devices must be requested before JAX starts: the test sets
XLA_FLAGS=--xla_force_host_platform_device_count=N in this process's environment.

For every run, RESULTS_JSONL gets a line `{"id", "event": "start"}` before it (flushed, so that a run
which hangs or aborts the process can be named by the test) and one `{"id", "event": "end", ...}`
after it, with the exit status, the lines the run wrote to stderr, its summary.json, the run
directory's checkpoints before and after, and the most devices any computation it compiled spans.
"""

import contextlib
import io
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from jaxtyping import install_import_hook

with install_import_hook("research", "beartype.beartype"):  # the same shape checks as the test suite
    import jax

    # The experiments' imports of research, checked too (imported for the hook, not used here).
    import research.per_example  # noqa: F401
    import research.population  # noqa: F401
    from research.cli import main_entry
    from research.experiment import load_experiment

jax.config.update("jax_numpy_rank_promotion", "raise")


class CompiledDevices(logging.Handler):
    """How many computations compiled while attached, and the most devices one of them spans, from
    JAX's compile log line ("Compiling <name> with global shapes and types ... Argument mapping:
    <shardings>"; a computation without shardings runs on one device). "It ran on one device" is only
    claimed from compilations actually seen: a run served from caches compiles nothing."""

    LOGGER = "jax._src.interpreters.pxla"

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled = 0
        self.most = 0

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("Compiling "):
            return
        self.compiled += 1
        self.most = max(self.most, 1)
        for arg in record.args if isinstance(record.args, tuple) else ():
            for sharding in arg if isinstance(arg, (tuple, list)) else ():
                devices = getattr(sharding, "device_set", None)
                if devices is not None:
                    self.most = max(self.most, len(devices))

    def __enter__(self):
        logger = logging.getLogger(self.LOGGER)
        self._level, self._propagate = logger.level, logger.propagate
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the debug lines stay out of the run's stderr
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)
        logger.propagate = self._propagate


def run_dir_of(argv: list[str]) -> Path | None:
    return Path(argv[argv.index("--run-dir") + 1]) if "--run-dir" in argv else None


def checkpoints(run_dir: Path | None) -> dict[str, int]:
    """Checkpoint file name -> mtime_ns, to tell whether a run wrote one."""
    if run_dir is None or not (run_dir / "checkpoints").is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in sorted((run_dir / "checkpoints").iterdir())}


def files(run_dir: Path | None) -> dict[str, int]:
    """Every file of the run directory -> mtime_ns, to tell whether a run touched any."""
    if run_dir is None or not run_dir.is_dir():
        return {}
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in sorted(run_dir.rglob("*")) if p.is_file()}


def mtime(path: Path | None) -> int | None:
    return path.stat().st_mtime_ns if path is not None and path.exists() else None


def run_one(script: str, argv: list[str]) -> dict:
    module = load_experiment(script)
    run_dir = run_dir_of(argv)
    before, files_before = checkpoints(run_dir), files(run_dir)
    summary_path = run_dir / "summary.json" if run_dir is not None else None
    summary_before = mtime(summary_path)
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [f"{Path(script).stem}.py", *argv]  # main_entry names the program after sys.argv[0]
    start = time.perf_counter()
    with CompiledDevices() as compiled, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main_entry(module.main, module.Config, argv)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # what Python would do: print the traceback, exit with 1
            traceback.print_exc()
            status = 1
    written = mtime(summary_path) not in (None, summary_before)  # by this run, not an earlier one
    summary = json.loads(summary_path.read_text()) if written else None
    return {
        "status": status,
        "stderr": stderr.getvalue().splitlines(),
        "stdout_tail": stdout.getvalue().splitlines()[-5:],
        "summary": summary,
        "checkpoints_before": before,
        "checkpoints_after": checkpoints(run_dir),
        "files_touched": sorted(k for k, v in files(run_dir).items() if files_before.get(k) != v),
        "stdout": stdout.getvalue().splitlines()[:20],
        "run_dir_exists": bool(run_dir and run_dir.exists()),
        "run_dir": str(run_dir) if run_dir else None,
        "compilations": compiled.compiled,
        "compiled_devices": compiled.most,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    jax.local_device_count()  # start JAX with the devices of XLA_FLAGS (a --devices 1 run would otherwise pick 1)
    with open(sys.argv[2], "a") as results:
        for run in runs:
            results.write(json.dumps({"id": run["id"], "event": "start"}) + "\n")
            results.flush()
            result = run_one(run["script"], run["argv"])
            results.write(json.dumps({"id": run["id"], "event": "end", **result}) + "\n")
            results.flush()


if __name__ == "__main__":
    main()
