"""What a run reports: the line it prints when it starts, its summary (`summary.json`'s numbers and the
line it prints when it ends), and its learning curves (`curves.png`, and `scripts/plot_runs`)."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .curves import CurvePool, draw_curves
from .provenance import describe_parameters
from .train import FitResult, RunDir, TrainState


def start_line(experiment: str, record: dict[str, Any], state: TrainState, run: RunDir) -> str:
    """What a run prints when it starts: the model and its size, the steps, the devices, where it writes."""
    counts, place = record["parameters"], record["machine"]
    members = f"{counts['members']} members of " if "members" in counts else ""
    devices = f"{place['devices']} {place['device_kind']} device" + ("s" if place["devices"] > 1 else "")
    processes = f" in {place['processes']} processes" if place["processes"] > 1 else ""
    return (
        f"{experiment}: {type(state.model).__name__}, {members}{describe_parameters(counts)}; "
        f"{record['resolved']['num_steps']:,} steps on {devices}{processes}; run directory {run.path}"
    )


def run_summary(result: FitResult) -> dict[str, Any]:
    """A run's final numbers: `test_<metric>` (of the EMA model with an EMA, and `test_raw_<metric>` of
    the trained one), `train_loss`, `step`; a population's include each member's and the ensemble's."""
    summary = {f"test_{k}": v for k, v in (result.eval_metrics or {}).items()}
    summary.update({f"val_{k}": v for k, v in (result.val_metrics or {}).items()})
    summary.update({f"test_raw_{k}": v for k, v in (result.raw_eval_metrics or {}).items()})
    summary.update({f"train_{k}": v for k, v in result.train_metrics.items() if k in ("loss", "member_loss")})
    summary["step"] = int(np.max(np.asarray(result.state.step)))
    return summary


def summary_line(experiment: str, summary: dict[str, Any], run: RunDir) -> str:
    """What a run prints when it ends (and when it is resumed after it finished)."""
    raw = f", without EMA {100 * summary['test_raw_accuracy']:.2f}%" if "test_raw_accuracy" in summary else ""
    if "test_ensemble_accuracy" in summary:
        members = np.asarray(summary["test_member_accuracy"])
        raw += (
            f"; {len(members)} members {100 * members.min():.2f}-{100 * members.max():.2f}%, their ensemble "
            f"(mean of probabilities) {100 * summary['test_ensemble_accuracy']:.2f}%"
        )
    if "val_accuracy" in summary:
        raw += f"; validation accuracy {100 * summary['val_accuracy']:.2f}%"
    what = "mean member test accuracy" if "test_ensemble_accuracy" in summary else "test accuracy"
    return (
        f"{experiment}: {what} {100 * summary['test_accuracy']:.2f}%{raw} "
        f"(test loss {summary['test_loss']:.4f}, train loss {summary['train_loss']:.4f}) "
        f"at step {summary['step']}, {summary['wall_seconds']:.1f} s\nrun directory: {run.path} "
        "(learning curves: curves.png)"
    )


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
