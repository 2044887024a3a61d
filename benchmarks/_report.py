"""docs/benchmarks.md and docs/benchmarks.png from one run's results (rewritten completely each run)."""

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path

from ._timing import Timing

PURE = "pure JAX"


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in ["jax", "jaxlib", "equinox", "optax", "flax", "torch", "numpy"]:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _find(timings: list[Timing], prefix: str) -> Timing | None:
    return next((t for t in timings if t.name.startswith(prefix)), None)


def _table(timings: list[Timing], unit: str, extra: dict[str, callable] | None = None) -> list[str]:
    """Median, interquartile range, min-max and the ratio to the pure-JAX row of the same run."""
    extra = extra or {}
    base = _find(timings, PURE)
    head = f"| candidate | median per {unit} | IQR | min - max | x pure JAX |" + "".join(f" {k} |" for k in extra)
    lines = [head, "|" + " --- |" * (5 + len(extra))]
    for t in timings:
        q1, q3 = t.quartiles
        ratio = f"{t.median / base.median:.2f}" if base else "-"
        cells = "".join(f" {f(t)} |" for f in extra.values())
        lines.append(
            f"| {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - {_fmt_seconds(q3)} | "
            f"{_fmt_seconds(min(t.seconds))} - {_fmt_seconds(max(t.seconds))} | {ratio} |{cells}"
        )
    return lines


