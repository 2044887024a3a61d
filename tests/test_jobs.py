"""scripts/sweep --executor slurm's code path, run through submitit's local executor: each run a job of its
own `--resume auto` command, the jobs' ids kept so that a sweep run again collects them, a job stopped
by its signal (a timeout, a preemption) checkpointed and requeued to finish the run bit for bit."""

import json
import os
import time
from pathlib import Path

import pytest
from test_sweep import TINY, run_sweep

from research.services import RunDir
from research.tools import sweep
from research.tools._jobs import submit_and_collect

submitit = pytest.importorskip("submitit")


def job_process(job) -> int:
    """The process of a local job's task (a child of submitit's local controller)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = Path(f"/proc/{job._process.pid}/task/{job._process.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("the local job's task did not start")


@pytest.mark.slow
def test_a_grid_of_jobs_trains_every_run_and_prints_the_table(tmp_path, capsys):
    code, out, err = run_sweep(
        ["xor", "lr=0.1,0.3", "--executor", "submitit-local", "--sweep-dir", str(tmp_path / "s"), *TINY], capsys
    )
    assert code == 0, err
    assert "sweep: 2 job(s) submitted, 0 collected (submitit-local: " in err
    ids = json.loads((tmp_path / "s" / "jobs.json").read_text())
    assert sorted(ids) == ["lr=0.1", "lr=0.3"] and all(RunDir(tmp_path / "s" / n).read_summary() for n in ids)
    assert out.splitlines()[0] == "| run | lr | test_accuracy | test_loss | train_loss | step | wall_seconds |"
    code, out, err = run_sweep(
        ["xor", "lr=0.1,0.3", "--executor", "submitit-local", "--sweep-dir", str(tmp_path / "s"), *TINY], capsys
    )
    assert code == 0 and err.count("already finished") == 2 and "submitted" not in err  # nothing to submit


def test_options_the_jobs_cannot_take_are_refused_in_one_line(tmp_path, capsys):
    for args, message in (
        (["--search", "random", "lr=0.1:1"], "--executor submitit-local takes a grid"),
        (["--no-wait", "lr=0.1"], "--no-wait needs jobs that outlive the sweep: --executor slurm"),
    ):
        code, _, err = run_sweep(["xor", *args, "--executor", "submitit-local", "--sweep-dir", str(tmp_path)], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err


class Options:  # the sweep's --slurm-* options, as `submit_and_collect` reads them
    jobs, slurm_time, slurm_partition, slurm_gpus, slurm_cpus, slurm_mem, slurm_extra = 2, 60, None, 0, 2, None, []


@pytest.mark.slow
def test_a_job_stopped_by_its_signal_checkpoints_requeues_and_finishes_the_run_bit_for_bit(tmp_path):
    """The job's signal (what SLURM sends before a time limit or a preemption) reaches the run as SIGTERM:
    it saves a checkpoint and stops; submitit requeues the same command, which resumes it; a sweep run
    again meanwhile collects the job instead of submitting another."""
    # 40,000 steps, one a call: seconds to stop it in (a first record comes after a tenth of a second)
    args = [
        "--epochs",
        "5000",
        "--train-size",
        "256",
        "--test-size",
        "64",
        "--batch-size",
        "32",
        "--log-every",
        "2000",
        "--steps-per-call",
        "1",
        "--checkpoint-minutes",
        "0",
    ]
    module, script = sweep._experiment("xor")
    axes = [sweep.parse_axis("lr=0.3", sweep.sweepable_fields(module.Config), "xor")]
    runs = [sweep._make_run(script, tmp_path / name, args, axes, {"lr": "0.3"}) for name in ("cut", "straight")]
    [straight] = submit_and_collect(
        runs[1:], "submitit-local", tmp_path / "straight", Options(), wait=True, finished=lambda outcome: None
    )
    [job] = submit_and_collect(
        runs[:1], "submitit-local", tmp_path / "cut", Options(), wait=False, finished=lambda outcome: None
    )
    metrics = runs[0].path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or not metrics.read_text().endswith("\n"):
        assert time.monotonic() < deadline and not job.done(), "the run logged nothing in time"
        time.sleep(0.05)
    os.kill(job_process(job), submitit.JobEnvironment._usr_sig())  # what SLURM sends the job before its end
    outcomes = []
    [again] = submit_and_collect(
        runs[:1], "submitit-local", tmp_path / "cut", Options(), wait=True, finished=outcomes.append
    )
    assert again.job_id == job.job_id and outcomes[0].ok, outcomes  # collected, not submitted twice
    err = (tmp_path / "cut" / "logs" / f"{runs[0].name}.err").read_text()
    assert "stopped by SIGTERM at step" in err and "resuming" in err  # the requeued command resumed the run
    untimed = lambda run: [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(run.path).read_metrics()]  # noqa: E731,E501
    assert untimed(runs[0]) == untimed(runs[1])
