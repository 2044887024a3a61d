"""`python -m benchmarks.lm_anatomy [--shape gpt2-small] [--precision bf16]`: the LM's step beside nanoGPT's,
measured without a GPU.

What a training step keeps for its backward pass, and the program it lowers to, do not depend on the backend
(issue 56). Two tables, written to stdout as markdown:

- **Saved for the backward pass**, bytes a token and a block: ours from the jaxpr (`saved_residuals` of the whole
  model's loss at depth 1 and 2, batch 1 and 2: the difference is one block's share of one token's, whatever the
  scan and the checkpoint policy do), beside nanoGPT's block in PyTorch under bf16 autocast (every tensor
  `saved_tensors_hooks` packs, storages counted once, batch 1 against 2). Then what one block saves, by tensor.
- **The step lowered for CUDA** (StableHLO for `cuda`, with cuDNN's attention as an H200 takes it): operations by
  kind, and the converts, transposes and float32 tensors of activation size (at least tokens x width elements) that
  XLA must then fuse away or pay for. The scanned block appears once in the program, however deep the model.
"""

import argparse
import collections
import contextlib
import re
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from research.nn import LanguageModel, build_model

SHAPES = {
    "gpt2-small": {"dim": 768, "depth": 12, "heads": 12, "context": 1024, "batch": 16},
    "lm-default": {"dim": 64, "depth": 4, "heads": 4, "context": 128, "batch": 32},
    "tiny": {"dim": 32, "depth": 2, "heads": 2, "context": 64, "batch": 4},
}


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Trace the LM as it is traced on a GPU with cuDNN (Hopper): `causal_attention` takes the fused kernel,
    whose checks for a GPU and its cuDNN version are answered yes. For lowering and counting only: nothing runs."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from research.nn import _lm

    saved = cudnn.check_cudnn_version, cudnn.check_compute_capability, _lm.fused_attention_available
    cudnn.check_cudnn_version = lambda: 91000
    cudnn.check_compute_capability = lambda capability: True
    _lm.fused_attention_available = lambda: True
    try:
        yield
    finally:
        cudnn.check_cudnn_version, cudnn.check_compute_capability, _lm.fused_attention_available = saved


def _is_leaf_array(x: object) -> bool:
    """An array or an abstract one (`eqx.filter_eval_shape` builds models of these: nothing is drawn)."""
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct)


def _model(shape: dict, depth: int, precision: str, remat: bool) -> LanguageModel:
    compute_dtype = "bfloat16" if precision == "bf16" else "float32"
    return eqx.filter_eval_shape(
        lambda: build_model(
            "lm",
            key=jax.random.key(0),
            context=shape["context"],
            dim=shape["dim"],
            depth=depth,
            heads=shape["heads"],
            remat=remat,
            compute_dtype=compute_dtype,
        )[0]
    )


def _loss(model: LanguageModel, tokens: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1))


def _residual_bytes(model: LanguageModel, batch: int) -> int:
    from jax._src.ad_checkpoint import saved_residuals

    params, static = eqx.partition(model, _is_leaf_array)
    tokens = jax.ShapeDtypeStruct((batch, model.context), jnp.int32)
    residuals = saved_residuals(lambda p, t: _loss(eqx.combine(p, static), t), params, tokens)
    return sum(int(np.prod(aval.shape)) * aval.dtype.itemsize for aval, _ in residuals)


def ours_saved_per_token(shape: dict, precision: str, remat: bool) -> dict[str, float]:
    """Bytes our step saves for its backward pass a token: `block` (one block's share) and `outside` (embedding,
    final norm, logits, loss). Traced for this machine's backend (inside `as_on_a_gpu`: for an H200's)."""
    saved = {
        (depth, batch): _residual_bytes(_model(shape, depth, precision, remat), batch)
        for depth in (1, 2)
        for batch in (1, 2)
    }
    tokens = shape["context"]
    block = (saved[2, 2] - saved[2, 1] - saved[1, 2] + saved[1, 1]) / tokens
    return {"block": block, "outside": (saved[1, 2] - saved[1, 1]) / tokens - block}


