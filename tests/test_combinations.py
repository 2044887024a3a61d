"""Every training experiment under every combination of the options that should not break it.

Each combination of the grid below is one short invocation of the experiment script's entry point.
It must do what the grid's table (REFUSALS, printed as docs/combinations.md) says: finish (exit 0), or
refuse in one line naming the reason the table gives (exit 2, exactly one line on stderr, no checkpoint
written); never a traceback, never a hang. Resuming a finished run (`--resume auto`, as a
requeued job does) prints its summary and touches none of its files. A run that finishes with `--ema-decay` must
report the model without the EMA too (test_raw_*); one that finishes on 4 devices must have compiled
its computations for 4 devices and give the final train loss and test metrics of the same run on 1
device: to float rounding, and to the bit with `--deterministic-reduction`. Where the product of
placements, EMAs and loaders grows, the 4-device placements run a pairwise cover of it across the
experiments (`pairwise`), and each of them resumes every other experiment (`resumes_on`).

The runs happen in subprocesses of `tests/_combination_worker.py`, which runs many of them in one
process (imports and compilations are shared): one worker with 1 device, one with 4 simulated devices
(XLA_FLAGS must be set before JAX starts). A run that hangs or kills its worker is reported as such,
and a new worker carries on with the runs after it. Each combination is a test of its own, named
`experiment-placement-ema-loader-phase`.
"""

import concurrent.futures
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _image_formats import native_digits
from test_tracking import assert_same_history, jsonl_history, mlflow_history, tensorboard_history, wandb_history

from research.services import RunDir, read_wandb_runs

# -- the grid ------------------------------------------------------------------------------------------
# Flags and spellings change as the CLI evolves: everything the runs pass is in this block.


@dataclasses.dataclass(frozen=True)
class Experiment:
    short: tuple[str, ...]  # the cheapest real run: a handful of steps on tiny data
    longer: tuple[str, ...]  # the same run made longer, which `--resume` continues the short one to
    has_loader: bool = False  # takes --loader {device,torch}
    data_dir: bool = False  # reads MNIST-1D from --data-dir (tests/conftest.py's generated directory)
    images: bool = False  # reads --data: a .npz of 256 + 64 of scikit-learn's digits (tests/_image_formats.py)
    digits8: bool = False  # reads --data: the same digits 8x8 grey, as scikit-learn ships them
    init_from: str | None = None  # starts from one of PRETRAINED's checkpoints (--init-from; made by transformers)
    tokens: bool = False  # reads --tokens: a token file as nanoGPT's train.bin (uint16), 20,000 tokens below 64
    ema_everywhere: bool = True  # else --ema-decay on the first placement only (each placement compiles anew)
    emas: tuple[str, ...] | None = None  # the EMAS variants it runs on every placement; None: all
    tracked: bool = True  # runs once more with every tracker (the trackers do not depend on the step)
    script: str | None = None  # experiments/<script>.py; None: the name in EXPERIMENTS
    phases: tuple[str, ...] | None = None  # the PHASES it runs; None: all
    pairwise: bool = True  # False: every EMA on every placement (one variant is refused: a second a run)
    timeout: float = 90  # seconds for one run (a short run takes a few, a loaded machine 45+); then a hang
    requires: str | None = None  # a module of an extra it needs (its runs are skipped, saying so, where it is missing)


