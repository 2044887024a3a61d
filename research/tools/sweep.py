"""Many runs of one experiment: a grid, or a random / TPE search through Optuna.

    scripts/sweep xor lr=0.1,0.3,1 seed=0,1 --jobs 2 -- --epochs 5
    scripts/sweep xor lr=1e-3:1:log hidden=4:32 --search tpe --trials 20 --metric test_accuracy
    scripts/sweep xor lr=0.1,0.3,1 seed=0,1 --vmapped -- --epochs 5

Each `KEY=VALUES` names an option of the experiment's config: `lr=0.1,0.3` (a list: a grid's
values, a search's choices) or `lr=1e-3:1e-1:log` (a numeric range, for a search). Every run is
checked as its command line before anything starts; a bad key or value is refused in one line
(exit status 2). Each run is its own process, `--jobs` at a time, started like
`scripts/run EXPERIMENT [flags after --] --KEY VALUE... --run-dir SWEEP_DIR/KEY=VALUE,... --resume auto
--no-progress` (and `--group SWEEP_DIR's name`, which groups the runs in W&B and MLflow, unless the flags
give one); its output goes to `SWEEP_DIR/logs/`. Rerunning the same command skips the runs
that finished (touching none of their files: a run whose summary.json and config.json say it
finished with this config is not even started, as `--resume auto` would only print its summary) and
resumes the others. A failed run is reported
with the last line it wrote to stderr; the others go on, and the sweep then exits with status 1.
A search keeps its trials in `SWEEP_DIR/study.db` (Optuna, SQLite), so it resumes too.

`--vmapped` trains a grid over vmappable options (the seed; hyperparameters the optimizer keeps in
its state, marked `option(vmappable=True)`) as one population in one compiled program (`_vmapped`)
and writes the same run directories; a killed one resumes when rerun. With `--devices N` after `--`
the population trains on N devices of this process (simulated on the CPU), its members or its
batches split over them.

`--executor slurm` submits each run (or the `--vmapped` population) as a SLURM job through submitit
(`_jobs`; `--slurm-*` options), each running the same `--resume auto` command, so requeued and preempted
jobs continue; the sweep waits and prints the table, or with `--no-wait` returns, and running it again
collects the jobs. `--executor submitit-local` is the same through submitit's local executor.

At the end the sweep prints the `compare_runs` table (with `--over seed` when a grid sweeps
several seeds) and writes it to `SWEEP_DIR/results.md`, and plots the runs to `SWEEP_DIR/curves.png`.
"""

import itertools
import json
import shlex
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from io import StringIO
from pathlib import Path
from typing import Any

from .. import install
from ..cli import RunConfig, devices_of, parse_config, use_compilation_cache
from ..config import headline_of
from ..errors import ConfigError, Preempted, ResearchInputError
from ..experiment import RUNS_ROOT, experiment_script, load_experiment
from ..messages import messages_to_stderr
from ..parallel import setup_devices
from ..progress import format_duration
from ..run_plan import Finished, plan_run
from ._axes import SET_BY_SWEEP, Axis, check_passed_flags, flag_words, parse_axis, run_name, sweepable_fields
from ._jobs import EXECUTORS, submit_and_collect
from ._pool import INTERRUPTS, Outcome, Run, run_all
from ._runs import Parser, UsageError, fail
from ._vmapped import check_vmappable, sweep_vmapped
from .compare_runs import compare_runs
from .plot_runs import plot_runs

SEARCHES = ("grid", "random", "tpe")


def _experiment(name: str) -> tuple[types.ModuleType, Path]:
    """The experiment's module and script path (`xor` is experiments/xor.py)."""
    try:
        module = load_experiment(name)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if not hasattr(module, "Config"):
        raise UsageError(f"{name}: the experiment has no Config to sweep")
    return module, experiment_script(name)


