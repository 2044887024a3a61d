"""Sampling from a byte-level language model: the key-value cache computes what the whole model does,
greedy generation matches a loop that re-runs the model (past its context too), keys and top-k, the
refusals, and scripts/sample on a trained run."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.cli import main_entry
from research.data import read_text_bytes, split_held_out
from research.experiment import load_experiment
from research.nn import LanguageModel, build_model, generate
from research.nn._generate import START_TOKEN, generate_with_logits
from research.tools import sample

ROOT = Path(__file__).parent.parent
SHAPE = {"context": 16, "dim": 32, "depth": 2, "heads": 4}  # the tiny run below has it too: one compile of both
CONTEXT = SHAPE["context"]
LENGTH = 200  # what the experiment samples: after a 5-byte prompt the window re-fills 22 times
PROMPT = jnp.asarray(np.frombuffer(b"hello", np.uint8))


@pytest.fixture(scope="module")
def model() -> LanguageModel:
    return build_model("lm", key=jax.random.key(3), **SHAPE)[0]


@pytest.fixture(scope="module", params=["tied", "untied"])
def either_head(request, model) -> LanguageModel:
    """The tied model, and one with its own head (each compiles its loop: the other tests use the tied one)."""
    return model if request.param == "tied" else build_model("lm", key=jax.random.key(4), tied=False, **SHAPE)[0]


def windows(stream: list[int], prompt_length: int) -> list[list[int]]:
    """The tokens the model sees before each generated token of `stream`, by generate's rule written
    out the slow way: at most the prompt's last `context`; when a window is full, the next one starts
    from its last `context // 2` tokens (the new one included)."""
    start, seen = max(0, prompt_length - CONTEXT), []
    for end in range(prompt_length, len(stream)):
        if end - start > CONTEXT:
            start = end - CONTEXT // 2
        seen.append(stream[start:end])
    return seen


@eqx.filter_jit
def _forward(model: LanguageModel, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def last_logits(model: LanguageModel, window: list[int]) -> jax.Array:
    """The whole model's `model(window)[-1]`, without a cache: `window` padded to the context (the model
    is causal, so padding changes nothing before it: tests/test_lm.py) to compile the model once."""
    padded = np.zeros(CONTEXT, np.int32)
    padded[: len(window)] = window
    return _forward(model, jnp.asarray(padded))[len(window) - 1]


@pytest.mark.slow
def test_cached_logits_equal_the_whole_models_at_every_position(either_head):
    model = either_head
    tokens, logits = generate_with_logits(model, PROMPT, LENGTH, key=jax.random.key(0), temperature=1.0)
    stream = [*np.asarray(PROMPT).tolist(), *np.asarray(tokens).tolist()]
    seen = windows(stream, len(PROMPT))
    assert [len(w) for w in seen].count(CONTEXT // 2) == 22 and max(map(len, seen)) == CONTEXT  # re-filled
    np.testing.assert_allclose(logits, np.stack([last_logits(model, w) for w in seen]), atol=1e-5, rtol=0)


def test_greedy_generation_equals_a_loop_that_reruns_the_model(model):
    """Past the context too: the reference re-runs the whole model on the window generate's rule gives."""
    long_prompt = jnp.asarray(np.arange(CONTEXT + 5) % 256, jnp.int32)  # longer than the context: its last 16
    for prompt in (PROMPT, long_prompt):
        stream, start = np.asarray(prompt).tolist(), max(0, len(prompt) - CONTEXT)
        for _ in range(LENGTH):
            if len(stream) - start > CONTEXT:
                start = len(stream) - CONTEXT // 2
            stream.append(int(jnp.argmax(last_logits(model, stream[start:]))))
        generated = generate(model, prompt, LENGTH, key=jax.random.key(0), temperature=0)
        assert np.asarray(generated).tolist() == stream[len(prompt) :]


def test_keys_temperature_and_top_k(model):
    key = jax.random.key(7)
    first = generate(model, PROMPT, LENGTH, key=key)
    assert generate(model, PROMPT, LENGTH, key=key).tolist() == first.tolist()  # the same key, the same tokens
    assert generate(model, PROMPT, LENGTH, key=jax.random.key(8)).tolist() != first.tolist()
    greedy = generate(model, PROMPT, LENGTH, key=key, temperature=0)
    assert generate(model, PROMPT, LENGTH, key=jax.random.key(8), top_k=1).tolist() == greedy.tolist()
    tokens, logits = generate_with_logits(model, PROMPT, LENGTH, key=key, temperature=2.0, top_k=3)
    top3 = np.argsort(np.asarray(logits), axis=-1)[:, -3:]
    # only ever one of the 3 likeliest
    assert all(token in row for token, row in zip(np.asarray(tokens), top3, strict=True))
    assert generate(model, PROMPT, LENGTH, key=key, temperature=2.0, top_k=3).tolist() == tokens.tolist()
    assert first.dtype == jnp.int32 and first.shape == (LENGTH,)


def test_an_empty_prompt_starts_after_a_newline(model):
    newline = jnp.asarray([START_TOKEN], jnp.int32)
    empty = generate(model, jnp.zeros(0, jnp.int32), LENGTH, key=jax.random.key(0), temperature=0)
    assert empty.tolist() == generate(model, newline, LENGTH, key=jax.random.key(0), temperature=0).tolist()