def targets(results: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, wanted, measured, met) for each target of issue 6 that this run measured."""
    rows = []
    if "xor" in results:
        step, fit = results["xor"]["step"], results["xor"]["fit"]
        ours, pure, eqx_ = _find(step, "ours"), _find(step, PURE), _find(step, "eqx")
        rows.append(
            (
                "(a) our step vs pure JAX with donation",
                "<= 1.15x",
                f"{ours.median / pure.median:.2f}x",
                ours.median / pure.median <= 1.15,
            )
        )
        rows.append(
            (
                "(a) eqx.filter_jit step vs ours",
                ">= 4x",
                f"{eqx_.median / ours.median:.2f}x",
                eqx_.median / ours.median >= 4,
            )
        )
        tutorial, ours_fit = _find(fit, "tutorial"), _find(fit, "ours")
        if tutorial:
            r = tutorial.median / ours_fit.median
            rows.append(("(a) tutorial 100-epoch run vs our fit", ">= 40x", f"{r:.1f}x", r >= 40))
        else:
            rows.append(("(a) tutorial 100-epoch run vs our fit", ">= 40x", "not measured (flax absent)", None))
    if "mlp" in results:
        ours = max(
            (t for t in results["mlp"]["step"] if t.name.startswith("ours")), key=lambda t: t.extra["fraction_of_peak"]
        )
        f = ours.extra["fraction_of_peak"]
        rows.append(("(b) MLP step, fraction of matmul peak", ">= 80%", f"{100 * f:.0f}% ({ours.name})", f >= 0.8))
    if "cnn" in results:
        runs = results["cnn"]["runs"]
        ours, torch_ = _find(runs, "ours"), _find(runs, "PyTorch")
        r = ours.median / torch_.median
        gap = 100 * (ours.extra["accuracy"] - torch_.extra["accuracy"])
        rows.append(
            (
                "(c) MNIST-1D CNN time vs PyTorch eager",
                "<= 0.4x, same accuracy",
                f"{r:.2f}x, accuracy {100 * ours.extra['accuracy']:.1f}% vs {100 * torch_.extra['accuracy']:.1f}%",
                r <= 0.4 and gap > -1.0,
            )
        )
    if "per_example" in results:
        calls = results["per_example"]["calls"]
        ours, tf = _find(calls, "ours"), _find(calls, "torch.func")
        r = tf.median / ours.median
        rows.append(("(d) per-example gradients vs torch.func", ">= 1x as fast", f"{r:.2f}x as fast", r >= 1))
    if "dp_sgd" in results:
        for model, timings in results["dp_sgd"]["models"].items():
            ordinary, vmap = _find(timings, "ordinary"), _find(timings, "DP-SGD, vmap")
            ghost = _find(timings, "DP-SGD, ghost clipping")  # the first: with noise
            r = ghost.median / ordinary.median
            rows.append((f"(e) DP-SGD step (ghost) vs ordinary step, {model} (issue 18)", "<= 2x", f"{r:.2f}x", r <= 2))
            if "MLP" in model:
                m = vmap.extra["memory"]["temp"] / max(ghost.extra["memory"]["temp"], 1)
                rows.append(
                    (f"(e) gradient memory, vmap(grad) / ghost, {model} (issue 18)", ">= 5x", f"{m:.0f}x", m >= 5)
                )
            opacus = _find(timings, "Opacus")
            if opacus:
                r = opacus.median / ghost.median
                rows.append(
                    (
                        f"(e) DP-SGD step (ghost), ours vs Opacus ghost clipping, {model} (issue 18)",
                        "faster",
                        f"{r:.2f}x as fast",
                        r > 1,
                    )
                )
    if "population" in results:
        for grid, timings in results["population"]["grids"].items():
            alone, together = _find(timings, "K runs"), _find(timings, "one vmapped")
            r = alone.median / together.median
            wanted = ">= 4x" if grid.startswith("XOR") else "faster"
            rows.append(
                (
                    f"(f) {grid}: one vmapped population vs the runs one by one (issue 16)",
                    wanted,
                    f"{r:.1f}x",
                    r >= 4 if grid.startswith("XOR") else r > 1,
                )
            )
    if "fsdp" in results:
        rows_ = results["fsdp"]["placements"]
        one, fsdp = rows_["one device"], rows_["FSDP, 4 devices"]
        r = fsdp["state_bytes_per_device"] / one["state_bytes_per_device"]
        rows.append(
            (
                "(g) LM train state on one device under FSDP over 4, vs on one device (issue 15)",
                "<= 1/4 + the unshardable rest",
                f"{r:.3f}",
                r <= 0.3,
            )
        )
    for shape, result in results.get("gpt", {}).items():
        ours, torch_ = _find(result["step"], "ours"), _find(result["step"], "PyTorch")
        r = torch_.median / ours.median
        rows.append(
            (
                f"(i) LM step vs a PyTorch GPT of the same shape, {shape} (issue 56)",
                ">= 1.0x as fast",
                f"{r:.2f}x as fast",
                r >= 1.0,
            )
        )
    for model, label in (("cnn", "MNIST-1D CNN"), ("lm", "LM")):
        row = results.get("deterministic", {}).get("devices", {}).get("1 device", {}).get(model)
        if row is not None:
            ordinary, fixed = _find(row["step"], "ordinary"), _find(row["step"], "--deterministic")
            r = fixed.median / ordinary.median
            rows.append(
                (
                    f"(j) {label} step with --deterministic-reduction vs without, one device (issue 29)",
                    "<= 1.25x the time",
                    f"{r:.2f}x the time",
                    r <= 1.25,
                )
            )
    for model, result in results.get("generative", {}).get("models", {}).items():
        ours, by_hand = _find(result["step"], "ours"), _find(result["step"], "hand-written")
        r = ours.median / by_hand.median
        rows.append(
            (
                f"(k) {model} step vs a hand-written Equinox loop of the same model",
                "<= 1.0x the time",
                f"{r:.2f}x the time",
                r <= 1.0,
            )
        )
    for label, timings in results.get("ppo", {}).get("populations", {}).items():
        ours, peer = _find(timings, "ours"), _find(timings, "rejax")
        if peer is None:
            continue
        r = peer.median / ours.median
        rows.append(
            (
                f"(l) PPO on CartPole-v1, {label}: environment steps a second vs rejax (issue 43)",
                ">= 1x as fast",
                f"{r:.2f}x as fast ({1 / ours.median:,.0f} vs {1 / peer.median:,.0f} a second)",
                r >= 1,
            )
        )
    if "startup" in results:
        run, sample = (_wall_and(results["startup"][key]) for key in ("run", "sample"))
        training = run["compilation (a cache hit: tracing, loading)"] + run["training, evaluation, checkpoints"]
        ratio = run["wall time"] / training
        rows.append(
            (
                "(m) a second `xor --epochs 3` run: its wall time vs its training (issue 58)",
                "<= 2x",
                f"{ratio:.1f}x ({run['wall time']:.1f} s, training {training:.1f} s)",
                ratio <= 2,
            )
        )
        wall = sample["wall time"]
        rows.append(("(m) `research sample` of a finished lm run (issue 58)", "< 10 s", f"{wall:.1f} s", wall < 10))
    return rows


def _wall_and(timings: list[Timing]) -> dict[str, float]:
    """Each phase's median seconds by name."""
    return {t.name: t.median for t in timings}


