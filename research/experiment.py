"""What every experiment script does around `fit`: the run directory, resume, the summary."""

import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.utils.data

from .cli import ConfigError, TrainConfig
from .data import DeviceLoader, TorchLoader
from .train import RunDir, TrainState, fit, load_checkpoint

RUNS_ROOT = Path("runs")
# Options that may change between a run and its resumption.
RESUMABLE_OPTIONS = {
    "skip_nonfinite", "resume", "run_dir", "progress", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "epochs", "steps",
}


def _versions() -> dict[str, str]:
    names = ["jax", "jaxlib", "equinox", "optax", "jaxtyping", "numpy", "torch"]
    return {n: importlib.metadata.version(n) for n in names}


def _config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted((set(saved) | set(current)) - RESUMABLE_OPTIONS)
    return [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def resolve_run_dir(experiment: str, config: TrainConfig) -> tuple[RunDir, Path | None]:
    """The run directory to use and, when resuming, the checkpoint to resume from.

    Refuses (with `ConfigError`) to resume without a checkpoint, to resume with a different config,
    and to start a new run in a directory that already holds one.
    """
    if config.resume:
        path = Path(config.run_dir) if config.run_dir else RunDir.latest(RUNS_ROOT, experiment)
        if path is None or not (path / "config.json").exists():
            where = config.run_dir or f"{RUNS_ROOT / experiment}/*"
            raise ConfigError(f"--resume: no run to resume in {where}; start one without --resume")
        run = RunDir(path)
        checkpoint, problems = run.latest_valid_checkpoint()
        for problem in problems:
            print(f"warning: skipping {problem}", file=sys.stderr)
        if checkpoint is None:
            raise ConfigError(f"--resume: no valid checkpoint in {run.checkpoints}")
        differences = _config_differences(run.read_config()["config"], config.to_dict())
        if differences:
            raise ConfigError(f"--resume: the config differs from the run in {path}: " + "; ".join(differences))
        return run, checkpoint
    path = Path(config.run_dir) if config.run_dir else RunDir.new_path(RUNS_ROOT, experiment)
    if (path / "config.json").exists():
        raise ConfigError(f"--run-dir {path} already holds a run; pass --resume to continue it, or pick a new directory")
    return RunDir(path), None


def run_experiment(
    experiment: str,
    config: TrainConfig,
    *,
    build_state: Callable[[], TrainState],
    train_data: DeviceLoader | TorchLoader,
    eval_data: DeviceLoader | torch.utils.data.DataLoader,
    num_steps: int,
    **fit_kwargs: Any,
) -> dict[str, Any]:
    """Train, evaluate and record one run; returns (and writes to `summary.json`) its final numbers.

    `build_state()` makes the step-0 TrainState; when resuming it is the skeleton the checkpoint is
    loaded into. The run directory gets `config.json` (with the resolved step count and library
    versions), `metrics.jsonl`, `checkpoints/` and `summary.json`.
    """
    run, checkpoint = resolve_run_dir(experiment, config)
    state = build_state()
    header: dict[str, Any] = {}
    if checkpoint is not None:
        state, header = load_checkpoint(checkpoint, state)
        run.truncate_metrics(after_step=header["step"])
        print(f"resuming {run.path} from step {header['step']} ({checkpoint.name})", file=sys.stderr)
    run.create()
    run.write_config({
        "experiment": experiment,
        "config": config.to_dict(),
        "resolved": {"num_steps": num_steps, "steps_per_epoch": train_data.steps_per_epoch},
        "versions": _versions(),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
    })
    start = time.perf_counter()
    result = fit(
        state,
        train_data,
        num_steps=num_steps,
        eval_data=eval_data,
        eval_every=config.eval_every or None,
        log_every=config.log_every,
        steps_per_call=config.steps_per_call,
        run=run,
        checkpoint_every=config.checkpoint_every or None,
        keep_checkpoints=config.keep_checkpoints,
        checkpoint_header={"experiment": experiment, "config": config.to_dict()},
        resume_window=header.get("window"),
        skip_nonfinite=config.skip_nonfinite,
        progress=config.progress,
        **fit_kwargs,
    )
    assert result.eval_metrics is not None
    summary = {
        "experiment": experiment,
        "test_accuracy": result.eval_metrics["accuracy"],
        "test_loss": result.eval_metrics["loss"],
        "train_loss": result.train_metrics.get("loss"),
        "step": int(result.state.step),
        "wall_seconds": time.perf_counter() - start,
    }
    run.write_summary(summary)
    print(
        f"{experiment}: test accuracy {100 * summary['test_accuracy']:.2f}% "
        f"(test loss {summary['test_loss']:.4f}, train loss {summary['train_loss']:.4f}) "
        f"at step {summary['step']}, {summary['wall_seconds']:.1f} s\nrun directory: {run.path}"
    )
    return summary
