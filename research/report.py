"""What a run reports: the line it prints when it starts, its summary (`summary.json`'s numbers and the
line it prints when it ends), and its learning curves (`curves.png`, and `scripts/plot_runs`)."""

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


CURVE_PANELS = (("loss", "loss"), ("accuracy", "accuracy"))


def _curve(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [s for s, _ in points], [v for _, v in points]


def plot_curves(runs: Sequence[RunDir], labels: Sequence[str], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the learning curves of `runs` (one colour each, named by `labels`) into the PNG file `out`;
    returns its path. Training metrics are solid lines, test metrics dashed with dots.
    `scripts/plot_runs` (`research.tools.plot_runs`) draws several runs with it."""
    from matplotlib.figure import Figure  # imported here: a second to import, needed only at the end of a run
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(11, 4.2), dpi=110)
    # Fixed margins: the constrained layout engine measured as half of the time of every run's plot.
    figure.subplots_adjust(left=0.06, right=0.99, bottom=0.12, top=0.87, wspace=0.2)
    axes = figure.subplots(1, len(CURVE_PANELS))
    experiments = []
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        records = run.read_metrics()
        experiment = run.read_config().get("experiment")
        if experiment and experiment not in experiments:
            experiments.append(experiment)
        for ax, (metric, _) in zip(axes, CURVE_PANELS, strict=True):
            steps, values = _curve(records, f"train/{metric}")
            ax.plot(steps, values, color=f"C{i}", linewidth=1.6, label=label)
            steps, values = _curve(records, f"test/{metric}")
            ax.plot(steps, values, color=f"C{i}", linestyle="--", marker="o", markersize=4, linewidth=1.2)
    for ax, (metric, ylabel) in zip(axes, CURVE_PANELS, strict=True):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{metric} (solid: train, dashed: test)", fontsize=10, y=1.0)  # y: no auto-placement (slow)
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