def write_markdown(path: Path, results: dict, info: dict, quick: bool, seconds: float, findings: str) -> None:
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `scripts/bench{' --quick' if quick else ''}` on {info['date']} in {seconds:.0f} s; "
        "rewritten completely by each run (do not edit by hand).",
        "",
        f"- Machine: {info['cpu']}, {info['cores']} cores; load average {info['load_before']} before, "
        f"{info['load_after']} after the run.",
        f"- Python {info['python']}; " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()) + ".",
        f"- {info['torch_threads']}.",
        "- Every candidate is compiled and warmed up first; candidates then run interleaved (round-robin with "
        "a rotating start) and repeated, so load bursts hit all of them alike. Tables give the median, "
        "the interquartile range and min - max over repeats, and the ratio to the pure-JAX row of the same run.",
    ]
    lines += [f"- Case ({case}) {why}" for case, why in info.get("skipped", {}).items()]
    if quick:
        lines += ["", "**Quick run**: tiny repeat counts and shortened runs; a smoke test, not a measurement."]
    lines += [
        "",
        "![benchmarks](benchmarks.png)",
        "",
        "## Targets (issue 6)",
        "",
        "| target | wanted | measured | met |",
        "| --- | --- | --- | --- |",
    ]
    for name, wanted, measured, met in targets(results):
        lines.append(f"| {name} | {wanted} | {measured} | {'yes' if met else 'n/a' if met is None else '**no**'} |")
    if "xor" in results:
        x = results["xor"]
        lines += [
            "",
            "## (a) XOR MLP: one step and 100 epochs",
            "",
            "MLP 2-8-1 tanh, SGD 0.1, batch 128, 2,500 training points (the tutorial's recipe). One step "
            "on a device-resident batch, called in a Python loop (time per call); the model is tiny, so "
            "this is dispatch overhead.",
            "",
        ]
        lines += _table(x["step"], "step")
        lines += [
            "",
            f"{x['epochs']} epochs ({x['steps_per_epoch']} steps an epoch; the tutorial's DataLoader "
            "also runs the last partial batch), evaluated on 500 test points; the second call in the "
            "process is measured (warm).",
            "",
        ]
        lines += _table(x["fit"], "run", {"test accuracy": lambda t: f"{100 * t.extra['accuracy']:.1f}%"})
        lines += [f"- {k}: {v}" for k, v in x["notes"].items()]
    if "mlp" in results:
        m = results["mlp"]
        lines += [
            "",
            "## (b) Compute-bound MLP: 784-1024-1024-10, batch 512, Adam",
            "",
            f"One step is {m['flops'] / 1e9:.2f} GFLOP of matmuls. Float32 matmul peak, measured in this run "
            f"with a jitted {m['peak_size']}x{m['peak_size']} matmul interleaved with the candidates (same "
            f"load): median {m['peak_gflops']:.0f} GFLOP/s (min {m['peak_spread'][0]:.0f}, "
            f"max {m['peak_spread'][1]:.0f}).",
            "",
        ]
        lines += _table(
            m["step"],
            "step",
            {
                "GFLOP/s": lambda t: f"{t.extra['gflops']:.0f}",
                "of peak": lambda t: f"{100 * t.extra['fraction_of_peak']:.0f}%",
            },
        )
        lines += [f"- {k}: {v}" for k, v in m["notes"].items()]
    if "cnn" in results:
        c = results["cnn"]
        lines += [
            "",
            "## (c) MNIST-1D CNN, the reference recipe",
            "",
            f"{c['steps']} Adam steps (lr 1e-2, batch 100) on 4,000 training examples, then test accuracy on "
            f"1,000; wall time of the whole run, compiled beforehand. Model and data: {c['source']}.",
            "",
        ]
        lines += _table(c["runs"], "run", {"test accuracy": lambda t: f"{100 * t.extra['accuracy']:.1f}%"})
    if "per_example" in results:
        p = results["per_example"]
        lines += [
            "",
            "## (d) Per-example gradients",
            "",
            "Full per-example gradients of the MNIST-1D CNN (5,210 parameters) for a batch of 100, one "
            "call each. Our gradients equal torch.func's for the same weights to "
            f"{p['max_abs_difference']:.1e} (largest absolute difference, head weights).",
            "",
        ]
        lines += _table(p["calls"], "batch")
        lines += [
            "",
            "Memory bound: the result holds batch x parameters floats (100 x 5,210 x 4 bytes = 2.1 MB "
            "here), and the vmapped backward pass keeps every example's activations, so peak memory grows "
            "linearly with the batch; for large models take them in chunks of the batch, or compute only "
            "their norms.",
        ]
    if "dp_sgd" in results:
        lines += [
            "",
            "## (e) DP-SGD at the cost of ordinary training",
            "",
            f"One engine step (`CompiledTrainer.step`, Adam, batch {results['dp_sgd']['batch']}) of the ordinary "
            "loss and of `DPSGDLoss` (clip 1, noise 1, whole batch at once) with ghost clipping (per-example "
            "norms and the clipped sum from layer inputs and output gradients, one backward pass) and with "
            "vmap(grad) (every per-example gradient materialised). The first three run interleaved (10 steps "
            "a call on the CNN, 5 on the MLP); vmap(grad) runs after them on its own (1 step a call on the "
            "MLP), since freeing its per-example gradients slowed the candidate that ran next. Opacus (when "
            'installed) runs the same DP-Adam step in PyTorch eager with `grad_sample_mode="ghost"` (norms '
            "from activations and output gradients for its Linear layers, per-sample gradients for the "
            "convolutions, then a second backward pass), interleaved with the first three; its memory is not "
            "XLA's to plan, so not given. Memory: the "
            "temporary bytes XLA plans for the gradient computation of the step (`memory_analysis()`, "
            "deterministic; for DP-SGD including its parameter-sized Gaussian noise), and for the clipped sum "
            "alone (`clipped_gradient_sum`, no noise); parameters, batch and gradient outputs come on top and "
            "are the same for all three.",
            "",
        ]
        lines += [
            "| model | candidate | median per step | IQR | x ordinary | gradient temp memory | x ordinary "
            "| clipped sum alone |",
            "|" + " --- |" * 8,
        ]
        for model, timings in results["dp_sgd"]["models"].items():
            base = _find(timings, "ordinary")
            for t in timings:
                q1, q3 = t.quartiles
                temp, base_temp = t.extra["memory"].get("temp"), max(base.extra["memory"]["temp"], 1)
                lines.append(
                    f"| {model} | {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - "
                    f"{_fmt_seconds(q3)} | {t.median / base.median:.2f} | {_fmt_bytes(temp)} | "
                    f"{'-' if temp is None else f'{temp / base_temp:.1f}'} | "
                    f"{_fmt_bytes(t.extra['memory'].get('clipped_sum_temp'))} |"
                )
        lines += [f"- {k}: {v}" for k, v in results["dp_sgd"].get("notes", {}).items()]
    if "population" in results:
        lines += [
            "",
            "## (f) Populations: K runs in one program",
            "",
            "K runs of a grid over the seed and the learning rate, trained one after another as "
            "`scripts/run` trains each (run directory, evaluation, checkpoint, plot; one compilation per run, "
            "since each learning rate is another optimizer), against the same runs as one vmapped population "
            "(`scripts/sweep --vmapped`: one compilation, each member on its own run's batch order, then the K "
            "run directories written out, batched: the checkpoints in the background, the plots by a worker "
            "process started with the sweep and by the sweep itself); both in this process (a sweep of "
            "processes pays each run's start-up on top). Both times include writing every run directory.",
            "",
        ]
        for grid, timings in results["population"]["grids"].items():
            lines += [f"**{grid}**", ""]
            lines += _table(timings, "K runs")
            lines += [""]
    if "fsdp" in results:
        g = results["fsdp"]
        lines += [
            "",
            "## (g) FSDP, data parallel, one device: the language model",
            "",
            f"`experiments/lm.py --dim 128` (depth 4, context 128, AdamW), global batch 32 windows, {g['steps']} "
            "steps, each placement its own process; 4 devices are simulated on this machine's cores, so "
            "their times show the cost of the collectives and the partitioning on one host, not a speed-up. "
            "State bytes: the train state (parameters, Adam moments, key, step) held by the first device.",
            "",
            "| placement | state bytes on one device | x one device | bytes/s trained | held-out bits/byte |",
            "| --- | --- | --- | --- | --- |",
        ]
        base = g["placements"]["one device"]["state_bytes_per_device"]
        for name, row in g["placements"].items():
            lines.append(
                f"| {name} | {_fmt_bytes(row['state_bytes_per_device'])} | "
                f"{row['state_bytes_per_device'] / base:.3f} | {row['bytes_per_s']:,.0f} | "
                f"{row['test_bits_per_byte']:.4f} |"
            )
    if "loaders" in results:
        lines += _loaders_section(results["loaders"])
    if "gpt" in results:
        lines += _gpt_section(results["gpt"])
    if "deterministic" in results:
        lines += _deterministic_section(results["deterministic"])
    if "generative" in results:
        lines += _generative_section(results["generative"])
    if "ppo" in results:
        lines += _ppo_section(results["ppo"])
    if "startup" in results:
        lines += _startup_section(results["startup"])
    lines += ["", findings.strip(), ""]
    path.write_text("\n".join(lines))


