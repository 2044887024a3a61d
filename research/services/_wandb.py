"""A Weights & Biases run as a tracker, through the `wandb` library (the `wandb` extra)."""

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..install import require_extra
from ._tracking import Ending, scalars

EXIT_CODES = {"finished": 0, "failed": 1, "killed": 143}


class WandbTracker:
    """Every record of a run to a W&B run, then its summary and files (config.json, summary.json,
    curves.png, also as an image).

    W&B runs offline unless the environment says otherwise (`$WANDB_MODE`: `online`, `disabled`): the
    run is kept in `directory/wandb/offline-run-*` and `wandb sync DIRECTORY/wandb/offline-run-*` uploads
    it later (a cluster without internet). `$WANDB_PROJECT`, `$WANDB_ENTITY` and W&B's other settings
    apply as usual.

    **Arguments:**

    - `directory`: where W&B keeps its files (a run directory keeps them beside its metrics).
    - `project`: the W&B project (`$WANDB_PROJECT` wins).
    - `name`, `group`: the run's display name, and the group it belongs to (a sweep).
    - `run_id`: continue this W&B run (a resumed run), else start a new one (`run_id` then says which).
    - `config`: the run's options (W&B's config).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        project: str,
        name: str,
        run_id: str | None = None,
        group: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        require_extra("WandbTracker", "wandb")
        import wandb

        self._run = wandb.init(
            dir=str(Path(directory).resolve()),  # W&B's service may run in another working directory
            project=os.environ.get("WANDB_PROJECT", project),
            name=name,
            group=group,
            id=run_id,
            resume="allow",
            # $WANDB_MODE read each time (W&B reads it once a process); W&B checks the values of both.
            mode=os.environ.get("WANDB_MODE") or "offline",  # pyright: ignore[reportArgumentType]
            # The run's output is its own (progress bars, the summary line): W&B copies it only when asked to.
            settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE", "off")),  # pyright: ignore[reportArgumentType]
        )
        self._run.config.update(dict(config or {}), allow_val_change=True)  # a resumed run may change a few
        self.run_id = self._run.id
        self.directory = Path(directory)

    @property
    def identity(self) -> dict[str, Any]:
        """What config.json keeps to continue this W&B run on resume, and whether it syncs (`mode`)."""
        return {"run_id": self.run_id, "project": self._run.project, "mode": self._run.settings.mode}

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(scalars(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's final numbers into W&B's summary (`RunTrackers.close` gives them under their records'
        names, which W&B's summary holds the last values of already)."""
        self._run.summary.update(dict(summary))

    def log_files(self, paths: Sequence[Path]) -> None:
        import wandb

        for path in paths:
            self._run.save(str(path), base_path=str(path.parent), policy="now")
            if path.suffix == ".png":
                self._run.summary[path.stem] = wandb.Image(str(path))

    def finish(self, ending: Ending = "finished") -> None:
        self._run.finish(exit_code=EXIT_CODES[ending])


def read_wandb_runs(directory: str | Path) -> list[dict[str, Any]]:
    """The W&B runs written under `directory` (say a run directory), read back by W&B's own reader
    (`wandb leet inspect --json`), oldest first: each `{"run_id", "config", "summary", "history":
    [{"step": s, name: value, ...}, ...], "files": [...], "exit_code"}`; a resumed run is one entry
    per time it was started. W&B's own keys (`_runtime`, `_timestamp`, ...) are left out."""
    runs = []
    for run_dir in Path(directory).glob("wandb/*run-*"):
        read = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if read.returncode:
            raise OSError(f"wandb leet inspect cannot read {run_dir}: {read.stderr.strip()}")
        records = read.stdout.splitlines()
        run: dict[str, Any] = {"config": {}, "summary": {}, "history": [], "files": [], "exit_code": None}
        for record in map(json.loads, records):
            kind = record["type"]
            if kind == "run":
                run["run_id"], run["start_time"] = record["run"]["run_id"], record["run"].get("start_time", "")
                run["group"] = record["run"].get("run_group")
                run["config"].update(
                    {k: v for k, v in record["run"].get("config", {}).get("update", {}).items() if k != "_wandb"}
                )
            elif kind == "config":
                run["config"].update({k: v for k, v in record["config"].get("update", {}).items() if k != "_wandb"})
            elif kind == "history":
                item = {k: v for k, v in record["history"]["item"].items() if not k.startswith("_")}
                run["history"].append({"step": int(record["history"]["step"]["num"]), **item})
            elif kind == "summary":
                run["summary"].update(
                    {k: v for k, v in record["summary"].get("update", {}).items() if not k.startswith("_")}
                )
            elif kind == "files":
                run["files"] += [f["path"] for f in record["files"]["files"]]
            elif kind == "exit":
                run["exit_code"] = record["exit"].get("exit_code", 0)
        runs.append(run)
    return sorted(runs, key=lambda run: run.get("start_time", ""))
