"""The trackers a run's config asks for (`--tracker jsonl,tensorboard,wandb,mlflow`), for one run directory.

metrics.jsonl is always written (by `fit`); the others are opened here, on process 0 only, before
training, and closed after the run's summary with its files. Each keeps its identity in config.json
(`trackers`), so a resumed run continues the same W&B and MLflow runs; a tracker added when a run is
resumed first gets the records logged before (from metrics.jsonl), and so does every tracker of a run
written after the fact (`track_finished_run`: the members of `scripts/sweep --vmapped`).
"""

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import RunConfig, Tracking, tracking_of
from .errors import ConfigError
from .services import (
    TRACKERS,
    Ending,
    MlflowTracker,
    RunDir,
    RunTracker,
    TensorBoardTracker,
    WandbTracker,
    parse_trackers,
    summary_metrics,
)


def trackers_of(tracking: Tracking) -> tuple[str, ...]:
    """The trackers a config's tracking options ask for (`--tensorboard` spells `--tracker tensorboard`)."""
    names = set(parse_trackers(tracking.tracker)) | ({"tensorboard"} if tracking.tensorboard else set())
    return tuple(name for name in TRACKERS if name in names)


def mlflow_uri(tracking: Tracking, runs_root: Path) -> str:
    """`--mlflow-uri`, else `$MLFLOW_TRACKING_URI`, else a SQLite database in the runs folder."""
    uri = tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{(runs_root / 'mlflow.db').resolve()}"


class RunTrackers:
    """The run's trackers besides metrics.jsonl, as one: `fit`'s tracker, then `close` with the summary."""

    def __init__(self, trackers: Mapping[str, RunTracker]):
        self.trackers = dict(trackers)

    def identities(self) -> dict[str, Any]:
        identities = {name: getattr(tracker, "identity", None) for name, tracker in self.trackers.items()}
        return {name: identity for name, identity in identities.items() if identity is not None}  # W&B's, MLflow's

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for tracker in self.trackers.values():
            tracker.log(step, metrics)

    def finish(self) -> None:
        """Nothing to do here: `close` ends the run, once the summary is known."""

    def replay(self, records: Sequence[dict[str, Any]]) -> None:
        """Log records of metrics.jsonl (`{"step": s, ...}`) again."""
        for record in records:
            self.log(record["step"], {k: v for k, v in record.items() if k != "step"})

    def close(self, ending: Ending, summary: Mapping[str, Any] | None = None, files: Sequence[Path] = ()) -> None:
        """Give each tracker the summary (its metrics under their records' names: `summary_metrics`) and the
        files that exist, then finish it with `ending`."""
        for tracker in self.trackers.values():
            try:
                if summary is not None:
                    tracker.log_summary(summary_metrics(summary))
                tracker.log_files([path for path in files if path.is_file()])
            finally:
                tracker.finish(ending)


def open_trackers(
    experiment: str,
    config: RunConfig,
    run: RunDir,
    *,
    runs_root: Path,
    start_step: int = 0,
    previous: Mapping[str, Any] | None = None,
) -> RunTrackers:
    """Open the trackers `config` asks for on the run in `run`: those named in `previous` (the
    `trackers` of the run's config.json, when it is resumed) continue their runs; a new one of a run
    resumed at `start_step` first gets metrics.jsonl's records up to there. A tracker that cannot start
    (an MLflow store it cannot reach, W&B online without a login) is a `ConfigError` naming it; the
    ones that may refuse open first, so that a refused run leaves no directory behind."""
    previous = previous or {}
    tracking = tracking_of(config)
    name, group = run.path.resolve().name, tracking.group
    options = config.to_dict()  # every option by name, as config.json holds them
    trackers: dict[str, RunTracker] = {}
    try:
        for tracker in sorted(trackers_of(tracking)[1:], key=OPEN_ORDER.index):  # jsonl: fit writes it
            known = previous.get(tracker, {}).get("run_id")
            if tracker == "tensorboard":
                known = next(run.path.glob("events.out.tfevents.*"), None)  # its points up to the resume stay
                trackers[tracker] = TensorBoardTracker(run.path, purge_step=start_step + 1 if start_step else None)
            elif tracker == "wandb":
                trackers[tracker] = _opened(
                    tracker,
                    functools.partial(
                        WandbTracker, run.path, project=experiment, name=name, run_id=known, group=group, config=options
                    ),
                )
            elif tracker == "mlflow":
                uri = previous.get(tracker, {}).get("uri") if known else mlflow_uri(tracking, runs_root)
                trackers[tracker] = _opened(
                    tracker,
                    functools.partial(
                        MlflowTracker,
                        uri,
                        experiment=experiment,
                        name=name,
                        run_id=known,
                        group=group,
                        params=options,
                        tags={"run_dir": str(run.path.resolve())},
                    ),
                )
            if start_step and not known:
                RunTrackers({tracker: trackers[tracker]}).replay(run.read_metrics())
    except BaseException:
        RunTrackers(trackers).close("failed")
        raise
    return RunTrackers(trackers)


OPEN_ORDER = ("mlflow", "wandb", "tensorboard")


def _opened(name: str, make: Callable[[], RunTracker]) -> RunTracker:
    try:
        return make()
    except Exception as e:  # the library's own error, whatever its type: said in one line, as bad input
        message = " ".join(str(e).split())[:400] or type(e).__name__
        raise ConfigError(f"--tracker {name} could not start: {message}") from e


def track_finished_run(experiment: str, config: RunConfig, run: RunDir, *, runs_root: Path) -> dict[str, Any]:
    """Send a finished run's records, summary and files to the trackers `config` asks for (as new runs);
    returns their identities, for its config.json."""
    trackers = open_trackers(experiment, config, run, runs_root=runs_root)
    trackers.replay(run.read_metrics())
    trackers.close("finished", run.read_summary(), run_files(run))
    return trackers.identities()


def run_files(run: RunDir) -> list[Path]:
    """The files of a run its trackers keep: config.json, summary.json, curves.png."""
    return [run.config_file, run.summary_file, run.path / "curves.png"]