def _make_run(
    script: Path, sweep_dir: Path, flags: Sequence[str], axes: Sequence[Axis], values: dict[str, str], prefix: str = ""
) -> Run:
    pairs = tuple((axis.key, values[axis.key]) for axis in axes)
    name = prefix + run_name(pairs)
    path = sweep_dir / name
    swept = [word for axis in axes for word in flag_words(axis, values[axis.key])]
    command = (sys.executable, str(script), *flags, *swept, "--run-dir", str(path), "--resume", "auto", "--no-progress")
    return Run(name, pairs, path, command)


def _check(config_class: type[RunConfig], run: Run) -> RunConfig:
    """Parse the run's command line as the experiment would: its one-line error becomes a `UsageError`;
    returns the config (with the experiment's per-model defaults filled in where it has them, as its
    config.json records them: `parse_config` resolves them)."""
    with redirect_stderr(StringIO()) as err:
        try:
            return parse_config(config_class, list(run.command[2:]), prog=run.command[1])
        except SystemExit:
            message = err.getvalue().strip().splitlines()[-1:] or ["refused"]
            raise UsageError(f"{run.name}: {message[0].split(': error: ', 1)[-1]}") from None


def _as_saved(config: RunConfig) -> dict[str, Any]:
    """The config as config.json holds it."""
    return json.loads(json.dumps(config.to_dict()))


def finished_before(run: Run, config: RunConfig) -> bool:
    """Whether `run` finished with this `config` (but the options the sweep sets): `--resume auto` would
    then only print its summary (`plan_run`), so the sweep skips it without starting a process (JAX takes
    seconds)."""
    saved = run.path / "config.json"
    if not saved.exists():
        return False
    saved_run = json.loads(saved.read_text())
    same = {k: v for k, v in saved_run.get("config", {}).items() if k not in SET_BY_SWEEP} == {
        k: v for k, v in _as_saved(config).items() if k not in SET_BY_SWEEP
    }
    num_steps = saved_run.get("resolved", {}).get("num_steps")
    if not same or num_steps is None:  # another option may change the step count, which only setup works out
        return False
    try:
        return isinstance(plan_run(saved_run["experiment"], config, num_steps=num_steps), Finished)
    except ConfigError:  # the run's own process refuses it, in its log
        return False


def grid_runs(make: Callable[[dict[str, str]], Run], axes: Sequence[Axis]) -> list[Run]:
    """The Cartesian product of the axes' values, the first axis outermost."""
    for axis in axes:
        if axis.range is not None:
            raise UsageError(
                f"{axis.key}: a range is for --search random or tpe; a grid takes a list ({axis.key}=a,b,c)"
            )
    keys = [a.key for a in axes]
    return [make(dict(zip(keys, combo, strict=True))) for combo in itertools.product(*(a.values for a in axes))]


def _check_points(config_class: type, make: Callable[[dict[str, str]], Run], axes: Sequence[Axis]) -> None:
    """A search's values that can be checked up front: each choice and each range end, the other
    axes at their first."""
    first = {axis.key: axis.points[0] for axis in axes}
    for axis in axes:
        for point in axis.points:
            _check(config_class, make({**first, axis.key: point}))


class Progress:
    """One line per finished run on stderr: `k/N done`, how it ended, and the time left."""

    def __init__(self, total: int, metric: str):
        self.total, self.metric, self.done, self.start = total, metric, 0, time.monotonic()

    def __call__(self, outcome: Outcome, problem: str | None = None, *, together: bool = False) -> None:
        """`together`: the run ended with the others still to report (a vmapped population's members), so
        nothing is left to wait for."""
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = 0.0 if together else elapsed / self.done * (self.total - self.done)
        print(
            f"[sweep] {self.done}/{self.total} done: {outcome.run.name} {self._result(outcome, problem)} "
            f"| elapsed {format_duration(elapsed)}, ETA {format_duration(eta)}",
            file=sys.stderr,
            flush=True,
        )

    def _result(self, outcome: Outcome, problem: str | None) -> str:
        if problem or not outcome.ok:
            status = f"exit {outcome.status}" if outcome.status >= 0 else f"killed by signal {-outcome.status}"
            return f"FAILED ({status}): {problem or outcome.last_error}"
        value = (outcome.summary() or {}).get(self.metric)
        shown = f"{100 * value:.2f}%" if "accuracy" in self.metric and isinstance(value, float) else value
        how = "already finished" if outcome.skipped else f"finished in {outcome.seconds:.1f} s"
        return f"{how}, {self.metric} {shown}"


