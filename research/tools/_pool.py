"""The runs of a sweep as processes, N at a time; each one's output goes to the sweep's `logs/`."""

import ctypes
import dataclasses
import io
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..services import RunDir
from .launch import stop

# What `run_experiment` prints when `--resume auto` finds the run finished (it then exits 0, touching nothing).
ALREADY_FINISHED = ": nothing to train"


class _Interrupts:
    """The sweep's SIGTERM/SIGINT handler: raises KeyboardInterrupt, except while a run is being
    started, when it is held until the run is registered (an interrupt inside `Popen` would leave a
    process no one stops)."""

    def __init__(self) -> None:
        self.starting = self.pending = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.starting:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def start(self, running: list, run: "Run", log_dir: Path) -> None:
        self.starting = True
        try:
            running.append(_start(run, log_dir))
        finally:
            self.starting = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


INTERRUPTS = _Interrupts()


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its name (`lr=0.1,seed=0`), the swept values, its directory and command."""

    name: str
    values: tuple[tuple[str, str], ...]
    path: Path
    command: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a run ended: its exit status, seconds, the last line it wrote to stderr, and whether it had
    already finished before this sweep (then it trained nothing)."""

    run: Run
    status: int
    seconds: float
    last_error: str
    skipped: bool

    @property
    def ok(self) -> bool:
        return self.status == 0

    def summary(self) -> dict | None:
        return RunDir(self.run.path).read_summary() if self.ok else None


@dataclasses.dataclass
class _Started:
    run: Run
    process: subprocess.Popen
    start: float
    logs: tuple[io.TextIOWrapper, io.TextIOWrapper]


def _death_signal() -> Callable[[], None] | None:
    """Linux: what makes a run get SIGTERM when the sweep dies, even by SIGKILL, so that no orphan
    keeps writing a run directory the next sweep resumes (prctl PR_SET_PDEATHSIG). Looked up here,
    in the sweep: the child, forked from a process with threads, only calls it."""
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))


def _start(run: Run, log_dir: Path) -> _Started:
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / f"{run.name}.out", "w")
    err = open(log_dir / f"{run.name}.err", "w+")
    process = subprocess.Popen(
        run.command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_death_signal()
    )
    return _Started(run, process, time.monotonic(), (out, err))


def _finish(started: _Started) -> Outcome:
    out, err = started.logs
    out.close()
    err.seek(0)
    lines = [line.strip() for line in err.read().splitlines() if line.strip()]
    err.close()
    skipped = started.process.returncode == 0 and any(line.endswith(ALREADY_FINISHED) for line in lines)
    return Outcome(
        started.run, started.process.returncode, time.monotonic() - started.start, lines[-1] if lines else "", skipped
    )


def run_all(
    next_run: Callable[[], Run | None], jobs: int, log_dir: Path, on_finish: Callable[[Outcome], None]
) -> list[Outcome]:
    """Start runs from `next_run()` (None: no more for now) while fewer than `jobs` run; call
    `on_finish` as each ends. On KeyboardInterrupt the running ones are stopped before it propagates."""
    running: list[_Started] = []
    outcomes: list[Outcome] = []
    try:
        while True:
            while len(running) < jobs and (run := next_run()) is not None:
                INTERRUPTS.start(running, run, log_dir)
            if not running:
                return outcomes
            time.sleep(0.05)
            for started in [s for s in running if s.process.poll() is not None]:
                running.remove(started)
                outcomes.append(_finish(started))
                on_finish(outcomes[-1])
    except BaseException:
        stop([s.process for s in running])
        for started in running:
            _finish(started)
        raise