GENERATIVE = ("--features", "4", "--batch-size", "16", "--steps-per-call", "2", "--log-every", "2", "--eval-every", "2")
METALEARN_MEMBERS = ("--start-lrs", "1.5", "0.15", "0.5", "1.0")
LM = tuple(
    "--dim 16 --depth 1 --heads 2 --context 16 --batch-size 8 --steps-per-call 2 --log-every 2 --eval-every 2 "
    "--text-bytes 20000".split()
)
LM_TOKENS = tuple(
    "--dim 16 --depth 1 --heads 2 --context 16 --batch-size 8 --log-every 2 --eval-every 2 --vocab 64 "
    "--eval-windows 8".split()
)
CONTRASTIVE = tuple(
    "--features 4 --blocks 1 --projection 8 --batch-size 64 --steps-per-call 2 --log-every 2 --eval-every 2 "
    "--neighbours 5".split()
)
PPO = tuple(  # 8 environments (micro-batches and parts divide them), 16 steps each a rollout: 128 a step
    "--batch-size 8 --rollout-steps 16 --minibatches 2 --epochs 2 --eval-episodes 4 --steps-per-call 2 "
    "--log-every 2 --eval-every 2".split()
)
LOTTERY = tuple("--rounds 1 --schedule-length 2 --hidden 4 --steps 2 --steps-per-call 2 --log-every 2".split())
VIT = ("--batch-size", "64", "--optimizer", "adamw", "--lr", "0.01")
GPT2 = tuple(
    "--context 16 --batch-size 8 --steps-per-call 2 --log-every 2 --eval-every 2 --text-bytes 20000 "
    "--lora-rank 2".split()
)
# Tiny checkpoints that transformers saves (random weights, nothing downloaded), for --init-from: {name: config}
PRETRAINED = {
    # 32x32 RGB as the digits are, 4 patches a side; 5 classes, so the 10 digits get a new head (zeros)
    "vit": {
        "model_type": "vit",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "image_size": 32,
        "patch_size": 8,
        "num_labels": 5,
    },
    # byte-level: 256 tokens, read as bytes without a tokenizer.json
    "gpt2": {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 32, "vocab_size": 256},
}
EXPERIMENTS = {  # state_passing is no training run
    "xor": Experiment(
        ("--epochs", "1", "--train-size", "256", "--test-size", "64", "--batch-size", "32"),
        ("--epochs", "2", "--train-size", "256", "--test-size", "64", "--batch-size", "32"),
        has_loader=True,
    ),
    "circles": Experiment(  # 5 steps of 400 an epoch (4 micro-batches x 2 parts divide it)
        ("--epochs", "1", "--batch-size", "400", "--hidden", "8"),
        ("--epochs", "2", "--batch-size", "400", "--hidden", "8"),
    ),
    "mnist1d": Experiment(
        ("--model", "mlp", "--steps", "4", "--batch-size", "32"),
        ("--model", "mlp", "--steps", "8", "--batch-size", "32"),
        has_loader=True,
        data_dir=True,
    ),
    # 4 steps; the default --max-batch-size (expected + 4 std + 4) is rounded up to a multiple of the devices
    "dp_sgd": Experiment(
        ("--channels", "4", "--epochs", "1", "--batch-size", "1000"),
        ("--channels", "4", "--epochs", "2", "--batch-size", "1000"),
        data_dir=True,
    ),
    "dp_sgd_oddbatch": Experiment(  # 1113 rows, which 4 devices cannot share: refused before any work
        ("--channels", "4", "--epochs", "1", "--batch-size", "1000", "--max-batch-size", "1113"),
        ("--channels", "4", "--epochs", "2", "--batch-size", "1000", "--max-batch-size", "1113"),
        data_dir=True,
        script="dp_sgd",
        phases=("fresh",),
    ),
    # 24 training pairs a full batch (4 devices share it), evaluated every 2 steps for the grokking step; fresh
    # runs only: its transformer takes seconds to compile, and resume is the engine's, tested above
    "grokking": Experiment(
        (
            "--modulus",
            "7",
            "--train-fraction",
            "0.5",
            "--dim",
            "8",
            "--heads",
            "2",
            "--steps",
            "4",
            "--steps-per-call",
            "2",
            "--eval-every",
            "2",
            "--log-every",
            "2",
        ),
        (
            "--modulus",
            "7",
            "--train-fraction",
            "0.5",
            "--dim",
            "8",
            "--heads",
            "2",
            "--steps",
            "8",
            "--steps-per-call",
            "2",
            "--eval-every",
            "2",
            "--log-every",
            "2",
        ),
        phases=("fresh",),
    ),
    # one width (the whole curve is a sweep of processes), on the published 4,000 / 1,000 signals: 4 steps
    "double_descent": Experiment(
        ("--width", "8", "--epochs", "1", "--batch-size", "1000", "--num-samples", "5000", "--train-split", "0.8"),
        ("--width", "8", "--epochs", "2", "--batch-size", "1000", "--num-samples", "5000", "--train-split", "0.8"),
        data_dir=True,
    ),
    # a ResNet of 4, 8, 16 channels on 32x32 digits, 4 steps of 64 an epoch (a small rate: BatchNorm amplifies
    # the rounding that differs between 1 and 4 devices). Its compilations take seconds: no requeue phase, and
    # the EMA on one device (it is the same hook everywhere: the other experiments cover it on every placement)
    "images": Experiment(
        ("--epochs", "1", "--features", "4", "--blocks", "1", "--batch-size", "64", "--lr", "0.01"),
        ("--epochs", "2", "--features", "4", "--blocks", "1", "--batch-size", "64", "--lr", "0.01"),
        images=True,
        phases=("fresh", "resumed"),
        ema_everywhere=False,
        timeout=120,  # compiling the ResNet's train and evaluation steps beside the 4-device worker took > 45 s
    ),
    # the byte LM on the first 20 KB of the standard library's source (no file to make), training its norms alone
    # (--trainable: the rest keeps its bits, no optimizer state), then with LoRA adapters (fresh runs: the
    # adapters are the same step); --init-from is lm_gpt2's, below
    "lm": Experiment(
        ("--steps", "4", *LM, "--trainable", "norm"),
        ("--steps", "8", *LM, "--trainable", "norm"),
        tracked=False,
        timeout=90,
    ),
    "lm_lora": Experiment(
        ("--steps", "4", *LM, "--lora-rank", "2"),
        ("--steps", "8", *LM, "--lora-rank", "2"),
        script="lm",
        phases=("fresh",),
        timeout=90,
    ),
    # the LM on a token file, memory-mapped, random windows a step read on the host (one compiled call a step), on
    # every placement with and without the EMA (pairwise), fresh and resumed; tests/test_tokens.py has the rest
    # (its refusals, --vmapped refused, a file larger than the memory limit)
    "lm_tokens": Experiment(
        ("--steps", "4", *LM_TOKENS),
        ("--steps", "8", *LM_TOKENS),
        tokens=True,
        script="lm",
        phases=("fresh", "resumed"),
        tracked=False,
        timeout=90,
    ),
    "ensemble": Experiment(
        ("--num-members", "2", "--hidden", "8", "--epochs", "1", "--batch-size", "1000"),
        ("--num-members", "2", "--hidden", "8", "--epochs", "2", "--batch-size", "1000"),
        data_dir=True,
    ),
    # two networks, two optimizers: two discriminator updates (on every other row of the batch: the same rows on
    # every placement) and a generator update a step; evaluated by the discriminator's loss on the test images (the
    # fid is tests/test_generative.py's). Each compiles for seconds: on every placement the variant that must match
    # one device to the bit (--deterministic-reduction, with the EMA), in every phase; no tracked runs
    "gan": Experiment(
        ("--steps", "2", *GENERATIVE, "--latent", "8", "--critic-steps", "2"),
        ("--steps", "4", *GENERATIVE, "--latent", "8", "--critic-steps", "2"),
        digits8=True,
        emas=("ema-det",),
        tracked=False,
        timeout=120,  # its first run compiles both networks' updates beside the other worker
    ),
    # the supervised step over images alone, its EMA on by default, evaluated by its test loss; as gan
    "diffusion": Experiment(
        ("--steps", "2", *GENERATIVE, "--levels", "1", "--diffusion-steps", "10", "--sample-steps", "2"),
        ("--steps", "4", *GENERATIVE, "--levels", "1", "--diffusion-steps", "10", "--sample-steps", "2"),
        digits8=True,
        emas=("ema-det",),
        tracked=False,
        timeout=120,
    ),
    # SimCLR: NT-Xent over the two views of every image of the GLOBAL batch (no mean of per-example terms: the
    # embeddings gathered from every device, micro-batch and part), evaluated by a linear probe and k-NN on the
    # frozen encoder; as gan, on every placement the variant that must match one device to the bit
    "contrastive": Experiment(
        ("--epochs", "1", *CONTRASTIVE),
        ("--epochs", "2", *CONTRASTIVE),
        digits8=True,
        emas=("ema-det",),
        tracked=False,  # its runs compile for tens of seconds; the trackers do not depend on the step
        timeout=120,
    ),
    # four members (one unrolled run each) spread over sharded4's mesh; pmap and --deterministic-reduction (no rows
    # to split) refused
    "metalearn_lr": Experiment(
        ("--steps", "2", "--inner-steps", "3", "--hidden", "4", "--num-samples", "5000", *METALEARN_MEMBERS),
        ("--steps", "3", "--inner-steps", "3", "--hidden", "4", "--num-samples", "5000", *METALEARN_MEMBERS),
        data_dir=True,
        pairwise=False,
    ),  # 5,000 signals: the data set tests/conftest.py generated
    # one engine run of 4 phases (the dense round, a pruning round, the two controls), 2 steps each, logged and
    # evaluated at each phase's end; its length is fixed by --rounds and --steps (no longer run to resume it to).
    # No --ema-decay (an average across rewinds means nothing): refused
    "lottery_ticket": Experiment(
        LOTTERY,
        LOTTERY,
        data_dir=True,
        phases=("fresh", "resumed-finished"),
        pairwise=False,
    ),
    # a step that makes its own data: each device steps its share of the environments, which live in the train
    # state (a resume continues their episodes); 4 steps, then 8
    "ppo": Experiment(("--env-steps", "512", *PPO), ("--env-steps", "1024", *PPO), requires="gymnax", timeout=90),
    # a transformers ViT fine-tuned on the digits: its (new) head alone, fresh and resumed (the resumed run reads the
    # checkpoint again); then through LoRA adapters on its blocks, the new head training beside them (fresh runs)
    "images_vit": Experiment(
        ("--epochs", "1", *VIT, "--trainable", "head"),
        ("--epochs", "2", *VIT, "--trainable", "head"),
        images=True,
        init_from="vit",
        script="images",
        phases=("fresh", "resumed"),
        timeout=90,
        requires="transformers",
    ),
    "images_vit_lora": Experiment(
        ("--epochs", "1", *VIT, "--lora-rank", "2"),
        ("--epochs", "2", *VIT, "--lora-rank", "2"),
        images=True,
        init_from="vit",
        script="images",
        phases=("fresh",),
        timeout=90,
        requires="transformers",
    ),
    # a transformers GPT-2 (bytes as its tokens) fine-tuned through LoRA on the standard library's first 20 KB
    "lm_gpt2": Experiment(
        ("--steps", "4", *GPT2),
        ("--steps", "8", *GPT2),
        init_from="gpt2",
        script="lm",
        phases=("fresh", "resumed"),
        timeout=90,
        requires="transformers",
    ),
}
PLACEMENTS = {  # the first is the reference the others must match
    "1dev": (),
    "pmap4": ("--devices", "4", "--parallel", "pmap"),
    "sharded4": ("--devices", "4", "--parallel", "sharded"),
}
# The second variant also trains with --deterministic-reduction (4 micro-batches: the 4 devices divide them, and
# they divide every batch of the grid) and --grad-accum 2 (each micro-batch in 2 parts), compared with the same
# variant on one device to the bit: every experiment meets both flags on every placement without doubling the grid.
EMAS = {
    "noema": (),
    "ema-det": ("--ema-decay", "0.9", "--deterministic-reduction", "--micro-batches", "4", "--grad-accum", "2"),
}
# Every experiment once more with every tracker and a profile of step 2, fresh and resumed: each tracker must
# hold metrics.jsonl's records (checked in `tracker_problems`). On one device: trackers run on process 0's host
# whatever the placement (tests/test_parallel.py tracks a 2-process run), and the 4-device worker is the longer.
TRACKERS = {"untracked": (), "tracked": ("--tracker", "tensorboard,wandb,mlflow", "--profile-steps", "1:2")}
TRACKED_PHASES = ("fresh", "resumed")
LOADERS = {"device": (), "torch": ("--loader", "torch")}  # only for experiments with --loader
# Invocations in one run directory, in this order: the short run, `--resume` continuing it to the
# longer run, `--resume auto` of that finished run (a requeued job: it reports the run and exits 0).
PHASES = {
    "fresh": lambda e: e.short,
    "resumed": lambda e: ("--resume", *e.longer),
    "resumed-finished": lambda e: ("--resume", "auto", *e.longer),
}
COMMON = ("--no-progress",)
EMA_KEYS = re.compile(r"test_raw_")  # with an EMA the summary also reports the raw (non-EMA) model
COMPARED = re.compile(r"^(train|test|ensemble|member)")  # summary numbers that must match across placements
TOLERANCE = 1e-5  # tests/test_parallel.py's
# The 1-device and the 4-device worker side by side: ~20% sooner on 2 cores when the grid runs alone; one
# at a time under scripts/test's pytest-xdist workers, where another test file already keeps a core busy.
WORKERS_AT_ONCE = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@dataclasses.dataclass(frozen=True)
class Refuses:
    """The runs of `experiment` that must refuse, in one line on stderr containing `because`: those whose other
    given fields are these (None: any)."""

    experiment: str
    because: str
    placement: str | None = None
    ema: str | None = None
    loader: str | None = None
    phase: str | None = None

    def covers(self, combination: "Combination") -> bool:
        fields = ("experiment", "placement", "ema", "loader", "phase")
        return all(getattr(self, f) in (None, getattr(combination, f)) for f in fields)


