"""`research.load_run`: a run directory's trained model rebuilt from config.json and its newest valid
checkpoint, bit for bit, for every experiment; evaluated, it gives the numbers of summary.json."""

import importlib.util
import json
import shutil
import warnings

import jax
import pytest

import research
import research.experiment
from research.errors import CheckpointError
from research.experiment import load_experiment, load_run
from research.population import evaluate_population
from research.services import checkpoint_digest, tree_digest
from research.train import evaluate
from research.train.evaluation import averaged_and_raw

xor = load_experiment("xor")


def payload(path) -> str:
    """What a checkpoint holds, bit for bit."""
    return checkpoint_digest(path)


def serialised(tree) -> str:
    return tree_digest(tree)


def train_xor(tmp_path, monkeypatch, **options) -> tuple:
    monkeypatch.chdir(tmp_path)
    config = xor.Config.from_options(run_dir="runs/xor/run", epochs=2, progress=False, **options)
    return config, xor.main(config), tmp_path / "runs/xor/run"


def test_load_run_is_exported_from_the_package():
    assert research.load_run is load_run and "load_run" in research.__all__


@pytest.mark.parametrize("ema_decay", [0.0, 0.9])
def test_a_loaded_xor_run_is_its_last_checkpoint_and_scores_its_summary(tmp_path, monkeypatch, ema_decay):
    config, summary, path = train_xor(tmp_path, monkeypatch, ema_decay=ema_decay)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing damaged: no warning
        loaded = load_run(path)

    assert loaded.step == summary["step"] == 38 and loaded.summary == summary
    assert loaded.config.to_dict() == config.to_dict() and loaded.experiment == "xor"
    assert loaded.checkpoint == path / "checkpoints/step_000000038"
    assert serialised(loaded.state) == payload(loaded.checkpoint)  # bit-identical, EMA included
    test = loaded.setup.eval_data
    trained = evaluate(loaded.model, loaded.model_state, test)
    if ema_decay:
        assert loaded.state.ema is not None and loaded.ema_model is not None
        assert evaluate(loaded.ema_model, loaded.ema_model_state, test) == {
            "loss": summary["test_loss"],
            "accuracy": summary["test_accuracy"],
        }
        assert trained == {"loss": summary["test_raw_loss"], "accuracy": summary["test_raw_accuracy"]}
    else:
        assert loaded.ema_model is None and loaded.ema_model_state is None
        assert trained == {"loss": summary["test_loss"], "accuracy": summary["test_accuracy"]}


def test_loading_computes_no_step_0_state_for_the_checkpoint_to_replace(tmp_path, monkeypatch):
    """The skeleton is the step-0 state's shapes alone (`eqx.filter_eval_shape`): building it runs no
    computation, which for a large model is many compilations; the arrays come from the checkpoint."""
    _, _, path = train_xor(tmp_path, monkeypatch)
    built = []
    initial_state = research.experiment.initial_state

    def recorded(*args, **kwargs):
        state = initial_state(*args, **kwargs)
        built.append(state.step)
        return state

    monkeypatch.setattr(research.experiment, "initial_state", recorded)
    loaded = load_run(path)
    assert len(built) == 1 and isinstance(built[0], jax.core.Tracer)  # traced for its shapes, never run
    assert serialised(loaded.state) == payload(loaded.checkpoint)


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, monkeypatch):
    _, _, path = train_xor(tmp_path, monkeypatch, checkpoint_every=19)
    newest = path / "checkpoints/step_000000038"
    files = json.loads((newest / "checkpoint.json").read_text())["files"]
    data = newest / max(files, key=lambda name: files[name][0])  # the array bytes
    data.write_bytes(data.read_bytes()[:-10])  # truncated
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_000000038 is truncated"):
        loaded = load_run(path)
    assert loaded.step == 19 and loaded.checkpoint.name == "step_000000019"
    assert serialised(loaded.state) == payload(loaded.checkpoint)
    assert loaded.summary is None  # summary.json is of step 38, not of this state


