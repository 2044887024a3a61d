"""A byte-level decoder-only transformer language model (research.nn.LanguageModel).

By default it reads the first `--text-bytes` of this Python's standard library source (`*.py`, in
sorted order), holds out the last `--held-out` of the bytes, and learns to predict each next byte
of non-overlapping `--context`-byte windows (`--text` takes a file, a folder, or a Hugging Face datasets
directory: its `--text-column`, a row a line, a DatasetDict's test split held out). It reports held-out
bits per byte beside two yardsticks on the same bytes (byte frequencies, zlib -9) and the training
throughput in bytes/s, then prints what the trained model writes after the start of the held-out text
(`research.nn.generate`).

`--tokens FILE` trains on a file of tokens instead (nanoGPT's or llm.c's train.bin, larger than memory: memory-
mapped, random windows drawn per step from the seed), held out from `--held-out-tokens` (a val.bin) or its tail,
and evaluated on the first `--eval-windows` windows of the held-out tokens.
"""

import dataclasses
import functools
from pathlib import Path
from typing import ClassVar

import equinox as eqx
import jax
import numpy as np
import optax

from research.cli import (
    ConfigError,
    FineTuning,
    TrainConfig,
    Training,
    group,
    main_entry,
    non_negative,
    option,
    positive,
)
from research.data import (
    DeviceLoader,
    TextTokenizer,
    TokenFile,
    TokenSpan,
    TokenWindows,
    check_token_dtype,
    is_datasets_directory,
    next_byte_windows,
    open_tokens,
    read_datasets_text,
    read_text_bytes,
    reference_bits_per_byte,
    split_held_out,
    token_spans,
)
from research.experiment import Setup, initial_model, run_experiment, saved_run_config
from research.nn import LanguageModel, LoRA, build_model, load_gpt2
from research.services import Headline
from research.tools.sample import sample_bytes
from research.train import FitResult, NextTokenLoss, SupervisedStep, TrainState
from research.train.evaluation import evaluate_language_model
from research.train.fine_tuning import Frozen, check_fine_tuning, only_trainable, trained_pattern, with_adapters
from research.typing import PRNGKeyArray

GPT2_VOCAB = 50257  # the vocabulary of nanoGPT's and llm.c's GPT-2 token files
EVAL_WINDOWS = 256  # --tokens' held-out windows evaluated by default


def _fraction(value: float) -> str | None:
    return None if 0 < value < 0.5 else "must be in (0, 0.5)"


@dataclasses.dataclass(frozen=True)
class LMTraining(Training):
    batch_size: int = option(32, "windows per optimizer step (split over --grad-accum micro-batches)", check=positive)
    lr: float = option(
        3e-3, "peak learning rate (linear warmup over the first 5% of steps, cosine to 10%)", check=positive
    )
    steps_per_call: int = option(50, "training steps per compiled call", check=positive)
    log_every: int = option(100, "steps between logged training metrics", check=positive, resumable=True)


