"""Learning curves of one or more runs: loss and accuracy against step, one colour per run.

    scripts/plot_runs RUN_DIR... [-o out.png]

Training metrics are solid lines, test metrics dashed with dots (a run evaluated only at the end
has a single test dot). Drawn with matplotlib's Agg canvas: no display needed.
"""

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._runs import Parser, UsageError, fail, open_runs, run_labels

PANELS = (("loss", "loss"), ("accuracy", "accuracy"))


def _series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in records
              if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the learning curves of `run_dirs` into the PNG file `out`; returns its path."""
    runs = open_runs(run_dirs)
    from matplotlib.figure import Figure  # imported here: a second to import, needed only at the end of a run
    from matplotlib.ticker import PercentFormatter

    labels = run_labels(runs)
    figure = Figure(figsize=(11, 4.2), layout="constrained", dpi=110)
    axes = figure.subplots(1, len(PANELS))
    experiments = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        records = run.read_metrics()
        experiment = run.read_config().get("experiment")
        if experiment and experiment not in experiments:
            experiments.append(experiment)
        for ax, (metric, _) in zip(axes, PANELS):
            steps, values = _series(records, f"train/{metric}")
            ax.plot(steps, values, color=f"C{i}", linewidth=1.6, label=label)
            steps, values = _series(records, f"test/{metric}")
            ax.plot(steps, values, color=f"C{i}", linestyle="--", marker="o", markersize=4, linewidth=1.2)
    for ax, (metric, ylabel) in zip(axes, PANELS):
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(prog="plot_runs", description="Plot the learning curves of run directories to a PNG.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    parser.add_argument("-o", "--out", default="curves.png", help="the PNG to write")
    parser.add_argument("--title", default=None, help="figure title (default: the experiments' names)")
    args = parser.parse_args(argv)
    try:
        print(plot_runs(args.runs, args.out, title=args.title))
    except UsageError as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
