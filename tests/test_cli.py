import dataclasses
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from research import command, install
from research.cli import (
    ConfigError,
    RunConfig,
    TrainConfig,
    check_combination,
    devices_of,
    ema_of,
    help_text,
    main_entry,
    option,
    parse_config,
    positive,
    tracking_of,
)
from research.config import option_fields, resumable_options
from research.experiment import experiment_names, load_experiment
from research.messages import quiet_when_stdout_closes

ROOT = Path(__file__).parent.parent


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """A test experiment."""

    width: int = option(8, "hidden width", check=positive)
    kind: Literal["a", "b"] = option("a", "which kind")
    sizes: tuple[int, ...] = option((4, 4), "layer sizes")


@dataclasses.dataclass(frozen=True)
class Small(RunConfig):
    """An experiment that takes two option groups (training, checkpointing): no devices, EMA or TensorBoard."""

    width: int = option(8, "hidden width", check=positive)


def test_defaults_and_overrides():
    config = parse_config(Config, [])
    assert config == Config()
    config = parse_config(
        Config, ["--width", "3", "--kind", "b", "--lr", "0.5", "--sizes", "1", "2", "3", "--resume", "--no-progress"]
    )
    assert (config.width, config.kind, config.training.lr, config.sizes) == (3, "b", 0.5, (1, 2, 3))
    assert config.checkpointing.resume == "must" and not config.training.progress


@pytest.mark.parametrize(
    "argv, resume",
    [
        ([], None),
        (["--resume"], "must"),
        (["--resume", "must"], "must"),
        (["--resume", "never"], None),
        (["--no-resume"], None),
        (["--resume", "auto", "--run-dir", "r"], "auto"),
        (["--resume=auto", "--run-dir", "r"], "auto"),
        (["--resume", "--run-dir", "r"], "must"),
    ],
)
def test_resume_spellings(argv, resume):
    assert parse_config(Config, argv).checkpointing.resume == resume


def test_resume_from_python_takes_a_bool_too():
    def resume(**options):
        return Config.from_options(**options).checkpointing.resume

    assert resume(resume=True) == "must" and resume(resume=False) is None
    assert resume(resume="never") is None and resume(resume="auto", run_dir="r") == "auto"


def test_help_lists_every_option_once_with_one_default():
    text = help_text(Config)
    lines = text.splitlines()
    # an option's first line (not a rule under a group's description); its help continues indented further
    option_line = re.compile(r"\W (--[a-z][a-z-]*)")
    starts = {m[1]: i for i, line in enumerate(lines) if (m := option_line.match(line))}
    flags = ["--" + name.replace("_", "-") for name in option_fields(Config)]
    assert sorted(starts) == sorted(flags)  # every option, and each once (a second entry would show as an extra)
    assert len([line for line in lines if option_line.match(line)]) == len(flags)
    for start in starts.values():
        end = min([i for i in starts.values() if i > start] + [len(lines)])
        entry = " ".join(lines[start:end])
        assert entry.count("default:") == 1, entry
    assert "(default: 128)" in text and "hidden width" in text and "(default: never)" in text


def test_an_option_the_experiment_does_not_take_is_refused_and_not_in_its_help(capsys):
    text = help_text(Small)
    assert "--width" in text and "--batch-size" in text and "--resume" in text
    for flag in ("--devices", "--parallel", "--ema-decay", "--tensorboard", "--num-processes"):
        assert flag not in text
    with pytest.raises(SystemExit) as info:
        parse_config(Small, ["--ema-decay", "0.9"], prog="small.py")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("small.py: error: --ema-decay is not an option of Small") and err.count("\n") == 1