@dataclasses.dataclass(frozen=True)
class LMFineTuning(FineTuning):
    init_from: str | None = option(
        None,
        "start from a GPT-2 saved by Hugging Face transformers (a save_pretrained directory) or from an lm run (its "
        "trained model, not its EMA's): its shape and weights (--dim, --depth, --heads, --untied then keep their "
        "defaults), and its tokenizer",
    )
    trainable: str = option(
        "all",
        "what trains: all, head (an --untied head), or a regular expression searched in the parameters' names "
        "(norm, blocks.mlp_, ...); the rest keeps its weights and takes no optimizer state",
        check=lambda value: None if value else "must name what trains (all: everything)",
    )


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train a GPT-style byte-level language model (AdamW, warmup + cosine decay, gradient clipping at 1)."""

    headline: ClassVar[Headline] = Headline("accuracy")
    training: LMTraining = group(LMTraining)
    steps: int = option(4800, "training steps", check=positive, resumable=True)
    weight_decay: float = option(0.0, "decoupled weight decay (AdamW)", check=non_negative)
    context: int = option(128, "bytes per window (learned positions)", check=positive)
    depth: int = option(4, "transformer blocks (stacked and run with lax.scan)", check=positive)
    dim: int = option(64, "model width", check=positive)
    heads: int = option(4, "attention heads (must divide --dim)", check=positive)
    untied: bool = option(False, "give the output head its own weights instead of the token embedding's")
    text: str | None = option(
        None,
        "a file or a folder (all its files, sorted) to learn, or a Hugging Face datasets directory (save_to_disk) "
        "whose --text-column it learns (a DatasetDict: its train split, its test split held out); default: the "
        "Python standard library's *.py source",
    )
    text_column: str = option("text", "the column of text of a datasets directory --text (a row a line)")
    text_bytes: int = option(16_000_000, "read at most this many bytes of the text", check=positive)
    held_out: float = option(0.05, "fraction of the bytes (the last ones) held out for evaluation", check=_fraction)
    val_fraction: float = option(
        0.0,
        "fraction of the training bytes (the last ones, before the held-out bytes) "
        "kept out of training as a validation set, evaluated as val/... (0: none)",
        check=lambda value: None if value == 0 else _fraction(value),
    )
    remat: bool = option(
        False,
        "recompute each block whole in the backward pass: least memory, a third more compute (default: each block "
        "keeps its products' outputs and recomputes its norms and GELU)",
    )
    tokenizer: str | None = option(
        None,
        "read the text as the tokens of a Hugging Face tokenizer (a tokenizer.json, or a directory with one) "
        "instead of bytes; default: --init-from's tokenizer.json where it has one",
    )
    fine_tuning: LMFineTuning = group(LMFineTuning)
    tokens: str | None = option(
        None,
        "train on a file of tokens instead of text, memory-mapped (it may be larger than memory): nanoGPT's "
        "train.bin (raw tokens, no header) or llm.c's (its header recognised and skipped); each step reads random "
        "windows drawn from (--seed, step)",
    )
    held_out_tokens: str | None = option(
        None, "with --tokens: a file of held-out tokens (a val.bin); default: the last --held-out of --tokens"
    )
    token_dtype: str | None = option(
        None,
        "with --tokens: the width of a token, uint16 or uint32 (a vocabulary above 65,536); default: uint16, or the "
        "width an llm.c header names",
        check=check_token_dtype,
    )
    vocab: int | None = option(
        None,
        f"with --tokens: the model's vocabulary (a token not below it is refused where it is read); default: "
        f"{GPT2_VOCAB} (GPT-2's tokenizer, nanoGPT's and llm.c's) for uint16 tokens, --init-from's vocabulary",
        check=positive,
    )
    eval_windows: int | None = option(
        None,
        f"with --tokens: held-out windows evaluated (non-overlapping, from the held-out tokens' start); default: "
        f"{EVAL_WINDOWS}",
        check=positive,
    )


def text_tokenizer(config: Config) -> TextTokenizer | None:
    """The tokenizer the text is read with (`--tokenizer`, else `--init-from`'s: the tokenizer.json of a
    Hugging Face directory, the one a run of ours read its text with), or None: bytes."""
    if config.tokenizer is not None:
        return TextTokenizer(config.tokenizer)
    init_from = config.fine_tuning.init_from
    if init_from is None:
        return None
    if (source := saved_run_config(init_from, "lm")) is not None:
        return text_tokenizer(source)
    return TextTokenizer(init_from) if (Path(init_from) / "tokenizer.json").is_file() else None


DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def build_state(config: Config) -> TrainState:
    """The step-0 model and optimizer of a config."""
    model_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    model = with_adapters(base_model(config, model_key), config.fine_tuning, key=jax.random.fold_in(model_key, 1))
    adamw = optax.adamw(learning_rate(config), weight_decay=config.weight_decay)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    if pattern := trained_pattern(config.fine_tuning):
        optimizer = only_trainable(optimizer, pattern)
    return TrainState.create(model, optimizer, key=train_key)


def base_model(config: Config, key: PRNGKeyArray) -> LanguageModel:
    """The language model of a config before any adapter: --init-from's, or one drawn with `key`."""
    # Its own precision policy (the matmul weights cast inside its call) also serves sampling after training.
    compute_dtype = "bfloat16" if config.training.precision == "bf16" else "float32"
    if config.fine_tuning.init_from is not None:
        model = initial_model(config.fine_tuning.init_from, "lm", load_gpt2)[0]
        return model.with_compute_dtype(compute_dtype).with_remat(config.remat)
    return build_model(
        "lm",
        key=key,
        context=config.context,
        vocab=model_vocab(config),
        dim=config.dim,
        depth=config.depth,
        heads=config.heads,
        tied=not config.untied,
        remat=config.remat,
        compute_dtype=compute_dtype,
    )[0]