def test_a_run_without_a_valid_checkpoint_is_refused_in_one_line(tmp_path, monkeypatch):
    _, _, path = train_xor(tmp_path, monkeypatch)
    shutil.rmtree(path / "checkpoints/step_000000038")
    with pytest.raises(CheckpointError, match=r"no checkpoint to load in .*checkpoints: the run has no checkpoint"):
        load_run(path)
    with pytest.raises(CheckpointError, match="no run to load in .*elsewhere: it has no config.json"):
        load_run(tmp_path / "elsewhere")


def test_a_config_json_the_script_no_longer_fits_is_refused(tmp_path, monkeypatch):
    _, _, path = train_xor(tmp_path, monkeypatch)
    saved = json.loads((path / "config.json").read_text())
    saved["config"]["width"] = 3
    (path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(research.errors.ConfigError, match="has options that .* does not: width"):
        load_run(path)


def test_a_run_tracked_by_a_library_this_machine_lacks_loads_without_its_trackers(tmp_path, monkeypatch):
    """Trained with W&B and TensorBoard (say on a cluster), loaded where neither is installed: the same model,
    the trackers left out of the loaded config."""
    config, summary, path = train_xor(tmp_path, monkeypatch, tracker="wandb", tensorboard=True)
    missing = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboardX") else missing(name, *a)
    )
    with pytest.raises(research.errors.ConfigError, match="--tracker wandb needs the wandb package"):
        xor.Config.from_options(tracker="wandb")  # what load_run used to raise
    loaded = load_run(path)
    assert loaded.step == summary["step"] and serialised(loaded.state) == payload(loaded.checkpoint)
    assert loaded.config.to_dict() == config.replace(tracker="jsonl", tensorboard=False).to_dict()


@pytest.mark.slow
def test_a_loaded_ensemble_is_its_stacked_population(tmp_path, monkeypatch, mnist1d_dir):
    monkeypatch.chdir(tmp_path)
    ensemble = load_experiment("ensemble")
    config = ensemble.Config.from_options(
        num_members=3, epochs=1, hidden=16, data_dir=str(mnist1d_dir), run_dir="ens", progress=False, ema_decay=0.5
    )
    summary = ensemble.main(config)
    loaded = load_run("ens")

    assert loaded.step == summary["step"] == 40 and loaded.state.step.shape == (3,)
    assert serialised(loaded.state) == payload(loaded.checkpoint)
    metrics, raw = averaged_and_raw(evaluate_population, loaded.state, loaded.setup.eval_data)
    assert {f"test_{k}": v for k, v in metrics.items()} == {
        k: summary[k] for k in summary if k.startswith("test_") and not k.startswith("test_raw_")
    }
    assert {f"test_raw_{k}": v for k, v in raw.items()} == {k: summary[k] for k in summary if k.startswith("test_raw_")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "experiment, options",
    [
        ("circles", {"epochs": 1}),
        ("mnist1d", {"model": "resnet", "steps": 3, "ema_decay": 0.5}),  # stateful: BatchNorm statistics
        ("dp_sgd", {"epochs": 1, "batch_size": 500, "steps_per_call": 8}),
    ],
)
def test_every_other_experiment_loads_bit_for_bit(tmp_path, monkeypatch, mnist1d_dir, experiment, options):
    monkeypatch.chdir(tmp_path)
    module = load_experiment(experiment)
    if "data_dir" in module.Config.__dataclass_fields__:
        options = {**options, "data_dir": str(mnist1d_dir)}
    summary = module.main(module.Config.from_options(run_dir="run", progress=False, **options))
    loaded = load_run("run")
    assert loaded.step == summary["step"] and serialised(loaded.state) == payload(loaded.checkpoint)
    model, model_state = (
        (loaded.ema_model, loaded.ema_model_state) if loaded.state.ema else (loaded.model, loaded.model_state)
    )
    assert evaluate(model, model_state, loaded.setup.eval_data) == {
        "loss": summary["test_loss"],
        "accuracy": summary["test_accuracy"],
    }
