"""Deep double descent on MNIST-1D (Greydanus's notebook "deep double descent", after Nakkiran et al. 2019).

The notebook's recipe: MNIST-1D generated with 16,000 signals, the first 4,000 for training and 12,000
for testing; 15% of the training labels changed to another class (`--label-noise`, seeded by `--seed`;
test labels clean; the notebook redraws 15% of them from all 10 classes, so ~13.5% change); an MLP
40 -> w -> w -> 10 (ReLU) trained with SGD (lr 0.01, momentum 0.9, batch 100) for 500 epochs at each
hidden width w. The test error first falls, then rises to a peak near the width where the training
error reaches 0 (the model interpolates the noisy labels), then falls again.

`./scripts/run double_descent` runs the whole curve: one run per width of `--widths` through
`research.tools.sweep` (each its own process and run directory `RUN_DIR/width=W`; rerun the same
command to resume it), then prints the curve and its peak beside the notebook's and writes
`curve.md`, `curve.json` and `double_descent.png` into RUN_DIR. `--width W` trains the one MLP of
width W as an ordinary run. Run `./scripts/run double_descent --help` for the options.
"""

import dataclasses
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import optax

from research.cli import (
    ConfigError,
    TrainConfig,
    Training,
    flag_name,
    group,
    main_entry,
    open_unit_interval,
    option,
    positive,
    unit_interval,
)
from research.data import MNIST1D_CLASSES, MNIST1D_LENGTH, DeviceLoader, corrupt_labels, load_mnist1d
from research.experiment import RUNS_ROOT, Setup, run_experiment
from research.nn import build_model
from research.services import Headline, RunDir
from research.tools import sweep
from research.train import FitResult, TrainState, evaluate

# The notebook's widths, np.unique(np.geomspace(2, 300, 20, dtype=int)), and its test errors (%) with 15%
# label noise (greydanus/mnist1d, notebooks/deep-double-descent.ipynb, the run at commit 9129ceb).
NOTEBOOK_WIDTHS = (2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 47, 61, 80, 104, 135, 177, 230, 300)
PUBLISHED_TEST_ERROR = (
    69.59,
    67.50,
    62.55,
    57.45,
    54.80,
    48.97,
    50.28,
    47.24,
    50.84,
    50.69,
    52.80,
    54.05,
    54.02,
    52.08,
    50.23,
    48.39,
    47.88,
    46.54,
    45.47,
)
PUBLISHED_TRAIN_ERROR = (
    71.68,
    68.65,
    62.75,
    57.95,
    54.45,
    47.45,
    46.47,
    39.70,
    38.08,
    29.55,
    19.02,
    5.47,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
)


# Options that stay with the sweep itself rather than going to each of its runs.
NOT_FORWARDED = ("width", "widths", "jobs", "run_dir", "resume", "progress")
EVAL_BATCH = 2000


def positive_widths(widths: tuple[int, ...]) -> str | None:
    return None if widths and min(widths) > 0 else "must be one or more positive widths"


