"""A markdown table of runs: the config options that differ between them, then their final numbers.

    scripts/compare_runs RUN_DIR...
    scripts/compare_runs --over seed RUN_DIR...

Options that do not change what is trained (the run directory, resume, the progress bar, the compilation cache,
the trackers, the profile, NaN debugging) are left out, and so are the measurements of the machine (compile
time, peak memory). Final numbers come from `summary.json`; a run without
one (still running, or killed) shows its last logged metrics, marked `(unfinished)`.

With `--over OPTION` (repeatable), runs that differ only in those options (say, seeds) make one row:
each number is the mean +- the sample standard deviation over the group's runs, and `runs` counts them.
"""

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import install
from ..messages import messages_to_stderr
from ..services import RunDir
from ._runs import Parser, UsageError, fail, open_runs, run_labels

NOT_COMPARED = {
    "run_dir",
    "resume",
    "progress",
    "tensorboard",
    "tracker",
    "mlflow_uri",
    "group",
    "profile_steps",
    "debug_nans",
    "compilation_cache",
}
NOT_SHOWN = {"compile_seconds", "peak_host_memory_bytes", "peak_device_memory_bytes"}
FIRST_METRICS = ["val_accuracy", "val_loss", "test_accuracy", "test_loss", "train_loss", "step", "wall_seconds"]
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


def _format_spread(key: str, values: list[Any]) -> str:
    """`mean ± std` of a group's numbers (a single value, or equal ones, print as that value)."""
    values = [v for v in values if v is not None]
    if len(values) < 2 or len(set(values)) == 1 or not all(map(math.isfinite, values)):
        return " / ".join(dict.fromkeys(_format(key, v) for v in values)) if values else _format(key, None)
    mean, std = statistics.fmean(values), statistics.stdev(values)
    if "accuracy" in key:
        return f"{100 * mean:.2f} ± {100 * std:.2f}%"
    if key.endswith("seconds"):
        return f"{mean:.1f} ± {std:.1f}"
    return f"{mean:.4g} ± {std:.2g}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def compare_runs(run_dirs: Sequence[str | Path], over: Sequence[str] = ()) -> str:
    """The markdown comparison table of `run_dirs`; with `over`, one row per group of runs that
    differ only in those options (see the module docstring)."""
    runs = open_runs(run_dirs)
    labels = run_labels(runs)
    settings = [_settings(run) for run in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    unknown = [k for k in over if k not in keys]
    if unknown:
        raise UsageError(f"--over {unknown[0]}: no run has that option (options: {', '.join(keys)})")
    differing = [k for k in keys if k not in over and len({json.dumps(s.get(k), sort_keys=True) for s in settings}) > 1]
    finals = [_final_numbers(run) for run in runs]
    numeric = {
        k
        for numbers, _ in finals
        for k, v in numbers.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_SHOWN
    }
    # The experiments' headline metrics first (test_accuracy unless config.json names another), then the usual.
    headlines = [f"test_{run.read_config().get('headline', {}).get('metric', 'accuracy')}" for run in runs]
    first = [*dict.fromkeys(headlines), *FIRST_METRICS]
    metrics = [k for k in dict.fromkeys(first) if k in numeric] + sorted(numeric - set(first))
    if over:
        groups: dict[str, list[int]] = {}
        for i, setting in enumerate(settings):
            groups.setdefault(json.dumps([setting.get(k) for k in differing]), []).append(i)
        header = ["runs", *differing, *metrics]
        lines = [_row(header), "|" + "|".join(" --- " for _ in header) + "|"]
        for members in groups.values():
            unfinished = sum(not finals[i][1] for i in members)
            cells = [f"{len(members)}" + (f" ({unfinished} unfinished)" if unfinished else "")]
            cells += [_format(k, settings[members[0]].get(k)) for k in differing]
            cells += [_format_spread(k, [finals[i][0].get(k) for i in members]) for k in metrics]
            lines.append(_row(cells))
        return "\n".join(lines)
    header = ["run", *differing, *metrics]
    lines = [_row(header), "|" + "|".join(" --- " for _ in header) + "|"]
    for label, setting, (numbers, finished) in zip(labels, settings, finals, strict=True):
        cells = [label + ("" if finished else " (unfinished)")]
        cells += [_format(k, setting.get(k)) for k in differing]
        cells += [_format(k, numbers.get(k)) for k in metrics]
        lines.append(_row(cells))
    if not differing and len(runs) > 1:
        lines.append("\n(the runs' configs are identical)")
    return "\n".join(lines)


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(
        prog="compare_runs",
        usage=f"{install.command('compare')} RUN_DIR... [--over OPTION]",
        description="Print a markdown table comparing run directories.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with config.json)")
    parser.add_argument(
        "--over",
        action="append",
        default=[],
        metavar="OPTION",
        help="group runs that differ only in this option (repeatable; e.g. seed) into one row of mean ± std",
    )
    args = parser.parse_args(argv)
    try:
        print(compare_runs(args.runs, over=args.over))
    except UsageError as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
