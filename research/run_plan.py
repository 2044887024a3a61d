"""What a run will do, decided once before any work (`plan_run`), with the `--resume` rules and their
refusals: start afresh (`Fresh`), continue from a checkpoint (`Resume`), only evaluate a run
checkpointed at its last step but stopped before its summary (`EvaluateOnly`), or report a run that
finished and touch nothing (`Finished`).

`research.experiment.run_experiment` carries the plan out; the sweep skips the runs whose plan is
`Finished` without starting a process for them.
"""

import dataclasses
import logging
from pathlib import Path
from typing import Any

from .config import Checkpointing, ConfigError, RunConfig, check_resumable
from .parallel import process_zero_text
from .services import RUNS_ROOT, RunDir, read_header

logger = logging.getLogger(__name__)  # research.messages: what shows them, and where


@dataclasses.dataclass(frozen=True)
class Fresh:
    """Train from step 0 in `run`; `restart`: the run stopped before its first checkpoint, so the
    metrics it logged are dropped."""

    run: RunDir
    restart: bool = False


@dataclasses.dataclass(frozen=True)
class Resume:
    """Continue the run in `run` from `checkpoint` (at `step`, before the last one)."""

    run: RunDir
    checkpoint: Path
    step: int


@dataclasses.dataclass(frozen=True)
class EvaluateOnly:
    """The run's training ended (`checkpoint` is at its last `step`) but it stopped before its summary:
    evaluate that state and write the summary."""

    run: RunDir
    checkpoint: Path
    step: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """The run finished at `step` (say, a requeued job): report its `summary`, touch nothing."""

    run: RunDir
    summary: dict[str, Any]
    step: int

    def note(self) -> str:
        """The log line (the sweep recognises a skipped run by its ending, `research.tools._pool`)."""
        return f"{self.run.path} finished at step {self.step}: nothing to train"


Plan = Fresh | Resume | EvaluateOnly | Finished


def plan_run(experiment: str, config: RunConfig, *, num_steps: int, writer: bool = True) -> Plan:
    """What the run of `config` (training `num_steps` steps in all) does; refuses with `ConfigError`.

    Without `--resume` the run gets `--run-dir` or a new directory (`runs/<experiment>/<time>`), and the
    `writer` (process 0) refuses one that already holds a run. `--resume must` (bare `--resume`)
    continues `--run-dir` or the experiment's latest run from its newest valid checkpoint and refuses
    when there is no run or no valid checkpoint; `--resume auto` then starts afresh in `--run-dir`
    instead (when it holds no committed checkpoint at all, valid or damaged). Both refuse a config
    that differs from the run's (but in `resumable` options) and a run already past `num_steps`.
    """
    checkpointing = config.checkpointing
    if not checkpointing.resume:
        return Fresh(_new_run(experiment, checkpointing, writer))
    path = _run_to_resume(experiment, checkpointing)
    if checkpointing.resume == "auto" and path is not None and not RunDir(path).checkpoint_paths():
        run = RunDir(path)
        if run.config_file.exists():  # a run stopped before its first checkpoint: start it again
            check_same_config(run, config)
        return Fresh(run, restart=run.config_file.exists())
    if path is None or not (path / "config.json").exists():
        raise ConfigError(no_run_to_resume(checkpointing.run_dir or f"{RUNS_ROOT / experiment}/*"))
    run = RunDir(path)
    checkpoint = _latest_valid_checkpoint(run)
    check_same_config(run, config)
    header = read_header(checkpoint)
    step = header["step"]
    if step > num_steps:
        raise ConfigError(
            f"--resume: the run in {path} is at step {step}, past the {num_steps} steps "
            "this config trains; resume with as many steps or more"
        )
    if step < num_steps and "finished" not in header:  # (a hook ended it early: `StepInfo.finish`)
        return Resume(run, checkpoint, step)
    summary = run.read_summary()
    return EvaluateOnly(run, checkpoint, step) if summary is None else Finished(run, summary, step)


def _new_run(experiment: str, checkpointing: Checkpointing, writer: bool) -> RunDir:
    # A new run's default name is the time: every process takes process 0's (they save into one directory).
    path = Path(checkpointing.run_dir or process_zero_text(str(RunDir.new_path(RUNS_ROOT, experiment))))
    if writer and (path / "config.json").exists():
        raise ConfigError(holds_a_run(path))
    return RunDir(path)


def _run_to_resume(experiment: str, checkpointing: Checkpointing) -> Path | None:
    if checkpointing.run_dir:
        return Path(checkpointing.run_dir)
    latest = process_zero_text(str(RunDir.latest(RUNS_ROOT, experiment) or ""))  # every process resumes process 0's
    return Path(latest) if latest else None


def _latest_valid_checkpoint(run: RunDir) -> Path:
    checkpoint, problems = run.latest_valid_checkpoint()
    for problem in problems:
        logger.warning("warning: skipping %s", problem)
    if checkpoint is None:
        raise ConfigError(f"--resume: no valid checkpoint in {run.checkpoints}")
    return checkpoint


def no_run_to_resume(where: str | Path) -> str:
    return f"--resume: no run to resume in {where}; start one without --resume"


def holds_a_run(path: Path) -> str:
    return f"--run-dir {path} already holds a run; pass --resume to continue it, or pick a new directory"


def check_same_config(run: RunDir, config: RunConfig) -> None:
    """Refuse to continue the run in `run` with a config that differs from its own (but in `resumable` options)."""
    check_resumable(run.read_config()["config"], config, run.path)