@dataclasses.dataclass(frozen=True)
class DoubleDescentTraining(Training):
    batch_size: int = option(100, "examples per step", check=positive)
    lr: float = option(0.01, "SGD learning rate", check=positive)
    steps_per_call: int = option(200, "training steps per compiled call", check=positive)
    log_every: int = option(2000, "steps between logged training metrics", check=positive, resumable=True)


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """MNIST-1D with noisy training labels: MLPs of growing width, their test error (the double descent
    curve) and its peak beside the notebook's. One run per width (--width), or all of --widths."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: DoubleDescentTraining = group(DoubleDescentTraining)
    width: int | None = option(
        None, "train the one MLP of this hidden width; unset: a run for each of --widths and the curve", check=positive
    )
    widths: tuple[int, ...] = option(
        NOTEBOOK_WIDTHS, "hidden widths of the curve (default: the notebook's 19)", check=positive_widths
    )
    jobs: int = option(1, "runs of the curve trained at a time (each a process)", check=positive)
    label_noise: float = option(0.15, "fraction of the training labels changed to another class", check=unit_interval)
    epochs: int = option(500, "passes over the training signals", check=positive, resumable=True)
    momentum: float = option(0.9, "SGD momentum", check=unit_interval)
    num_samples: int = option(
        16_000, "MNIST-1D signals generated (the notebook's: 4,000 training, 12,000 test)", check=positive
    )
    train_split: float = option(
        0.25, "fraction of the signals (the first ones) in the training set", check=open_unit_interval
    )
    data_dir: str = option("data", "where MNIST-1D is generated and cached")


def build_state(config: Config) -> TrainState:
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    model, _ = build_model(
        "mlp",
        in_size=MNIST1D_LENGTH,
        out_size=MNIST1D_CLASSES,
        hidden=(config.width,) * 2,
        activation="relu",
        key=model_key,
    )
    return TrainState.create(model, optax.sgd(config.training.lr, momentum=config.momentum), key=train_key)


def setup(config: Config) -> Setup:
    """The model of `--width`, the noisy training set and the clean test set, without training."""
    if config.width is None:
        raise ConfigError("double_descent: setup builds one run; pass --width")
    train, test = load_mnist1d(config.data_dir, num_samples=config.num_samples, train_split=config.train_split)
    noisy = corrupt_labels(train.labels, config.label_noise, MNIST1D_CLASSES, seed=config.training.seed)
    train_data = DeviceLoader(train.inputs, noisy, config.training.batch_size, seed=config.training.seed)
    eval_data = DeviceLoader(test.inputs, test.labels, min(EVAL_BATCH, len(test.labels)), shuffle=False)
    return Setup(
        lambda: build_state(config), train_data, config.epochs * train_data.steps_per_epoch, eval_data=eval_data
    )


def train_accuracy(train_data: DeviceLoader) -> Callable[[FitResult], dict[str, float]]:
    """`summary_extra`: the trained model's accuracy on the whole (noisy) training set."""
    full = DeviceLoader(*train_data.host, min(EVAL_BATCH, train_data.size), shuffle=False)
    return lambda result: {"train_accuracy": evaluate(result.state.model, result.state.model_state, full)["accuracy"]}


def forwarded_flags(config: Config) -> list[str]:
    """The command-line flags of every option that differs from its default (but `NOT_FORWARDED`): what
    each run of the curve gets after the sweep's `--`."""
    words, defaults = [], type(config)().to_dict()
    for name, value in config.to_dict().items():
        if name in NOT_FORWARDED or value == defaults[name]:
            continue
        flag = flag_name(name)
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, *map(str, value if isinstance(value, tuple) else [value])]
    return words


def find_peak(
    widths: Sequence[int], test_error: Sequence[float], train_error: Sequence[float], noise: float
) -> dict[str, Any]:
    """Where the double-descent curve peaks (errors in %, `noise` the % of training labels changed).

    A model whose training error is above `noise` cannot even fit the labels a clean classifier
    fits: that is the classical, underfitting side, where the test error falls as the width grows.
    The peak is the highest test error from the lowest test error of that side on (so the
    underfitting widths' large errors never count as the peak); `interpolation_width` is the first
    width whose training error is <= 1% (it fits the noisy labels too).
    """
    classical = [i for i, error in enumerate(train_error) if error > noise]
    start = min(classical, key=lambda i: test_error[i]) if classical else 0
    peak = max(range(start, len(widths)), key=lambda i: test_error[i])
    return {
        "peak_width": widths[peak],
        "peak_test_error": test_error[peak],
        "interpolation_width": next((w for w, e in zip(widths, train_error, strict=True) if e <= 1.0), None),
        "last_width": widths[-1],
        "last_test_error": test_error[-1],
    }


PUBLISHED = find_peak(NOTEBOOK_WIDTHS, PUBLISHED_TEST_ERROR, PUBLISHED_TRAIN_ERROR, 15.0)