# What the grid expects: every run trains (exit 0, its checks below) except these, which refuse before any work.
# docs/combinations.md prints the table they make (`python tests/test_combinations.py` writes it again).
REFUSALS = (
    # 1113 rows: four devices cannot share them, nor four micro-batches
    Refuses("dp_sgd_oddbatch", "which must divide the batch size", placement="1dev", ema="ema-det"),
    Refuses("dp_sgd_oddbatch", "cannot be split evenly over 4 devices", placement="pmap4"),
    Refuses("dp_sgd_oddbatch", "cannot be split evenly over 4 devices", placement="sharded4"),
    # an average of the weights across its rewinds would mean nothing: the option does not exist
    Refuses("lottery_ticket", "--ema-decay is not an option of lottery_ticket", ema="ema-det"),
    # a member's step is one unrolled run: no rows to split; its members are spread over a mesh's devices
    Refuses("metalearn_lr", "has no batch to split into micro-batches", ema="ema-det"),
    Refuses("metalearn_lr", "spreads its members over the devices of a mesh", placement="pmap4"),
)

# ------------------------------------------------------------------------------------------------------

WORKER = Path(__file__).parent / "_combination_worker.py"
# Each compiled program holds memory maps of its code, and a process may hold 65,530 of them (Linux's
# vm.max_map_count): a worker running ~100 runs ran out ("LLVM compilation error: Cannot allocate memory", then
# SIGSEGV), so a worker takes this many runs and the next one the rest.
RUNS_A_WORKER = 40


