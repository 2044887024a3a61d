"""What every experiment script does around `fit`: the run directory, resume, the summary, the plot."""

import dataclasses
import importlib.metadata
import importlib.util
import math
import sys
import types
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from .cli import ConfigError, TrainConfig
from .data import Batch, DeviceLoader, HostLoader, TorchLoader
from .parallel import check_device_count, make_strategy
from .train import LossFn, RunDir, TensorBoardTracker, TrainState, classification_loss, fit, load_checkpoint

RUNS_ROOT = Path("runs")
EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"
# Options that may change between a run and its resumption (a run may continue on other devices).
RESUMABLE_OPTIONS = {
    "skip_nonfinite", "resume", "run_dir", "progress", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "epochs", "steps",
    "tensorboard", "debug_nans",
    "devices", "parallel", "coordinator_address", "num_processes", "process_id", "distributed_timeout",
}


def load_experiment(name: str) -> types.ModuleType:
    """Import an experiment script by name (`xor` is `experiments/xor.py`) or by path, without running it."""
    path = Path(name) if name.endswith(".py") or "/" in name else EXPERIMENTS_DIR / f"{name}.py"
    if not path.is_file():
        available = " ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.py")))
        raise ConfigError(f"no experiment {name!r} ({path} does not exist); available: {available}")
    spec = importlib.util.spec_from_file_location(f"experiments.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _versions() -> dict[str, str]:
    names = ["jax", "jaxlib", "equinox", "optax", "jaxtyping", "numpy", "torch"]
    return {n: importlib.metadata.version(n) for n in names}


def _config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted((set(saved) | set(current)) - RESUMABLE_OPTIONS)
    return [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def resolve_run_dir(experiment: str, config: TrainConfig, *, writer: bool = True) -> tuple[RunDir, Path | None]:
    """The run directory to use and, when resuming, the checkpoint to resume from.

    Refuses (with `ConfigError`) to resume without a checkpoint, to resume with a different config,
    and (for the `writer`, process 0) to start a new run in a directory that already holds one.
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
    if writer and (path / "config.json").exists():
        raise ConfigError(f"--run-dir {path} already holds a run; pass --resume to continue it, or pick a new directory")
    return RunDir(path), None


@dataclasses.dataclass
class Setup:
    """What one run trains, built without training: an experiment script's `setup(config)` returns it,
    its `main` hands it to `run_experiment`, and `scripts/show_jaxpr` uses it to trace one step.

    **Fields:**

    - `build_state`: makes the step-0 TrainState (when resuming, the skeleton a checkpoint fills).
    - `train_data`: a `DeviceLoader` or a `TorchLoader`.
    - `eval_data`: a `DeviceLoader` or a torch `DataLoader` of numpy batches.
    - `num_steps`: the total number of training steps.
    - `loss_fn`: `(model, model_state, batch, key) -> (loss, (metrics, model_state))`.
    - `lr_schedule`: the optimizer's learning-rate schedule, when it has one (logged as `lr`).
    """

    build_state: Callable[[], TrainState]
    train_data: DeviceLoader | TorchLoader
    eval_data: DeviceLoader | HostLoader
    num_steps: int
    loss_fn: LossFn = classification_loss
    lr_schedule: Callable[[int], Any] | None = None


def initial_state(setup: Setup, config: TrainConfig) -> TrainState:
    """The step-0 TrainState a run trains (and the skeleton its checkpoints restore into):
    `setup.build_state()`, with an EMA of the model when `config.ema_decay > 0` (unless it has one)."""
    state = setup.build_state()
    if config.ema_decay and state.ema is None:
        state = state.with_ema(config.ema_decay)
    return state


def first_batch(data: DeviceLoader | TorchLoader) -> Batch:
    """The batch of training step 0, as the train loop would see it."""
    if isinstance(data, DeviceLoader):
        index = data.step_indices(0, 1)[0]
        return Batch(data.arrays.inputs[index], data.arrays.labels[index])
    return next(data.batches(0))


def _setup_from(setup: Setup | None, kwargs: dict[str, Any]) -> tuple[Setup, dict[str, Any]]:
    """Accept `run_experiment(name, config, setup)` and the older keyword form
    `run_experiment(name, config, build_state=..., train_data=..., ...)`."""
    if setup is not None:
        return setup, kwargs
    names = {f.name for f in dataclasses.fields(Setup)}
    return Setup(**{k: v for k, v in kwargs.items() if k in names}), {k: v for k, v in kwargs.items() if k not in names}


CURVE_PANELS = (("loss", "loss"), ("accuracy", "accuracy"))


def _curve(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in records
              if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [s for s, _ in points], [v for _, v in points]


def plot_curves(runs: Sequence[RunDir], labels: Sequence[str], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the learning curves of `runs` (one colour each, named by `labels`) into the PNG file `out`;
    returns its path. Training metrics are solid lines, test metrics dashed with dots.
    `scripts/plot_runs` (`research.tools.plot_runs`) draws several runs with it."""
    from matplotlib.figure import Figure  # imported here: a second to import, needed only at the end of a run
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(11, 4.2), layout="constrained", dpi=110)
    axes = figure.subplots(1, len(CURVE_PANELS))
    experiments = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        records = run.read_metrics()
        experiment = run.read_config().get("experiment")
        if experiment and experiment not in experiments:
            experiments.append(experiment)
        for ax, (metric, _) in zip(axes, CURVE_PANELS):
            steps, values = _curve(records, f"train/{metric}")
            ax.plot(steps, values, color=f"C{i}", linewidth=1.6, label=label)
            steps, values = _curve(records, f"test/{metric}")
            ax.plot(steps, values, color=f"C{i}", linestyle="--", marker="o", markersize=4, linewidth=1.2)
    for ax, (metric, ylabel) in zip(axes, CURVE_PANELS):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{metric} (solid: train, dashed: test)", fontsize=10)
        ax.grid(True, alpha=0.3)
        values = [y for line in ax.get_lines() for y in line.get_ydata()]
        if metric == "loss" and values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")  # losses fall over orders of magnitude
        if metric == "accuracy":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0].legend(title="run", fontsize=9)
    figure.suptitle(title or ", ".join(experiments) or "runs")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def run_experiment(
    experiment: str,
    config: TrainConfig,
    setup: Setup | None = None,
    *,
    summary_extra: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Train, evaluate and record one run; returns (and writes to `summary.json`) its final numbers,
    with `summary_extra` (say, the privacy spent) added.

    The run directory gets `config.json` (with the resolved step count and library versions),
    `metrics.jsonl`, `checkpoints/`, `summary.json` and `curves.png` (and TensorBoard event files
    with `--tensorboard`). Other keyword arguments go to `fit`.

    With `config.ema_decay > 0` the state gets an EMA of the model (unless `build_state` gave it
    one): `test_accuracy`/`test_loss` are then the EMA model's, and `test_raw_accuracy`/
    `test_raw_loss` the trained model's.

    Training runs on `config.devices` devices per process with the `config.parallel` strategy (build
    BatchNorm layers with `research.parallel.batch_axis_name(config.parallel)`). With several
    processes every process trains and evaluates, and only process 0 writes the run directory.
    """
    setup, fit_kwargs = _setup_from(setup, kwargs)
    check_device_count(config.devices)
    strategy = make_strategy(config.parallel, config.devices)
    strategy.check_batch_size(config.batch_size)
    if config.debug_nans and strategy.name != "none":
        raise ConfigError("--debug-nans replays steps op by op on one device; drop --devices and --parallel")
    writer = jax.process_index() == 0
    run, checkpoint = resolve_run_dir(experiment, config, writer=writer)
    state = initial_state(setup, config)
    start_step = 0
    header: dict[str, Any] = {}
    if checkpoint is not None:
        state, header = load_checkpoint(checkpoint, state)
        start_step = header["step"]
        if writer:
            run.truncate_metrics(after_step=start_step)
            print(f"resuming {run.path} from step {start_step} ({checkpoint.name})", file=sys.stderr)
    if writer:
        run.create()
        run.write_config({
            "experiment": experiment,
            "config": config.to_dict(),
            "resolved": {"num_steps": setup.num_steps, "steps_per_epoch": setup.train_data.steps_per_epoch},
            "versions": _versions(),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        })
    tracker = None
    if config.tensorboard and writer:
        tracker = TensorBoardTracker(run.path, purge_step=start_step + 1 if start_step else None)
    start = time.perf_counter()
    try:
        result = fit(
            state,
            setup.train_data,
            num_steps=setup.num_steps,
            loss_fn=setup.loss_fn,
            lr_schedule=setup.lr_schedule,
            eval_data=setup.eval_data,
            eval_every=config.eval_every or None,
            log_every=config.log_every,
            steps_per_call=config.steps_per_call,
            run=run if writer else None,
            checkpoint_every=config.checkpoint_every or None,
            keep_checkpoints=config.keep_checkpoints,
            checkpoint_header={"experiment": experiment, "config": config.to_dict()},
            resume_window=header.get("window"),
            skip_nonfinite=config.skip_nonfinite,
            progress=config.progress and writer,
            parallel=strategy,
            tracker=tracker,
            debug_nans=config.debug_nans,
            **fit_kwargs,
        )
    finally:
        if tracker is not None:
            tracker.finish()
    assert result.eval_metrics is not None
    summary = {
        "experiment": experiment,
        "test_accuracy": result.eval_metrics["accuracy"],
        "test_loss": result.eval_metrics["loss"],
        "train_loss": result.train_metrics.get("loss"),
        "step": int(result.state.step),
        "wall_seconds": time.perf_counter() - start,
        **(summary_extra or {}),
    }
    raw = ""
    if result.raw_eval_metrics is not None:
        summary["test_raw_accuracy"] = result.raw_eval_metrics["accuracy"]
        summary["test_raw_loss"] = result.raw_eval_metrics["loss"]
        raw = f", without EMA {100 * summary['test_raw_accuracy']:.2f}%"
    if writer:
        run.write_summary(summary)
        plot_curves([run], [run.path.resolve().name], run.path / "curves.png")
        print(
            f"{experiment}: test accuracy {100 * summary['test_accuracy']:.2f}%{raw} "
            f"(test loss {summary['test_loss']:.4f}, train loss {summary['train_loss']:.4f}) "
            f"at step {summary['step']}, {summary['wall_seconds']:.1f} s\nrun directory: {run.path} "
            f"(learning curves: curves.png)"
        )
    return summary