def report(runs: Sequence[Run], sweep_dir: Path, over: Sequence[str], title: str) -> None:
    """Print the comparison table of the runs that got a run directory; write it and the plot."""
    started = [run.path for run in runs if (run.path / "config.json").exists()]
    if not started:
        print("sweep: no run got as far as its run directory: no table", file=sys.stderr)
        return
    table = compare_runs(started, over=over)
    (sweep_dir / "results.md").write_text(table + "\n")
    plot = plot_runs(started, sweep_dir / "curves.png", title=title)
    print(table, flush=True)
    runs_in = f"{len(started)} run" + ("s" if len(started) > 1 else "")
    print(f"sweep: {runs_in} in {sweep_dir} (table: {sweep_dir / 'results.md'}, plot: {plot})", file=sys.stderr)


def _failures(failed: Sequence[tuple[Outcome, str]]) -> int:
    for outcome, problem in failed:
        print(f"sweep: {outcome.run.name} failed: {problem}", file=sys.stderr)
    if failed:
        print(f"sweep: {len(failed)} run(s) failed; their output is in logs/ of the sweep directory", file=sys.stderr)
    return 1 if failed else 0


def sweep_grid(
    runs: Sequence[Run], configs: Sequence[RunConfig], sweep_dir: Path, jobs: int, metric: str, title: str
) -> int:
    """Run `runs` (of `configs`) that did not finish before, `jobs` at a time; report them all; the exit
    status (1 when any failed)."""
    progress = Progress(len(runs), metric)
    failed: list[tuple[Outcome, str]] = []

    def finished(outcome: Outcome) -> None:
        progress(outcome)
        if not outcome.ok:
            failed.append((outcome, outcome.last_error))

    pending = []
    for run, config in zip(runs, configs, strict=True):
        if finished_before(run, config):
            finished(Outcome(run, 0, 0.0, "", skipped=True))
        else:
            pending.append(run)
    todo = iter(pending)
    run_all(lambda: next(todo, None), jobs, sweep_dir / "logs", finished)
    seeds = {dict(run.values).get("seed") for run in runs}
    report(runs, sweep_dir, ["seed"] if len(seeds) > 1 else [], title)
    return _failures(failed)


def sweep_jobs(args: Any, runs: Sequence[Run], configs: Sequence[RunConfig], title: str) -> int:
    """The grid's runs as jobs of `--executor` (slurm, submitit-local): the finished ones skipped, the
    others submitted, or collected when an earlier sweep submitted them; then, unless `--no-wait`, waited
    for and reported like a grid of processes. `--vmapped`: the population is one job, this sweep."""
    if args.vmapped:
        command = (
            sys.executable,
            "-m",
            "research.tools.sweep",
            args.experiment,
            *args.axes,
            "--vmapped",
            "--sweep-dir",
            str(args.sweep_dir),
            "--metric",
            args.metric,
            "--",
            *args.flags,
        )
        jobs = [Run("population", (), args.sweep_dir, command)]
    else:
        jobs = [run for run, config in zip(runs, configs, strict=True) if not finished_before(run, config)]
    progress = Progress(len(runs), args.metric)
    for run in runs:
        if not args.vmapped and run not in jobs:
            progress(Outcome(run, 0, 0.0, "", skipped=True))
    failed: list[tuple[Outcome, str]] = []

    def finished(outcome: Outcome) -> None:
        if not args.vmapped:
            progress(outcome)
        if not outcome.ok:
            failed.append((outcome, outcome.last_error))

    if jobs:
        try:
            submit_and_collect(jobs, args.executor, args.sweep_dir, args, wait=not args.no_wait, finished=finished)
        except KeyboardInterrupt:
            print("sweep: interrupted; the jobs go on: run the same sweep again to collect them", file=sys.stderr)
            return 130
        if args.no_wait:
            print(
                "sweep: not waiting (--no-wait): run the same sweep again to collect the jobs and print the table",
                file=sys.stderr,
            )
            return 0
    seeds = {dict(run.values).get("seed") for run in runs}
    report(runs, args.sweep_dir, ["seed"] if len(seeds) > 1 else [], title)
    return _failures(failed)


