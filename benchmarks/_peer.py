"""gpu-check's `peer` part: our LM's train step beside a PyTorch GPT of the same shape (the steps `profile` traces).

Ours: `research.nn`'s LM (`benchmarks.lm_scale.compiled_step`: bf16 compute, optax's AdamW, the state's buffers
donated as the engine does). PyTorch's: `benchmarks._gpt.TorchGPT`, nanoGPT's structure with our LM's biases (so the
same parameters), with what nanoGPT's train.py turns on for a GPU: `torch.compile`, fused AdamW, bf16 autocast. On a
CPU (`--tiny` in CI) PyTorch runs eagerly in float32, so that the code path is exercised in seconds.
"""

import importlib.util
import os
import statistics
import time

import numpy as np

from .gpu_check import PEAK_BF16

VOCAB, LR, WEIGHT_DECAY = 256, 1e-3, 1e-4  # optax.adamw's default weight decay, given to PyTorch's too
MEMORY_FRACTION = "0.45"  # of the GPU for JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION), PyTorch's beside it


def flops_per_token(parameters: int, shape: dict) -> int:
    """PaLM's count: 6 x parameters + 12 x depth x context x width."""
    return 6 * parameters + 12 * shape["depth"] * shape["context"] * shape["dim"]


def ours_step(shape: dict):
    """(compiled, leaves, batch, compile seconds, parameters) of our LM's train step; its first run warms it up."""
    import equinox as eqx
    import jax

    from .lm_scale import compiled_step

    compiled, leaves, batch, seconds = compiled_step(
        shape["depth"],
        shape["dim"],
        shape["context"],
        shape["batch"],
        shape["heads"],
        compute_dtype="bfloat16",
        donate=True,
    )
    parameters = sum(x.size for x in jax.tree.leaves(eqx.filter(leaves.model, eqx.is_inexact_array)))
    leaves, loss = compiled(leaves, batch)
    jax.block_until_ready(loss)
    return compiled, leaves, batch, seconds, parameters


def torch_step(shape: dict, *, bias: bool = True, warmup: int = 3):
    """(step, parameters, device, setup) of the PyTorch GPT's train step, run `warmup` times (compiling it on CUDA)."""
    import torch

    from ._gpt import TorchGPT

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # beside XLA's threads on a CPU; the figures there mean nothing anyway
    torch.manual_seed(0)
    model = TorchGPT(shape["dim"], shape["depth"], shape["heads"], shape["context"], bias=bias).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=cuda)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (shape["batch"], shape["context"] + 1))
    inputs, labels = (torch.from_numpy(a).long().to(device) for a in (tokens[:, :-1], tokens[:, 1:]))
    forward = torch.compile(model) if cuda else model

    def step() -> None:
        with torch.autocast(device, torch.bfloat16, enabled=cuda):
            logits = forward(inputs)
        torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), labels.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    setup = "torch.compile, fused AdamW, bf16 autocast" if cuda else "eager, float32, AdamW, 1 thread (a CPU)"
    return step, sum(p.numel() for p in model.parameters()), device, f"PyTorch {torch.__version__}, {setup}"


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _side(parameters: int, seconds: float, shape: dict, peak_bytes: int | None, kind: str) -> dict:
    tokens_per_s = shape["batch"] * shape["context"] / seconds
    peak = next((v for k, v in PEAK_BF16.items() if k in kind), None)
    return {
        "parameters": parameters,
        "step_ms": round(1e3 * seconds, 3),
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * flops_per_token(parameters, shape) / peak, 3) if peak else None,
        "peak_memory_gib": round(peak_bytes / 2**30, 2) if peak_bytes is not None else None,
    }


def peer(shape: dict, steps: int, *, tiny: bool) -> dict:
    """Both steps at `shape`, warm, timed in alternating rounds of `steps` steps (ours first): the median round."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)
    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch not installed"}
    import jax

    compiled, leaves, batch, compile_seconds, ours_parameters = ours_step(shape)  # JAX's CUDA first, then PyTorch's
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step, torch_parameters, device, torch_setup = torch_step(shape)
    seconds: dict[str, list[float]] = {"ours": [], "pytorch": []}
    for _ in range(2 if tiny else 5):
        start = time.perf_counter()
        for _ in range(steps):
            leaves, loss = compiled(leaves, batch)
        jax.block_until_ready(loss)
        seconds["ours"].append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(device)
        seconds["pytorch"].append((time.perf_counter() - start) / steps)
    jax_device = jax.devices()[0]
    ours_peak = (jax_device.memory_stats() or {}).get("peak_bytes_in_use")
    torch_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    torch_kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    ours = _side(ours_parameters, statistics.median(seconds["ours"]), shape, ours_peak, jax_device.device_kind)
    pytorch = _side(torch_parameters, statistics.median(seconds["pytorch"]), shape, torch_peak, torch_kind)
    ratio = {
        key: round(ours[key] / pytorch[key], 3) if ours[key] and pytorch[key] else None
        for key in ("step_ms", "tokens_per_s", "mfu", "peak_memory_gib")
    }
    return {
        "shape": shape,
        "steps": steps,
        "rounds": len(seconds["ours"]),
        "ours": {
            **ours,
            "compile_s": round(compile_seconds, 2),
            "setup": f"JAX {jax.__version__} on "
            f"{jax_device.device_kind}, bf16 compute, optax AdamW, donated state, one jit call a step",
        },
        "pytorch": {**pytorch, "setup": f"{torch_setup} on {torch_kind}"},
        "ratio": ratio,
        "models": "the same architecture and parameters: pre-norm blocks, attention without biases, a GELU (tanh) MLP "
        "and layer norms with biases, learned positions, a head tied to the embedding; nanoGPT's `bias=False` (the "
        "first GPU run's) drops the MLP's and norms' biases; AdamW with weight decay 1e-4 on every parameter in both",
    }
