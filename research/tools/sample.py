"""Samples of a trained generative run: text from a byte-level language model (`./scripts/run lm`), or a
grid of images from an image model (`gan`, `diffusion`).

    scripts/sample RUN_DIR [--prompt TEXT] [--bytes N] [--temperature T] [--top-k K] [--seed S] [--ema]
    scripts/sample RUN_DIR [--count N] [--seed S] [--ema] [-o FILE]

Of a language model, prints the prompt followed by the `--bytes` bytes the model writes after it
(`research.nn.generate`, with its key-value cache), decoded as UTF-8 (a broken sequence shows as
U+FFFD), and on stderr one line with the generation speed in bytes/s, timed on a second call (the first
one compiles the loop). Of an image model (an experiment whose script defines `sampler(config)`),
writes `--count` images drawn with the keys of `--seed` as one PNG grid (`-o`, default
`RUN_DIR/sample-seed<S>.png`) and says where on stderr.
"""

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import install
from ..cli import use_compilation_cache
from ..data import TextTokenizer
from ..experiment import load_experiment, load_run
from ..judge import sample_images
from ..messages import messages_to_stderr
from ..nn import LanguageModel, LoRA, generate
from ..report import save_image_grid
from ..typing import PRNGKeyArray
from ._runs import Parser, UsageError, fail, open_runs, within


@dataclasses.dataclass(frozen=True)
class Sample:
    """Bytes a model wrote after `prompt`, and how long it took (`seconds`: the second, compiled call)."""

    prompt: bytes
    text: bytes
    seconds: float
    compile_seconds: float

    @property
    def bytes_per_s(self) -> float:
        return len(self.text) / max(self.seconds, 1e-9)

    def decoded(self) -> str:
        """The prompt and the text as one UTF-8 string (a sequence split between them decodes whole)."""
        return (self.prompt + self.text).decode("utf-8", errors="replace")


def sample_bytes(
    model: LanguageModel,
    prompt: bytes,
    length: int,
    *,
    key: PRNGKeyArray,
    temperature: float | int = 0.8,
    top_k: int | None = 40,
    tokenizer: TextTokenizer | None = None,
) -> Sample:
    """`length` bytes (of a model over a `tokenizer`'s vocabulary: tokens, decoded) `model` writes after
    `prompt`, generated twice with `key`: the first call compiles, the second is timed. See
    `research.nn.generate` for the arguments."""
    if tokenizer is None and model.vocab > 256:
        raise UsageError(f"the model has {model.vocab} tokens, not bytes: its tokens need the run's tokenizer")
    prompt_array = np.frombuffer(prompt, np.uint8)
    tokens = jnp.asarray(prompt_array.astype(np.int32) if tokenizer is None else tokenizer.encode(prompt_array))

    def run() -> np.ndarray:
        return np.asarray(generate(model, tokens, length, key=key, temperature=temperature, top_k=top_k))

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    generated = run()
    seconds = time.perf_counter() - start
    text = generated.astype(np.uint8).tobytes() if tokenizer is None else tokenizer.decode(generated)
    return Sample(prompt, text, seconds, max(first - seconds, 0.0))


def load_language_model(run_dir: str | Path, *, ema: bool = False) -> LanguageModel:
    """The trained model (`ema`: the EMA model) of an `lm` run's newest valid checkpoint."""
    return load_language_run(run_dir, ema=ema)[0]


def load_language_run(run_dir: str | Path, *, ema: bool = False) -> tuple[LanguageModel, TextTokenizer | None]:
    """`load_language_model`'s model, and the tokenizer the run read its text with (`--tokenizer`,
    `--init-from`'s; None: bytes)."""
    experiment = open_runs([run_dir])[0].read_config().get("experiment")
    if experiment != "lm":
        raise UsageError(
            f"{run_dir} is a run of {experiment}, not of lm: sample from a language model trained with "
            f"{install.command('run')} lm"
        )
    run = load_run(run_dir)
    if run.setup.population:
        raise UsageError(f"{run.path} is a population of models: sample from one member's run")
    model = run.ema_model if ema else run.model
    if model is None:
        raise UsageError(f"--ema: the run in {run.path} kept no EMA of its weights (it trained without --ema-decay)")
    if isinstance(model, LoRA):
        model = model.merged()
    if not isinstance(model, LanguageModel):
        raise UsageError(f"{run.path} holds a {type(model).__name__}, not a LanguageModel")
    return model, load_experiment("lm").text_tokenizer(run.config)