@dataclasses.dataclass(frozen=True)
class Combination:
    experiment: str
    placement: str
    ema: str
    loader: str
    phase: str
    tracker: str = "untracked"

    @property
    def id(self) -> str:
        return "-".join(self._parts())

    @property
    def run_name(self) -> str:  # the phases of one series share a run directory
        return "-".join(p for p in self._parts() if p != self.phase)

    def _parts(self) -> tuple[str, ...]:
        parts = dataclasses.astuple(self)
        return parts if self.tracker != "untracked" else parts[:-1]

    @property
    def devices(self) -> int:
        flags = PLACEMENTS[self.placement]
        return int(flags[flags.index("--devices") + 1]) if "--devices" in flags else 1

    def reference(self) -> "Combination":  # trackers change nothing trained
        return dataclasses.replace(self, placement=next(iter(PLACEMENTS)), tracker="untracked")

    @property
    def refusal(self) -> "Refuses | None":
        """The row of REFUSALS this run must refuse by; None: it must train."""
        return next((row for row in REFUSALS if row.covers(self)), None)

    @property
    def missing(self) -> str | None:
        """The module of an extra this run needs that is not installed."""
        requires = EXPERIMENTS[self.experiment].requires
        return requires if requires and importlib.util.find_spec(requires) is None else None

    @property
    def checks_trackers(self) -> bool:  # the last phase of a tracked series, whose run directory is complete
        phases = [p for p in EXPERIMENTS[self.experiment].phases or PHASES if p in TRACKED_PHASES]
        return self.tracker != "untracked" and self.phase == phases[-1]

    def argv(
        self, root: Path, data_dir: Path, images: Path, digits8: Path, pretrained: dict[str, Path], tokens: Path
    ) -> list[str]:
        experiment = EXPERIMENTS[self.experiment]
        return [
            *PHASES[self.phase](experiment),
            *PLACEMENTS[self.placement],
            *EMAS[self.ema],
            *LOADERS[self.loader],
            *TRACKERS[self.tracker],
            *(("--data-dir", str(data_dir)) if experiment.data_dir else ()),
            *(("--data", str(images)) if experiment.images else ()),
            *(("--data", str(digits8)) if experiment.digits8 else ()),
            *(("--init-from", str(pretrained[experiment.init_from])) if experiment.init_from else ()),
            *(("--tokens", str(tokens)) if experiment.tokens else ()),
            "--run-dir",
            str(root / "runs" / self.run_name),
            *COMMON,
        ]


