"""Experiments and sweeps called from Python (a notebook cell, a script) with their options as keyword
arguments, checked as the command line checks them.

    run = research.train_experiment("xor", epochs=5, lr=0.3)
    run.summary["test_accuracy"], run.path, run.model
    runs = research.sweep_experiment("xor", {"lr": [0.1, 0.3]}, epochs=5, vmapped=True)
"""

import contextlib
import io
import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from .cli import RunConfig, prepare_process, restore_run, restored_options, run_to_restore
from .config import flag_name
from .errors import ConfigError, Preempted
from .experiment import LoadedRun, experiment_script, load_experiment, load_run
from .run_plan import no_run_to_resume
from .services import RUNS_ROOT, RunDir
from .tools import sweep
from .tools.sweep import SET_BY_SWEEP, default_sweep_dir, run_name


def train_experiment(name: str, /, **options: Any) -> LoadedRun:
    """Train experiment `name` (`experiments/NAME.py`) in this process, as `scripts/run NAME --flags` would,
    and return the trained run loaded back from its directory (`research.load_run`): `.summary` its final
    numbers, `.path` the run directory, `.model` the trained model, `.config`, `.setup`, `.state`.

    **Arguments:**

    - `name`: the experiment, `"xor"`, `"mnist1d"`, `"lm"`, ... (or an experiment script's path).
    - `options`: its options by their flags' names with underscores: `epochs=5`, `lr=0.3`,
      `ema_decay=0.999`, `resume="auto"`. A bad name or value raises `ConfigError` naming the option,
      before any work. Without `run_dir` a new `runs/NAME/<time>` directory is made (`resume` without
      `run_dir`: the experiment's latest run). A resumed run takes the options not given from its
      config.json; those given must be `resumable` or as the run had them.

    `devices=N` on the CPU simulates N devices only before JAX has created its first array (first in a
    fresh kernel); after that it raises `DeviceError` saying so. Stopped by the notebook's stop button
    (SIGINT) or SIGTERM, the run checkpoints and raises `Preempted` with the call that continues it.
    Other bad input (data that does not fit, a damaged checkpoint) raises the library's error types
    (`research.errors`) where the command line would exit with status 2.
    """
    module = load_experiment(str(experiment_script(name)))
    experiment = Path(module.__file__ or name).stem
    options = _with_run_dir(experiment, options)
    run = run_to_restore(options.get("resume"), options["run_dir"], experiment)
    if run is None:
        config: RunConfig = module.Config.from_dict(options)
    else:  # a resumed run's options come back from its config.json, as on the command line
        saved = restored_options(module.Config, run, f"{experiment}.py")  # named as its script: a run of it
        config = restore_run(module.Config, run, saved, {**saved, **options})
    prepare_process(config, f"research.train_experiment({name!r})")
    try:
        module.main(config)
    except Preempted as e:
        again = {**options, "resume": "auto"}
        call = ", ".join([repr(name), *(f"{key}={value!r}" for key, value in again.items())])
        message = str(e).replace("rerun the same command with --resume auto", f"research.train_experiment({call})")
        raise Preempted(message, step=e.step, status=e.status) from None
    return load_run(Path(options["run_dir"]).absolute())


