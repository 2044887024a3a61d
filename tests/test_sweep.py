"""scripts/sweep: a grid of xor runs as processes, killed and resumed; refusals; a failing run; an Optuna search."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from research.services import RunDir
from research.tools import sweep

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--", "--epochs", "1", "--train-size", "256", "--test-size", "64", "--batch-size", "32"]


def run_sweep(args: list[str], capsys) -> tuple[int, str, str]:
    """`scripts/sweep ARGS` in this process: its exit status, stdout and stderr."""
    try:
        sweep.main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def mtimes(paths) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for path in paths for p in [path, *path.rglob("*")]}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["lrr=0.1"],
            "sweep: error: lrr is not an option of xor (did you mean lr?)",
        ),
        (
            ["run_dir=a,b"],
            "sweep: error: run_dir is set by the sweep; the keys it varies: batch_size, checkpoint_every,",
        ),
        (["lr=0.1,abc"], "sweep: error: lr=abc: argument --lr: invalid float value: 'abc'"),
        (["lr=0.1,-1"], "sweep: error: lr=-1: --lr must be positive (got -1.0)"),
        (["lr=1e-3:1e-1:log"], "sweep: error: lr: a range is for --search random or tpe"),
        (["lr=1:0.1", "--search", "random"], "sweep: error: lr=1:0.1: LOW must be below HIGH"),
        (["lr=0.1", "--", "--lr", "0.3"], "sweep: error: --lr after '--': lr is swept"),
        (["lr=0.1", "--", "--run-dir", "x"], "sweep: error: --run-dir after '--': run_dir is set by the sweep"),
        (["lr=0.1", "--", "--epochs", "zero"], "sweep: error: lr=0.1: argument --epochs: invalid int value: 'zero'"),
    ],
)
def test_a_bad_key_or_value_is_refused_in_one_line_before_anything_starts(args, message, tmp_path, capsys):
    code, out, err = run_sweep(["xor", *args[:1], "--sweep-dir", str(tmp_path / "sweep"), *args[1:]], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "sweep").exists()


def test_a_dry_run_prints_each_run_of_the_grid_as_its_command(tmp_path, capsys):
    code, out, _ = run_sweep(
        ["xor", "lr=0.1,0.3", "tensorboard=false", "--dry-run", "--sweep-dir", "s", "--", "--epochs", "2"], capsys
    )
    assert code == 0
    assert out.splitlines() == [
        f"scripts/run xor --epochs 2 --group s --lr {lr} --no-tensorboard --run-dir s/lr={lr},tensorboard=false "
        "--resume auto --no-progress"
        for lr in ("0.1", "0.3")
    ]


@pytest.mark.slow
def test_a_grid_runs_every_combination_resumes_after_a_kill_then_skips_every_finished_run(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    args = ["xor", "lr=0.1,0.3,1.0", "seed=0,1", "--sweep-dir", str(sweep_dir)]
    # One run at a time, killed (SIGKILL: no chance to clean up) once the first run has ended and the
    # second has started (its log file is there).
    killed = subprocess.Popen(
        [sys.executable, "-m", "research.tools.sweep", *args, *TINY],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(list(sweep_dir.glob("logs/*.err"))) < 2 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    # Its running run got SIGTERM when it died (PR_SET_PDEATHSIG); one past its last step still finishes.
    while processes_running(str(sweep_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    finished = [p.parent for p in sweep_dir.glob("*/summary.json")]
    assert 1 <= len(finished) < 6
    before = mtimes(finished)

    code, out, err = run_sweep([*args, "--jobs", "2", *TINY], capsys)
    assert code == 0, err
    names = [f"lr={lr},seed={seed}" for lr in ("0.1", "0.3", "1.0") for seed in (0, 1)]
    assert sorted(p.parent.name for p in sweep_dir.glob("*/summary.json")) == sorted(names)
    assert mtimes(finished) == before
    assert err.count("already finished") == len(finished) and "[sweep] 6/6 done: " in err
    table = out.splitlines()
    assert table[0] == "| runs | lr | test_accuracy | test_loss | train_loss | step | wall_seconds |"
    assert [row.split(" | ")[:2] for row in table[2:]] == [["| 2", "0.1"], ["| 2", "0.3"], ["| 2", "1"]]
    assert (sweep_dir / "results.md").read_text() == out and (sweep_dir / "curves.png").exists()

    before = mtimes(sweep_dir / name for name in names)
    code, again, err = run_sweep([*args, "--jobs", "2", *TINY], capsys)
    assert code == 0 and err.count("already finished") == 6
    assert mtimes(sweep_dir / name for name in names) == before
    assert [row.split(" | ")[:2] for row in again.splitlines()] == [row.split(" | ")[:2] for row in table]


def processes_running(word: str) -> list[str]:
    """The command lines of this machine's processes that mention `word` (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in text:
            found.append(text)
    return found