def pairwise(name: str, placement: str, ema: str, loader: str) -> bool:
    """Whether a series belongs to the grid's pairwise cover of placement x EMA x loader: every series on the
    first placement (each later placement's reference); on each later one, one EMA variant and one loader an
    experiment, the pairing turned from one experiment to the next (the EMA with its index's parity, the
    loader with its half's), so that across the grid each placement meets each EMA and each loader, and each
    EMA each loader."""
    experiment, first = EXPERIMENTS[name], next(iter(PLACEMENTS))
    emas, later, turn = list(experiment.emas or EMAS), list(PLACEMENTS)[1:], list(EXPERIMENTS).index(name)
    if placement == first or len(emas) < 2 or not experiment.ema_everywhere or not experiment.pairwise:
        return True
    if (later.index(placement) + emas.index(ema) + turn) % len(emas):
        return False
    return not experiment.has_loader or (later.index(placement) + turn // 2) % len(LOADERS) == list(LOADERS).index(
        loader
    )


def resumes_on(name: str, placement: str) -> bool:
    """Whether the series of `name` on `placement` goes on past its fresh run: on the first placement, and on one
    later placement an experiment, turned from one experiment to the next (each later placement resumes about half
    the experiments; test_deterministic_reduction.py resumes runs across device counts)."""
    later = list(PLACEMENTS)[1:]
    return placement not in later or later.index(placement) == list(EXPERIMENTS).index(name) % len(later)


COMBINATIONS = [
    Combination(name, placement, ema, loader, phase)
    for name, experiment in EXPERIMENTS.items()
    for placement, ema, loader, phase in itertools.product(
        PLACEMENTS,
        experiment.emas or EMAS,
        LOADERS if experiment.has_loader else list(LOADERS)[:1],
        experiment.phases or PHASES,
    )
    if (experiment.ema_everywhere or ema == "noema" or placement == next(iter(PLACEMENTS)))
    and pairwise(name, placement, ema, loader)
    and (phase == "fresh" or resumes_on(name, placement))
] + [
    Combination(name, "1dev", "noema", "device", phase, "tracked")
    for name, experiment in EXPERIMENTS.items()
    if experiment.script is None and experiment.tracked
    for phase in experiment.phases or PHASES
    if phase in TRACKED_PHASES
]


