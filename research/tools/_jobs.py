"""A sweep's runs as cluster jobs through submitit (the `slurm` extra): `scripts/sweep ... --executor slurm`.

Each run (or a `--vmapped` population) is one job that runs the run's own command, `... --run-dir DIR
--resume auto`, so a job SLURM requeues, or one preempted, continues where its run stopped: on the job's
signal (SLURM's, before its time limit or a preemption) `RunCommand.checkpoint` stops the run with SIGTERM,
which checkpoints it, and asks submitit to requeue the same command. The jobs' ids are kept in
`SWEEP_DIR/jobs.json`: with `--no-wait` the sweep returns once they are submitted, and running the same
sweep again collects them (waiting for those still queued or running) instead of submitting them twice.
`--executor submitit-local` runs the same jobs through submitit's local executor: the code path of
SLURM, on this machine (its jobs are the sweep's children: it always waits for them).
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..install import require_extra
from ._pool import ALREADY_FINISHED, Outcome, Run

EXECUTORS = ("processes", "slurm", "submitit-local")


class RunCommand:
    """A run's command as a submitit job (a `submitit.helpers.Checkpointable`: requeued with its own
    state). Its output goes to `log_dir/NAME.out|err`, as a sweep's processes' does."""

    def __init__(self, name: str, command: Sequence[str], log_dir: str):
        self.name, self.command, self.log_dir = name, list(command), log_dir
        self._process: subprocess.Popen | None = None

    def __call__(self) -> int:
        logs = Path(self.log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{self.name}.out", "a") as out, open(logs / f"{self.name}.err", "a") as err:
            self._process = subprocess.Popen(self.command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            status = self._wait(self._process)
        if status != 0:
            raise RuntimeError(f"{self.name} exited with status {status}: {last_line(logs / f'{self.name}.err')}")
        return status

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The job's signal (a timeout, a preemption): the run saves a checkpoint on SIGTERM and stops;
        then the same command is resubmitted, and `--resume auto` continues it."""
        import submitit

        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            if self._wait(self._process, timeout=600) is None:
                self._process.kill()
        return submitit.helpers.DelayedSubmission(RunCommand(self.name, self.command, self.log_dir))

    @staticmethod
    def _wait(process: subprocess.Popen, timeout: float = float("inf")) -> int | None:
        """The run's exit status (None: still running after `timeout` seconds), polled: `checkpoint` runs in
        a signal handler that may interrupt this wait, and `Popen.wait` would hold a lock it needs."""
        deadline = time.monotonic() + timeout
        while (status := process.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return status

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "command": self.command, "log_dir": self.log_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _process=None)


def last_line(path: Path) -> str:
    lines = (
        [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if path.exists()
        else []
    )
    return lines[-1] if lines else ""


def make_executor(kind: str, folder: Path, options: Any) -> Any:
    """submitit's executor for `kind` ('slurm' or 'submitit-local') with the sweep's `--slurm-*` options."""
    require_extra(f"--executor {kind}", "submitit")
    import submitit

    if kind == "slurm":
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        extra = dict(word.split("=", 1) for word in options.slurm_extra)
        executor.update_parameters(
            timeout_min=options.slurm_time,
            slurm_array_parallelism=options.jobs,
            gpus_per_node=options.slurm_gpus,
            cpus_per_task=options.slurm_cpus,
            slurm_signal_delay_s=120,
            **({"slurm_partition": options.slurm_partition} if options.slurm_partition else {}),
            **({"mem_gb": options.slurm_mem} if options.slurm_mem else {}),
            **({"slurm_additional_parameters": extra} if extra else {}),
        )
        return executor
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(timeout_min=options.slurm_time)
    return executor


# The jobs this process submitted: a local job's state is known only to the process that started it.
_SUBMITTED: dict[str, Any] = {}


def _job(kind: str, folder: Path, job_id: str) -> Any:
    """The job of `job_id`: SLURM knows its state; a local job is known by the process that submitted it."""
    import submitit

    if job_id in _SUBMITTED:
        return _SUBMITTED[job_id]
    return (submitit.SlurmJob if kind == "slurm" else submitit.LocalJob)(folder=folder, job_id=job_id)


def _read_jobs(path: Path) -> dict[str, str]:
    return json.loads(path.read_text()) if path.exists() else {}


def submit_and_collect(
    runs: Sequence[Run], kind: str, sweep_dir: Path, options: Any, *, wait: bool, finished: Callable[[Outcome], None]
) -> list[Any]:
    """Submit the runs without a job still queued or running (the others' jobs are collected), record
    their ids in `SWEEP_DIR/jobs.json`, and, with `wait`, call `finished` as each job ends. Returns the
    jobs (submitted or collected)."""
    folder, ledger = sweep_dir / "submitit", sweep_dir / "jobs.json"
    known = _read_jobs(ledger)
    jobs: dict[str, Any] = {}
    for run in runs:
        if run.name in known:
            job = _job(kind, folder, known[run.name])
            if not job.done():
                jobs[run.name] = job  # queued or running from an earlier sweep: collect it
    executor = make_executor(kind, folder, options)
    todo = [run for run in runs if run.name not in jobs]
    if todo:
        with executor.batch():  # one job array
            submitted = [
                (run, executor.submit(RunCommand(run.name, run.command, str(sweep_dir / "logs")))) for run in todo
            ]
        jobs.update({run.name: job for run, job in submitted})
        _SUBMITTED.update({str(job.job_id): job for _, job in submitted})
    known.update({name: str(job.job_id) for name, job in jobs.items()})
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.with_suffix(".tmp").write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")
    os.replace(ledger.with_suffix(".tmp"), ledger)  # a sweep killed while writing leaves the previous ledger
    ids = ", ".join(str(job.job_id) for job in jobs.values())
    print(
        f"sweep: {len(todo)} job(s) submitted, {len(jobs) - len(todo)} collected ({kind}: {ids}); logs in "
        f"{sweep_dir / 'logs'}, submitit's in {folder}",
        file=sys.stderr,
        flush=True,
    )
    if wait:
        _wait(runs, jobs, sweep_dir / "logs", finished)
    return list(jobs.values())


def _wait(runs: Sequence[Run], jobs: dict[str, Any], log_dir: Path, finished: Callable[[Outcome], None]) -> None:
    pending = {run.name: run for run in runs if run.name in jobs}
    start = time.monotonic()
    while pending:
        for name in [n for n, _ in pending.items() if jobs[n].done()]:
            run = pending.pop(name)
            try:
                jobs[name].result()
                status = 0
            except Exception:  # the job failed: its run's own last line says why
                status = 1
            error = last_line(log_dir / f"{name}.err")
            finished(
                Outcome(
                    run,
                    status,
                    time.monotonic() - start,
                    error,
                    skipped=status == 0 and error.endswith(ALREADY_FINISHED),
                )
            )
        time.sleep(0.5)