def ours_block_breakdown(shape: dict, precision: str, remat: bool) -> list[tuple[str, str, float]]:
    """What one block keeps (with the model's own checkpoint policy), by tensor: (dtype and shape a token, where it
    comes from, bytes a token)."""
    from jax._src.ad_checkpoint import saved_residuals

    from research.nn._lm import for_backward

    model = build_model(
        "lm",
        key=jax.random.key(0),
        context=shape["context"],
        dim=shape["dim"],
        depth=1,
        heads=shape["heads"],
        compute_dtype="bfloat16" if precision == "bf16" else "float32",
    )[0].computing()
    block = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, model.blocks)
    params, static = eqx.partition(block, _is_leaf_array)
    x = jax.ShapeDtypeStruct((1, shape["context"], shape["dim"]), jnp.float32)
    layer = for_backward(lambda p, h: jax.vmap(eqx.combine(p, static))(h), remat)
    residuals = saved_residuals(lambda p, h: layer(p, h).sum(), params, x)
    rows = []
    for aval, source in residuals:
        if aval.ndim < 2 or aval.shape[1] != shape["context"]:  # parameters and scalars: not a token's
            continue
        per_token = int(np.prod(aval.shape[2:])) * aval.dtype.itemsize
        rows.append((f"{aval.dtype.name}{list(aval.shape[2:])}", _source(source), float(per_token)))
    return rows


def _source(description: str) -> str:
    """`saved_residuals`' description shortened to what made the tensor and the line of ours it comes from."""
    made = description.split(" from ")[0].removeprefix("output of ")
    if description.startswith("from the argument"):
        return "the block's input"
    ours = re.search(r"research/nn/(\w+\.py):(\d+)", description)
    where = re.search(r"\((\w[\w.<>]*)\)\s*$", description)
    return f"{made} ({ours.group(1)}:{ours.group(2)}{', ' + where.group(1) if where else ''})" if ours else made


def nanogpt_saved_per_token(shape: dict, precision: str) -> tuple[float, list[tuple[str, float]]]:
    """Bytes nanoGPT's block (`benchmarks._gpt.TorchBlock`: its structure) saves a token in PyTorch, under bf16
    autocast for `bf16`; and by tensor (dtype and shape a token)."""
    import torch

    from ._gpt import TorchBlock

    torch.manual_seed(0)
    block = TorchBlock(shape["dim"], shape["heads"])
    tokens = shape["context"]

    def saved(batch: int) -> dict[int, torch.Tensor]:
        tensors: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            tensors[tensor.untyped_storage().data_ptr()] = tensor
            return tensor

        x = torch.randn(batch, tokens, shape["dim"], requires_grad=True)
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            block(x).float().sum()
        # the parameters, and autocast's bf16 copies of them: tensors of a weight's shape (or its transpose)
        weights = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape[::-1]) for p in block.parameters()}
        return {ptr: t for ptr, t in tensors.items() if tuple(t.shape) not in weights}

    dims = {d for p in block.parameters() for d in p.shape}
    if tokens in dims or 2 * tokens in dims:  # an activation would pass for a weight above
        raise ValueError(f"context {tokens}: choose one whose 1 and 2 windows' tokens are no weight's dimension")
    one, two = saved(1), saved(2)
    nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts.values())  # noqa: E731
    rows = [
        (f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}", t.untyped_storage().nbytes() / tokens)
        for t in one.values()
    ]
    return (nbytes(two) - nbytes(one)) / tokens, rows


def lowered_for_cuda(shape: dict, precision: str, remat: bool) -> str:
    """The StableHLO of one AdamW train step of the LM at `shape`, lowered for CUDA as on an H200."""
    import optax

    from research.data import Batch
    from research.train import NextTokenLoss, TrainState, train_step

    model = _model(shape, shape["depth"], precision, remat)
    state = eqx.filter_eval_shape(lambda m: TrainState.create(m, optax.adamw(1e-3), key=jax.random.key(1)), model)
    leaves, static = eqx.partition(state, _is_leaf_array)
    windows = jax.ShapeDtypeStruct((shape["batch"], shape["context"]), jnp.int32)

    def step(leaves, batch):
        new_state, metrics = train_step(eqx.combine(leaves, static), batch, NextTokenLoss())
        return eqx.filter(new_state, eqx.is_array), metrics["loss"]

    with as_on_a_gpu():
        return jax.jit(step).trace(leaves, Batch(windows, windows)).lower(lowering_platforms=("cuda",)).as_text()