def _loaders_section(h: dict) -> list[str]:
    def plain(timings: list[Timing], unit: str, per: str) -> list[str]:
        base = timings[0].median
        rows = [f"| candidate | median per {unit} | IQR | x {per} |", "| --- | --- | --- | --- |"]
        for t in timings:
            q1, q3 = t.quartiles
            rows.append(
                f"| {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - {_fmt_seconds(q3)} | "
                f"{t.median / base:.2f} |"
            )
        return rows

    return [
        "",
        "## (h) Host loaders: streaming from disk, resuming in O(1)",
        "",
        "The MNIST-1D MLP recipe (40-100-100-10, Adam, batch 128), trained warm by `fit` with each loader (the "
        "device loader runs 100 steps a compiled call; host batches run one a call):",
        "",
        *plain(h["training"], "step", "the device loader"),
        "",
        f"Reading a memory-mapped {h['size']:,} x 28 x 28 uint8 `.npy` a batch of 128 at a time (the device "
        "loader holds the set on the device and gathers a batch there; the host loaders read it from the "
        "file, `ArrayDataset.__getitems__` in one indexing):",
        "",
        *plain(h["reading"], "batch", "the device loader"),
        "",
        "The first batch of a run resumed at an early and a late step of that set, a fresh loader each (the "
        "torch loader before issue 26 made a DataLoader for the epoch and read and dropped the epoch's batches "
        "before the resume point):",
        "",
        *plain(h["resume"], "first batch", "the first row"),
    ]


