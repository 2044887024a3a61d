"""A markdown table of runs: the config options that differ between them, then their final numbers.

    scripts/compare_runs RUN_DIR...

Options that do not change what is trained (the run directory, resume, the progress bar,
TensorBoard, NaN debugging) are left out. Final numbers come from `summary.json`; a run without
one (still running, or killed) shows its last logged metrics, marked `(unfinished)`.
"""

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..train import RunDir
from ._runs import Parser, UsageError, fail, open_runs, run_labels

NOT_COMPARED = {"run_dir", "resume", "progress", "tensorboard", "debug_nans"}
FIRST_METRICS = ["test_accuracy", "test_loss", "train_loss", "step", "wall_seconds"]
_FROM_METRICS = {"test_accuracy": "test/accuracy", "test_loss": "test/loss", "train_loss": "train/loss"}


def _settings(run: RunDir) -> dict[str, Any]:
    saved = run.read_config()
    settings = {"experiment": saved.get("experiment")}
    settings.update({k: v for k, v in saved.get("config", {}).items() if k not in NOT_COMPARED})
    return settings


def _final_numbers(run: RunDir) -> tuple[dict[str, Any], bool]:
    summary = run.read_summary()
    if summary is not None:
        return summary, True
    last: dict[str, Any] = {}
    for record in run.read_metrics():
        last.update(record)
    numbers = {key: last[name] for key, name in _FROM_METRICS.items() if name in last}
    if "step" in last:
        numbers["step"] = last["step"]
    return numbers, False


def _format(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
        return text.replace("|", "\\|")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if "accuracy" in key:
        return f"{100 * value:.2f}%"
    if key.endswith("seconds"):
        return f"{value:.1f}"
    return f"{value:.4g}"


def compare_runs(run_dirs: Sequence[str | Path]) -> str:
    """The markdown comparison table of `run_dirs` (see the module docstring)."""
    runs = open_runs(run_dirs)
    labels = run_labels(runs)
    settings = [_settings(run) for run in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differing = [k for k in keys if len({json.dumps(s.get(k), sort_keys=True) for s in settings}) > 1]
    finals = [_final_numbers(run) for run in runs]
    numeric = {k for numbers, _ in finals for k, v in numbers.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics = [k for k in FIRST_METRICS if k in numeric] + sorted(numeric - set(FIRST_METRICS))
    header = ["run", *differing, *metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for label, setting, (numbers, finished) in zip(labels, settings, finals):
        cells = [label + ("" if finished else " (unfinished)")]
        cells += [_format(k, setting.get(k)) for k in differing]
        cells += [_format(k, numbers.get(k)) for k in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    if not differing and len(runs) > 1:
        lines.append("\n(the runs' configs are identical)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(prog="compare_runs", description="Print a markdown table comparing run directories.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with config.json)")
    args = parser.parse_args(argv)
    try:
        print(compare_runs(args.runs))
    except UsageError as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
