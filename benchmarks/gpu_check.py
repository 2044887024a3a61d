"""`python -m benchmarks.gpu_check [--tiny] [--parts ...] [--out DIR]`: one prepared check of a machine's JAX.

Meant for a machine with a GPU and JAX already installed (`scripts/gpu-check` runs it with the Python it is given,
the repository on `PYTHONPATH`); it installs nothing. Its parts, each written to DIR/gpu-check.md and .json:

- `env`: Python, JAX and the libraries' versions, the backend and its devices, `XLA_FLAGS`.
- `lm`: one compiled train step of the LM (`experiments/lm.py`'s model, AdamW) at GPT-2-small's shape (width 768,
  12 blocks, 12 heads, context 1024, bf16 compute): compile seconds, step seconds, tokens/s, peak device memory,
  and model-FLOPs utilisation against the chip's dense bf16 peak (`PEAK_BF16`; 6 x parameters + 12 x depth x
  context x width FLOPs a token, PaLM's count).
- `attention`: causal attention's forward and backward pass at the LM's shape in bf16, through XLA and through
  cuDNN's fused kernel (on a GPU), and which one the LM's `causal_attention` takes there (vmapped over examples,
  as the LM runs it): milliseconds each.
- `bitwise`: the same LM run twice in fresh processes with no compilation cache (a cached program would hide a
  difference), with and without `--deterministic-reduction`: do their checkpoints hold the same bits? (xor under
  `--tiny`.)
- `experiments`: every training experiment (or `--experiments`) for a few steps on tiny data (MNIST-1D generated,
  scikit-learn's digits): exit status, seconds, test numbers.
- `tests`: the quick tier of the test files whose code depends on the backend (`TESTS`).
- `bench`: `python -m benchmarks --cases a,b,c` (with `--quick` under `--tiny`).

`--tiny` shrinks every part to seconds on a CPU (CI runs it, so the script never rots); its figures mean nothing.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "lm", "attention", "bitwise", "experiments", "tests", "bench")
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
    """Compile and time one train step of the LM at `shape` with bf16 compute."""
    import equinox as eqx
    import jax

    from .lm_scale import compiled_step, steps_per_s

    compiled, leaves, batch, compile_seconds = compiled_step(
        shape["depth"], shape["dim"], shape["context"], shape["batch"], shape["heads"], compute_dtype="bfloat16"
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="every part at a size of seconds on a CPU (CI)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS), help="comma-separated (default: all)")
    parser.add_argument("--lm-steps", type=int, default=20, help="timed LM steps (default: 20)")
    parser.add_argument("--out", default="runs/gpu-check", help="output directory (default: runs/gpu-check)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    experiments = args.experiments.split(",")
    if unknown := set(experiments) - set(EXPERIMENTS):
        parser.error(f"--experiments: unknown {', '.join(sorted(unknown))}; choose from {', '.join(EXPERIMENTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tiny": args.tiny}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        if "env" in parts:
            report["env"] = environment()
        shape = SHAPES["tiny" if args.tiny else "gpt2-small"]
        if "lm" in parts:
            report["lm"] = lm_step(shape, 2 if args.tiny else args.lm_steps)
        if "attention" in parts:
            report["attention"] = attention_timings(shape, 2 if args.tiny else 20)
        if "bitwise" in parts:
            report["bitwise"] = bitwise_pairs(work, env, args.tiny)
        if "experiments" in parts:
            from research.data import load_mnist1d

            load_mnist1d(work / "mnist1d")
            data = {"mnist1d": work / "mnist1d", "digits": digits_npz(work / "digits.npz")}
            report["experiments"] = {
                name: run_experiment(name, EXPERIMENTS[name], work / "runs" / name, data, env) for name in experiments
            }
        if "tests" in parts:
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *TESTS],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-300:]
            report["tests"] = {"status": result.returncode, "summary": re.sub(r"=+", "", last).strip()}
        if "bench" in parts:
            command = [sys.executable, "-m", "benchmarks", "--cases", "a,b,c", "--out", str(out / "bench")]
            result = subprocess.run([*command, *(["--quick"] if args.tiny else [])], cwd=ROOT, env=env)
            report["bench"] = {"status": result.returncode, "report": str(out / "bench" / "benchmarks.md")}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu-check.md").write_text(markdown(report))
    print(markdown(report), end="")


def markdown(report: dict) -> str:
    lines = [
        f"# gpu-check, {report['date']}{' (--tiny: sizes for a CPU, figures meaningless)' if report['tiny'] else ''}"
    ]
    if "env" in report:
        lines += ["", "## Environment", "", *(f"- {k}: {v}" for k, v in report["env"].items())]
    if "lm" in report:
        lm = report["lm"]
        lines += [
            "",
            "## LM train step (bf16 compute, AdamW)",
            "",
            f"- shape: {lm['shape']}, {lm['parameters']:,} parameters",
        ]
        lines += [f"- {k}: {v}" for k, v in lm.items() if k not in ("shape", "parameters")]
    if "attention" in report:
        lines += ["", "## Causal attention, forward and backward (bf16)", ""]
        lines += [f"- {k}: {v}" for k, v in report["attention"].items()]
    if "bitwise" in report:
        lines += ["", "## Bitwise pairs (two fresh processes, no compilation cache)", ""]
        lines += [
            f"- {p['experiment']}, --deterministic-reduction {p['deterministic_reduction']}: exit {p['statuses']}, "
            f"same bits: {p['same_bits']}"
            for p in report["bitwise"]
        ]
    if "experiments" in report:
        lines += [
            "",
            "## Experiments",
            "",
            "| experiment | exit | seconds | test numbers |",
            "| --- | --- | --- | --- |",
        ]
        for name, r in report["experiments"].items():
            numbers = ", ".join(f"{k} {v:.4g}" for k, v in r["numbers"].items()) or r["error"]
            lines.append(f"| {name} | {r['status']} | {r['seconds']} | {numbers} |")
    if "tests" in report:
        lines += [
            "",
            "## Tests",
            "",
            f"- {' '.join(TESTS)}: exit {report['tests']['status']}, {report['tests']['summary']}",
        ]
    if "bench" in report:
        lines += ["", "## Bench (a)-(c)", "", f"- exit {report['bench']['status']}: {report['bench']['report']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
