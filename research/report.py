"""What a run reports: the line it prints when it starts, its summary (`summary.json`'s numbers and the
line it prints when it ends), and its learning curves (`curves.png`, and `scripts/plot_runs`)."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .curves import CurvePool, draw_curves
from .provenance import describe_parameters
from .services import Headline, RunDir
from .train import AbstractTrainState, FitResult


def start_line(
    experiment: str, record: dict[str, Any], state: AbstractTrainState, run: RunDir, trackers: dict[str, Any]
) -> str:
    """What a run prints when it starts: the model and its size, the steps, the devices, where it writes
    (and whether W&B syncs: offline unless $WANDB_MODE says otherwise). `trackers`: their identities."""
    counts, place = record["parameters"], record["machine"]
    members = f"{counts['members']} members of " if "members" in counts else ""
    devices = f"{place['devices']} {place['device_kind']} device" + ("s" if place["devices"] > 1 else "")
    processes = f" in {place['processes']} processes" if place["processes"] > 1 else ""
    models = " + ".join(type(network).__name__ for network in state.networks().values())
    return (
        f"{experiment}: {models}, {members}{describe_parameters(counts)}; "
        f"{record['resolved']['num_steps']:,} steps on {devices}{processes}; run directory {run.path}"
        + _wandb_mode(trackers.get("wandb"))
    )


def _wandb_mode(identity: dict[str, Any] | None) -> str:
    if identity is None:
        return ""
    if identity.get("mode") == "offline":
        return "; W&B offline, in the run directory (`wandb sync` it, or set WANDB_MODE=online)"
    return f"; W&B {identity.get('mode', 'online')}, project {identity['project']}"


def run_summary(result: FitResult, losses: tuple[str, ...] = ("loss",)) -> dict[str, Any]:
    """A run's final numbers: `test_<metric>` (of the EMA model with an EMA, and `test_raw_<metric>` of
    the trained one), the train `losses` (`train_loss`; a GAN's `train_d_loss`, `train_g_loss`), `step`; a
    population's include each member's and the ensemble's."""
    summary = {f"test_{k}": v for k, v in (result.eval_metrics or {}).items()}
    summary.update({f"val_{k}": v for k, v in (result.val_metrics or {}).items()})
    summary.update({f"test_raw_{k}": v for k, v in (result.raw_eval_metrics or {}).items()})
    kept = {*losses, *(f"member_{name}" for name in losses)}
    summary.update({f"train_{k}": v for k, v in result.train_metrics.items() if k in kept})
    summary["step"] = int(np.max(np.asarray(result.state.step)))
    return summary


def summary_line(experiment: str, summary: dict[str, Any], run: RunDir, headline: Headline = Headline()) -> str:
    """What a run prints when it ends (and when it is resumed after it finished): its `headline` number
    (with the EMA, the trained model's beside it; a population's members and ensemble), the losses; when
    the evaluation did not report the headline (a GAN without a judge's fid), its test numbers instead."""
    name, key = headline.metric, headline.summary_key
    raw = f", without EMA {headline.shown(summary[f'test_raw_{name}'])}" if f"test_raw_{name}" in summary else ""
    if f"test_ensemble_{name}" in summary:
        members = np.asarray(summary[f"test_member_{name}"], dtype=float)
        raw += (
            f"; {len(members)} members {headline.shown(members.min())}-{headline.shown(members.max())}, their "
            f"ensemble (mean of probabilities) {headline.shown(summary[f'test_ensemble_{name}'])}"
        )
    if f"val_{name}" in summary:
        raw += f"; validation {name.replace('_', ' ')} {headline.shown(summary[f'val_{name}'])}"
    what = f"mean member test {name}" if f"test_ensemble_{name}" in summary else f"test {name}"
    what = what.replace("_", " ")
    train_losses = sorted(k for k in summary if k.startswith("train_") and k.endswith("loss") and "member_" not in k)
    shown = ("test_loss",) if key in summary else sorted(k for k in summary if _test_number(k, summary[k]))
    losses = [
        f"{k.replace('_', ' ')} {_number(summary[k])}"
        for k in (*shown, *train_losses)
        if k in summary and k != headline.summary_key
    ]
    headline_part = f"{what} {headline.shown(summary[key])}{raw} " if key in summary else ""
    early = f" (finished early: {summary['finished_early']})" if "finished_early" in summary else ""
    return (
        f"{experiment}: {headline_part}({', '.join(losses) or 'no losses'}) "
        f"at step {summary['step']}{early}, {summary['wall_seconds']:.1f} s\nrun directory: {run.path} "
        "(learning curves: curves.png)"
    )


def _test_number(key: str, value: Any) -> bool:
    """Whether `key` is a number of the test evaluation, of the model the run stands for."""
    return key.startswith("test_") and not key.startswith(("test_raw_", "test_member_")) and isinstance(value, float)


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def plot_curves(
    runs: Sequence[RunDir],
    labels: Sequence[str],
    out: str | Path,
    *,
    title: str | None = None,
    pool: CurvePool | None = None,
) -> Path:
    """Draw the learning curves of `runs` (one colour each, named by `labels`) into the PNG file `out`;
    returns its path. Training metrics are solid lines, test metrics dashed with dots
    (`research.curves.draw_curves`); with a `pool`, queued to it (drawn once the pool is closed at the
    latest). `scripts/plot_runs` (`research.tools.plot_runs`) draws several runs with it."""
    experiments = []
    for run in runs:
        experiment = run.read_config().get("experiment")
        if experiment and experiment not in experiments:
            experiments.append(experiment)
    records = [(run.read_metrics(), label) for run, label in zip(runs, labels, strict=True)]
    title = title or ", ".join(experiments) or "runs"
    if pool is None:
        return draw_curves(records, out, title=title)
    pool.draw(records, out, title=title)
    return Path(out)


def save_image_grid(
    path: str | Path, images: np.ndarray, *, columns: int | None = None, scale: int | None = None
) -> Path:
    """Write `images` (`[count, height, width, channels]`, uint8, one or three channels) as one PNG grid,
    `columns` wide (default: a square), each image magnified `scale` times (default: to about 64 pixels,
    at least twice), with a one-pixel grey border."""
    import matplotlib.image

    images = np.asarray(images)
    count, height, width, channels = images.shape
    scale = scale or max(2, 64 // max(height, width))
    if images.dtype != np.uint8 or channels not in (1, 3):
        raise ValueError(f"an image grid takes uint8 images of 1 or 3 channels, got {images.dtype} x {channels}")
    columns = columns or int(np.ceil(np.sqrt(count)))
    rows = -(-count // columns)
    grid = np.full((rows * (height + 1) + 1, columns * (width + 1) + 1, channels), 128, np.uint8)
    for i, image in enumerate(images):
        top, left = 1 + (i // columns) * (height + 1), 1 + (i % columns) * (width + 1)
        grid[top : top + height, left : left + width] = image
    grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    matplotlib.image.imsave(path, grid[..., 0] if channels == 1 else grid, cmap="gray", vmin=0, vmax=255)
    return Path(path)