def _with_run_dir(experiment: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the run directory the run will have: a call must know it to load the run back."""
    if options.get("run_dir"):
        return options
    if options.get("resume") and options["resume"] != "never":
        latest = RunDir.latest(RUNS_ROOT, experiment)
        if latest is None:
            raise ConfigError(no_run_to_resume(RUNS_ROOT / experiment))
        return {**options, "run_dir": str(latest)}
    return {**options, "run_dir": str(RunDir.new_path(RUNS_ROOT, experiment))}


def sweep_experiment(
    name: str,
    axes: Mapping[str, Sequence[Any]],
    /,
    *,
    vmapped: bool = False,
    jobs: int = 1,
    sweep_dir: str | Path | None = None,
    **options: Any,
) -> dict[str, LoadedRun]:
    """Train experiment `name` over the grid of `axes` as `scripts/sweep` does (its table printed, its
    `results.md` and `curves.png` written), and return each run loaded back, by its directory's name
    (`"lr=0.1"`, `"lr=0.1,seed=1"`).

    **Arguments:**

    - `axes`: each swept option and its values, `{"lr": [0.1, 0.3], "seed": [0, 1]}`.
    - `vmapped`: train the grid as one vmapped population in this process (the swept options must be
      vmappable: seeds, hyperparameters kept in the optimizer's state); else each run is a process,
      `jobs` at a time.
    - `sweep_dir`: where the runs go (default: `runs/NAME/grid-KEYS`); a sweep called again there
      skips its finished runs and resumes the others.
    - `options`: the options every run shares, as `train_experiment` takes them.

    **Raises:** `ConfigError` for a bad option, axis or value (before anything starts); `RuntimeError`
    naming the failed runs (their logs in the sweep directory's `logs/`).
    """

    module = load_experiment(str(experiment_script(name)))
    config_class = module.Config
    for key, values in axes.items():
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"axis {key}: give its values as a non-empty list, say {{{key!r}: [0.1, 0.3]}}")
    for key in set(options) & set(SET_BY_SWEEP):
        raise ConfigError(f"{key}: set by the sweep for each run (sweep_dir= says where the runs go)")
    config_class.from_dict({**options, **{key: values[0] for key, values in axes.items()}})  # refuses a bad one
    where = Path(sweep_dir or default_sweep_dir(name, "grid", list(axes)))
    argv = [
        name,
        *(f"{key}={','.join(str(v) for v in values)}" for key, values in axes.items()),
        *(["--vmapped"] if vmapped else []),
        *(["--jobs", str(jobs), "--sweep-dir", str(where), "--"]),
        *_option_flags(options),
    ]
    with _errors_raised("sweep"):
        sweep.main(argv)
    return {run: load_run(where.absolute() / run) for run in _grid_names(axes)}


def _grid_names(axes: Mapping[str, Sequence[Any]]) -> list[str]:
    """The run directories' names `scripts/sweep` gives a grid (`lr=0.1,seed=0`), in its order."""
    grid = itertools.product(*(dict.fromkeys(str(v) for v in values) for values in axes.values()))
    return [run_name(list(zip(axes, point, strict=True))) for point in grid]


def _option_flags(options: Mapping[str, Any]) -> list[str]:
    """The command-line flags that give `options` (`{"lr": 0.3, "progress": False}` -> `--lr 0.3 --no-progress`),
    options that `Config.from_dict` has accepted."""
    flags: list[str] = []
    for key, value in options.items():
        if value is True:
            flags.append(flag_name(key))
        elif value is False:
            flags.append(flag_name(key).replace("--", "--no-", 1))
        elif isinstance(value, list | tuple):
            flags += [flag_name(key), *(str(v) for v in value)]
        else:
            flags += [flag_name(key), str(value)]
    return flags


class _LastLine(io.TextIOBase):
    """A text stream that passes everything on to `stream` and keeps the last line written."""

    def __init__(self, stream: TextIO):
        self.stream, self.last = stream, ""

    def write(self, text: str) -> int:
        lines = [line for line in text.splitlines() if line.strip()]
        self.last = lines[-1] if lines else self.last
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def _errors_raised(tool: str) -> Iterator[None]:
    """A tool's exit status as an exception: 2 (refused) a `ConfigError` with its message, any other failure a
    `RuntimeError`; its output goes on to stderr as it comes."""
    stderr = _LastLine(sys.stderr)
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    except SystemExit as e:
        if e.code in (0, None):
            return
        if e.code == 2:
            raise ConfigError(stderr.last.removeprefix(f"{tool}: error: ")) from None
        raise RuntimeError(f"{tool} exited with status {e.code}: {stderr.last}") from None
