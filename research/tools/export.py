"""The weights of a trained run in the format the rest of the field exchanges them in.

    scripts/export RUN_DIR [--format safetensors|npz|hf] [--ema] [-o FILE]

Writes the model's arrays (`--ema`: the EMA model's) of the run's newest valid checkpoint under their
names (`research.nn.array_names`: `blocks.0.conv1.weight`, ...), a stateful model's state (BatchNorm's
running statistics) under `state.` and theirs, and in the metadata the experiment, the step, the model's
class and the run's config (JSON). `research.nn.load_weights(FILE, model, state)` loads it back into a
model built with that config; the `safetensors` library (or `np.load`) reads it anywhere. A model trained
with LoRA adapters (`--lora-rank`) is written with them merged into its weights: the base model's.
`--format hf` writes an `lm` run's model as a GPT-2 directory that `transformers` loads, with the run's
tokenizer.json, and an `images` run's ViT (`--model vit`, `--init-from`) as a ViT image classifier with its
image processor (`ViTForImageClassification`, `ViTImageProcessor`).
"""

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import install
from ..cli import use_compilation_cache
from ..errors import ResearchInputError
from ..experiment import load_experiment, load_run
from ..messages import messages_to_stderr
from ..nn import LanguageModel, LoRA, VisionTransformer, save_gpt2, save_vit, save_weights
from ._runs import Parser, UsageError, fail


def export_weights(
    run_dir: str | Path, out: str | Path | None = None, *, format: str = "safetensors", ema: bool = False
) -> Path:
    """Write the weights of the run in `run_dir` to `out` (default: `RUN_DIR/model[-ema].FORMAT`); returns it."""
    run = load_run(run_dir)
    model, state = (run.ema_model, run.ema_model_state) if ema else (run.model, run.model_state)
    if model is None:
        raise UsageError(f"--ema: the run in {run.path} kept no EMA of its weights (it trained without --ema-decay)")
    if run.setup.population:
        raise UsageError(
            f"{run.path} is a population of models: export one member's run ({install.command('sweep')} --vmapped "
            "writes one a member)"
        )
    if isinstance(model, LoRA):  # the adapters merged into the weights: the base model's class and names
        model = model.merged()
    if format == "hf":
        return _export_hugging_face(
            run, model, Path(out) if out is not None else run.path / f"hf{'-ema' if ema else ''}"
        )
    metadata = {
        "format": "research weights 1",
        "experiment": run.experiment,
        "step": str(run.step),
        "model": type(model).__name__,
        "ema": json.dumps(ema),
        "config": json.dumps(run.config.to_dict()),
    }
    suffix = "safetensors" if format == "safetensors" else "npz"
    out = Path(out) if out is not None else run.path / f"model{'-ema' if ema else ''}.{suffix}"
    if (out.suffix == ".safetensors") != (format == "safetensors"):
        raise UsageError(f"-o {out}: a {format} file's name ends in .{suffix}")
    save_weights(out, model, state, metadata=metadata)
    return out


def _export_hugging_face(run: Any, model: Any, out: Path) -> Path:
    """A directory `transformers` loads (`save_pretrained`'s layout): a language model as a GPT-2, with the
    tokenizer.json its run read text with; a ViT as a ViT image classifier, with its image processor."""
    if isinstance(model, VisionTransformer):
        save_vit(model, out)
        return out
    if not isinstance(model, LanguageModel):
        raise UsageError(
            f"--format hf: {run.path} holds a {type(model).__name__}; only language models (lm, as GPT-2) and "
            "ViTs (images --model vit, as ViTForImageClassification) go out to transformers"
        )
    save_gpt2(model, out)
    tokenizer = load_experiment("lm").text_tokenizer(run.config)
    if tokenizer is not None:
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
    return out


def _parser() -> Parser:
    parser = Parser(
        prog="export",
        usage=f"{install.command('export')} RUN_DIR [--format safetensors|npz|hf] [--ema] [-o FILE]",
        description="Write a trained run's weights under their names, with its config, to a safetensors or .npz file; "
        "or a language model or a ViT as a Hugging Face directory.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with config.json and a checkpoint)")
    parser.add_argument(
        "--format",
        choices=("safetensors", "npz", "hf"),
        default="safetensors",
        help="safetensors (the default), numpy's .npz, or hf: an lm run's model or an images run's ViT as a directory "
        "transformers loads (GPT2LMHeadModel, ViTForImageClassification.from_pretrained; default RUN_DIR/hf[-ema])",
    )
    parser.add_argument("--ema", action="store_true", help="the EMA model's weights (a run with --ema-decay)")
    parser.add_argument("-o", "--out", default=None, help="the file to write (default: RUN_DIR/model[-ema].FORMAT)")
    return parser


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    use_compilation_cache()  # what loading the run compiles (merging LoRA adapters, say)
    try:
        out = export_weights(args.run_dir, args.out, format=args.format, ema=args.ema)
    except (UsageError, ResearchInputError) as e:
        fail(parser.prog, e)
    print(f"export: the {'EMA model' if args.ema else 'model'} of {args.run_dir} written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