def model_vocab(config: Config) -> int:
    """The vocabulary of a model drawn afresh: --tokens' (--vocab, else GPT-2's for uint16 tokens), the
    tokenizer's, else bytes (256)."""
    if config.tokens is not None:
        return token_vocab(config, open_tokens(config.tokens, config.token_dtype))
    return 256 if (tokenizer := text_tokenizer(config)) is None else tokenizer.vocab


def token_vocab(config: Config, tokens: TokenFile) -> int:
    if config.vocab is not None:
        return config.vocab
    if tokens.tokens.dtype == np.uint16:
        return GPT2_VOCAB
    raise ConfigError(f"--tokens {config.tokens} holds {tokens.tokens.dtype} tokens: give their --vocab")


def learning_rate(config: Config) -> optax.Schedule:
    warmup = max(config.steps // 20, 1) if config.steps > 1 else 0  # one step: no warmup, or no decay would be left
    return optax.warmup_cosine_decay_schedule(
        0.0, config.training.lr, warmup, config.steps, end_value=config.training.lr / 10
    )


def setup(config: Config) -> Setup:
    """The model, the windows of text (or of --tokens) and the loss of a run, built without training."""
    if config.dim % config.heads:
        raise ConfigError(f"--heads {config.heads} must divide --dim {config.dim}")
    check_token_options(config)
    tokens = None if config.tokens is None else open_tokens(config.tokens, config.token_dtype)
    if config.fine_tuning.init_from is not None:
        model = _checked_initial_model(config, None if tokens else text_tokenizer(config))
    else:
        model = eqx.filter_eval_shape(base_model, config, jax.random.key(0))  # shapes only: nothing drawn
    check_fine_tuning(model, config.fine_tuning)
    data = text_data(config) if tokens is None else token_data(config, tokens, model.vocab)
    loss = NextTokenLoss(data.bytes_per_token)
    return Setup(
        build_state=lambda: build_state(config),
        train_data=data.train,
        eval_data=data.held_out,
        num_steps=config.steps,
        step=SupervisedStep(Frozen(loss, pattern) if (pattern := trained_pattern(config.fine_tuning)) else loss),
        lr_schedule=learning_rate(config),
        evaluator=functools.partial(evaluate_language_model, bytes_per_token=data.bytes_per_token),
        val_data=data.val,
    )


@dataclasses.dataclass(frozen=True)
class LMData:
    """What a run trains and evaluates on: its training batches, its held-out and validation windows, and
    the text's bytes a token (1: bytes, or --tokens, whose bytes are unknown)."""

    train: DeviceLoader | TokenWindows
    held_out: DeviceLoader
    val: DeviceLoader | None
    bytes_per_token: float = 1.0


def text_data(config: Config) -> LMData:
    """--text (or the standard library) as bytes or --tokenizer's tokens, split and windowed, in memory."""
    tokenizer = text_tokenizer(config)
    train, held_out = text_splits(config)
    train, val = split_held_out(train, config.val_fraction)
    bytes_per_token = 1.0
    if tokenizer is not None:
        train_bytes, (train, held_out, val) = len(train), (tokenizer.encode(part) for part in (train, held_out, val))
        bytes_per_token = train_bytes / max(len(train), 1)
    train_data = DeviceLoader(
        *next_byte_windows(train, config.context), config.training.batch_size, seed=config.training.seed
    )
    val_data = _evaluation_windows(val, config.context) if config.val_fraction else None
    return LMData(train_data, _evaluation_windows(held_out, config.context), val_data, bytes_per_token)


def token_data(config: Config, tokens: TokenFile, vocab: int) -> LMData:
    """--tokens memory-mapped: random windows of its training part a step (`TokenWindows`), the first
    --eval-windows windows of the held-out tokens (and of the validation part) read into memory."""
    held_out = None
    if config.held_out_tokens is not None:
        held_out = open_tokens(config.held_out_tokens, config.token_dtype, option="--held-out-tokens")
    train, test, val = token_spans(tokens, held_out, config.held_out, config.val_fraction)
    train_data = TokenWindows(train, config.context, config.training.batch_size, seed=config.training.seed, vocab=vocab)
    val_data = None if val is None else _token_evaluation(val, config, vocab, "its validation part")
    return LMData(train_data, _token_evaluation(test, config, vocab, "its held-out part"), val_data)


def _token_evaluation(span: TokenSpan, config: Config, vocab: int, what: str) -> DeviceLoader:
    windows = span.evaluation_windows(config.context, config.eval_windows or EVAL_WINDOWS, vocab, what)
    batch = max(1, config.training.batch_size // config.training.grad_accum)  # what a step's part holds in memory
    return DeviceLoader(*windows, min(batch, len(windows.labels)), shuffle=False)


def check_token_options(config: Config) -> None:
    """Refuse (before any work) the options that contradict --tokens, or that need it."""
    if config.tokens is None:
        needs = {
            "--held-out-tokens": config.held_out_tokens,
            "--token-dtype": config.token_dtype,
            "--vocab": config.vocab,
            "--eval-windows": config.eval_windows,
        }
        if given := [flag for flag, value in needs.items() if value is not None]:
            raise ConfigError(f"{', '.join(given)}: only with --tokens FILE (a token file's options)")
        return
    text = [
        name for name in ("text", "tokenizer", "text_bytes", "text_column") if getattr(config, name) != DEFAULTS[name]
    ]
    if text:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in text)
        raise ConfigError(f"--tokens {config.tokens} trains on tokens, not on text: drop {flags}")
    if config.held_out_tokens is not None and config.held_out != DEFAULTS["held_out"]:
        raise ConfigError(
            "--held-out-tokens are the held-out tokens: drop --held-out (the tail of --tokens without it)"
        )


def text_splits(config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes) of --text: a datasets directory's train and test splits
    (`research.data.read_datasets_text`), else the last --held-out of a file's or a folder's bytes."""
    if config.text is not None and is_datasets_directory(config.text):
        return read_datasets_text(
            config.text, column=config.text_column, max_bytes=config.text_bytes, held_out=config.held_out
        )
    if config.text_column != DEFAULTS["text_column"]:
        raise ConfigError(f"--text-column names a column of a datasets directory; --text {config.text} is not one")
    return split_held_out(read_text_bytes(config.text, max_bytes=config.text_bytes), config.held_out)


def _checked_initial_model(config: Config, tokenizer: TextTokenizer | None) -> LanguageModel:
    """--init-from's model, refused (before any work) where the other options contradict it."""
    shaped = [f"--{name}" for name in ("dim", "depth", "heads", "untied") if getattr(config, name) != DEFAULTS[name]]
    init_from = config.fine_tuning.init_from
    if shaped:
        raise ConfigError(f"--init-from takes the model's shape from {init_from}: drop {', '.join(shaped)}")
    model = initial_model(init_from, "lm", load_gpt2)[0]  # also refuses a damaged or foreign checkpoint
    if config.context > model.context:
        raise ConfigError(f"--context {config.context} is longer than {init_from}'s {model.context} positions")
    if config.tokens is not None:
        if config.vocab is not None and config.vocab != model.vocab:
            raise ConfigError(f"--vocab {config.vocab}: {init_from}'s model has {model.vocab} tokens; drop --vocab")
        return model
    if tokenizer is None and model.vocab != 256:
        raise ConfigError(
            f"--init-from {init_from}: {model.vocab} tokens and no tokenizer.json to read text: give --tokenizer"
        )
    if tokenizer is not None and tokenizer.vocab > model.vocab:
        raise ConfigError(
            f"--tokenizer {tokenizer.path} has {tokenizer.vocab} tokens, more than {init_from}'s {model.vocab}"
        )
    return model


def _evaluation_windows(data: np.ndarray, context: int) -> DeviceLoader:
    windows = next_byte_windows(data, context)
    return DeviceLoader(*windows, min(256, len(windows.labels)), shuffle=False)


def main(config: Config) -> dict:
    tokens_per_step = config.training.batch_size * config.context
    unit = "bytes" if config.tokens is None else "tokens"
    trained: dict[str, LanguageModel] = {}  # the final model (the EMA's with --ema-decay), to sample from

    def throughput(result: FitResult) -> dict:
        model = result.state.averaged().model
        trained["model"] = model.merged() if isinstance(model, LoRA) else model
        return {f"{unit}_per_s": (result.steps_per_s or 0.0) * tokens_per_step}

    summary = run_experiment("lm", config, setup(config), summary_extra=throughput)
    if jax.process_index() != 0:
        return summary
    if config.tokens is not None:
        print(
            f"lm: held-out loss {summary['test_loss']:.3f} nats/token ({summary['test_bits_per_byte']:.3f} bits/"
            f"token); {summary['tokens_per_s']:,.0f} tokens/s trained ({tokens_per_step} a step)"
        )
        return summary  # no sample: nothing here decodes the tokens
    train, held_out = text_splits(config)
    reference = reference_bits_per_byte(train, held_out)
    print(
        f"lm: held-out {summary['test_bits_per_byte']:.3f} bits/byte (same bytes: byte frequencies "
        f"{reference['unigram']:.3f}, zlib -9 {reference['zlib']:.3f}); {summary['bytes_per_s']:,.0f} "
        f"bytes/s trained ({tokens_per_step} a step)"
    )
    if "model" in trained:  # not when a finished run is only reported (scripts/sample reads its checkpoint)
        key = jax.random.fold_in(jax.random.key(config.training.seed), 1)
        print_sample(trained["model"], bytes(held_out[:32]), key, tokenizer=text_tokenizer(config))
    return summary


def print_sample(
    model: LanguageModel, prompt: bytes, key: PRNGKeyArray, length: int = 200, tokenizer: TextTokenizer | None = None
) -> None:
    """One line: what `model` writes after `prompt` (temperature 0.8, top-k 40), newlines shown as \\n."""
    sample = sample_bytes(model, prompt, length, key=key, temperature=0.8, top_k=40, tokenizer=tokenizer)
    shown = lambda text: repr(text.decode("utf-8", errors="replace"))  # noqa: E731
    unit = "bytes" if tokenizer is None else "tokens"
    print(
        f"lm: sample: {shown(sample.prompt)} + {shown(sample.text)} ({length} {unit} at temperature 0.8, top-k 40: "
        f"{sample.bytes_per_s:,.0f} bytes/s with the key-value cache)"
    )


if __name__ == "__main__":
    main_entry(main, Config)
