"""An MLflow run as a tracker, through MLflow's client (the `mlflow` extra)."""

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..install import require_extra
from ._tracking import Ending, scalars

STATUSES = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
BATCH = 1000  # MLflow takes at most 1,000 metrics (and 100 parameters) in one call


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` tracking URI (None for any other store)."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


class MlflowTracker:
    """Every record of a run to an MLflow run (metrics with their steps), its options as parameters, then
    its summary (as metrics at the last step) and files as artifacts (config.json, summary.json, curves.png).

    **Arguments:**

    - `uri`: the tracking URI: a server (`http://...`), a database (`sqlite:////abs/path/mlflow.db`: its
      artifacts go beside it, in `mlartifacts/`), ...
    - `experiment`: the MLflow experiment (made when missing).
    - `name`, `group`: the run's name, and a `group` tag (a sweep's runs share it).
    - `run_id`: continue this MLflow run (a resumed run): its parameters stay as first logged (new ones
      are added), and records at steps it already holds (logged after the checkpoint a killed run resumes
      from, the same numbers) are not logged twice. Else a new run (`run_id` then says which).
    - `params`: the run's options.
    - `tags`: more tags for a new run.
    """

    def __init__(
        self,
        uri: str,
        *,
        experiment: str,
        name: str,
        run_id: str | None = None,
        group: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        require_extra("MlflowTracker", "mlflow")
        from mlflow.tracking import MlflowClient

        self.uri = uri
        with _store_lock(uri):  # several runs of a sweep may create the same database and experiment at once
            self._client = MlflowClient(uri)
            experiment_id = self._experiment_id(experiment)
        tags = {**(tags or {}), **({"group": group} if group else {})}
        if run_id is None:
            self.run_id = self._client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
            self.logged_until = -1
        else:
            self.run_id = run_id
            self._client.update_run(run_id, status="RUNNING")
            self.logged_until = self._last_logged_step()
        self._logged_at: dict[int, set[str]] = {}  # the names logged at each step by this tracker
        self._log_new_params({k: _param(v) for k, v in (params or {}).items()})

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        database = sqlite_path(self.uri)
        location = (database.parent / "mlartifacts" / name).as_uri() if database else None
        try:
            return self._client.create_experiment(name, artifact_location=location)
        except MlflowException:  # made by another process meanwhile
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _last_logged_step(self) -> int:
        names = self._client.get_run(self.run_id).data.metrics
        steps = [m.step for name in names for m in self._client.get_metric_history(self.run_id, name)]
        return max(steps, default=-1)

    def _log_new_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        logged = self._client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):
            self._client.log_batch(self.run_id, params=new[i : i + 100])

    @property
    def identity(self) -> dict[str, Any]:
        """What config.json keeps to continue this MLflow run on resume."""
        return {"run_id": self.run_id, "uri": self.uri}

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if step > self.logged_until:
            values = scalars(metrics)
            self._log_metrics(values, step)
            self._logged_at.setdefault(step, set()).update(values)

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, value, now, step) for name, value in values.items()]
        for i in range(0, len(batch), BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + BATCH])

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The summary's numbers at its step, but for those the record of that step logged already (the final
        evaluation's, under the same names: `summary_metrics`)."""
        step = int(summary.get("step", 0))  # the x axis, not a metric
        values = scalars({k: v for k, v in summary.items() if k != "step"})
        self.log(step, {k: v for k, v in values.items() if k not in self._logged_at.get(step, set())})

    def log_files(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))

    def finish(self, ending: Ending = "finished") -> None:
        self._client.set_terminated(self.run_id, status=STATUSES[ending])


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:6000]  # MLflow's limit on a parameter's value


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Hold a file lock beside a SQLite store while it is opened: the first open creates its tables."""
    database = sqlite_path(uri)
    if database is None:
        yield
        return
    from filelock import FileLock

    database.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(database) + ".lock", timeout=300):
        yield