@pytest.mark.slow
def test_sigterm_stops_the_sweep_and_its_running_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    process = subprocess.Popen(
        [sys.executable, "-m", "research.tools.sweep", "xor", "lr=0.1,0.3", "--sweep-dir", str(sweep_dir), *TINY],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(sweep_dir.glob("logs/*.err")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "sweep: interrupted; its runs were stopped: rerun the same command to resume"
    assert not processes_running(str(sweep_dir))


@pytest.mark.slow
def test_a_failing_run_is_reported_with_its_last_line_and_the_others_finish(tmp_path, capsys):
    code, out, err = run_sweep(
        [
            "xor",
            "batch_size=32,512",
            "--jobs",
            "2",
            "--sweep-dir",
            str(tmp_path),
            "--",
            "--epochs",
            "1",
            "--train-size",
            "256",
            "--test-size",
            "64",
        ],
        capsys,
    )
    assert code == 1
    problem = "xor.py: error: batch size must be between 1 and the dataset size 256, got 512"
    assert f"FAILED (exit 2): {problem}" in err and f"sweep: batch_size=512 failed: {problem}" in err
    assert (tmp_path / "batch_size=32/summary.json").exists()
    assert "batch_size=32" in out.splitlines()[2]  # the table of the run that finished

    # Another --keep-checkpoints (an option a run resumes with) starts the finished run: it only says so.
    before = mtimes([tmp_path / "batch_size=32"])
    code, _, err = run_sweep(
        [
            "xor",
            "batch_size=32",
            "--sweep-dir",
            str(tmp_path),
            "--",
            "--epochs",
            "1",
            "--train-size",
            "256",
            "--test-size",
            "64",
            "--keep-checkpoints",
            "2",
        ],
        capsys,
    )
    assert code == 0 and "[sweep] 1/1 done: batch_size=32 already finished" in err
    assert mtimes([tmp_path / "batch_size=32"]) == before


@pytest.mark.slow
def test_a_random_search_keeps_its_trials_in_sqlite_and_resumes_a_killed_trial(tmp_path, capsys):
    optuna = pytest.importorskip("optuna")
    args = ["xor", "lr=0.01:1:log", "--search", "random", "--jobs", "2", "--sweep-dir", str(tmp_path)]
    code, out, err = run_sweep([*args, "--trials", "3", *TINY], capsys)
    assert code == 0, err
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert len(out.splitlines()) == 2 + 3 and "sweep: best trial trial=00" in err
    for trial in study.trials:
        run = tmp_path / f"trial={trial.number:03d},lr={trial.params['lr']:.4g}"
        assert (run / "summary.json").exists() and trial.value == RunDir(run).read_summary()["test_accuracy"]

    # A sweep killed mid-trial leaves it RUNNING in the study: the next sweep runs it first.
    stale = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 1, log=True)})
    code, _, err = run_sweep([*args, "--trials", "4", *TINY], capsys)
    assert code == 0 and f"[sweep] 1/1 done: trial=003,lr={stale.params['lr']:.4g} finished" in err
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    code, _, err = run_sweep([*args, "--trials", "4", *TINY], capsys)
    assert code == 0 and "already holds 4 finished trials" in err

    code, _, err = run_sweep(["xor", "lr=0.01:0.5:log", "--search", "random", "--sweep-dir", str(tmp_path)], capsys)
    assert code == 2 and "holds a study with another space, flags" in err
