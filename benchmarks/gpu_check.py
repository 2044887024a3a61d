"""`python -m benchmarks.gpu_check [--tiny] [--parts ...] [--out DIR]`: one prepared check of a machine's JAX.

Meant for a machine with a GPU and JAX already installed (`scripts/gpu-check` runs it with the Python it is given,
the repository on `PYTHONPATH`). Each part runs in its own process under `--part-timeout` and is written to
DIR/gpu-check.md and .json as soon as it ends, so a part that fails or hangs loses only itself (its error's last
line is in the report, its whole output in DIR/logs/PART.log). The parts:

- `env`: Python, JAX and the libraries' versions, the backend and its devices, `XLA_FLAGS`.
- `lm`: one compiled train step of the LM (`experiments/lm.py`'s model, AdamW) at GPT-2-small's shape (width 768,
  12 blocks, 12 heads, context 1024, batch 16, bf16 compute): compile seconds, step seconds, tokens/s, peak device
  memory, and model-FLOPs utilisation against the chip's dense bf16 peak (`PEAK_BF16`; 6 x parameters + 12 x depth x
  context x width FLOPs a token, PaLM's count).
- `peer`: the same step beside a PyTorch GPT of nanoGPT's structure (`benchmarks/_gpt.py`'s `TorchGPT`) with
  `torch.compile`, fused AdamW and bf16 autocast on CUDA (eager float32 on a CPU), in one process, timed in
  alternating rounds once both are warm: tokens/s, MFU, peak memory, and the ratio ours / PyTorch.
- `profile`: the top kernels of both steps by total time (`jax.profiler`'s perfetto trace summed by name beside
  `torch.profiler`'s `key_averages`), with their calls and share of the traced steps.
- `attention`: causal attention's forward and backward pass at the LM's shape in bf16, through XLA and through
  cuDNN's fused kernel (on a GPU), and which one the LM's `causal_attention` takes there (vmapped over examples,
  as the LM runs it): milliseconds each.
- `bitwise`: the same LM run twice in fresh processes with no compilation cache (a cached program would hide a
  difference), with and without `--deterministic-reduction`: do their checkpoints hold the same bits? (xor under
  `--tiny`.)
- `experiments`: every training experiment (or `--experiments`) for a few steps on tiny data (MNIST-1D generated,
  scikit-learn's digits): exit status, seconds, compile seconds (summary.json's `compile_seconds`), test numbers.
- `tests`: the quick tier of the test files whose code depends on the backend (`TESTS`).
- `bench`: `python -m benchmarks --cases a,b,c,k` (with `--quick` under `--tiny`).

Python packages the machine lacks come from a folder of wheels: `--wheels DIR`, run where PyPI is reachable, derives
and downloads them (`benchmarks/_wheels.py`); `GPU_CHECK_WHEELS=DIR`, on the GPU machine, installs into a temporary
folder only those `importlib.metadata` finds missing or at a version the requirement does not admit.
`--tiny` shrinks every part to seconds on a CPU (CI runs it, so the script never rots); its figures mean nothing.
"""

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from research.install import command