def _gpt_section(results: dict) -> list[str]:
    lines = [
        "",
        "## (i) The language model against a PyTorch GPT of the same shape",
        "",
        "One training step of `experiments/lm.py`'s model and optimizer (the compiled trainer, 20 steps a call) "
        "and of a PyTorch GPT written in the bench with the same parameters (pre-norm blocks, attention "
        "without biases through `scaled_dot_product_attention`, GELU (tanh) MLP, tied embedding, AdamW after "
        "clipping at 1, fused), on the same batch of windows each step. Model FLOPs: 6 per matmul parameter "
        "per token plus attention's 12 x depth x width x context per token; the peak is a jitted 2048 x 2048 "
        "float32 matmul timed interleaved with both.",
        "",
    ]
    for shape, result in results.items():
        parameters = result["parameters"]
        lines += [
            f"**{shape}**: {parameters['ours']:,} parameters (PyTorch: {parameters['pytorch']:,}), "
            f"{result['flops'] / 1e9:.2f} GFLOP a step, peak {result['peak_gflops']:.0f} GFLOP/s",
            "",
            "| candidate | median per step | IQR | bytes/s | GFLOP/s | of peak | x PyTorch's time |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        base = _find(result["step"], "PyTorch").median
        for t in result["step"]:
            q1, q3 = t.quartiles
            lines.append(
                f"| {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - {_fmt_seconds(q3)} | "
                f"{t.extra['bytes_per_s']:,.0f} | {t.extra['gflops']:.0f} | "
                f"{100 * t.extra['fraction_of_peak']:.0f}% | {t.median / base:.2f} |"
            )
        lines += [""]
    return lines


def _deterministic_section(j: dict) -> list[str]:
    lines = [
        "",
        "## (j) What --deterministic-reduction costs",
        "",
        "MNIST-1D's CNN (batch 128, 100 steps a compiled call) and `experiments/lm.py`'s language model (32 "
        "windows of 128 bytes, 20 steps a call), trained warm by `fit` with the ordinary step and with the "
        f"layout-invariant one ({j['micro_batches']} micro-batches in a `lax.scan`, summed in a fixed order), on "
        "one device and on 4 simulated devices (`sharded`; they share this machine's cores). Temporary bytes: "
        "XLA's buffers for one compiled call, per device (`memory_analysis().temp_size_in_bytes`).",
        "",
        "| model | devices | candidate | median per step | IQR | x ordinary | temporary bytes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for devices, models in j["devices"].items():
        for model, row in models.items():
            base = _find(row["step"], "ordinary").median
            for t in row["step"]:
                q1, q3 = t.quartiles
                lines.append(
                    f"| {model} | {devices} | {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - "
                    f"{_fmt_seconds(q3)} | {t.median / base:.2f}x | {_fmt_bytes(row['temp_bytes'][t.name])} |"
                )
    return lines


def _generative_section(k: dict) -> list[str]:
    models = k["models"]
    gan, diffusion = models["GAN"]["recipe"], models["diffusion"]["recipe"]
    lines = [
        "",
        "## (k) The generative experiments' steps against hand-written Equinox loops",
        "",
        "One training step of `experiments/gan.py` and of `experiments/diffusion.py` at their default recipes on "
        "scikit-learn's 8x8 digits (1,437 uint8 training images), through the engine as `run_experiment` drives "
        f"it (`compiled_trainer(step, state).run` over a `DeviceLoader`, {gan['steps_per_call']} steps a call), "
        "against the same model, losses, per-example latents / noise and optimizers written as Equinox's "
        "examples write them (`deep_convolutional_gan`, `score_based_diffusion`): `eqx.filter_jit` step "
        "functions taking the models, optimizer states and key, called in a Python loop once a batch, each "
        "batch gathered from a device array with numpy indices; the GAN's loop calls a discriminator update, "
        "then a generator update. GAN: latent "
        f"{gan['latent']}, features {gan['features']}, batch {gan['batch']}, one discriminator update a step, "
        f"Adam {gan['lr']:g} (b1 {gan['beta1']:g}) each ({gan['parameters']['generator']:,} + "
        f"{gan['parameters']['discriminator']:,} "
        f"parameters). Diffusion: UNet features {diffusion['features']}, levels {diffusion['levels']} "
        f"({diffusion['parameters']['unet']:,} parameters), 1,000-step schedule, batch {diffusion['batch']}, "
        f"Adam {diffusion['lr']:g} after clipping at 1, the recipe's EMA of the weights ({diffusion['ema_decay']:g}) "
        "in both. "
        f"Each sample is {k['steps']} steps; losses: their mean over the last sample (keys differ, so they "
        "agree in size, not in value). The engine also computes the experiments' other metrics (gradient "
        "norms, D's mean probabilities), which the hand-written loops leave out. Building the four networks "
        f"and their optimizer states took {k['seconds']['build']:.0f} s of this case, compiling the four "
        f"candidates (and a first step of each) {k['seconds']['compile']:.0f} s, two at a time, the timed samples "
        f"{k['seconds']['timed']:.0f} s.",
        "",
        "| model | candidate | median per step | IQR | min - max | x hand-written | mean losses |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, result in models.items():
        base = _find(result["step"], "hand-written").median
        for t in result["step"]:
            q1, q3 = t.quartiles
            losses = ", ".join(f"{name} {value:.3f}" for name, value in t.extra["losses"].items() if "loss" in name)
            lines.append(
                f"| {model} | {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - {_fmt_seconds(q3)} | "
                f"{_fmt_seconds(min(t.seconds))} - {_fmt_seconds(max(t.seconds))} | {t.median / base:.2f} | "
                f"{losses} |"
            )
    return lines


def _ppo_section(l_: dict) -> list[str]:
    r = l_["recipe"]
    lines = [
        "",
        "## (l) PPO through the engine against rejax's PPO",
        "",
        "`experiments/ppo.py` through the engine as `run_experiment` drives it (`compiled_trainer(step, state)"
        ".run`, 10 PPO iterations a call; a population is `--population 16`, the engine's vmapped step) against "
        "rejax 0.1.3's `PPO.train` under `jax.jit` (a population: `jax.jit(jax.vmap(train))` over 16 seeds), "
        f"training only, on gymnax's {r['env']} with the recipe both take: {r['num_envs']} environments, rollouts "
        f"of {r['num_steps']} steps, {r['num_epochs']} epochs of {r['num_minibatches']} minibatches, gamma "
        f"{r['gamma']:g}, GAE lambda {r['gae_lambda']:g}, clip {r['clip_eps']:g}, entropy {r['ent_coef']:g}, value "
        f"{r['vf_coef']:g}, gradients clipped at {r['max_grad_norm']:g}, Adam at a constant {r['learning_rate']:g}, "
        f"{r['hidden']}x{r['hidden']} tanh policy and value networks. rejax's evaluation is switched off (a no-op "
        "callback); ours also bootstraps truncated episodes (the values of the true next observations, one more "
        "critic product a rollout) and "
        "keeps episode and update metrics on the device, which rejax does not; rejax clips gradients element by "
        "element and updates the two networks apart (benchmarks/_ppo.py lists every difference). A sample is "
        f"{l_['iterations']} iterations ({l_['iterations'] * r['num_envs'] * r['num_steps']:,} environment steps an "
        "agent), continuing from the last sample; the rate counts every member's steps. Compiling the "
        f"candidates (and a first sample of each) took {l_['seconds']['compile']:.0f} s of this case. Return: "
        "ours' mean training episode return over its last sample (rejax keeps none).",
        "",
        "| agents | candidate | environment steps a second (median) | IQR | x rejax | return |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, timings in l_["populations"].items():
        peer = _find(timings, "rejax")
        for t in timings:
            q1, q3 = t.quartiles
            ret = t.extra.get("episode_return")
            lines.append(
                f"| {label} | {t.name} | {1 / t.median:,.0f} | {1 / q3:,.0f} - {1 / q1:,.0f} | "
                f"{'-' if peer is None else f'{peer.median / t.median:.2f}'} | {'-' if ret is None else f'{ret:.1f}'} |"
            )
    if l_.get("peer"):
        lines += ["", f"- {l_['peer']}"]
    return lines


def _startup_section(m: dict) -> list[str]:
    def table(timings: list[Timing], first: list[Timing], unit: str, first_name: str) -> list[str]:
        wall = timings[-1].median
        rows = [
            f"| phase | {unit} (median) | IQR | of the wall time | {first_name} |",
            "| --- | --- | --- | --- | --- |",
        ]
        for t, f in zip(timings, first, strict=True):
            q1, q3 = t.quartiles
            rows.append(
                f"| {t.name} | {_fmt_seconds(t.median)} | {_fmt_seconds(q1)} - {_fmt_seconds(q3)} | "
                f"{100 * t.median / wall:.0f}% | {_fmt_seconds(f.median)} |"
            )
        return rows

    return [
        "",
        "## (m) How fast a small run starts: a second run, and a sample of a finished one",
        "",
        f"`research run xor --epochs 3 --no-progress` ({m['steps']} steps) run a second time, each in a fresh "
        "process (`python -m benchmarks._startup_probe`, which runs the command as `research` does and notes when "
        "each phase ends) with the compilation cache the first run filled (a scratch directory, "
        f"`$RESEARCH_COMPILATION_CACHE_DIR`); median of {m['repeats']} runs, the first run beside. "
        "Compilation is `Engine.fit`'s calls up to its first stop (`compile_seconds`: tracing, lowering, then "
        "the cache's program or XLA's); training the rest of `fit` (the steps, the evaluations, the checkpoints); "
        "exit is from the command's return to the process's end.",
        "",
        *table(m["run"], m["first_run"], "second run", "first run"),
        "",
        f"`research sample RUN_DIR` (256 bytes, generated twice: the first call compiles) of a finished `research "
        f"run {' '.join(m['lm'])}`, in a fresh process; median of {m['repeats']} samples after the first, which "
        "compiles the generation loop into the cache (beside).",
        "",
        *table(m["sample"], m["first_sample"], "a sample", "first sample"),
    ]


def write_chart(path: Path, results: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (install the `bench` extra)"
    panels = [
        (k, t, title, scale)
        for k, t, title, scale in [
            ("xor", "step", "(a) XOR step (us)", 1e6),
            ("xor", "fit", "(a) XOR 100 epochs (ms)", 1e3),
            ("mlp", "step", "(b) MLP step (ms)", 1e3),
            ("cnn", "runs", "(c) MNIST-1D CNN run (s)", 1),
            ("per_example", "calls", "(d) per-example grads (ms)", 1e3),
        ]
        if k in results
    ]
    panels += [
        ("dp_sgd", model, f"(e) {model}: DP-SGD step (ms)", 1e3)
        for model in results.get("dp_sgd", {}).get("models", {})
    ]
    panels += [("population", grid, f"(f) {grid} (s)", 1) for grid in results.get("population", {}).get("grids", {})]
    panels += [
        ("generative", model, f"(k) {model} step (ms)", 1e3)
        for model in results.get("generative", {}).get("models", {})
    ]
    panels += [
        ("ppo", label, f"(l) PPO, {label}: us an environment step", 1e6)
        for label in results.get("ppo", {}).get("populations", {})
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels) + 0.5), squeeze=False)
    for ax, (case, key, title, scale) in zip(axes[:, 0], panels, strict=True):
        nested = {"dp_sgd": "models", "population": "grids", "generative": "models", "ppo": "populations"}
        timings = results[case][nested[case]][key] if case in nested else results[case][key]
        timings = timings["step"] if case == "generative" else timings
        medians = [t.median * scale for t in timings]
        errors = [
            [(t.median - t.quartiles[0]) * scale for t in timings],
            [(t.quartiles[1] - t.median) * scale for t in timings],
        ]
        colors = [
            "tab:blue" if t.name.startswith("ours") else "tab:gray" if t.name.startswith(PURE) else "tab:orange"
            for t in timings
        ]
        ax.barh([t.name for t in timings], medians, xerr=errors, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
