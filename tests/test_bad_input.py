"""Every kind of bad input is refused with one clear line and exit status 2, and overwrites nothing.

`CASES` is the table: (id, command-line arguments, what the message must say, set-up[, experiment]).
Set-ups prepare a run directory or swap the data set before the command runs; the experiment is
`xor` unless named (`mnist1d`, for options only it has).
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

from research.cli import RunConfig, main_entry
from research.data import DeviceLoader, XORDataset
from research.services import RunDir
from research.train import Step, SupervisedStep

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("xor_experiment_bad_input", ROOT / "experiments" / "xor.py")
xor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xor)
spec = importlib.util.spec_from_file_location("mnist1d_experiment_bad_input", ROOT / "experiments" / "mnist1d.py")
mnist1d = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mnist1d)

QUICK = {
    "xor": ["--epochs", "1", "--no-progress", "--train-size", "256", "--test-size", "64", "--batch-size", "32"],
    "mnist1d": ["--steps", "1", "--no-progress"],
}


def finished_run(tmp_path, monkeypatch):
    run_main(QUICK["xor"] + ["--run-dir", "r"])


def run_main(argv, experiment="xor"):
    module = {"xor": xor, "mnist1d": mnist1d}[experiment]
    main_entry(module.main, module.Config, argv)


class ThreeFeatureXOR(XORDataset):
    def __init__(self, size, seed, std=0.1):
        super().__init__(size, seed, std)
        self.inputs = np.concatenate([self.inputs, self.inputs[:, :1]], axis=1)


class FloatLabelXOR(XORDataset):
    def __init__(self, size, seed, std=0.1):
        super().__init__(size, seed, std)
        self.labels = self.labels.astype(np.float32)


def corrupt_every_checkpoint(tmp_path, monkeypatch):
    finished_run(tmp_path, monkeypatch)
    for path in RunDir(tmp_path / "r").checkpoint_paths():
        files = json.loads((path / "checkpoint.json").read_text())["files"]
        data = path / max(files, key=lambda name: files[name][0])  # the array bytes
        data.write_bytes(data.read_bytes()[:-4])


def foreign_checkpoint(tmp_path, monkeypatch):
    """A run whose saved config claims 16 hidden units while its checkpoint holds 8."""
    finished_run(tmp_path, monkeypatch)
    config_file = tmp_path / "r/config.json"
    saved = json.loads(config_file.read_text())
    saved["config"]["hidden"] = 16
    config_file.write_text(json.dumps(saved))


def unlabelled_test_data(tmp_path, monkeypatch):
    """The test set's inputs alone (a DeviceLoader made with labels=None), under the default evaluator:
    it used to train every step, then fail in the evaluation's trace (exit 1, no checkpoint)."""
    built = xor.setup

    def setup(config):
        made = built(config)
        test = made.eval_data
        return dataclasses.replace(made, eval_data=DeviceLoader(test.host.inputs, None, test.batch_size, shuffle=False))

    monkeypatch.setattr(xor, "setup", setup)


class BrokenStep(Step):
    """xor's `SupervisedStep` with its result broken as `how` says: what the engine refuses before any step."""

    how: str = eqx.field(static=True)
    finite_metrics: tuple[str, ...] = eqx.field(static=True, default=("loss", "grad_norm"))

    def __call__(self, state, batch, key, global_batch):
        new, metrics = SupervisedStep()(state, batch, key, global_batch)
        if self.how == "vector":
            metrics = {**metrics, "loss": jnp.stack([metrics["loss"], metrics["loss"]])}
        return new, metrics


def swap_step(step):
    def swap(tmp_path, monkeypatch):
        built = xor.setup
        monkeypatch.setattr(xor, "setup", lambda config: dataclasses.replace(built(config), step=step))

    return swap


def no_headline(tmp_path, monkeypatch):
    monkeypatch.setattr(xor.Config, "headline", None)


def swap_dataset(cls):
    return lambda tmp_path, monkeypatch: monkeypatch.setattr(xor, "XORDataset", cls)


