"""`scripts/sweep ... --vmapped`: the runs of a grid that differ only in vmappable options (the seed,
hyperparameters the optimizer keeps in its state) trained as ONE vmapped population through the
engine, in this process, then written out as the run directories separate runs would have left.

The population itself is a run too, `SWEEP_DIR/population-<hash of its members>/` (its checkpoints,
its metrics with one value per member): a killed sweep resumes it. Each member's directory gets its
config.json, its own metrics.jsonl and summary.json (the member's values taken out of the
population's), a checkpoint of its final state and curves.png, so `load_run`, `compare_runs`,
`--resume auto` and a later sweep without `--vmapped` treat it as the finished run it equals.

Writing K run directories costs more than training K small members (`scripts/bench` case (f)), so
it is batched: config.json's provenance is worked out once, the checkpoints are written one after
another in the background, and the plots are drawn by a `research.curves.CurvePool` (worker
processes started with the sweep, and this process once it has queued everything else); each
summary.json, which marks a run finished, comes last, once everything else is on disk.

With `--devices N` the population trains on N devices, its members (or, when N does not divide
them, each batch) split over them (`research.parallel.population_placement`).
"""

import functools
import hashlib
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from ..config import RunConfig, devices_of, ema_of, tracking_of, vmappable_options
from ..curves import CurvePool, plot_processes
from ..data import DeviceLoader
from ..errors import CheckpointError
from ..experiment import RUNS_ROOT, Setup, config_record, initial_state, run_experiment
from ..population import evaluate_members, member, stack_members
from ..services import CheckpointWriter, RunDir, load_checkpoint
from ..tracking import track_finished_run, trackers_of
from ._pool import Run
from ._runs import UsageError


def check_vmappable(config_class: type, keys: Sequence[str], config: RunConfig) -> None:
    """Refuse, before any work, a grid one program cannot train: a swept option that changes more than
    array values, several processes, or a placement other than one device or a mesh of them."""
    allowed = vmappable_options(config_class)
    fixed = [key for key in keys if key not in allowed]
    if fixed:
        raise UsageError(
            f"--vmapped: {', '.join(fixed)} cannot vary inside one program (this experiment's "
            f"vmappable options: {', '.join(sorted(allowed)) or 'none'}); sweep it without --vmapped"
        )
    devices = devices_of(config)
    if devices.num_processes not in (None, 1):
        raise UsageError(
            "--vmapped trains its population in one process; drop the multi-process options (or sweep "
            "without --vmapped)"
        )
    parallel = devices.parallel
    if devices.devices > 1 and parallel not in ("auto", "sharded"):
        raise UsageError(
            f"--vmapped splits its population's members (or its batches) over --devices with --parallel auto "
            f"or sharded, not {parallel}"
        )
    if config.training.early_stopping:
        raise UsageError(
            "--vmapped trains its members for the same steps, and --early-stopping would end them at different "
            "ones; sweep without --vmapped"
        )
    if config.to_dict().get("loader", "device") != "device":  # an option of the experiment's own, if it has one
        raise UsageError("--vmapped gathers each member's batches on the device: use --loader device")


def member_values(values: dict[str, Any], k: int) -> dict[str, Any]:
    """Member `k`'s numbers out of a population's record or summary: `test/member_loss[k]` becomes
    `test/loss`, `train_member_loss[k]` `train_loss`; the members' means and the ensemble's are dropped."""
    own = {key.replace("member_", ""): value[k] for key, value in values.items() if "member_" in key}
    shared = {
        key: value
        for key, value in values.items()
        if key not in own and "member_" not in key and "ensemble_" not in key and key != "members"
    }
    return {**shared, **own}


def _population_setup(experiment: str, configs: Sequence[RunConfig], setups: Sequence[Setup]) -> Setup:
    first = setups[0]
    loaders = [setup.train_data for setup in setups if isinstance(setup.train_data, DeviceLoader)]
    if len(loaders) != len(setups):
        raise UsageError(
            f"--vmapped: {experiment} does not train from a DeviceLoader with these options (it reads its batches "
            "on the host: a token file, a torch or Grain loader); sweep without --vmapped"
        )
    if any(setup.population for setup in setups):
        raise UsageError(f"--vmapped: {experiment} is a population already; sweep it without --vmapped")
    if any(setup.hooks for setup in setups):
        raise UsageError(
            f"--vmapped: {experiment}'s own hooks act on one state, not a population; sweep it without --vmapped"
        )
    if len({setup.num_steps for setup in setups}) > 1 or any(s.step != first.step for s in setups):
        raise UsageError("--vmapped: the members train for different numbers of steps or with different losses")
    return Setup(
        # Built once: the population's run and then the skeleton its checkpoint is read into (K members' builds).
        build_state=functools.cache(
            lambda: stack_members([initial_state(s, ema_of(c)) for s, c in zip(setups, configs, strict=True)])
        ),
        train_data=DeviceLoader.for_members(loaders),
        eval_data=first.eval_data,
        val_data=first.val_data,
        num_steps=first.num_steps,
        eval_at=first.eval_at,
        step=first.step,
        population=True,
        evaluator=None if first.evaluator is None else evaluate_members(first.evaluator),
    )