def run_worker(runs: list[dict], devices: int, root: Path) -> dict[str, dict]:
    """Run `runs` in worker processes with `devices` simulated devices; a run that hangs past
    its experiment's `timeout`, or kills its worker, gets `{"status": "timeout" | "died", ...}` and a new worker
    carries on with the runs after it."""
    timeouts = {run["id"]: run["timeout"] for run in runs}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # A few steps a run: compiling is most of the grid's time, and LLVM's optimisation most of that. Every
    # number compared here comes from programs compiled alike (tests/test_deterministic_reduction.py checks the
    # bits of a default compilation).
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    results: dict[str, dict] = {}
    for attempt in itertools.count():
        remaining = [r for r in runs if r["id"] not in results][:RUNS_A_WORKER]
        if not remaining:
            return results
        spec, out, log = (root / f"worker{devices}-{attempt}.{ext}" for ext in ("json", "jsonl", "log"))
        spec.write_text(json.dumps(remaining))
        out.touch()
        with open(log, "w") as log_file:
            process = subprocess.Popen(
                [sys.executable, str(WORKER), str(spec), str(out)],
                cwd=root,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        current, started, offset, finished = None, time.monotonic(), 0, 0
        try:
            while True:
                exited = process.poll() is not None
                with open(out) as f:
                    f.seek(offset)
                    text = f.read()
                lines = text.splitlines(keepends=True)
                for line in lines:
                    if not line.endswith("\n"):
                        break
                    offset += len(line)
                    record = json.loads(line)
                    if record["event"] == "start":
                        current, started = record["id"], time.monotonic()
                    else:
                        results[record["id"]], current, finished = record, None, finished + 1
                if exited:
                    break
                limit = timeouts[current] if current is not None else 60 + max(timeouts.values())  # + start-up
                if time.monotonic() - started > limit:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    results[current or next(r["id"] for r in remaining if r["id"] not in results)] = {
                        "status": "timeout",
                        "log": _tail(log),
                        "seconds": time.monotonic() - started,
                    }
                    break
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if current is not None and current not in results:  # the worker died during this run
            code = process.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
            results[current] = {"status": "died", "how": how, "log": _tail(log)}
        elif process.returncode == 0 and finished < len(remaining):
            raise AssertionError(f"the worker exited without running every run; its output:\n{_tail(log)}")
        elif finished == 0 and current is None and remaining[0]["id"] not in results:
            raise AssertionError(f"the worker failed before its first run; its output:\n{_tail(log)}")
    raise AssertionError("unreachable")


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    """PRETRAINED's checkpoints, each saved by transformers (`save_pretrained`) in a directory: {name: directory};
    none without transformers (the entries that read them require it)."""
    if importlib.util.find_spec("transformers") is None:
        return {}
    import torch
    import transformers

    root = tmp_path_factory.mktemp("pretrained")
    kinds = {"vit": transformers.ViTForImageClassification, "gpt2": transformers.GPT2LMHeadModel}
    for name, fields in PRETRAINED.items():
        torch.manual_seed(0)
        kinds[fields["model_type"]](transformers.AutoConfig.for_model(**fields)).save_pretrained(root / name)
    return {name: root / name for name in PRETRAINED}


@pytest.fixture(scope="session")
def combination_results(request, tmp_path_factory, mnist1d_dir, digits_formats, pretrained) -> dict[str, dict]:
    """The result of every combination this session selected (and the 1-device runs they compare with),
    run in one worker per device count."""
    selected = {
        item.callspec.params["combination"]
        for item in request.session.items
        if hasattr(item, "callspec") and "combination" in item.callspec.params
    }
    selected |= {c.reference() for c in selected}
    series = {c.run_name for c in selected}  # a resume needs the phases before it
    needed = [c for c in COMBINATIONS if c.run_name in series and not c.missing]
    root = tmp_path_factory.mktemp("combinations")
    digits = np.load(digits_formats["npz"])
    images = root / "digits-small.npz"
    np.savez(
        images,
        x_train=digits["x_train"][::5][:256],
        y_train=digits["y_train"][::5][:256],
        x_test=digits["x_test"][::5][:64],
        y_test=digits["y_test"][::5][:64],
    )
    train8, test8 = native_digits(256, 64)
    digits8 = root / "digits8-small.npz"
    np.savez(digits8, x_train=train8.inputs, y_train=train8.labels, x_test=test8.inputs, y_test=test8.labels)
    tokens = root / "train.bin"
    np.random.default_rng(0).integers(0, 64, 20_000).astype(np.uint16).tofile(tokens)

    def runs(devices: int) -> list[dict]:
        return [
            {
                "id": c.id,
                "script": EXPERIMENTS[c.experiment].script or c.experiment,
                "timeout": EXPERIMENTS[c.experiment].timeout,
                "argv": c.argv(root, mnist1d_dir, images, digits8, pretrained, tokens),
            }
            for c in needed
            if c.devices == devices
        ]

    with concurrent.futures.ThreadPoolExecutor(WORKERS_AT_ONCE) as pool:
        futures = [pool.submit(run_worker, runs(devices), devices, root) for devices in {c.devices for c in needed}]
        results = {k: v for f in futures for k, v in f.result().items()}
    (root / "results.json").write_text(json.dumps(results))  # every run's outcome, for whoever reads a failure
    return results


def problems(combination: Combination, results: dict[str, dict]) -> list[str]:
    """What is wrong with one combination's run, in one line each (nothing: it passed)."""
    result = results[combination.id]
    status = result["status"]
    if status == "timeout":
        return [f"hangs: no exit after {result['seconds']:.0f} s (killed)"]
    if status == "died":
        last = [line for line in result["log"].splitlines() if line.strip()][-1:] or ["(no output)"]
        return [f"kills the process ({result['how']}): {last[0][:200]}"]
    stderr = result["stderr"]
    last_line = stderr[-1][:160] if stderr else "(nothing on stderr)"
    if any(line.startswith("Traceback") for line in stderr):
        frames = [m.groups() for m in map(re.compile(r'\s*File "(.*)", line (\d+), in (.*)').match, stderr) if m]
        where = f" (at {Path(frames[-1][0]).name}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""
        return [f"traceback, exit {status}: {last_line}{where}"]
    refusal = combination.refusal
    if status == 2:
        if refusal is None:
            found = [f"refused where it must train: {last_line}"]
        else:
            found = [] if refusal.because in stderr[-1] else [f"refused, not because {refusal.because!r}: {last_line}"]
        if len(stderr) != 1:
            found.append(f"exit 2 with {len(stderr)} lines on stderr, not 1: {last_line}")
        if result["checkpoints_after"] != result["checkpoints_before"]:
            found.append(f"exit 2 after writing a checkpoint: {last_line}")
        return found
    if status != 0:
        return [f"exit {status}: {last_line}"]
    if refusal is not None:
        return [f"exit 0 where it must refuse ({refusal.because!r})"]

    if combination.phase == "resumed-finished":  # a requeued job: report the finished run, touch nothing
        found = [f"touched {name} of the finished run" for name in result["files_touched"]]
        script = EXPERIMENTS[combination.experiment].script or combination.experiment
        if not any(line.startswith(f"{script}: ") for line in result["stdout"]):
            found.append("did not print the finished run's summary")
        return found
    summary = result["summary"]
    if summary is None:
        return ["exit 0 without writing summary.json"]
    found = []
    if EMAS[combination.ema] and not any(EMA_KEYS.match(k) for k in summary):
        found.append("ignores --ema-decay: the summary has no test_raw_* (non-EMA) numbers")
    if combination.devices > 1 and result["compilations"] and result["compiled_devices"] == 1:
        found.append(f"ignores --devices {combination.devices}: every computation it compiled runs on one device")
    if combination.devices > 1:
        reference = results[combination.reference().id]
        if reference["status"] != 0 or not reference["summary"]:
            found.append(f"nothing to compare with: the 1-device run {combination.reference().id} did not train")
        else:
            tolerance = 0 if combination.ema == "ema-det" else TOLERANCE
            differences = compare(summary, reference["summary"], tolerance=tolerance)
            if differences:
                found.append("differs from 1 device: " + "; ".join(differences))
    if combination.checks_trackers:
        found += tracker_problems(Path(result["run_dir"]))
    return found


def tracker_problems(run_dir: Path) -> list[str]:
    """What the trackers of each run in `run_dir` (itself, or its rounds) miss of its metrics.jsonl, the
    W&B and MLflow runs continued across the resume."""
    found = []
    runs = [
        RunDir(p.parent)
        for p in sorted(run_dir.rglob("metrics.jsonl"))
        if "wandb" not in p.parts and "trackers" in RunDir(p.parent).read_config()
    ]
    for run in runs:
        expected, saved = jsonl_history(run), run.read_config()["trackers"]
        where = f"{run.path.relative_to(run_dir)}: " if run.path != run_dir else ""
        for tracker in ("tensorboard", "wandb", "mlflow"):
            try:
                assert_same_history(tracker_history(tracker, run, expected, saved), expected)
            except (AssertionError, KeyError, OSError) as e:
                found.append(f"{where}{tracker} differs from metrics.jsonl: {' '.join(str(e).split())[:300]}")
    return found or ([] if runs else ["no run directory names its trackers in config.json"])


def tracker_history(tracker: str, run: RunDir, expected: dict, saved: dict) -> dict:
    """What `tracker` recorded of `run` (of MLflow's, only the metrics that metrics.jsonl has too)."""
    if tracker == "tensorboard":
        return tensorboard_history(run)
    if tracker == "wandb":
        return wandb_history(read_wandb_runs(run.path))
    history = mlflow_history(saved["mlflow"]["uri"], saved["mlflow"]["run_id"])
    return {s: {k: v for k, v in h.items() if k in expected.get(s, {})} for s, h in history.items()}


def compare(summary: dict, reference: dict, tolerance: float) -> list[str]:
    differences = []
    for key in sorted(k for k in set(summary) | set(reference) if COMPARED.match(k)):
        a, b = summary.get(key), reference.get(key)
        same_length_lists = isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
        pairs = list(zip(a, b, strict=True)) if same_length_lists else [(a, b)]
        if not all(
            isinstance(x, (int, float))
            and isinstance(y, (int, float))
            and math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance)
            for x, y in pairs
        ):
            differences.append(f"{key} {_short(a)} vs {_short(b)}")
    for key in ("step",):
        if summary.get(key) != reference.get(key):
            differences.append(f"{key} {summary.get(key)} vs {reference.get(key)}")
    return differences


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.9g}"  # enough digits to tell float32 values apart
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return repr(value)