def curve_table(widths: Sequence[int], test_error: Sequence[float], train_error: Sequence[float]) -> str:
    """A markdown table of the curve, with the notebook's errors at the widths it has."""
    published = dict(zip(NOTEBOOK_WIDTHS, zip(PUBLISHED_TEST_ERROR, PUBLISHED_TRAIN_ERROR, strict=True), strict=True))
    lines = [
        "| width | test error | train error | notebook test error | notebook train error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for width, test, train in zip(widths, test_error, train_error, strict=True):
        theirs = published.get(width)
        shown = f"{theirs[0]:.2f}% | {theirs[1]:.2f}%" if theirs else "– | –"
        lines.append(f"| {width} | {test:.2f}% | {train:.2f}% | {shown} |")
    return "\n".join(lines)


def plot_curve(widths: Sequence[int], test_error: Sequence[float], train_error: Sequence[float], out: Path) -> None:
    from matplotlib.figure import Figure  # imported here: a second to import, needed once at the end

    figure = Figure(figsize=(7, 4), layout="constrained", dpi=110)
    ax = figure.subplots()
    ax.plot(widths, test_error, "o-", color="C0", label="test (ours)")
    ax.plot(widths, train_error, "o-", color="C1", alpha=0.5, label="train, noisy labels (ours)")
    ax.plot(NOTEBOOK_WIDTHS, PUBLISHED_TEST_ERROR, "s--", color="C0", alpha=0.5, label="test (notebook)")
    ax.set_xscale("log")
    ax.set_xlabel("hidden width")
    ax.set_ylabel("error (%)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    figure.savefig(out)


def run_curve(config: Config) -> dict[str, Any]:
    """One run per width through `research.tools.sweep` (rerun to resume), then the curve and its peak."""
    if jax.process_count() > 1:  # each width's run is a process of its own, started here
        raise ConfigError(
            "the curve trains one process per width (--jobs at a time), not across several "
            "processes; pass --width W to train one width over several processes"
        )
    run_dir = config.checkpointing.run_dir
    sweep_dir = Path(run_dir) if run_dir else RunDir.new_path(RUNS_ROOT, "double_descent")
    widths = sorted(set(config.widths))
    with warnings.catch_warnings():
        # JAX (started by main_entry) warns at every fork; each run's fork is followed at once by an exec.
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        sweep.main(
            [
                "double_descent",
                "width=" + ",".join(map(str, widths)),
                "--sweep-dir",
                str(sweep_dir),
                "--jobs",
                str(config.jobs),
                "--",
                *forwarded_flags(config),
            ]
        )  # exits 1 when a run failed
    summaries = [RunDir(sweep_dir / f"width={w}").read_summary() for w in widths]
    test_error = [100 * (1 - s["test_accuracy"]) for s in summaries]
    train_error = [100 * (1 - s["train_accuracy"]) for s in summaries]
    curve = {
        "widths": widths,
        "test_error": test_error,
        "train_error": train_error,
        **find_peak(widths, test_error, train_error, 100 * config.label_noise),
    }
    (sweep_dir / "curve.json").write_text(json.dumps(curve, indent=2) + "\n")
    table = curve_table(widths, test_error, train_error)
    (sweep_dir / "curve.md").write_text(table + "\n")
    plot_curve(widths, test_error, train_error, sweep_dir / "double_descent.png")
    print(table)
    print(
        f"double_descent: test error peaks at {curve['peak_test_error']:.2f}% at width {curve['peak_width']} "
        f"(training error <= 1% from width {curve['interpolation_width']}), {curve['last_test_error']:.2f}% at "
        f"width {curve['last_width']}; the notebook: {PUBLISHED['peak_test_error']:.2f}% at width "
        f"{PUBLISHED['peak_width']} (training error 0 from width {PUBLISHED['interpolation_width']}), "
        f"{PUBLISHED['last_test_error']:.2f}% at width {PUBLISHED['last_width']}\n"
        f"curve: {sweep_dir / 'curve.md'}, plot: {sweep_dir / 'double_descent.png'}"
    )
    return curve


def main(config: Config) -> dict:
    if config.width is None:
        return run_curve(config)
    run = setup(config)
    return run_experiment("double_descent", config, run, summary_extra=train_accuracy(run.train_data))


if __name__ == "__main__":
    main_entry(main, Config)