def draw_images(run_dir: str | Path, count: int, *, seed: int = 0, ema: bool = False) -> np.ndarray:
    """`count` uint8 images drawn by the trained model of an image run (`ema`: its EMA's) with the keys of
    `seed`, through its experiment script's `sampler(config)`."""
    experiment = open_runs([run_dir])[0].read_config().get("experiment", "?")
    module = load_experiment(experiment)
    if not hasattr(module, "sampler"):
        raise UsageError(f"{run_dir} is a run of {experiment}, which draws no images (gan and diffusion do)")
    run = load_run(run_dir)
    if run.setup.population:
        raise UsageError(f"{run.path} is a population of models: sample from one member's run")
    model, model_state = (run.ema_model, run.ema_model_state) if ema else (run.model, run.model_state)
    if model is None:
        raise UsageError(f"--ema: the run in {run.path} kept no EMA of its weights (it trained with --ema-decay 0)")
    return sample_images(module.sampler(run.config), model, model_state, count, seed=seed)


TEXT_OPTIONS = ("prompt", "bytes", "temperature", "top_k")
IMAGE_OPTIONS = ("count", "out")


def _parser() -> Parser:
    shown = install.command("sample")
    parser = Parser(
        prog="sample",
        usage=f"{shown} RUN_DIR [--prompt TEXT] [--bytes N] [--temperature T] [--top-k K] [--seed S] [--ema]\n"
        f"       {shown} RUN_DIR [--count N] [--seed S] [--ema] [-o FILE]",
        description="Print text sampled from a trained byte-level language model (an lm run), or write a grid of "
        "images drawn by a trained image model (a gan or diffusion run).",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="an lm, gan or diffusion run directory (with config.json and a checkpoint)"
    )
    parser.add_argument(
        "--prompt", default=None, help="the text to continue (default: none, the model starts after a newline)"
    )
    parser.add_argument(
        "--bytes",
        type=within(1, 10**9, int),
        default=None,
        help="bytes to generate, tokens of a run with a tokenizer (default 256)",
    )
    parser.add_argument(
        "--temperature",
        type=within(0, float("inf"), float),
        default=None,
        help="sampling temperature; 0: always the most likely byte (default 0.8)",
    )
    parser.add_argument(
        "--top-k",
        type=within(0, 10**7, int),
        default=None,
        help="sample among the K most likely bytes or tokens; 0: all of them (default 40)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    parser.add_argument("--ema", action="store_true", help="the EMA model (a run with --ema-decay)")
    parser.add_argument(
        "--count", type=within(1, 10**5, int), default=None, help="images to draw, of an image run (default 64)"
    )
    parser.add_argument(
        "-o", "--out", default=None, help="the PNG file of an image run's grid (default: RUN_DIR/sample-seed<S>.png)"
    )
    return parser


def _image_run(run_dir: str) -> bool:
    experiment = open_runs([run_dir])[0].read_config().get("experiment")
    return experiment != "lm" and hasattr(load_experiment(str(experiment)), "sampler")


def _refuse_options_of_the_other_kind(args: Any, image_run: bool) -> None:
    given = [name for name in (TEXT_OPTIONS if image_run else IMAGE_OPTIONS) if getattr(args, name) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        takes = "--count, -o" if image_run else "--prompt, --bytes, --temperature, --top-k"
        kind = "an image run, which draws images" if image_run else "a language model's run, which writes text"
        raise UsageError(f"{flags}: {args.run_dir} is {kind}; it takes {takes}")


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    use_compilation_cache()  # the sampling loop, compiled by an earlier sample of this run or another
    try:
        image_run = _image_run(args.run_dir)
        _refuse_options_of_the_other_kind(args, image_run)
        if image_run:
            images = draw_images(args.run_dir, args.count or 64, seed=args.seed, ema=args.ema)
            out = save_image_grid(args.out or Path(args.run_dir) / f"sample-seed{args.seed}.png", images)
            print(f"sample: {len(images)} images of {args.run_dir} written to {out}", file=sys.stderr)
            return
        model, tokenizer = load_language_run(args.run_dir, ema=args.ema)
        sample = sample_bytes(
            model,
            (args.prompt or "").encode(),
            args.bytes or 256,
            key=jax.random.key(args.seed),
            temperature=0.8 if args.temperature is None else args.temperature,
            top_k=40 if args.top_k is None else (args.top_k or None),
            tokenizer=tokenizer,
        )
    except ValueError as e:  # UsageError, ResearchInputError (a run that is missing or cannot load), generate's
        fail(parser.prog, e)
    print(sample.decoded())
    print(
        f"sample: {len(sample.text)} bytes in {sample.seconds:.3f} s: {sample.bytes_per_s:,.0f} bytes/s (the loop "
        f"compiled in {sample.compile_seconds:.1f} s before)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