@pytest.mark.slow
@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: c.id)
def test_combination_finishes_or_refuses_in_one_line(combination, combination_results):
    if combination.missing:
        pytest.skip(f"{combination.experiment} needs {combination.missing}, which is not installed")
    found = problems(combination, combination_results)
    assert not found, " | ".join(found)


# -- the table in docs/ ---------------------------------------------------------------------------------
PAGE = Path(__file__).parents[1] / "docs" / "combinations.md"
COLUMNS = {  # a cell of the page: the run of its row in this phase (with these trackers)
    "fresh": ("fresh", "untracked"),
    "resumed": ("resumed", "untracked"),
    "requeued": ("resumed-finished", "untracked"),
    "tracked, fresh": ("fresh", "tracked"),
    "tracked, resumed": ("resumed", "tracked"),
}
OPTIONS = {"noema": "", "ema-det": "EMA, det.", "device": "", "torch": "torch loader"}  # a row's options, briefly


def outcome(combination: Combination) -> str:
    refusal = combination.refusal
    return "trains" if refusal is None else f"refuses: {refusal.because}"


def outcomes_page() -> str:
    """docs/combinations.md: what the grid expects of each experiment on each placement, a row an option set."""
    lines = [
        "# Which options work with which experiment",
        "",
        "What `tests/test_combinations.py` runs and expects, written from its table",
        "(`python tests/test_combinations.py` writes this page again; a test fails while it differs).",
        "A run that trains must exit 0, match the same run on one device (to float rounding; to the bit",
        "with `--deterministic-reduction`) and keep its trackers in step; a refusal is one line on stderr,",
        "exit status 2, before any work, with the words shown. A dash: not in the grid (where placements,",
        "EMAs and loaders multiply, the 4-device placements take a pairwise cover of them, and each resumes",
        "every other experiment).",
        "",
        f"Options: *EMA, det.* is `{' '.join(EMAS['ema-det'])}`; *torch loader* `{' '.join(LOADERS['torch'])}`. "
        "Placements: "
        + ", ".join(f"*{name}* `{' '.join(flags) or '(one device)'}`" for name, flags in PLACEMENTS.items())
        + ". Phases: *fresh*, the experiment's short run; *resumed*, `--resume` continuing it to a longer run; "
        f"*requeued*, `--resume auto` of the finished run; *tracked*, with `{' '.join(TRACKERS['tracked'])}`.",
        "",
        "| experiment | placement | options | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    rows = dict.fromkeys((c.experiment, c.placement, c.ema, c.loader) for c in COMBINATIONS)
    for row in rows:
        runs = {(c.phase, c.tracker): c for c in COMBINATIONS if (c.experiment, c.placement, c.ema, c.loader) == row}
        options = ", ".join(OPTIONS[o] for o in row[2:] if OPTIONS[o]) or "-"
        cells = [outcome(runs[key]) if key in runs else "-" for key in COLUMNS.values()]
        lines.append(f"| {row[0]} | {row[1]} | {options} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def test_the_docs_print_the_grids_table():
    assert PAGE.read_text() == outcomes_page(), "docs/combinations.md is stale: `python tests/test_combinations.py`"


if __name__ == "__main__":
    PAGE.write_text(outcomes_page())
