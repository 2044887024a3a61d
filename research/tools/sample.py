"""Text sampled from a trained byte-level language model (a run of `./scripts/run lm`).

    scripts/sample RUN_DIR [--prompt TEXT] [--bytes N] [--temperature T] [--top-k K] [--seed S] [--ema]

Prints the prompt followed by the `--bytes` bytes the model writes after it (`research.nn.generate`,
with its key-value cache), decoded as UTF-8 (a broken sequence shows as U+FFFD), and on stderr one line
with the generation speed in bytes/s, timed on a second call (the first one compiles the loop).
"""

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..experiment import load_run
from ..messages import messages_to_stderr
from ..nn import LanguageModel, generate
from ..typing import PRNGKeyArray
from ._runs import Parser, UsageError, fail, open_runs


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
) -> Sample:
    """`length` bytes `model` writes after `prompt`, generated twice with `key`: the first call compiles,
    the second is timed. See `research.nn.generate` for the arguments."""
    if model.vocab > 256:
        raise UsageError(f"the model has {model.vocab} tokens, not bytes: its tokens cannot be written as text")
    tokens = jnp.asarray(np.frombuffer(prompt, np.uint8).astype(np.int32))

    def run() -> np.ndarray:
        return np.asarray(generate(model, tokens, length, key=key, temperature=temperature, top_k=top_k))

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    text = run().astype(np.uint8).tobytes()
    seconds = time.perf_counter() - start
    return Sample(prompt, text, seconds, max(first - seconds, 0.0))


def load_language_model(run_dir: str | Path, *, ema: bool = False) -> LanguageModel:
    """The trained model (`ema`: the EMA model) of an `lm` run's newest valid checkpoint."""
    experiment = open_runs([run_dir])[0].read_config().get("experiment")
    if experiment != "lm":
        raise UsageError(
            f"{run_dir} is a run of {experiment}, not of lm: sample from a language model trained with ./scripts/run lm"
        )
    run = load_run(run_dir)
    if run.setup.population:
        raise UsageError(f"{run.path} is a population of models: sample from one member's run")
    model = run.ema_model if ema else run.model
    if model is None:
        raise UsageError(f"--ema: the run in {run.path} kept no EMA of its weights (it trained without --ema-decay)")
    if not isinstance(model, LanguageModel):
        raise UsageError(f"{run.path} holds a {type(model).__name__}, not a LanguageModel")
    return model


def _within(low: int | float, high: int | float, kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value

    parse.__name__ = f"{kind.__name__} in {low}..{high}"  # argparse names the type in its message
    return parse


def _parser() -> Parser:
    parser = Parser(
        prog="sample",
        usage="scripts/sample RUN_DIR [--prompt TEXT] [--bytes N] [--temperature T] [--top-k K] [--seed S] [--ema]",
        description="Print text sampled from a trained byte-level language model (an lm run).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="an lm run directory (with config.json and a checkpoint)")
    parser.add_argument(
        "--prompt", default="", help="the text to continue (default: none, the model starts after a newline)"
    )
    parser.add_argument("--bytes", type=_within(1, 10**9, int), default=256, help="bytes to generate (default 256)")
    parser.add_argument(
        "--temperature",
        type=_within(0, float("inf"), float),
        default=0.8,
        help="sampling temperature; 0: always the most likely byte (default 0.8)",
    )
    parser.add_argument(
        "--top-k",
        type=_within(0, 256, int),
        default=40,
        help="sample among the K most likely bytes; 0: all of them (default 40)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    parser.add_argument("--ema", action="store_true", help="the EMA model (a run with --ema-decay)")
    return parser


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        model = load_language_model(args.run_dir, ema=args.ema)
        sample = sample_bytes(
            model,
            args.prompt.encode(),
            args.bytes,
            key=jax.random.key(args.seed),
            temperature=args.temperature,
            top_k=args.top_k or None,
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
