"""Random and TPE search through Optuna, its study kept in SQLite in the sweep directory.

The study is the bookkeeping: a trial is asked when a run can start and told the run's metric (or
FAIL) when it ends. A trial still RUNNING when the sweep starts belongs to a sweep that was killed;
its run directory is named by its number and values, so it is run again first (`--resume auto`
continues it), and told. `--trials K` is the number of finished trials the study should hold.
"""

import json
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna

from ._axes import Axis, format_value
from ._pool import Outcome, Run
from ._runs import UsageError

STUDY_FILE = "study.db"
STUDY_NAME = "sweep"
_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)


def _distribution(axis: Axis) -> optuna.distributions.BaseDistribution:
    if axis.range is None:
        return optuna.distributions.CategoricalDistribution(axis.values)
    if axis.range.integer:
        return optuna.distributions.IntDistribution(int(axis.range.low), int(axis.range.high), log=axis.range.log)
    return optuna.distributions.FloatDistribution(axis.range.low, axis.range.high, log=axis.range.log)


def _sampler(search: str, seed: int, jobs: int) -> optuna.samplers.BaseSampler:
    if search == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():  # constant_liar is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=jobs > 1)


def open_study(sweep_dir: Path, spec: dict[str, Any], *, search: str, seed: int, jobs: int) -> optuna.Study:
    """The study in `sweep_dir/study.db`, created or loaded; one made for another `spec` (experiment,
    space, flags, metric, direction) is refused. The sampler's seed is offset by the trials already
    there, so a resumed random search does not draw the same values again."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(sweep_dir / STUDY_FILE).resolve()}"
    exists = STUDY_NAME in optuna.get_all_study_names(storage)
    offset = len(optuna.load_study(study_name=STUDY_NAME, storage=storage).trials) if exists else 0
    study = optuna.create_study(
        study_name=STUDY_NAME,
        storage=storage,
        direction=spec["direction"],
        sampler=_sampler(search, seed + offset, jobs),
        load_if_exists=True,
    )
    saved = study.user_attrs.get("spec")
    if saved is None:
        study.set_user_attr("spec", spec)
    elif saved != json.loads(json.dumps(spec)):
        changed = ", ".join(k for k in spec if saved.get(k) != json.loads(json.dumps(spec[k])))
        raise UsageError(
            f"{sweep_dir / STUDY_FILE} holds a study with another {changed}; "
            "rerun it as it was or pick another --sweep-dir"
        )
    return study


class Search:
    """Runs for a study: `next_run` for `run_all`, `finish` to tell the study how each ended."""

    def __init__(
        self,
        study: optuna.Study,
        axes: Sequence[Axis],
        trials: int,
        metric: str,
        make_run: Callable[[int, dict[str, str]], Run],
    ):
        self.study, self.axes, self.metric, self.make_run = study, axes, metric, make_run
        states = [t.state for t in study.trials]
        self.stale = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
        self.todo = max(0, trials - sum(s in _FINISHED for s in states))
        self.started = 0
        self.numbers: dict[str, int] = {}

    def next_run(self) -> Run | None:
        if self.started >= self.todo:
            return None
        self.started += 1
        if self.stale:
            trial = self.stale.pop(0)
            number, params = trial.number, trial.params
        else:
            trial = self.study.ask({axis.key: _distribution(axis) for axis in self.axes})
            number, params = trial.number, trial.params
        run = self.make_run(number, {a.key: format_value(params[a.key]) for a in self.axes})
        self.numbers[run.name] = number
        return run

    def finish(self, outcome: Outcome) -> str:
        """Tell the study the run's metric; returns what went wrong (empty when nothing did)."""
        number = self.numbers[outcome.run.name]
        value = (outcome.summary() or {}).get(self.metric)
        if outcome.ok and isinstance(value, (int, float)) and math.isfinite(value):
            self.study.tell(number, float(value))
            return ""
        self.study.tell(number, state=optuna.trial.TrialState.FAIL)
        if outcome.ok:
            return f"its summary.json has no finite {self.metric!r}"
        return outcome.last_error

    def trial_runs(self) -> list[tuple[Run, float | None]]:
        """Every trial's run with its value (None: failed or unfinished), best first."""
        runs = [
            (self.make_run(t.number, {a.key: format_value(t.params[a.key]) for a in self.axes}), t.value)
            for t in self.study.trials
            if all(a.key in t.params for a in self.axes)
        ]
        sign = -1 if self.study.direction == optuna.study.StudyDirection.MAXIMIZE else 1
        return sorted(runs, key=lambda item: (item[1] is None, sign * (item[1] or 0)))