def test_groups_not_taken_are_absent_and_read_as_their_defaults_only_when_asked_for():
    config = Small()
    for name in ("devices", "ema", "tracking", "parallel", "ema_decay", "tensorboard", "no_such_option"):
        with pytest.raises(AttributeError):
            getattr(config, name)  # no fallback: a typo is an error, not a default
    devices, ema, tracking = devices_of(config), ema_of(config), tracking_of(config)
    assert (devices.devices, devices.parallel, ema.ema_decay, tracking.tensorboard) == (1, "auto", 0.0, False)
    assert "devices" not in config.to_dict() and "lr" in config.to_dict()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be positive (got 0)"),
        (["--lr", "-0.1"], "--lr must be positive (got -0.1)"),
        (["--width", "-2"], "--width must be positive (got -2)"),
        (["--ema-decay", "1"], "--ema-decay must be in [0, 1) (got 1.0)"),
        (["--ema-decay", "-0.5"], "--ema-decay must be in [0, 1) (got -0.5)"),
        (["--kind", "c"], "argument --kind: invalid choice: 'c' (choose from 'a', 'b')"),
        (["--batch-size", "many"], "argument --batch-size: invalid int value: 'many'"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--resume", "maybe"], "argument --resume: invalid choice: 'maybe' (choose from 'auto', 'must', 'never')"),
        (["--bogus"], "--bogus is not an option of test_cli; its options: --batch-size, --checkpoint-every, "),
        (["--bogus", "7"], "--bogus is not an option of test_cli"),  # a flag's value: no stray word of its own
        (["7"], "unrecognized arguments: 7"),
        (["--resume", "auto"], "--resume auto needs --run-dir"),
        (["--devices", "3"], "--batch-size 128 is not divisible by the 3 devices"),
        (["--devices", "2", "--parallel", "none"], "--parallel none trains on one device, not 2"),
        (
            ["--num-processes", "2", "--process-id", "2", "--batch-size", "2"],
            "--process-id must be below --num-processes 2",
        ),
        (["--debug-nans", "--parallel", "pmap"], "--debug-nans replays steps op by op on one device"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(Config, argv, prog="xor.py")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("xor.py: error: ") and message in err and err.count("\n") == 1


def test_bad_values_raise_config_error_from_python():
    with pytest.raises(ConfigError, match="--batch-size must be positive"):
        Config.from_options(batch_size=0)
    with pytest.raises(ConfigError, match="--width must be positive"):
        Small(width=0)
    with pytest.raises(ConfigError, match="--kind must be one of a, b"):
        Config(kind="c")


def test_options_that_span_options_are_checked_in_one_place():
    config = Config()
    check_combination(config)
    with pytest.raises(ConfigError, match="not divisible by the 4 devices"):
        check_combination(config.replace(devices=2, batch_size=6), processes=2)  # the processes JAX found


def test_resumable_options_come_from_the_fields():
    assert {"run_dir", "resume", "devices", "progress", "tensorboard"} <= resumable_options(Config)
    assert not {"seed", "batch_size", "lr", "width", "ema_decay"} & resumable_options(Config)
    assert {"log_every", "epochs"} <= resumable_options(xor.Config)  # xor's own default for log_every: resumable still


def test_experiment_script_refuses_bad_values_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "xor.py"), "--batch-size", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "xor.py: error: --batch-size must be positive (got 0)"
    assert not (tmp_path / "runs").exists()


# -- resume: auto, must, and a run that already finished ---------------------------------------------
spec = importlib.util.spec_from_file_location("xor_experiment_cli", ROOT / "experiments" / "xor.py")
xor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xor)
QUICK = ["--epochs", "1", "--no-progress", "--train-size", "256", "--test-size", "64", "--batch-size", "32"]


def run_xor(argv):
    main_entry(xor.main, xor.Config, QUICK + argv)


def stamps(root):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resume_auto_starts_a_run_then_resumes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_xor(["--run-dir", "r", "--resume", "auto"])  # nothing there: a fresh run
    first = json.loads((tmp_path / "r/summary.json").read_text())
    assert first["step"] == 8 and "resuming" not in capsys.readouterr().err
    run_xor(["--run-dir", "r", "--resume", "auto", "--epochs", "2"])  # a checkpoint there: continue it
    assert "resuming r from step 8" in capsys.readouterr().err
    assert json.loads((tmp_path / "r/summary.json").read_text())["step"] == 16


