"""What a run records about itself (config.json: parameters, machine, versions, git; summary.json: compile time,
peak memory; the start line), its profile (`--profile-steps`), and runs described by files (`--config`,
`scripts/run --from`)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from _entry import run_entry

from research.errors import ConfigError
from research.nn import MLP
from research.population import stack_states
from research.provenance import git_state, parameter_counts
from research.report import summary_line
from research.run import command
from research.services import Headline, RunDir
from research.train import TrainState

ROOT = Path(__file__).parent.parent
QUICK = [
    "--no-progress",
    "--train-size",
    "256",
    "--test-size",
    "64",
    "--batch-size",
    "32",
    "--log-every",
    "4",
    "--steps-per-call",
    "4",
]


def run(argv, name="xor"):
    """The experiment's entry point in this process, named as its script; its exit status."""
    return run_entry(argv, name)


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


# -- config.json, summary.json, the start line ---------------------------------------------------------
def test_a_run_records_its_parameters_machine_versions_and_commit_and_prints_the_count(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run([*QUICK, "--epochs", "1", "--hidden", "5", "--run-dir", "r"]) == 0
    out = capsys.readouterr().out
    record = RunDir(tmp_path / "r").read_config()
    # 2 -> 5 -> 1: weights 10 + 5, biases 5 + 1
    assert record["parameters"] == {"total": 21, "by_field": {"layers": 21}}
    assert out.startswith("xor: MLP, 21 parameters (layers 21); 8 steps on 1 cpu device; run directory r\n")
    assert record["machine"] == {
        "host": record["machine"]["host"],
        "platform": "cpu",
        "device_kind": "cpu",
        "devices": 1,
        "devices_available": jax.device_count(),
        "processes": 1,
    }
    assert record["versions"]["jax"] == jax.__version__ and record["versions"]["research"] == "0.1.0"
    assert record["git"] == {
        "commit": git(ROOT, "rev-parse", "HEAD"),
        "dirty": bool(git(ROOT, "status", "--porcelain", "--untracked-files=no")),
    }
    summary = RunDir(tmp_path / "r").read_summary()
    assert 0 < summary["compile_seconds"] < summary["wall_seconds"]
    assert summary["peak_host_memory_bytes"] > 100e6  # JAX alone takes more
    assert "peak_device_memory_bytes" not in summary  # the CPU backend reports none


def test_parameter_counts_by_field_and_per_member_of_a_population(getkey):
    model = MLP(4, 3, hidden=(8,), key=getkey())
    counts = parameter_counts(model)
    assert counts["total"] == 4 * 8 + 8 + 8 * 3 + 3 == sum(x.size for x in jax.tree.leaves(model))
    import optax

    population = stack_states(
        lambda key: TrainState.create(MLP(4, 3, hidden=(8,), key=key), optax.sgd(0.1), key=key),
        jax.random.split(getkey(), 3),
    )
    assert parameter_counts(population.model, members=3) == counts


def test_git_state_of_a_checkout_clean_or_dirty_and_of_an_installed_package(tmp_path):
    package = tmp_path / "repo" / "research"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert git_state(package) == "not a git checkout"
    git(tmp_path / "repo", "init", "-q")
    git(tmp_path / "repo", "add", ".")
    git(tmp_path / "repo", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    commit = git(tmp_path / "repo", "rev-parse", "HEAD")
    assert git_state(package) == {"commit": commit, "dirty": False}
    (package / "__init__.py").write_text("x = 1\n")
    assert git_state(package) == {"commit": commit, "dirty": True}
    venv = tmp_path / "repo" / ".venv" / "lib" / "research"  # installed into a venv inside a checkout
    venv.mkdir(parents=True)
    assert git_state(venv) == "not a git checkout"


# -- --profile-steps ------------------------------------------------------------------------------------
def test_profile_steps_writes_a_trace_holding_the_compiled_train_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run([*QUICK, "--epochs", "2", "--run-dir", "r", "--profile-steps", "4:12"]) == 0
    err = capsys.readouterr().err
    [trace] = (tmp_path / "r" / "profile").glob("plugins/profile/*/perfetto_trace.json.gz")
    shown = trace.relative_to(tmp_path)
    assert f"profile of steps 4-12: `tensorboard --logdir r/profile` (the Profile tab), or open {shown}" in err
    assert list(trace.parent.glob("*.xplane.pb"))  # TensorBoard's profile plugin reads these
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    calls = [e for e in events if e.get("name") == "PjitFunction(_run_impl)"]  # one compiled call: 4 steps
    within = lambda e, o: o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]  # noqa: E731
    assert len([e for e in calls if not any(within(e, o) for o in calls)]) == 2  # steps 4-8 and 8-12


def test_a_profile_window_past_the_run_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run([*QUICK, "--epochs", "1", "--run-dir", "r", "--profile-steps", "4:9"]) == 2
    assert capsys.readouterr().err == "xor.py: error: --profile-steps 4:9 ends past the run's 8 steps\n"
    assert not (tmp_path / "r").exists()
    assert run([*QUICK, "--profile-steps", "9:4"]) == 2
    assert "--profile-steps must be A:B, two step counts with A < B (say 10:20)" in capsys.readouterr().err


# -- --config FILE and --from RUN_DIR -------------------------------------------------------------------
def test_a_yaml_file_gives_the_defaults_and_flags_override_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(
        "lr: 3e-1  # YAML reads this as text: it is a number here\nhidden: 4\nepochs: 2\nbatch-size: 32\n"
    )
    assert run([*QUICK, "--config", "c.yaml", "--epochs", "1", "--run-dir", "r"]) == 0
    config = RunDir(tmp_path / "r").read_config()["config"]
    assert (config["lr"], config["hidden"], config["epochs"], config["batch_size"]) == (0.3, 4, 1, 32)


@pytest.mark.parametrize(
    "text, message",
    [
        ("lrate: 0.1\n", "--config c.yaml: lrate is not an option of xor; its options: batch_size, "),
        ("hiden: 4\n", "--config c.yaml: hiden is not an option of xor (did you mean hidden?)"),
        ("lr: -1\n", "--config c.yaml: --lr must be positive (got -1)"),
        ("loader: disk\n", "--config c.yaml: --loader must be one of device, torch (got 'disk')"),
        ("- 1\n", "--config c.yaml: expected option: value pairs, found a list"),
        ("lr: [1\n", "--config c.yaml: not valid YAML: "),
    ],
)
def test_a_bad_config_file_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, capsys, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(text)
    assert run([*QUICK, "--config", "c.yaml", "--run-dir", "r"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xor.py: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_from_a_run_reruns_it_into_a_new_directory_and_forks_it_with_flags(tmp_path, monkeypatch):
    """`scripts/run --from RUN_DIR`: the run's config.json as the defaults (not its run directory), so the
    same command trains the same numbers elsewhere, and a flag forks it."""
    monkeypatch.chdir(tmp_path)
    assert run([*QUICK, "--epochs", "2", "--hidden", "4", "--run-dir", "first"]) == 0
    script, flags = command(["--from", "first", "--run-dir", "again"])
    assert script.name == "xor.py" and flags == ["--config", "first/config.json", "--run-dir", "again"]
    assert run(flags) == 0

    def untimed(path):
        return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(tmp_path / path).read_metrics()]

    assert untimed("again") == untimed("first")
    again = RunDir(tmp_path / "again").read_config()["config"]
    assert again == {**RunDir(tmp_path / "first").read_config()["config"], "run_dir": "again"}
    assert run([*command(["--from", "first", "--seed", "3", "--run-dir", "fork"])[1]]) == 0
    assert RunDir(tmp_path / "fork").read_config()["config"]["seed"] == 3 and untimed("fork") != untimed("first")
    fork = (tmp_path / "fork/summary.json").read_bytes()
    assert run(command(["--from", "first", "--resume", "--epochs", "3"])[1]) == 0  # first, not the latest run
    assert (
        RunDir(tmp_path / "first").read_summary()["step"] == 3 * 8
        and (tmp_path / "fork/summary.json").read_bytes() == fork
    )
    assert run(["--config", "first/config.json"], name="circles") == 2  # a run of xor is no circles config


def test_from_a_run_with_resume_continues_that_run(tmp_path, monkeypatch):
    """`scripts/run --from RUN_DIR --resume`: RUN_DIR itself, its options from its config.json (not the
    experiment's latest run); `--resume never` forks it as without --resume."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "first").mkdir()
    (tmp_path / "first/config.json").write_text(json.dumps({"experiment": "xor", "config": {}}))
    xor = ROOT / "experiments" / "xor.py"
    assert command(["--from", "first", "--resume"]) == (xor, ["--run-dir", "first", "--resume"])
    assert command(["--from=first", "--epochs", "9", "--resume", "auto"])[1] == [
        "--run-dir", "first", "--epochs", "9", "--resume", "auto"
    ]  # fmt: skip
    assert command(["--from", "first", "--resume", "--resume", "never"])[1][:2] == ["--config", "first/config.json"]
    assert command(["--from", "first", "--resume", "--no-resume"])[1][:2] == ["--config", "first/config.json"]
    with pytest.raises(ConfigError, match="--from first --resume continues the run in first; leave out --run-dir"):
        command(["--from", "first", "--resume", "--run-dir", "other"])


def test_scripts_run_names_the_experiments_and_refuses_an_unknown_one_or_run(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "research.run", "nope"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2 and result.stderr.startswith("run: error: no experiment 'nope'")
    assert "xor" in result.stderr and result.stderr.count("\n") == 1
    result = subprocess.run(
        [sys.executable, "-m", "research.run", "--from", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == f"run: error: --from: no run in {tmp_path}: it has no config.json\n"
    assert command(["xor", "--epochs", "2"]) == (ROOT / "experiments" / "xor.py", ["--epochs", "2"])


def test_the_summary_line_shows_the_headline_or_else_the_test_numbers(tmp_path):
    """A GAN run without a judge reports no fid, its headline: its line shows the test numbers it has."""
    run = RunDir(tmp_path)
    common = {"train_d_loss": 1.3, "train_g_loss": 0.75, "step": 24, "wall_seconds": 5.0}
    held_out = {"test_d_loss": 1.38, "test_d_real": 0.5, "test_raw_d_loss": 1.4, "test_member_d_loss": [1.3, 1.4]}
    fid = Headline("fid", goal="min", percent=False)
    line = summary_line("gan", {**common, **held_out}, run, fid).splitlines()[0]
    assert (
        line
        == "gan: (test d loss 1.3800, test d real 0.5000, train d loss 1.3000, train g loss 0.7500) at step 24, 5.0 s"
    )
    line = summary_line("gan", {**common, **held_out, "test_fid": 12.5}, run, fid).splitlines()[0]
    assert line == "gan: test fid 12.5 (train d loss 1.3000, train g loss 0.7500) at step 24, 5.0 s"
    classifier = {"test_accuracy": 0.5, "test_loss": 0.7, "train_loss": 0.69, "step": 3, "wall_seconds": 1.0}
    line = summary_line("xor", classifier, run, Headline("accuracy")).splitlines()[0]
    assert line == "xor: test accuracy 50.00% (test loss 0.7000, train loss 0.6900) at step 3, 1.0 s"