def sweep_search(args: Any, axes: Sequence[Axis], make: Callable[[int, dict[str, str]], Run], title: str) -> int:
    """Run the trials of a random or TPE search; report them; the exit status."""
    from ._search import Search, open_study  # optuna is needed (and imported) only for a search

    spec = {
        "experiment": args.experiment,
        "space": args.axes,
        "flags": args.flags,
        "metric": args.metric,
        "direction": args.direction,
    }
    study = open_study(args.sweep_dir, spec, search=args.search, seed=args.search_seed, jobs=args.jobs)
    search = Search(study, axes, args.trials, args.metric, make)
    progress = Progress(search.todo, args.metric)
    failed: list[tuple[Outcome, str]] = []

    def finished(outcome: Outcome) -> None:
        problem = search.finish(outcome)
        progress(outcome, problem)
        if problem:
            failed.append((outcome, problem))

    if search.todo == 0:
        print(f"sweep: the study already holds {args.trials} finished trials", file=sys.stderr)
    run_all(search.next_run, args.jobs, args.sweep_dir / "logs", finished)
    trials = search.trial_runs()
    best = next(((run, value) for run, value in trials if value is not None), None)
    report([run for run, _ in trials], args.sweep_dir, [], title)
    if best is not None:
        print(f"sweep: best trial {best[0].name}: {args.metric} {best[1]:.6g}", file=sys.stderr)
    return _failures(failed)


def sweep_population(
    experiment: str,
    module: types.ModuleType,
    runs: Sequence[Run],
    configs: Sequence[RunConfig],
    sweep_dir: Path,
    metric: str,
    title: str,
) -> int:
    """Train the grid as one vmapped population (`_vmapped`) unless every run finished before; write the
    runs that did not; report them all."""
    progress = Progress(len(runs), metric)
    pending = []
    for run, config in zip(runs, configs, strict=True):
        if finished_before(run, config):
            progress(Outcome(run, 0, 0.0, "", skipped=True))
        else:
            pending.append((run, config))
    if pending:
        try:
            devices = devices_of(configs[0])  # --devices: simulated on the CPU before JAX starts; here, where it trains
            setup_devices(devices, configs[0].training.batch_size)
            use_compilation_cache(devices.compilation_cache)
            trained, seconds = sweep_vmapped(
                experiment, module, runs, configs, sweep_dir, write={run.name for run, _ in pending}
            )
        except Preempted as e:
            print(f"sweep: {e}", file=sys.stderr)
            return e.status
        except ResearchInputError as e:
            raise UsageError(str(e)) from None
        for run in trained:
            progress(Outcome(run, 0, seconds, "", skipped=False), together=True)
    report(runs, sweep_dir, ["seed"] if len({dict(r.values).get("seed") for r in runs}) > 1 else [], title)
    return 0


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the sweep like Ctrl-C does: its runs are stopped too (resume them by rerunning).
    Both are held while a run is being started (`_pool.INTERRUPTS`), so none escapes the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, INTERRUPTS) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def default_sweep_dir(experiment: str, search: str, keys: Sequence[str]) -> Path:
    """Where a sweep's runs go without --sweep-dir: `runs/EXPERIMENT/SEARCH-KEY-KEY`."""
    return RUNS_ROOT / experiment / f"{search}-{'-'.join(keys)}"