from . import _gpu_report, _wheels

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "lm", "peer", "profile", "attention", "bitwise", "experiments", "tests", "bench")
BENCH_CASES = "a,b,c,k"  # (a), (b): seconds; (c) the MNIST-1D CNN, (k) the generative experiments' steps
SHAPES = {
    "gpt2-small": {"dim": 768, "depth": 12, "heads": 12, "context": 1024, "batch": 16},
    "tiny": {"dim": 32, "depth": 2, "heads": 2, "context": 64, "batch": 4},
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}  # dense, by device_kind substring
TESTS = ("tests/test_models.py", "tests/test_lm.py", "tests/test_generate.py", "tests/test_deterministic_reduction.py")
# A few steps of each training experiment: `data` is the data flag it reads (`mnist1d`: --data-dir, `digits`: --data)
EXPERIMENTS = {
    "xor": ("--epochs", "1", "--train-size", "256", "--test-size", "64", "--batch-size", "32"),
    "circles": ("--epochs", "1", "--batch-size", "400", "--hidden", "8"),
    "mnist1d": ("--model", "cnn", "--steps", "4", "--batch-size", "32", "data=mnist1d"),
    "dp_sgd": ("--channels", "4", "--epochs", "1", "--batch-size", "1000", "data=mnist1d"),
    "double_descent": (
        "--width",
        "8",
        "--epochs",
        "1",
        "--batch-size",
        "1000",
        "--num-samples",
        "5000",
        "data=mnist1d",
    ),
    "ensemble": ("--num-members", "2", "--hidden", "8", "--epochs", "1", "--batch-size", "1000", "data=mnist1d"),
    "metalearn_lr": ("--steps", "2", "--inner-steps", "3", "--hidden", "4", "--num-samples", "5000", "data=mnist1d"),
    "lottery_ticket": tuple(
        "--rounds 1 --schedule-length 2 --hidden 4 --steps 2 --steps-per-call 2 --log-every 2".split()
    )
    + ("data=mnist1d",),
    "grokking": tuple(
        "--modulus 7 --train-fraction 0.5 --dim 8 --heads 2 --steps 4 --eval-every 2 --log-every 2".split()
    ),
    "images": ("--epochs", "1", "--features", "4", "--blocks", "1", "--batch-size", "64", "data=digits"),
    "gan": tuple("--steps 2 --features 4 --batch-size 16 --latent 8 --critic-steps 2 --log-every 2".split())
    + ("data=digits",),
    "diffusion": tuple(
        "--steps 2 --features 4 --batch-size 16 --levels 1 --diffusion-steps 10 --sample-steps 2".split()
    )
    + ("data=digits",),
    "lm": ("--steps", "4", "--dim", "32", "--depth", "2", "--context", "32", "--batch-size", "8", "--log-every", "2"),
}


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import jax

    versions = {}
    for name in ("jax", "jaxlib", "equinox", "optax", "orbax-checkpoint", "jaxtyping", "numpy", "torch"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    devices = jax.devices()
    return {
        "python": platform.python_version(),
        **versions,
        "backend": jax.default_backend(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }


def lm_step(shape: dict, steps: int) -> dict:
    """Compile and time one train step of the LM at `shape` with bf16 compute, its state's buffers donated (as the
    engine's step does: the peak memory counts the state once)."""
    import equinox as eqx
    import jax

    from .lm_scale import compiled_step, steps_per_s

    compiled, leaves, batch, compile_seconds = compiled_step(
        shape["depth"],
        shape["dim"],
        shape["context"],
        shape["batch"],
        shape["heads"],
        donate=True,
        compute_dtype="bfloat16",
    )
    parameters = sum(x.size for x in jax.tree.leaves(eqx.filter(leaves.model, eqx.is_inexact_array)))
    rate, loss = steps_per_s(compiled, leaves, batch, steps)
    tokens_per_s = rate * shape["batch"] * shape["context"]
    flops_per_token = 6 * parameters + 12 * shape["depth"] * shape["context"] * shape["dim"]
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = next((v for k, v in PEAK_BF16.items() if k in device.device_kind), None)
    return {
        "shape": shape,
        "parameters": parameters,
        "compile_s": round(compile_seconds, 2),
        "step_s": float(f"{1 / rate:.6g}"),  # six significant digits, however short the step
        "tokens_per_s": round(tokens_per_s),
        "peak_memory_gib": round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
        "xla_temp_gib": round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3),
        "model_tflops": round(tokens_per_s * flops_per_token / 1e12, 2),
        "mfu": round(tokens_per_s * flops_per_token / peak, 3) if peak else None,
        "final_loss": loss,
    }


def run_experiment(name: str, flags: tuple[str, ...], run_dir: Path, data: dict[str, Path], env: dict) -> dict:
    argv = []
    for flag in flags:
        if flag.startswith("data="):
            kind = flag.removeprefix("data=")
            argv += ["--data-dir" if kind == "mnist1d" else "--data", str(data[kind])]
        else:
            argv.append(flag)
    command = [sys.executable, "-m", "research.run", name, *argv, "--run-dir", str(run_dir), "--no-progress"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        "status": result.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "compile_s": round(summary["compile_seconds"], 2) if "compile_seconds" in summary else None,
        "numbers": {k: v for k, v in summary.items() if k.startswith("test_") and isinstance(v, (int, float))},
        "error": result.stderr.strip().splitlines()[-1] if result.returncode and result.stderr.strip() else "",
    }


def bitwise_pairs(work: Path, env: dict, tiny: bool) -> list[dict]:
    from research.services import RunDir, checkpoint_digest

    # the LM: its embedding's gradient is a scatter-add, which a GPU sums with atomics unless told otherwise
    name, flags = ("xor", EXPERIMENTS["xor"]) if tiny else ("lm", ("--steps", "20", "--dim", "256", "--depth", "4"))
    env = {**env, "RESEARCH_COMPILATION_CACHE": "0"}
    pairs = []
    for deterministic in (False, True):
        extra = ("--deterministic-reduction", "--micro-batches", "2") if deterministic else ()
        digests, statuses = [], []
        for attempt in range(2):
            run_dir = work / f"bitwise-{int(deterministic)}-{attempt}"
            result = run_experiment(name, (*flags, *extra), run_dir, {}, env)
            statuses.append(result["status"])
            checkpoint = RunDir(run_dir).checkpoint_paths()[-1] if result["status"] == 0 else None
            digests.append(checkpoint_digest(checkpoint) if checkpoint else None)
        pairs.append(
            {
                "experiment": name,
                "deterministic_reduction": deterministic,
                "statuses": statuses,
                "same_bits": digests[0] is not None and digests[0] == digests[1],
            }
        )
    return pairs


def digits_npz(path: Path) -> Path:
    """scikit-learn's 8x8 digits as a .npz of uint8 images (the first 1,500 to train, the rest to test)."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * 255 / 16).astype(np.uint8)[..., None]
    labels = digits.target.astype(np.int32)
    np.savez(path, x_train=images[:1500], y_train=labels[:1500], x_test=images[1500:], y_test=labels[1500:])
    return path


def attention_timings(shape: dict, repeats: int) -> dict:
    """Milliseconds of one forward and backward pass of causal attention over a batch at `shape` in bf16, by
    implementation; `lm`: `research.nn.causal_attention` vmapped over the examples, and the kernel it took."""
    import jax
    import jax.numpy as jnp

    from research.nn import causal_attention

    size = (shape["batch"], shape["context"], shape["heads"], shape["dim"] // shape["heads"])
    query, keys, values = (jax.random.normal(k, size, jnp.bfloat16) for k in jax.random.split(jax.random.key(0), 3))
    candidates = {
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "lm": jax.vmap(causal_attention),
    }
    timings: dict = {"shape": "x".join(map(str, size)) + " (batch x tokens x heads x head width)"}
    for name, attend in candidates.items():
        loss = lambda q, k, v, attend=attend: attend(q, k, v).astype(jnp.float32).sum()  # noqa: E731
        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(query, keys, values).compile()
        except Exception as error:  # noqa: BLE001 (cuDNN's refusals: no GPU, no cuDNN, a shape it lacks)
            timings[f"{name}_ms"] = f"unavailable: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        jax.block_until_ready(compiled(query, keys, values))
        start = time.perf_counter()
        for _ in range(repeats):
            out = compiled(query, keys, values)
        jax.block_until_ready(out)
        timings[f"{name}_ms"] = round(1e3 * (time.perf_counter() - start) / repeats, 3)
        if name == "lm":
            timings["lm_kernel"] = "cudnn" if "cudnn" in compiled.as_text() else "xla"
    return timings


def _shape(options: dict) -> dict:
    return SHAPES["tiny" if options["tiny"] else "gpt2-small"]


def experiments_part(options: dict) -> dict:
    from research.data import load_mnist1d

    work, env = Path(options["work"]), dict(os.environ)
    load_mnist1d(work / "mnist1d")
    data = {"mnist1d": work / "mnist1d", "digits": digits_npz(work / "digits.npz")}
    results: dict = {}
    for name in options["experiments"]:
        results[name] = run_experiment(name, EXPERIMENTS[name], work / "runs" / name, data, env)
        write_partial(options, results)
    return results


def write_partial(options: dict, result: Any) -> None:
    """What a part has so far: the report shows it if the part then fails or runs out of time."""
    path = Path(options["work"]) / "partial.json"
    (path.parent / "partial.json.tmp").write_text(json.dumps(result, indent=1, default=str))
    (path.parent / "partial.json.tmp").replace(path)


def tests_part(options: dict) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *TESTS]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-300:]
    return {"status": result.returncode, "summary": re.sub(r"=+", "", last).strip()}


def bench_part(options: dict) -> dict:
    out = Path(options["out"]) / "bench"
    command = [sys.executable, "-m", "benchmarks", "--cases", BENCH_CASES, "--out", str(out)]
    result = subprocess.run([*command, *(["--quick"] if options["tiny"] else [])], cwd=ROOT)
    return {"status": result.returncode, "cases": BENCH_CASES, "report": str(out / "benchmarks.md")}


def env_part(options: dict) -> dict:
    return environment()


def lm_part(options: dict) -> dict:
    return lm_step(_shape(options), 2 if options["tiny"] else options["lm_steps"])


def peer_part(options: dict) -> dict:
    from ._peer import peer

    return peer(_shape(options), 2 if options["tiny"] else options["lm_steps"], tiny=options["tiny"])


def profile_part(options: dict) -> dict:
    from ._profile import profile

    return profile(_shape(options), 2 if options["tiny"] else 5, Path(options["work"]))


def attention_part(options: dict) -> dict:
    return attention_timings(_shape(options), 2 if options["tiny"] else 20)


def bitwise_part(options: dict) -> list[dict]:
    return bitwise_pairs(Path(options["work"]), dict(os.environ), options["tiny"])


PART_FUNCTIONS: dict[str, Callable[[dict], Any]] = {
    "env": env_part,
    "lm": lm_part,
    "peer": peer_part,
    "profile": profile_part,
    "attention": attention_part,
    "bitwise": bitwise_part,
    "experiments": experiments_part,
    "tests": tests_part,
    "bench": bench_part,
}


def run_part(target: str, options_path: str, result_path: str) -> None:
    """In the part's own process: `module:function` (a `PART_FUNCTIONS` value) of the options, as JSON."""
    import importlib

    module, _, name = target.partition(":")
    function = getattr(importlib.import_module(module), name)
    result = function(json.loads(Path(options_path).read_text()))
    Path(result_path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def _target(function: Callable) -> str:
    """How the part's process finds `function`: its module and name."""
    module = "benchmarks.gpu_check" if function.__module__ == "__main__" else function.__module__
    return f"{module}:{function.__qualname__}"


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _end(process: subprocess.Popen) -> None:
    """Kill a part's process and whatever it started (its process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _run_one(name: str, function: Callable, options: dict, out: Path, timeout: float) -> tuple[dict, Any]:
    """Run one part in its own process (its own process group, so that a timeout ends its children too; not its own
    session, which would outlive a command stopped from outside): (status, result);
    the result of a part that failed or ran out of time is what it wrote with `write_partial`, if anything."""
    work = Path(options["work"]) / name
    work.mkdir(parents=True, exist_ok=True)
    options_path, result_path, log = work / "options.json", work / "result.json", out / "logs" / f"{name}.log"
    options_path.write_text(json.dumps({**options, "work": str(work)}))
    command = [sys.executable, "-c", "import sys; from benchmarks.gpu_check import run_part; run_part(*sys.argv[1:])"]
    partial = work / "partial.json"
    start = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*command, _target(function), str(options_path), str(result_path)],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(process)
            return {
                "status": "timed out",
                "seconds": round(time.perf_counter() - start, 1),
                "error": f"stopped at --part-timeout {timeout:g} s; its output so far: {log}",
            }, json.loads(partial.read_text()) if partial.exists() else None
        except BaseException:  # Ctrl-C, SIGTERM: the part goes too
            _end(process)
            raise
    seconds = round(time.perf_counter() - start, 1)
    if process.returncode or not result_path.exists():
        error = {"status": "failed", "seconds": seconds, "error": _last_line(log)}
        return error, json.loads(partial.read_text()) if partial.exists() else None
    result = json.loads(result_path.read_text())
    skipped = isinstance(result, dict) and set(result) == {"skipped"}
    return {"status": "skipped" if skipped else "ok", "seconds": seconds}, result


def run_parts(parts: dict[str, Callable], options: dict, out: Path, report: dict, timeout: float) -> dict:
    """Each part in turn in its own process; the report rewritten as each starts and ends."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    report.setdefault("parts", {})
    for name, function in parts.items():
        report["parts"][name] = {"status": "running", "since": time.strftime("%H:%M:%S UTC", time.gmtime())}
        write_report(out, report)
        report["parts"][name], result = _run_one(name, function, options, out, timeout)
        if result is not None:
            report[name] = result
        print(
            f"gpu-check: {name} {report['parts'][name]['status']} in {report['parts'][name]['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
        write_report(out, report)
    return report


def write_report(out: Path, report: dict) -> None:
    """DIR/gpu-check.json and .md, each replaced whole (written beside, then renamed)."""
    for path, text in (
        (out / "gpu-check.json", json.dumps(report, indent=1) + "\n"),
        (out / "gpu-check.md", _gpu_report.markdown(report, TESTS)),
    ):
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(text)
        partial.replace(path)


def _wheels_from_environment(out: Path) -> dict | None:
    """GPU_CHECK_WHEELS: install what this Python lacks into out/site and put it on the parts' PYTHONPATH."""
    folder = os.environ.get("GPU_CHECK_WHEELS")
    if not folder:
        return None
    site = out / "site"
    found = _wheels.install_missing(Path(folder), site)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"folder": folder, **found}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=command("gpu-check"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="every part at a size of seconds on a CPU (CI)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS), help="comma-separated (default: all)")
    parser.add_argument("--lm-steps", type=int, default=20, help="timed LM steps (lm, peer; default: 20)")
    parser.add_argument(
        "--part-timeout", type=float, default=600, help="seconds each part may run before it is stopped (default: 600)"
    )
    parser.add_argument("--out", default="runs/gpu-check", help="output directory (default: runs/gpu-check)")
    parser.add_argument(
        "--wheels",
        metavar="DIR",
        help="download, where PyPI is reachable, the wheels a GPU machine may lack into DIR (Python 3.12, manylinux "
        "x86_64, constraints.txt's versions) and run nothing else; there, GPU_CHECK_WHEELS=DIR installs those missing",
    )
    args = parser.parse_args(argv)
    if args.wheels:
        try:
            manifest = _wheels.download(Path(args.wheels))
        except _wheels.WheelError as error:
            sys.exit(f"gpu-check --wheels: {error}")
        wheels = [e["wheel"] for e in manifest["requirements"].values() if e["wheel"]]
        print(
            f"{len(wheels)} wheels in {args.wheels} (and {_wheels.MANIFEST}); on the GPU machine: "
            f"GPU_CHECK_WHEELS={args.wheels} {command('gpu-check')}"
        )
        return
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    experiments = args.experiments.split(",")
    if unknown := set(experiments) - set(EXPERIMENTS):
        parser.error(f"--experiments: unknown {', '.join(sorted(unknown))}; choose from {', '.join(EXPERIMENTS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tiny": args.tiny}
    try:
        report["wheels"] = _wheels_from_environment(out)
    except _wheels.WheelError as error:
        sys.exit(f"gpu-check: GPU_CHECK_WHEELS: {error}")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so that the running part goes too
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        options = {"tiny": args.tiny, "lm_steps": args.lm_steps, "experiments": experiments, "out": str(out)}
        chosen = {name: PART_FUNCTIONS[name] for name in PARTS if name in parts}
        run_parts(chosen, {**options, "work": work}, out, report, args.part_timeout)
    print(_gpu_report.markdown(report, TESTS), end="")


if __name__ == "__main__":
    # the module by its name, so that the parts' processes find its functions
    from benchmarks.gpu_check import main as _main

    _main()
