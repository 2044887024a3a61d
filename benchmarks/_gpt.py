"""Case (i): the language model's training step against a PyTorch GPT of the same shape (issue 28).

Both are pre-norm decoders over bytes: learned positions, attention without biases, a GELU (tanh) MLP
with biases, a final layer norm and an output head tied to the token embedding; AdamW after clipping
the gradient's global norm at 1; the same batch of windows every step (the data is not what is timed).
Ours is `experiments/lm.py`'s model and optimizer through the compiled trainer, several steps a call;
PyTorch runs eagerly with `scaled_dot_product_attention` and fused AdamW, at its best thread count.
Model FLOPs count the matmuls (6 per parameter of the blocks and the head, per token) plus attention's
(12 x depth x width x context per token, PaLM's formula), against a float32 matmul timed in the
same run."""

import functools

import jax.numpy as jnp
import numpy as np
import torch

from research.data import Batch
from research.train import NextTokenLoss, SupervisedStep

from ._frameworks import at_best_thread_count
from ._mlp import PEAK, compiled_run, matmul_candidate
from ._timing import interleave, timed

VOCAB, LR = 256, 1e-3


def shapes() -> dict[str, dict]:
    """The two shapes of the issue: nanoGPT's CPU "baby GPT", and `./scripts/run lm`'s defaults."""
    import experiments.lm as lm

    default = lm.Config.from_options()
    return {
        "width 128, 4 blocks, context 64, batch 12": dict(dim=128, depth=4, heads=4, context=64, batch=12),
        f"the lm default (width {default.dim}, {default.depth} blocks, context {default.context}, batch "
        f"{default.training.batch_size})": dict(
            dim=default.dim,
            depth=default.depth,
            heads=default.heads,
            context=default.context,
            batch=default.training.batch_size,
        ),
    }


def model_flops(dim: int, depth: int, heads: int, context: int, batch: int) -> float:
    """Model FLOPs of one training step (forward and backward)."""
    matmul_parameters = depth * 12 * dim * dim + dim * VOCAB
    return batch * context * (6 * matmul_parameters + 12 * depth * dim * context)


def _windows(context: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, VOCAB, (batch, context + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def ours(steps: int, *, dim: int, depth: int, heads: int, context: int, batch: int):
    """`steps` steps of experiments/lm.py's state in one compiled call."""
    import experiments.lm as lm

    config = lm.Config.from_options(dim=dim, depth=depth, heads=heads, context=context, batch_size=batch, lr=LR)
    windows = Batch(*map(jnp.asarray, _windows(context, batch)))
    return compiled_run(SupervisedStep(NextTokenLoss()), lm.build_state(config), windows, steps)


class TorchBlock(torch.nn.Module):
    """nanoGPT's block: pre-norm, one fused qkv projection, causal `scaled_dot_product_attention`, a GELU (tanh) MLP.
    `bias`: the layer norms' and the MLP's biases (ours has them; nanoGPT's `bias=False` drops them); attention has
    none either way (ours has none; nanoGPT's `bias=True` would add them)."""

    def __init__(self, dim: int, heads: int, bias: bool = True):
        super().__init__()
        self.heads = heads
        self.attention_norm = torch.nn.LayerNorm(dim, bias=bias)
        self.mlp_norm = torch.nn.LayerNorm(dim, bias=bias)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_in, self.mlp_out = torch.nn.Linear(dim, 4 * dim, bias=bias), torch.nn.Linear(4 * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for h in self.qkv(self.attention_norm(x)).split(d, dim=2)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    """nanoGPT's GPT over bytes with learned positions and a head tied to the token embedding; `bias` as in
    `TorchBlock` (and the final norm's): True, the default, has exactly our LM's parameters."""

    def __init__(self, dim: int, depth: int, heads: int, context: int, bias: bool = True):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, dim)
        self.positions = torch.nn.Parameter(0.02 * torch.randn(context, dim))
        self.blocks = torch.nn.Sequential(*(TorchBlock(dim, heads, bias) for _ in range(depth)))
        self.norm = torch.nn.LayerNorm(dim, bias=bias)
        torch.nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embedding(tokens) + self.positions[: tokens.shape[1]])
        return self.norm(x) @ self.embedding.weight.T


def pytorch(steps: int, *, dim: int, depth: int, heads: int, context: int, batch: int):
    torch.manual_seed(0)
    model = TorchGPT(dim, depth, heads, context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    inputs, labels = (torch.from_numpy(a).long() for a in _windows(context, batch))

    def run():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    return run


def parameter_count(dim: int, depth: int, heads: int, context: int, batch: int) -> dict[str, int]:
    """Both models' parameter counts (they must agree: the same architecture)."""
    import experiments.lm as lm
    from research.provenance import parameter_counts

    config = lm.Config.from_options(dim=dim, depth=depth, heads=heads, context=context, batch_size=batch)
    return {
        "ours": parameter_counts(lm.build_state(config).model)["total"],
        "pytorch": sum(p.numel() for p in TorchGPT(dim, depth, heads, context).parameters()),
    }


def run(quick: bool) -> dict:
    steps, repeats = (2, 2) if quick else (20, 7)
    results = {}
    for label, shape in list(shapes().items())[: 1 if quick else None]:  # quick: a smoke run of the first shape
        if quick:
            shape = {**shape, "batch": 2}
        candidates = {}
        for name, make in {f"ours ({steps} steps a call)": ours, "PyTorch eager (fused AdamW)": pytorch}.items():
            fn = make(steps, **shape)
            fn()
            if name.startswith("PyTorch"):
                name, fn = at_best_thread_count(name, fn)
            candidates[name] = functools.partial(timed, fn, steps)
        size = 512 if quick else 2048
        candidates[PEAK] = matmul_candidate(size)
        timings = interleave(candidates, repeats)
        peak = float(np.median([2 * size**3 / s / 1e9 for s in timings.pop(PEAK).seconds]))
        flops = model_flops(**shape)
        for timing in timings.values():
            timing.extra["gflops"] = flops / timing.median / 1e9
            timing.extra["fraction_of_peak"] = timing.extra["gflops"] / peak
            timing.extra["bytes_per_s"] = shape["batch"] * shape["context"] / timing.median
        results[label] = {
            "step": list(timings.values()),
            "shape": shape,
            "peak_gflops": peak,
            "flops": flops,
            "parameters": parameter_count(**shape),
        }
    return results