def sweep(args: Any) -> int:
    """Check every run, then run the sweep `args` (see `main`); returns the exit status."""
    module, script = _experiment(args.experiment)
    fields = sweepable_fields(module.Config)
    axes = [parse_axis(text, fields, Path(args.experiment).stem) for text in args.axes]
    if len({axis.key for axis in axes}) < len(axes):
        raise UsageError("a key is given twice")
    check_passed_flags(args.flags, axes)
    args.sweep_dir = Path(args.sweep_dir or default_sweep_dir(args.experiment, args.search, [a.key for a in axes]))
    headline = headline_of(module.Config)  # the experiment's own number, unless --metric names another
    args.metric = args.metric or headline.summary_key
    if args.direction is None:
        own = args.metric == headline.summary_key
        goal = headline.goal if own else ("max" if "accuracy" in args.metric else "min")
        args.direction = "maximize" if goal == "max" else "minimize"
    title = f"{args.experiment} sweep over {', '.join(a.key for a in axes)}"
    if "group" in fields and not any(word.split("=")[0] == "--group" for word in args.flags):
        args.flags = [*args.flags, "--group", args.sweep_dir.name]  # its runs, one group in the trackers

    def make(values: dict[str, str], prefix: str = "") -> Run:
        return _make_run(script, args.sweep_dir, args.flags, axes, values, prefix)

    if args.vmapped and args.search != "grid":
        raise UsageError("--vmapped trains a grid's runs as one population; drop --search")
    if args.executor != "processes" and args.search != "grid":
        raise UsageError(
            f"--executor {args.executor} takes a grid (or --vmapped); a search runs its trials as "
            "processes here, each asking Optuna for the next"
        )
    if args.no_wait and args.executor != "slurm":
        raise UsageError(
            "--no-wait needs jobs that outlive the sweep: --executor slurm (submitit's local jobs are "
            "this process's children)"
        )
    if args.search != "grid":
        install.require_extra(f"--search {args.search}", "optuna")
    if args.executor != "processes":
        install.require_extra(f"--executor {args.executor}", "submitit")
    if args.search == "grid":
        runs = grid_runs(make, axes)
        configs = [_check(module.Config, run) for run in runs]
        if args.vmapped:
            check_vmappable(module.Config, [axis.key for axis in axes], configs[0])
        if args.dry_run:
            print("\n".join(_shown(run, args.experiment) for run in runs))
            if args.vmapped:
                print(f"(as one vmapped population of {len(runs)} members, in this process)")
            if args.executor != "processes":
                print(f"(as {1 if args.vmapped else len(runs)} job(s) of --executor {args.executor})")
            return 0
        if args.executor != "processes":
            return sweep_jobs(args, runs, configs, title)
        if args.vmapped:
            return sweep_population(args.experiment, module, runs, configs, args.sweep_dir, args.metric, title)
        with _sigterm_interrupts():
            return sweep_grid(runs, configs, args.sweep_dir, args.jobs, args.metric, title)
    _check_points(module.Config, make, axes)
    if args.dry_run:
        print(f"{args.search} search, {args.trials} trials over: " + " ".join(args.axes))
        return 0
    with _sigterm_interrupts():
        return sweep_search(args, axes, lambda n, values: make(values, prefix=f"trial={n:03d},"), title)


def _shown(run: Run, experiment: str) -> str:
    return shlex.join([*install.command("run").split(), experiment, *run.command[2:]])