CASES = [
    ("batch size zero", ["--batch-size", "0"], "--batch-size must be positive (got 0)", None),
    ("batch size negative", ["--batch-size", "-5"], "--batch-size must be positive (got -5)", None),
    ("batch size not a number", ["--batch-size", "lots"], "argument --batch-size: invalid int value: 'lots'", None),
    (
        "batch larger than the data",
        ["--batch-size", "300"],
        "batch size must be between 1 and the dataset size 256, got 300",
        None,
    ),
    ("learning rate zero", ["--lr", "0"], "--lr must be positive (got 0.0)", None),
    ("learning rate negative", ["--lr", "-0.1"], "--lr must be positive (got -0.1)", None),
    ("epochs zero", ["--epochs", "0"], "--epochs must be positive (got 0)", None),
    ("hidden zero", ["--hidden", "0"], "--hidden must be positive (got 0)", None),
    ("train size zero", ["--train-size", "0"], "--train-size must be positive (got 0)", None),
    ("log cadence zero", ["--log-every", "0"], "--log-every must be positive (got 0)", None),
    ("eval cadence negative", ["--eval-every", "-1"], "--eval-every must be >= 0 (got -1)", None),
    ("keep no checkpoints", ["--keep-checkpoints", "0"], "--keep-checkpoints must be positive (got 0)", None),
    ("steps per call zero", ["--steps-per-call", "0"], "--steps-per-call must be positive (got 0)", None),
    ("unknown loader", ["--loader", "gpu"], "argument --loader: invalid choice: 'gpu'", None),
    ("unknown option", ["--optimiser", "adam"], "--optimiser is not an option of xor_experiment_bad_input", None),
    ("resume with no run", ["--resume"], "--resume: no run to resume in runs/xor/*", None),
    ("resume auto with no run directory", ["--resume", "auto"], "--resume auto needs --run-dir", None),
    (
        "resume with a different config",
        ["--resume", "--run-dir", "r", "--hidden", "16"],
        "--resume: the run in r was trained with --hidden 8, which cannot change when it resumes (given: --hidden 16); "
        "leave out --hidden to continue it, or start a new run with --config r/config.json",
        finished_run,
    ),
    (
        "resume with only damaged checkpoints",
        ["--resume", "--run-dir", "r"],
        "--resume: no valid checkpoint in r/checkpoints",
        corrupt_every_checkpoint,
    ),
    # --epochs 2: the run goes on training (a finished run resumed as it was only reports its summary)
    (
        "checkpoint of another architecture",
        ["--resume", "--run-dir", "r", "--hidden", "16", "--epochs", "2"],
        "is of a different architecture: .model.layers[0].weight: saved (8, 2) float32, expected (16, 2) float32",
        foreign_checkpoint,
    ),
    ("run directory already used", ["--run-dir", "r"], "--run-dir r already holds a run", finished_run),
    (
        "data of the wrong shape",
        [],
        "the data does not fit the model: research.nn._mlp.MLP.__call__ parameter 'x' got f32[3]",
        swap_dataset(ThreeFeatureXOR),
    ),
    (
        "labels of the wrong dtype",
        [],
        "the data does not fit the model: research.train._state.classification_metrics parameter 'labels' got f32[32]",
        swap_dataset(FloatLabelXOR),
    ),
    (
        "test data without labels",
        [],
        "the test data has no labels (a DeviceLoader made with labels=None), and the default evaluator",
        unlabelled_test_data,
    ),
    # in this process JAX has started with one CPU device: no more can be simulated
    ("more devices than exist", ["--devices", "4"], "--devices 4: JAX already started with 1 CPU device(s)", None),
    (
        "batch not divisible by the devices",
        ["--devices", "3"],
        "--batch-size 32 is not divisible by the 3 devices",
        None,
    ),
    (
        "unknown model",
        ["--model", "vgg"],
        "argument --model: invalid choice: 'vgg' (choose from 'logistic', 'mlp'",
        None,
        "mnist1d",
    ),
    ("EMA decay of 1 or more", ["--ema-decay", "1.5"], "--ema-decay must be in [0, 1) (got 1.5)", None, "mnist1d"),
    (
        "an experiment without a headline",
        [],
        "declares no headline, the number its runs are judged by",
        no_headline,
    ),
    (
        "step metrics that are not scalars",
        [],
        r"the step BrokenStep's metrics must each be a float32 scalar: loss is float32[2]",
        swap_step(BrokenStep("vector")),
    ),
    (
        "a step without its finite metrics",
        [],
        "the step BrokenStep declares finite_metrics ['loss', 'gradient_norm'], but its metrics",
        swap_step(BrokenStep("none", ("loss", "gradient_norm"))),
    ),
]


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    _, argv, message, setup, *named = case
    experiment = named[0] if named else "xor"
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path, monkeypatch)
    capsys.readouterr()
    before = snapshot(tmp_path)

    with pytest.raises(SystemExit) as info:
        run_main(QUICK[experiment] + argv, experiment)

    assert info.value.code == 2, "a bad input must exit with status 2"
    err = capsys.readouterr().err.strip()
    assert message in err
    errors = [line for line in err.splitlines() if not line.startswith("warning: skipping checkpoint")]
    assert len(errors) == 1 and ": error: " in errors[0]
    after = snapshot(tmp_path)
    assert {p: b for p, b in after.items() if p in before} == before  # nothing written over
    assert not [p for p in after if p not in before and "checkpoints" in p.parts]


def test_the_table_covers_the_kinds_of_bad_input():
    assert len(CASES) >= 25


@dataclasses.dataclass(frozen=True)
class OneProcess(RunConfig):
    """An experiment that takes no device or process options (every experiment script takes them now)."""


def test_an_experiment_without_process_options_refuses_several_processes(tmp_path, monkeypatch, capsys):
    """An experiment without device or process options, started by scripts/launch (which sets
    $JAX_NUM_PROCESSES): each process would name its own run directory."""
    monkeypatch.chdir(tmp_path)
    launched = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main_entry(lambda config: RunDir(tmp_path / "run").create(), OneProcess, [])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes no device or process options and runs in one process" in err[0]
    assert not list(tmp_path.iterdir())  # no run directory
