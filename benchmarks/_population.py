"""Case (f): populations in one program (issue 16). K runs that differ in seed and learning rate,
trained one after another as `scripts/run` trains each (run directory, evaluation, checkpoint, plot;
a compilation per run, since each learning rate is another optimizer), against the same K runs as
ONE vmapped population (`scripts/sweep --vmapped`: one compilation, then the K run directories
written out, batched: checkpoints in the background, plots by a `research.curves.CurvePool` worker
started with the sweep). Both times include writing every run directory. Both run in this process:
a sweep of processes pays each run's start-up on top (about 3 s here: importing JAX, loading the
data)."""

import contextlib
import io
import itertools
import tempfile
from pathlib import Path

from research.experiment import load_experiment
from research.tools._pool import Run
from research.tools._vmapped import sweep_vmapped

from ._timing import interleave, timed

# name: (experiment, swept values, fixed options)
GRIDS = {
    "XOR, K=16 (100 epochs, 1,900 steps)": ("xor", {"lr": [0.03, 0.1, 0.3, 1.0], "seed": [0, 1, 2, 3]}, {}),
    "MNIST-1D MLP, K=8 (4,000 steps)": (
        "mnist1d",
        {"lr": [3e-3, 1e-2], "seed": [0, 1, 2, 3]},
        {"model": "mlp", "steps": 4000, "data_dir": "data"},
    ),
}
QUICK = {"xor": {"epochs": 2}, "mnist1d": {"steps": 200}}  # and two values an axis


def _runs(module, grid: dict, fixed: dict, root: Path) -> tuple[list[Run], list]:
    runs, configs = [], []
    for values in itertools.product(*grid.values()):
        swept = dict(zip(grid, values, strict=True))
        name = ",".join(f"{k}={v}" for k, v in swept.items())
        config = module.Config.from_options(**fixed, **swept, run_dir=str(root / name), progress=False)
        runs.append(Run(name, tuple((k, str(v)) for k, v in swept.items()), root / name, ()))
        configs.append(config)
    return runs, configs


def _candidates(experiment: str, grid: dict, fixed: dict, scratch: Path) -> dict:
    module = load_experiment(experiment)
    count = itertools.count()

    def sequential():
        _, configs = _runs(module, grid, fixed, scratch / f"sequential{next(count)}")
        for config in configs:
            module.main(config)

    def vmapped():
        root = scratch / f"vmapped{next(count)}"
        runs, configs = _runs(module, grid, fixed, root)
        sweep_vmapped(experiment, module, runs, configs, root)

    def quietly(fn):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return timed(fn)

    return {"K runs one after another": lambda: quietly(sequential), "one vmapped population": lambda: quietly(vmapped)}


def run(quick: bool) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, (experiment, grid, fixed) in list(GRIDS.items())[: 1 if quick else None]:
            if quick:
                fixed, grid = {**fixed, **QUICK[experiment]}, {k: v[:2] for k, v in grid.items()}
            candidates = _candidates(experiment, grid, fixed, Path(scratch))
            for candidate in candidates.values():
                # Warm, as interleave expects and the report says of every case: the first call of each pays
                # this process's first-time costs (importing Orbax and matplotlib, compiling the evaluation),
                # which would land on whichever candidate the first round starts with.
                candidate()
            timings = interleave(candidates, 1 if quick else 2)
            results[name] = list(timings.values())
    return {"grids": results}