@pytest.mark.slow
def test_resume_auto_restarts_a_run_stopped_before_its_first_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_xor(["--run-dir", "r"])
    shutil.rmtree(tmp_path / "r/checkpoints")  # a checkpoint is a directory (Orbax)
    (tmp_path / "r/checkpoints").mkdir()
    (tmp_path / "r/summary.json").unlink()
    run_xor(["--run-dir", "r", "--resume", "auto"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # the stopped attempt's records were dropped, not doubled


def saved_run(path, **options):
    """A run directory whose config.json says it trained xor with `options` (the others at their defaults)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"experiment": "xor", "config": options}))


def test_resume_takes_every_option_from_the_run_and_the_resumable_ones_given_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved_run(tmp_path / "r", lr=0.3, hidden=4, epochs=2, log_every=7, tracker="jsonl", run_dir="old", process_id=0)
    config = parse_config(xor.Config, ["--run-dir", "r", "--resume", "--epochs", "5", "--hidden", "4"], prog="xor.py")
    assert (config.training.lr, config.hidden, config.epochs, config.training.log_every) == (0.3, 4, 5, 7)
    assert (config.checkpointing.run_dir, config.checkpointing.resume, config.devices.process_id) == ("r", "must", None)
    assert parse_config(xor.Config, ["--run-dir", "r", "--resume=auto", "--log-every", "9"]).training.log_every == 9
    assert parse_config(xor.Config, ["--run-dir", "r", "--no-resume"]).training.lr == 0.1  # not resuming: defaults
    saved_run(tmp_path / "runs/xor/latest", lr=0.2)
    latest = parse_config(xor.Config, ["--resume"], prog="xor.py")  # without --run-dir: the latest run, named
    assert (latest.training.lr, latest.checkpointing.run_dir) == (0.2, str(Path("runs/xor/latest")))
    (tmp_path / "c.yaml").write_text("epochs: 3\n")  # a config file's options come over the run's
    assert parse_config(xor.Config, ["--run-dir", "r", "--resume", "--config", "c.yaml"], prog="xor.py").epochs == 3


def test_resume_refuses_options_that_cannot_change_in_one_line_naming_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    saved_run(tmp_path / "r", lr=0.3, hidden=4)
    with pytest.raises(SystemExit) as info:
        parse_config(
            xor.Config, ["--run-dir", "r", "--resume", "--lr", "0.1", "--hidden", "8", "--epochs", "9"], prog="xor.py"
        )
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "xor.py: error: --resume: the run in r was trained with --hidden 4 --lr 0.3, which cannot change when it "
        "resumes (given: --hidden 8 --lr 0.1); leave out --hidden --lr to continue it, or start a new run with "
        "--config r/config.json\n"
    )
    (tmp_path / "c").mkdir()
    (tmp_path / "c/config.json").write_text(json.dumps({"experiment": "circles", "config": {}}))
    with pytest.raises(SystemExit):
        parse_config(xor.Config, ["--run-dir", "c", "--resume"], prog="xor.py")
    assert capsys.readouterr().err == "xor.py: error: --resume c is a run of circles, not of xor\n"


def test_resuming_a_finished_run_reports_it_and_touches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_xor(["--run-dir", "r"])
    start, summary = capsys.readouterr().out.split("\n", 1)  # the start line, then the summary
    assert start.startswith("xor: MLP, 33 parameters")
    before = stamps(tmp_path)
    for resume in (["--resume"], ["--resume", "auto"]):
        run_xor(["--run-dir", "r", *resume])  # used to fail an assertion in run_experiment
        captured = capsys.readouterr()
        assert captured.out == summary and "finished at step 8: nothing to train" in captured.err
    assert stamps(tmp_path) == before


def test_resume_auto_completes_a_run_stopped_between_its_last_checkpoint_and_its_summary(tmp_path, monkeypatch):
    """A job killed after writing its final checkpoint but before summary.json, then requeued: the run
    is not trained again; its final model is evaluated and the summary written, with the same numbers."""
    monkeypatch.chdir(tmp_path)
    run_xor(["--run-dir", "r"])
    summary_file = tmp_path / "r/summary.json"
    first = json.loads(summary_file.read_text())
    summary_file.unlink()
    checkpoints, metrics = stamps(tmp_path / "r/checkpoints"), (tmp_path / "r/metrics.jsonl").read_bytes()
    run_xor(["--run-dir", "r", "--resume", "auto"])
    again = json.loads(summary_file.read_text())
    measured = {"wall_seconds", "compile_seconds", "peak_host_memory_bytes"}  # of this run of the process
    assert {k: v for k, v in again.items() if k not in measured} == {
        k: v for k, v in first.items() if k not in measured
    }
    assert stamps(tmp_path / "r/checkpoints") == checkpoints and (tmp_path / "r/metrics.jsonl").read_bytes() == metrics


# The `config` of a config.json written before the option groups were nested (commit 6fa46b2, by
# `run_xor(["--run-dir", "r"])`): every option by its name alone. Runs still write it so.
FLAT_CONFIG = {
    "batch_size": 32, "checkpoint_every": 0, "checkpoint_minutes": 10.0, "compilation_cache": True,
    "coordinator_address": None, "debug_nans": False, "deterministic_reduction": False, "devices": 1,
    "distributed_timeout": 60, "ema_decay": 0.0, "epochs": 1, "eval_every": 0, "group": None, "hidden": 8,
    "keep_checkpoints": 3, "loader": "device", "log_every": 190, "lr": 0.1, "micro_batches": 8, "mlflow_uri": None,
    "num_processes": None, "parallel": "auto", "process_id": None, "profile_steps": None, "progress": False,
    "resume": None, "run_dir": "r", "seed": 0, "skip_nonfinite": False, "steps_per_call": 100, "tensorboard": False,
    "test_seed": 123, "test_size": 64, "tracker": "jsonl", "train_seed": 42, "train_size": 256,
}  # fmt: skip


def test_a_run_dir_from_before_the_nested_groups_resumes_and_loads(tmp_path, monkeypatch, capsys):
    from research.experiment import load_run

    monkeypatch.chdir(tmp_path)
    run_xor(["--run-dir", "r"])
    record = json.loads((tmp_path / "r/config.json").read_text())
    since = {"early_stopping": 0, "grad_accum": 1, "precision": "float32"}  # options added since: their defaults
    assert record["config"] == {**FLAT_CONFIG, **since}  # the same flat record, and options added since
    for config in (FLAT_CONFIG, {"training": {"lr": 0.1}, **{k: v for k, v in FLAT_CONFIG.items() if k != "lr"}}):
        (tmp_path / "r/config.json").write_text(json.dumps({**record, "config": config}))  # nested: read too
        loaded = load_run("r")
        assert (loaded.step, loaded.config.training.lr, loaded.config.epochs) == (8, 0.1, 1)
        assert parse_config(xor.Config, ["--config", "r/config.json"], prog="xor.py").to_dict() == {
            **FLAT_CONFIG,
            **since,
            "run_dir": None,  # --config takes what a run trains, not where it lives
        }
    with pytest.raises(SystemExit):  # a changed option is still refused, named as before
        run_xor(["--run-dir", "r", "--resume", "--epochs", "2", "--hidden", "4"])
    assert (
        "the run in r was trained with --hidden 8, which cannot change when it resumes (given: --hidden 4)"
        in capsys.readouterr().err
    )
    run_xor(["--run-dir", "r", "--resume", "--epochs", "2"])
    assert "resuming r from step 8" in capsys.readouterr().err
    assert json.loads((tmp_path / "r/summary.json").read_text())["step"] == 16


def test_a_config_file_may_nest_options_by_group(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("training:\n  lr: 0.3\n  batch-size: 64\nepochs: 2\ndevices: {ema_decay: 0.5}\n")
    with pytest.raises(SystemExit):  # ema_decay is not a device option: a group holds its own options only
        parse_config(xor.Config, ["--config", str(tmp_path / "c.yaml")], prog="xor.py")
    assert "devices.ema_decay is not an option of xor" in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("training:\n  lr: 0.3\n  batch-size: 64\nepochs: 2\nema: {ema_decay: 0.5}\n")
    config = parse_config(xor.Config, ["--config", str(tmp_path / "c.yaml"), "--lr", "0.2"], prog="xor.py")
    assert (config.training.lr, config.training.batch_size, config.epochs, config.ema.ema_decay) == (0.2, 64, 2, 0.5)


def test_resume_must_refuses_an_empty_run_dir_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        run_xor(["--run-dir", "r", "--resume"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{Path(sys.argv[0]).name}: error: --resume: no run to resume in r; start one without --resume"
    ]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_resuming_a_finished_run_from_the_shell_exits_0(tmp_path):
    command = [sys.executable, str(ROOT / "experiments" / "xor.py"), *QUICK, "--run-dir", "d"]
    assert subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=300).returncode == 0
    before = stamps(tmp_path)
    result = subprocess.run([*command, "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "xor: test accuracy" in result.stdout and stamps(tmp_path) == before


def test_no_line_of_an_experiments_description_starts_with_a_flag():
    """tyro's help breaks the description's paragraph before a line that starts with `--flag`."""
    configs = [getattr(load_experiment(name), "Config", None) for name in experiment_names()]
    docs = [inspect.cleandoc(vars(config)["__doc__"]) for config in configs if config is not None]
    assert len(docs) > 10
    assert not [line for doc in docs for line in doc.splitlines() if line.startswith("-")]


def run_command(argv: list[str], capsys) -> tuple[int, str]:
    """`research ARGV` (the `research` command) in this process: its exit status, and its stdout + stderr."""
    try:
        command.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_research_help_lists_each_command_on_one_line_without_importing_jax():
    """What `research --help` imports is timed in a fresh interpreter: no JAX, torch or tyro (tools' imports)."""
    check = (
        "import sys\nfrom research.command import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0\nheavy = {'jax', 'torch', 'numpy', 'tyro'} & set(sys.modules)\nassert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "usage: research COMMAND [args]"
    for name in command.COMMANDS:
        assert len([line for line in lines if line.startswith(f"  {name} ")]) == 1, name
    assert "setup" in result.stdout and "test" in result.stdout  # the repository's own scripts, said to be so


def test_help_into_a_pipe_nobody_reads_ends_without_a_traceback():
    """`research run xor --help | head -1`: a reader that has closed the pipe (here before the command writes,
    so no buffer can hide it); the command stops with a shell's SIGPIPE status and says nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from research.command import main; main()", "run", "xor", "--help"],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_a_broken_pipe_other_than_stdout_is_an_error_not_a_quiet_exit():
    with pytest.raises(BrokenPipeError), quiet_when_stdout_closes():
        raise BrokenPipeError("a worker's pipe")


@pytest.mark.parametrize("name", list(command.COMMANDS))
def test_each_command_has_help_whose_usage_names_the_command_typed(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu-check puts the checkout on it
    code, output = run_command([name, "--help"], capsys)
    assert code == 0 and output.startswith(f"usage: research {name} "), output
    assert "scripts/" not in output.splitlines()[0]


def test_in_a_checkout_the_scripts_usage_names_the_script(capsys):
    """`scripts/sweep` runs `python -m research.tools.sweep`: outside the `research` command, in a checkout,
    the usage and the commands a tool shows are the scripts'."""
    from research.tools import sweep

    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: scripts/sweep EXPERIMENT")
    code, output = run_command(["sweep", "xor", "lr=0.1", "--dry-run"], capsys)
    assert code == 0 and output.startswith("research run xor "), output  # the command typed, inside it too


def test_an_unknown_command_is_one_line_with_a_suggestion(capsys):
    assert run_command(["swep", "xor"], capsys) == (
        2,
        "research: error: no command 'swep' (did you mean sweep?); research --help lists them\n",
    )
    code, output = run_command([], capsys)
    assert code == 2 and output.startswith("usage: research COMMAND")


def test_gpu_check_outside_a_checkout_is_one_line_exit_2(capsys, monkeypatch):
    """The GPU check is the repository's (benchmarks/, tests/), which an installed package lacks."""
    monkeypatch.setattr(install, "checkout", lambda: None)
    code, output = run_command(["gpu-check", "--tiny"], capsys)
    assert code == 2 and output.count("\n") == 1 and "scripts/gpu-check in a checkout" in output, output


def test_an_unknown_option_is_one_message_on_the_command_line_from_python_and_in_a_config_file(
    tmp_path, monkeypatch, capsys
):
    """`--epoch`, `epoch=` and `epoch:` (for epochs) are refused by one message, with the option meant, spelled
    as each was given: a flag, a keyword, a key (and a sweep's axis, a key too)."""
    import research
    from research.tools import sweep

    monkeypatch.chdir(tmp_path)
    experiment = load_experiment("xor")
    refusals = []
    for argv in (["--epoch", "3"], ["--epoch=3"]):
        with pytest.raises(SystemExit):
            parse_config(experiment.Config, argv, prog="xor.py")
        refusals.append(capsys.readouterr().err)
    (tmp_path / "c.yaml").write_text("epoch: 3\n")
    with pytest.raises(SystemExit):
        parse_config(experiment.Config, ["--config", "c.yaml"], prog="xor.py")
    refusals.append(capsys.readouterr().err)
    for call in (lambda: experiment.Config.from_options(epoch=3), lambda: research.train_experiment("xor", epoch=3)):
        with pytest.raises(ConfigError) as refused:
            call()
        refusals.append(f"{refused.value}\n")
    with pytest.raises(SystemExit):
        sweep.main(["xor", "epoch=1,2"])
    refusals.append(capsys.readouterr().err)
    message = "epoch is not an option of xor (did you mean epochs?)\n"
    assert refusals == [
        f"xor.py: error: {message.replace('epoch', '--epoch')}",
        f"xor.py: error: {message.replace('epoch', '--epoch')}",
        f"xor.py: error: --config c.yaml: {message}",
        message,
        message,
        f"sweep: error: {message}",
    ]
    assert not (tmp_path / "runs").exists()
    with pytest.raises(
        ConfigError, match=r"^epoch, lrr are not options of xor \(did you mean epochs for epoch, lr for"
    ):
        experiment.Config.from_options(epoch=3, lrr=0.1)
    with pytest.raises(ConfigError, match=r"^zzz is not an option of xor; its options: batch_size, checkpoint_every, "):
        experiment.Config.from_options(zzz=1)