_OP = re.compile(r"=\s*\"?(stablehlo\.[a-z_]+|chlo\.[a-z_]+)\"?[ (]")
_RESULT = re.compile(r"->\s*\(?tensor<([0-9x]*)x?([a-z0-9]+)>")
_CUSTOM = re.compile(r"custom_call @([\w$]+)")


def op_mix(program: str, activation: int) -> dict[str, collections.Counter]:
    """Operations of a lowered program by kind (`all`), and those whose result has at least `activation`
    elements (`activation-size`), with `float32` the activation-size results in float32 by kind."""
    counts = {"all": collections.Counter(), "activation-size": collections.Counter(), "float32": collections.Counter()}
    for line in program.splitlines():
        if not (op := _OP.search(line)):
            continue
        kind = op.group(1).split(".", 1)[1]
        if kind == "custom_call" and (target := _CUSTOM.search(line)):
            kind = f"custom_call {target.group(1)}"
        counts["all"][kind] += 1
        if (result := _RESULT.search(line)) is None:
            continue
        dims, dtype = result.groups()
        if int(np.prod([int(d) for d in dims.split("x") if d] or [1])) >= activation:
            counts["activation-size"][kind] += 1
            if dtype == "f32":
                counts["float32"][kind] += 1
    return counts


KINDS = (
    "dot_general",
    "convert",
    "transpose",
    "custom_call __cudnn$fmhaSoftmax",
    "custom_call __cudnn$fmhaSoftmaxBackward",
)


def markdown(shape: dict, precision: str, remat: bool) -> str:
    name = next((k for k, v in SHAPES.items() if v == shape), str(shape))
    with as_on_a_gpu():
        ours = ours_saved_per_token(shape, precision, remat)
        breakdown = ours_block_breakdown(shape, precision, remat)
    torch_total, torch_rows = nanogpt_saved_per_token(shape, precision)
    lines = [
        f"**{name}** ({shape}), {precision}, remat {'on' if remat else 'off (save_only_these_names)'}",
        "",
        "| saved for the backward pass, bytes a token | ours | nanoGPT's block, PyTorch eager |",
        "| --- | --- | --- |",
        f"| a block | {ours['block']:,.0f} | {torch_total:,.0f} |",
        f"| outside the blocks (embedding, final norm, logits, loss) | {ours['outside']:,.0f} | |",
        "",
        "| ours: one block keeps | bytes a token |",
        "| --- | --- |",
        *(f"| {what} — {source} | {size:,.0f} |" for what, source, size in breakdown),
        "",
        "| nanoGPT's block keeps (PyTorch) | bytes a token |",
        "| --- | --- |",
        *(f"| {what} | {size:,.0f} |" for what, size in torch_rows),
    ]
    mix = op_mix(lowered_for_cuda(shape, precision, remat), shape["batch"] * shape["context"] * shape["dim"])
    lines += [
        "",
        "| lowered for CUDA: operations | in the program | of activation size | of which float32 |",
        "| --- | --- | --- | --- |",
        *(
            f"| {kind} | {mix['all'][kind]} | {mix['activation-size'][kind]} | {mix['float32'][kind]} |"
            for kind in sorted(set(KINDS) | set(mix["activation-size"]), key=lambda k: -mix["activation-size"][k])
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_anatomy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="gpt2-small", help="model shape (default: gpt2-small)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="compute dtype (default: bf16)")
    parser.add_argument("--remat", action="store_true", help="rematerialise each block whole (the lm's --remat)")
    args = parser.parse_args(argv)
    print(markdown(SHAPES[args.shape], args.precision, args.remat), end="")


if __name__ == "__main__":
    main()