def _write_members(
    experiment: str,
    members: Sequence[tuple[int, Run, RunConfig, Setup]],
    state: Any,
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    curves: CurvePool,
) -> None:
    """Write the run directories of `members` (`(k, run, config, setup)`), batched: first what every
    member's directory holds but its summary (config.json, metrics.jsonl, a checkpoint written in the
    background, curves.png drawn by `curves`), then, once all of that is on disk, each summary.json,
    which says the run finished."""
    # The members differ only in vmappable options, which show only in "config": the rest of config.json
    # (parameter counts, machine, versions, git state) is member 0's, worked out once.
    shared = config_record(experiment, members[0][2], members[0][3], member(state, members[0][0]))
    writer, step = CheckpointWriter(), int(summary["step"])
    try:
        for k, run, config, setup in members:
            out = RunDir(run.path).create()
            out.write_config({**shared, "config": config.to_dict(), "vmapped": summary["population"]})
            out.metrics_file.write_text("")
            own = [member_values(record, k) for record in records]
            for record in own:
                out.log(record)
            evaluated = {key: value for key, value in own[-1].items() if key.startswith(("test/", "val/"))}
            header = {"experiment": experiment, "config": config.to_dict(), "step": step, "eval": evaluated}
            writer.save(out.checkpoint_path(step), member(state, k), header)  # written while the others go on
            curves.draw([(own, run.name)], out.path / "curves.png", title=f"{experiment} {run.name} (vmapped)")
            if setup.draw is not None:  # the experiment's pictures of this member, as its own run draws them
                setup.draw(member(state, k), out.path)
        curves.close()  # every plot drawn (the workers' leftovers here, while the last checkpoint is written)
        writer.wait()
    finally:
        writer.close()
    for k, run, config, setup in members:
        _finish_member(experiment, RunDir(run.path), config, setup, summary, k)


def _finish_member(
    experiment: str, out: RunDir, config: RunConfig, setup: Setup, summary: dict[str, Any], k: int
) -> None:
    """Member `k`'s summary.json (the experiment's own numbers added, as a run alone gets them), and its
    tracked run."""
    own_summary = {key: value for key, value in member_values(summary, k).items() if key != "population"}
    if setup.summarize_run is not None:  # the experiment's numbers from the member's records, as alone
        own_summary.update(setup.summarize_run(out, own_summary) or {})
    out.write_summary(own_summary)
    if len(trackers_of(tracking_of(config))) > 1:  # one tracked run a member, as its own run would have been
        saved = out.read_config()
        out.write_config({**saved, "trackers": track_finished_run(experiment, config, out, runs_root=RUNS_ROOT)})


def sweep_vmapped(
    experiment: str,
    module: Any,
    runs: Sequence[Run],
    configs: Sequence[RunConfig],
    sweep_dir: Path,
    write: Collection[str] | None = None,
) -> tuple[list[Run], float]:
    """Train `runs` (their `configs`) as one population and write the run directories of those named in
    `write` (default: all); returns the runs written and the seconds it took. The population is always
    the whole grid, so a sweep stopped while it wrote its members resumes the same population (already
    trained: nothing to train) and writes the rest. Raises `Preempted` when a signal stopped the
    training (rerun the sweep: the population resumes from its last checkpoint)."""
    setups = [module.setup(config) for config in configs]
    population = _population_setup(experiment, configs, setups)
    chosen = [
        (k, run, config, setup)
        for k, (run, config, setup) in enumerate(zip(runs, configs, setups, strict=True))
        if write is None or run.name in write
    ]
    start = time.perf_counter()
    # The plots (the population's, then its members') are drawn by processes started now, ready once it has trained.
    with CurvePool(plot_processes(len(chosen))) as curves:
        state, records, summary = _train_population(experiment, runs, configs[0], population, sweep_dir, curves)
        if chosen:
            _write_members(experiment, chosen, state, records, summary, curves)
    return [run for _, run, _, _ in chosen], time.perf_counter() - start


def _train_population(
    experiment: str, runs: Sequence[Run], config: RunConfig, population: Setup, sweep_dir: Path, curves: CurvePool
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """Train (or resume, or find finished) the population run `SWEEP_DIR/population-<hash>`, its curves.png
    drawn by `curves`; returns its trained state, its records and its summary."""
    names = "\n".join(run.name for run in runs)
    path = sweep_dir / f"population-{hashlib.sha1(names.encode()).hexdigest()[:8]}"
    # The members are tracked as their runs (`_finish_member`), the population itself only in its metrics.jsonl.
    population_config = config.replace(
        run_dir=str(path), resume="auto", progress=True, tracker="jsonl", tensorboard=False
    )
    print(f"sweep: training {len(runs)} runs as one vmapped population in {path}", file=sys.stderr, flush=True)
    members = {"members": names.split("\n")}
    summary = run_experiment(experiment, population_config, population, summary_extra=members, curves=curves)
    summary["population"] = path.name
    population_run = RunDir(path)
    checkpoint, _ = population_run.latest_valid_checkpoint()
    if checkpoint is None:
        raise CheckpointError(
            f"{path}: the population left no valid checkpoint to write its members from; rerun the sweep"
        )
    state, _ = load_checkpoint(checkpoint, initial_state(population, ema_of(population_config)))
    return state, population_run.read_metrics(), summary