@pytest.mark.slow
def test_bf16_compute_gives_the_whole_models_logits_to_bf16_rounding():
    model = build_model("lm", key=jax.random.key(3), compute_dtype="bfloat16", **SHAPE)[0]
    tokens, logits = generate_with_logits(model, PROMPT, LENGTH, key=jax.random.key(0), temperature=0)
    stream = [*np.asarray(PROMPT).tolist(), *np.asarray(tokens).tolist()]
    expected = np.stack([last_logits(model, w) for w in windows(stream, len(PROMPT))])
    np.testing.assert_allclose(logits, expected, atol=0.01, rtol=0)  # measured 1e-3: one bf16 step at ~0.3
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"length": 0}, "length must be at least 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": 0}, r"top_k must be in 1..256"),
        ({"top_k": 257}, r"top_k must be in 1..256"),
        ({"prompt": jnp.asarray([104, 300, 105])}, r"prompt token 300 at position 1 is outside .* 0..255"),
        ({"prompt": jnp.asarray([-1])}, r"prompt token -1 at position 0"),
    ],
)
def test_bad_arguments_are_refused_saying_what_and_where(arguments, message):
    # refused before any computation: a model of shapes alone will do (building arrays costs seconds)
    model = eqx.filter_eval_shape(lambda: build_model("lm", key=jax.random.key(0), **SHAPE)[0])
    call = {"prompt": PROMPT, "length": 4, **arguments}
    with pytest.raises(ValueError, match=message):
        generate(model, call.pop("prompt"), call.pop("length"), key=jax.random.key(0), **call)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> tuple[Path, str]:
    """A tiny trained lm run (no EMA), through the experiment's own main (what ./scripts/run lm runs), and
    what it printed."""
    root = tmp_path_factory.mktemp("sample")
    (root / "text.txt").write_bytes("the quick brown fox jumps over the lazy dog. é ".encode() * 100)
    module = load_experiment("lm")
    shape = [f"--{name}={value}" for name, value in SHAPE.items()]
    flags = [
        "--text",
        str(root / "text.txt"),
        *shape,
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--steps-per-call",
        "2",
        "--log-every",
        "2",
        "--no-progress",
        "--run-dir",
        str(root / "lm"),
    ]
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        main_entry(module.main, module.Config, flags)
    return root / "lm", out.getvalue()


@pytest.mark.slow
def test_the_experiment_ends_with_a_sample_of_its_final_model(lm_run):
    """One line, newlines escaped: what the checkpointed final model writes after the held-out text's
    first 32 bytes, with the key the experiment folds from its seed."""
    run_dir, printed = lm_run
    line = printed.splitlines()[-1]
    held_out = split_held_out(read_text_bytes(run_dir.parent / "text.txt"), 0.05)[1]
    expected = sample.sample_bytes(
        sample.load_language_model(run_dir),
        bytes(held_out[:32]),
        200,
        key=jax.random.fold_in(jax.random.key(0), 1),
        temperature=0.8,
        top_k=40,
    )
    shown = [repr(text.decode("utf-8", errors="replace")) for text in (expected.prompt, expected.text)]
    assert line.startswith(f"lm: sample: {shown[0]} + {shown[1]} (200 bytes at temperature 0.8, top-k 40: "), line
    assert re.fullmatch(r".*: [\d,]+ bytes/s with the key-value cache\)", line)


def test_sample_prints_the_prompt_and_the_bytes_after_it(lm_run, capsys, monkeypatch):
    run_dir, loaded = lm_run[0], []
    load = sample.load_language_run
    monkeypatch.setattr(sample, "load_language_run", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[0])
    sample.main([str(run_dir), "--prompt", "the quick é", "--bytes", "200", "--seed", "1"])
    captured = capsys.readouterr()
    assert captured.out.startswith("the quick é") and captured.err.count("\n") == 1
    assert re.fullmatch(r"sample: 200 bytes in [\d.]+ s: [\d,]+ bytes/s .*\n", captured.err)
    model, tokenizer = loaded[0]  # what the tool sampled from: the bytes it printed, before decoding
    assert tokenizer is None  # a byte model
    result = sample.sample_bytes(model, "the quick é".encode(), 200, key=jax.random.key(1), top_k=40)
    assert result.prompt == "the quick é".encode() and len(result.text) == 200  # bytes, whatever they decode to
    assert captured.out == result.decoded() + "\n"


def test_sample_refuses_in_one_line_with_status_2(lm_run, tmp_path, capsys):
    run_dir = lm_run[0]
    (tmp_path / "no_checkpoint").mkdir()
    shutil.copy(run_dir / "config.json", tmp_path / "no_checkpoint")
    (tmp_path / "xor").mkdir()
    record = json.loads((run_dir / "config.json").read_text())
    (tmp_path / "xor/config.json").write_text(json.dumps({**record, "experiment": "xor"}))
    cases = {
        (str(tmp_path / "xor"),): "is a run of xor, not of lm",
        (str(tmp_path / "no_checkpoint"),): "no checkpoint to load",
        (str(run_dir), "--ema"): "kept no EMA of its weights",
        (str(tmp_path / "nothing"),): "is not a run directory",
        (str(run_dir), "--top-k", "300"): "top_k must be in 1..256 (the vocabulary) or None, got 300",
        (str(run_dir), "--bytes", "0"): "invalid int in 1..1000000000 value: '0'",
        (str(run_dir), "--temperature", "-1"): "invalid float in 0..inf value: '-1'",
    }
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            sample.main(list(argv))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, (argv, err)
