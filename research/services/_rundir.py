import dataclasses
import datetime
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import CheckpointError
from ..install import require_extra
from ._checkpoint import is_committed, read_header, remove_checkpoint, write_atomic
from ._single_file import SUFFIX

RUNS_ROOT = Path("runs")  # runs/<experiment>/<run>: where a run goes unless it is told
_CHECKPOINT = re.compile(r"^step_(\d+)(\.ckpt)?$")  # a directory; a file of the earlier format


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Headline:
    """The number an experiment's runs are judged by: the evaluation's `metric` (`test/<metric>` in
    metrics.jsonl, `test_<metric>` in summary.json) and its `goal` (`"max"`: higher is better). An
    experiment's config names it (`RunConfig.headline`); the summary line, the best checkpoint kept,
    `scripts/compare_runs` and `scripts/sweep`'s objective use it. `percent`: shown as a percentage."""

    metric: str = "accuracy"
    goal: Literal["max", "min"] = "max"
    percent: bool = True

    @property
    def summary_key(self) -> str:
        return f"test_{self.metric}"

    def shown(self, value: Any) -> str:
        """`value` as the summary line shows it (`97.50%`, `12.3456`)."""
        if not isinstance(value, (int, float)):
            return str(value)
        return f"{100 * value:.2f}%" if self.percent else f"{value:.4g}"

    def better(self, value: Any, than: float) -> bool:
        """Whether `value` is a number better than `than` (a run's value is better than none: +-inf)."""
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return value > than if self.goal == "max" else value < than

    @property
    def worst(self) -> float:
        return -math.inf if self.goal == "max" else math.inf


class RunDir:
    """One run's directory: `config.json`, `metrics.jsonl`, `summary.json`, `checkpoints/`, plots.

    **Arguments:**

    - `path`: the directory; created if missing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.config_file = self.path / "config.json"
        self.metrics_file = self.path / "metrics.jsonl"
        self.summary_file = self.path / "summary.json"

    @staticmethod
    def new_path(root: str | Path, experiment: str) -> Path:
        """`root/experiment/<UTC timestamp>`, with a suffix if that name is taken."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        path = Path(root) / experiment / stamp
        n = 1
        while path.exists():
            n += 1
            path = Path(root) / experiment / f"{stamp}-{n}"
        return path

    @staticmethod
    def latest(root: str | Path, experiment: str) -> Path | None:
        """The most recently modified run directory of `experiment` under `root`, if any."""
        runs = [p for p in (Path(root) / experiment).glob("*") if (p / "config.json").exists()]
        return max(runs, key=lambda p: p.stat().st_mtime, default=None)

    def create(self) -> "RunDir":
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        return self

    # -- config, metrics, summary --------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        write_atomic(self.config_file, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_file.read_text())

    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """The logged records; a last line cut short by a crash (no newline yet) is ignored."""
        if not self.metrics_file.exists():
            return []
        text = self.metrics_file.read_text()
        complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def metric_columns(self) -> dict[str, np.ndarray]:
        """metrics.jsonl as columns, one entry a record (a notebook's plot: `plt.plot(c["step"], c["train/loss"])`,
        or `pandas.DataFrame` of the 1-D ones): float64 with NaN where a record lacks the metric (training and
        evaluation records alternate), a population's per-member values as a 2-D column (records x members),
        `step` as int64. The strings metrics.jsonl keeps non-finite numbers as ("nan", "inf") are numbers again."""
        records = self.read_metrics()
        names = list(dict.fromkeys(name for record in records for name in record))
        columns = {}
        for name in names:
            present = [record[name] for record in records if name in record]
            members = max((len(v) for v in present if isinstance(v, list)), default=None)
            column = np.full((len(records),) if members is None else (len(records), members), np.nan)
            for row, record in enumerate(records):
                if name in record:
                    column[row] = np.asarray(record[name], dtype=np.float64)  # "nan", "inf": floats again
            if name == "step" and len(present) == len(records):
                column = column.astype(np.int64)
            columns[name] = column
        return columns

    def metric_frame(self) -> Any:
        """`metric_columns` as a `pandas.DataFrame` indexed by step (pandas is not a dependency: it must be
        installed), a population's per-member column spread into one column a member (`test/member_loss/0`,
        ..., as the trackers name them)."""
        require_extra("RunDir.metric_frame (not metric_columns)", "pandas")
        import pandas

        flat = {}
        for name, column in self.metric_columns().items():
            if column.ndim == 1:
                flat[name] = column
            else:
                flat.update({f"{name}/{member}": column[:, member] for member in range(column.shape[1])})
        return pandas.DataFrame(flat).set_index("step") if flat else pandas.DataFrame()

    def truncate_metrics(self, after_step: int) -> None:
        """Drop records logged after `after_step` (they belong to work a resume will redo)."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
        write_atomic(self.metrics_file, "".join(json.dumps(r) + "\n" for r in kept).encode())

    def write_summary(self, summary: dict[str, Any]) -> None:
        # Strict JSON: a NaN or an infinity is written as a string, as metrics.jsonl does.
        text = json.dumps(_jsonable(summary), indent=2, sort_keys=True, allow_nan=False)
        write_atomic(self.summary_file, (text + "\n").encode())

    def read_summary(self) -> dict[str, Any] | None:
        """The final numbers of a finished run; `None` while it runs (or if it was killed)."""
        return json.loads(self.summary_file.read_text()) if self.summary_file.exists() else None

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:09d}"

    def checkpoint_paths(self) -> list[Path]:
        """Committed checkpoints (directories; files of the earlier format), oldest step first."""
        found = []
        for path in self.checkpoints.glob("step_*"):
            match = _CHECKPOINT.match(path.name)
            if match and (path.is_file() if match.group(2) == SUFFIX else is_committed(path)):
                found.append((int(match.group(1)), path.is_dir(), path))
        return [path for *_, path in sorted(found)]

    def remove_uncommitted(self) -> None:
        """Delete what interrupted saves left behind: Orbax's temporary directories, step directories
        without a commit, temporary files of the earlier format (a run does this before it trains)."""
        if not self.checkpoints.is_dir():
            return
        committed = set(self.checkpoint_paths())
        for path in self.checkpoints.iterdir():
            leftover = path.name.startswith("step_") or (path.name.startswith(".step_") and path.suffix == ".tmp")
            if leftover and path not in committed:
                remove_checkpoint(path)

    def latest_valid_checkpoint(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose checksum verifies, and a message for each newer damaged one."""
        problems = []
        for path in reversed(self.checkpoint_paths()):
            try:
                read_header(path)
                return path, problems
            except CheckpointError as e:
                problems.append(str(e))
        return None, problems

    def best_checkpoint(self, headline: Headline = Headline()) -> Path | None:
        """The valid checkpoint whose header records the best `test/<headline metric>` (evaluated at its step)."""
        best, best_value = None, headline.worst
        for path in self.checkpoint_paths():
            try:
                value = read_header(path).get("eval", {}).get(f"test/{headline.metric}")
            except CheckpointError:
                continue
            if headline.better(value, best_value):
                best, best_value = path, value
        return best

    def prune_checkpoints(self, keep: int, headline: Headline = Headline()) -> None:
        """Delete all but the `keep` newest checkpoints and the best one by `headline` (`best_checkpoint`)."""
        paths = self.checkpoint_paths()
        if len(paths) <= keep:
            return
        best = self.best_checkpoint(headline)
        for path in paths[:-keep]:
            if path != best:
                remove_checkpoint(path)