def _parser() -> Parser:
    parser = Parser(
        prog="sweep",
        usage=f"{install.command('sweep')} EXPERIMENT KEY=VALUES... [options] [-- flags for every run]",
        description="Run an experiment over a grid of option values, or a random or TPE search "
        "(Optuna), as processes; rerun the same command to resume it.",
    )
    parser.add_argument("experiment", metavar="EXPERIMENT", help="experiments/EXPERIMENT.py (or a script path)")
    parser.add_argument(
        "axes",
        nargs="+",
        metavar="KEY=VALUES",
        help="an option of the experiment's config and its values: lr=0.1,0.3 (a list: a grid's "
        "values, a search's choices) or lr=1e-3:1e-1:log, hidden=4:32 (a range, for a search)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each a process (default: 1)")
    parser.add_argument(
        "--sweep-dir",
        default=None,
        help="where the runs go, one directory each named KEY=VALUE,... (default: runs/EXPERIMENT/SEARCH-KEYS)",
    )
    parser.add_argument(
        "--search",
        choices=SEARCHES,
        default="grid",
        help="grid: every combination of the lists; random, tpe: Optuna's samplers over the "
        "lists and ranges, the study in SWEEP_DIR/study.db (default: grid)",
    )
    parser.add_argument(
        "--trials", type=int, default=10, help="random, tpe: finished trials the study should hold (default: 10)"
    )
    parser.add_argument(
        "--metric",
        default=None,
        help="the summary.json number to report and, in a search, to optimise (default: the experiment's "
        "headline, test_accuracy for a classifier, test_fid for gan and diffusion)",
    )
    parser.add_argument(
        "--direction",
        choices=("maximize", "minimize"),
        default=None,
        help="of the search (default: the headline's direction; another metric: maximize one named *accuracy*, "
        "else minimize)",
    )
    parser.add_argument("--search-seed", type=int, default=0, help="seed of the search's sampler (default: 0)")
    parser.add_argument(
        "--vmapped",
        action="store_true",
        help="train the grid as ONE vmapped population in this process (one compiled program; the "
        "swept options must be vmappable: the seed, hyperparameters kept in the optimizer's "
        "state), then write each run's directory as its own run would",
    )
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="processes",
        help="processes: each run a process here, --jobs at a time (the default); slurm: each run a "
        "SLURM job (submitit), --jobs at a time; submitit-local: the same jobs on this machine",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="slurm: return once the jobs are submitted; the same sweep run again collects them "
        "(waits for those still queued or running) and prints the table",
    )
    parser.add_argument("--slurm-partition", default=None, help="slurm: the partition (default: the cluster's)")
    parser.add_argument(
        "--slurm-time",
        type=int,
        default=60,
        help="slurm, submitit-local: minutes a job may run before it is stopped at a checkpoint and "
        "requeued (default: 60)",
    )
    parser.add_argument("--slurm-gpus", type=int, default=0, help="slurm: GPUs a job (default: 0)")
    parser.add_argument("--slurm-cpus", type=int, default=2, help="slurm: CPUs a job (default: 2)")
    parser.add_argument(
        "--slurm-mem", type=int, default=None, help="slurm: memory a job, in GB (default: the cluster's)"
    )
    parser.add_argument(
        "--slurm-extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="slurm: another sbatch option, say --slurm-extra account=myproject (repeatable)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every run and print the grid's commands (a search's space); start nothing",
    )
    return parser


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = _parser()
    args = parser.parse_intermixed_args(own)
    args.flags = flags
    if args.jobs < 1 or args.trials < 1 or args.slurm_time < 1:
        parser.error("--jobs, --trials and --slurm-time must be positive")
    if any("=" not in word for word in args.slurm_extra):
        parser.error("--slurm-extra takes KEY=VALUE (say account=myproject)")
    try:
        status = sweep(args)
    except (UsageError, ResearchInputError) as e:  # ResearchInputError: an extra that is not installed
        fail(parser.prog, e)
    except KeyboardInterrupt:
        print("sweep: interrupted; its runs were stopped: rerun the same command to resume", file=sys.stderr)
        status = 130
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
