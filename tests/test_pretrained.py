"""GPT-2 and ViT checkpoints of Hugging Face `transformers` in and out as typed modules: tiny models with random
weights made and saved by `transformers` itself (nothing downloaded), compared with its own logits."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.errors import CheckpointError
from research.nn import LanguageModel, generate, load_gpt2, load_vit, named_arrays, save_gpt2, save_vit

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

VOCAB = 97


def gpt2(tmp_path, name: str = "gpt2", **overrides):
    """A tiny GPT-2 of `transformers` (weights ten times the usual spread, so logits are not all near 0) saved
    to `tmp_path / name`, and the model itself."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **{
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 48,
            "vocab_size": VOCAB,
            "initializer_range": 0.2,
            "bos_token_id": 0,
            "eos_token_id": 0,
            **overrides,
        }
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


def their_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None])).logits[0].numpy()


def our_logits(model: LanguageModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(eqx.filter_jit(model)(jnp.asarray(tokens, jnp.int32)))


TOKENS = np.random.default_rng(0).integers(0, VOCAB, 48)


@pytest.mark.parametrize("tied", [True, False])
def test_a_gpt2_gives_transformers_logits_at_every_position(tmp_path, tied):
    directory, theirs = gpt2(tmp_path, tie_word_embeddings=tied)
    ours = load_gpt2(directory)
    assert (ours.head is None) == tied and ours.context == 48 and ours.vocab == VOCAB and ours.depth == 2
    assert ours.blocks.attention.query_proj.bias is not None  # GPT-2's attention has biases
    expected = their_logits(theirs, TOKENS)
    assert np.abs(expected).max() > 1  # logits far enough from 0 for the comparison to mean something
    np.testing.assert_allclose(our_logits(ours, TOKENS), expected, atol=1e-5, rtol=0)


def test_our_cached_greedy_generation_is_transformers(tmp_path):
    directory, theirs = gpt2(tmp_path)
    prompt = TOKENS[:8]
    with torch.no_grad():
        expected = theirs.generate(
            torch.tensor(prompt[None]), max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, 8:].numpy()
    ours = generate(load_gpt2(directory), jnp.asarray(prompt, jnp.int32), 24, key=jax.random.key(0), temperature=0)
    np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.parametrize("tied", [True, False])
def test_saved_models_load_in_transformers_with_the_same_logits(tmp_path, tied):
    directory, theirs = gpt2(tmp_path, tie_word_embeddings=tied)
    save_gpt2(load_gpt2(directory), tmp_path / "again")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "again").eval()
    np.testing.assert_array_equal(their_logits(again, TOKENS), their_logits(theirs, TOKENS))
    # Any LanguageModel is a GPT-2 (attention without biases: zero biases), as experiments/lm.py trains it
    ours = LanguageModel(context=32, dim=16, depth=2, heads=2, tied=tied, key=jax.random.key(1))
    save_gpt2(ours, tmp_path / "ours")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    bytes_ = np.frombuffer(b"a language model over bytes", np.uint8).astype(np.int64)
    np.testing.assert_allclose(their_logits(loaded, bytes_), our_logits(ours, bytes_), atol=1e-5, rtol=0)


def _edit_tensors(directory, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


BROKEN = {  # what is done to a saved GPT-2, and the message its loading must give
    "missing tensor": (
        lambda d: _edit_tensors(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")),
        "the checkpoint has no tensor h.1.mlp.c_fc.bias",
    ),
    "unexpected tensor": (
        lambda d: _edit_tensors(d, lambda t: t.update({"transformer.h.0.adapter.weight": np.zeros(3, np.float32)})),
        "unexpected tensor h.0.adapter.weight",
    ),
    "shape": (
        lambda d: _edit_tensors(d, lambda t: t.update({"transformer.wpe.weight": np.zeros((40, 32), np.float32)})),
        r"tensor wpe.weight has shape \[40, 32\], the config asks for \[48, 32\]",
    ),
    "architecture": (lambda d: _edit_config(d, model_type="llama"), "model_type 'llama' is not read here"),
    "activation": (lambda d: _edit_config(d, activation_function="relu"), "activation_function 'relu' is not read"),
    "no config": (lambda d: (d / "config.json").unlink(), "it has no config.json"),
    "damaged weights": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64),
        "model.safetensors is not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_damaged_or_foreign_checkpoint_is_refused_in_one_line_naming_what(tmp_path, case):
    directory, _ = gpt2(tmp_path)
    damage, message = BROKEN[case]
    damage(directory)
    with pytest.raises(CheckpointError, match=message) as error:
        load_gpt2(directory)
    assert "\n" not in str(error.value)


def vit(tmp_path, name: str = "vit", **overrides):
    """A tiny ViT image classifier of `transformers` (5 classes, 16 x 16 x 3 images) saved to `tmp_path / name`."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        **{
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "image_size": 16,
            "patch_size": 4,
            "num_channels": 3,
            "num_labels": 5,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, model


IMAGES = np.random.default_rng(1).normal(size=(4, 16, 16, 3)).astype(np.float32)  # height x width x channels


def their_classes(model, images: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(pixel_values=torch.tensor(images.transpose(0, 3, 1, 2))).logits.numpy()  # channels first


def test_a_vit_gives_transformers_class_logits_and_writes_back_exactly(tmp_path):
    directory, theirs = vit(tmp_path)
    ours = load_vit(directory)
    assert (ours.image_size, ours.patch, ours.channels, ours.classes) == (16, 4, 3, 5)
    expected = their_classes(theirs, IMAGES)
    assert np.abs(expected).max() > 1
    np.testing.assert_allclose(eqx.filter_jit(eqx.filter_vmap(ours))(jnp.asarray(IMAGES)), expected, atol=1e-5, rtol=0)
    save_vit(ours, tmp_path / "again")
    again = transformers.ViTForImageClassification.from_pretrained(tmp_path / "again").eval()
    np.testing.assert_array_equal(their_classes(again, IMAGES), expected)


def test_a_vit_of_another_kind_is_refused_in_one_line(tmp_path):
    directory, _ = vit(tmp_path, hidden_act="relu")
    with pytest.raises(CheckpointError, match="hidden_act 'relu' is not read here"):
        load_vit(directory)
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                 intermediate_size=64, image_size=16, patch_size=4)).save_pretrained(
        tmp_path / "no-head"
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="the checkpoint has no tensor classifier.weight"):
        load_vit(tmp_path / "no-head")
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not read here"):
        load_vit(gpt2(tmp_path)[0])


TEXT = "".join(f"def step_{i}(x):\n    return x * {i} + {i % 7}  # line {i} of a small program\n" for i in range(300))


def bpe_tokenizer(directory, vocab: int = 320):
    """A byte-level BPE tokenizer (GPT-2's kind) trained by `tokenizers` on TEXT, saved as directory/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def test_a_tokenizer_reads_text_bytes_as_tokens_and_back(tmp_path):
    from research.data import TextTokenizer

    vocab = bpe_tokenizer(tmp_path)
    tokenizer = TextTokenizer(tmp_path)  # the directory, or the file itself
    assert tokenizer.vocab == vocab == TextTokenizer(tmp_path / "tokenizer.json").vocab
    data = np.frombuffer((TEXT + "é ünïcode\n").encode(), np.uint8)
    tokens = tokenizer.encode(data)
    assert tokens.dtype == np.int32 and 0 <= tokens.min() and tokens.max() < vocab
    assert len(tokens) < len(data) / 2  # merges learned on this text
    assert tokenizer.decode(tokens) == data.tobytes()
    tokenizer.CHUNK_BYTES = 100  # encoded in many pieces, cut after newlines: the same tokens
    np.testing.assert_array_equal(tokenizer.encode(data), tokens)


@pytest.mark.slow
def test_lm_fine_tunes_a_gpt2_on_its_tokens_and_samples_from_the_run(tmp_path, monkeypatch, capsys):
    """`lm --init-from DIR --trainable norm` starts from a transformers GPT-2 and reads the text with DIR's
    tokenizer.json: its layer norms train, every other parameter ends as the GPT-2's, to the bit; bits per byte
    are the loss over the text's bytes per token; scripts/sample decodes the run's tokens."""
    from research.cli import main_entry
    from research.data import split_held_out
    from research.experiment import load_experiment, load_run
    from research.tools import sample

    monkeypatch.chdir(tmp_path)
    vocab = bpe_tokenizer(tmp_path / "gpt2")
    directory, _ = gpt2(tmp_path, vocab_size=vocab)
    (tmp_path / "text.py").write_text(TEXT)
    lm = load_experiment("lm")
    flags = ["--text", "text.py", "--init-from", str(directory), "--context", "32", "--batch-size", "4"]
    flags += ["--steps", "2", "--steps-per-call", "2", "--log-every", "2", "--trainable", "norm", "--no-progress"]
    capsys.readouterr()
    main_entry(lm.main, lm.Config, [*flags, "--run-dir", "tuned"])
    out = capsys.readouterr().out
    assert "lm: sample: " in out and "tokens at temperature 0.8" in out
    run = load_run("tuned")
    assert run.model.vocab == vocab and run.model.context == 48 and run.model.depth == 2
    trained, initial = named_arrays(run.model), named_arrays(load_gpt2(directory))
    moved = sorted(name for name in initial if not np.array_equal(initial[name], trained[name]))
    assert moved == sorted(name for name in initial if "norm" in name) and len(moved) == 6
    summary = json.loads((tmp_path / "tuned/summary.json").read_text())
    tokenizer = lm.text_tokenizer(run.config)
    train, _ = split_held_out(np.frombuffer(TEXT.encode(), np.uint8), 0.05)  # --held-out's default
    bytes_per_token = len(train) / len(tokenizer.encode(train))
    assert summary["test_bits_per_byte"] == pytest.approx(summary["test_loss"] / np.log(2) / bytes_per_token)

    monkeypatch.setattr("sys.argv", ["sample"])
    sample.main(["tuned", "--prompt", "def step_", "--bytes", "12", "--temperature", "0"])
    printed = capsys.readouterr().out
    model, tokenizer = sample.load_language_run("tuned")
    prompt = tokenizer.encode(np.frombuffer(b"def step_", np.uint8))
    expected = generate(model, jnp.asarray(prompt), 12, key=jax.random.key(0), temperature=0)
    assert printed == "def step_" + tokenizer.decode(np.asarray(expected)).decode() + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dim", "32"], "--init-from takes the model's shape from .*: drop --dim"),
        (["--context", "64"], "--context 64 is longer than .*'s 48 positions"),
        (["--tokenizer", "none"], "none: no tokenizer.json"),
        (["--init-from", "xor"], "--init-from xor is a run of xor, not of lm"),
        (["--init-from", "gone"], "--init-from gone: no such directory"),  # moved since a run started from it
    ],
)
def test_lm_refuses_an_init_from_the_other_options_contradict(tmp_path, monkeypatch, capsys, flags, message):
    from research.cli import main_entry
    from research.experiment import load_experiment

    monkeypatch.chdir(tmp_path)
    directory, _ = gpt2(tmp_path)  # no tokenizer.json beside it
    (tmp_path / "text.txt").write_text(TEXT)
    (tmp_path / "xor").mkdir()
    (tmp_path / "xor/config.json").write_text(json.dumps({"experiment": "xor", "config": {}}))
    lm = load_experiment("lm")
    capsys.readouterr()  # transformers' own lines, saving the model
    with pytest.raises(SystemExit) as exit:
        main_entry(lm.main, lm.Config, ["--text", "text.txt", "--init-from", str(directory), "--no-progress", *flags])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    with pytest.raises(SystemExit):  # a GPT-2's 97 tokens and no tokenizer to read the text with
        main_entry(lm.main, lm.Config, ["--text", "text.txt", "--init-from", str(directory), "--context", "32"])
    assert "97 tokens and no tokenizer.json to read text: give --tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_fine_tuned_gpt2_exports_merged_to_a_directory_transformers_loads(tmp_path, monkeypatch, capsys):
    """`lm --init-from DIR --lora-rank 4` trains its adapters alone; `scripts/export --format hf` merges them
    into the weights: transformers loads the directory with no adapter code and computes the run's logits."""
    from research.cli import main_entry
    from research.experiment import load_experiment, load_run
    from research.tools import export

    monkeypatch.chdir(tmp_path)
    vocab = bpe_tokenizer(tmp_path / "gpt2")
    directory, theirs = gpt2(tmp_path, vocab_size=vocab)
    (tmp_path / "text.py").write_text(TEXT)
    lm = load_experiment("lm")
    flags = ["--text", "text.py", "--init-from", str(directory), "--context", "32", "--batch-size", "4", "--lr", "0.01"]
    flags += ["--steps", "4", "--steps-per-call", "2", "--log-every", "2", "--lora-rank", "4", "--no-progress"]
    main_entry(lm.main, lm.Config, [*flags, "--run-dir", "lora"])
    run = load_run("lora")
    assert sorted(run.model.adapters) == [
        f"blocks.{layer}" for layer in ("attention.key_proj", "attention.output_proj", "attention.query_proj",
                                        "attention.value_proj", "mlp_in", "mlp_out")
    ]  # fmt: skip
    base, initial = named_arrays(run.model.model), named_arrays(load_gpt2(directory))
    assert all(np.array_equal(base[name], initial[name]) for name in initial)  # the GPT-2 itself did not train
    export.main(["lora", "--format", "hf"])
    assert "written to lora/hf" in capsys.readouterr().err
    assert (tmp_path / "lora/hf/tokenizer.json").read_text() == (directory / "tokenizer.json").read_text()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "lora/hf").eval()
    tokens = TOKENS % vocab
    merged = our_logits(run.model.merged(), tokens)
    np.testing.assert_allclose(their_logits(loaded, tokens), merged, atol=1e-5, rtol=0)
    assert np.abs(merged - their_logits(theirs, tokens)).max() > 1e-3  # the adapters moved it

    # The run itself is a starting point: its adapters merged, and the tokenizer it read its text with
    config = lm.Config.from_options(text="text.py", init_from="lora", context=32)
    assert lm.text_tokenizer(config).path == directory / "tokenizer.json"
    start = named_arrays(lm.setup(config).build_state().model)
    assert jax.tree.all(jax.tree.map(np.array_equal, start, named_arrays(run.model.merged())))
    again = ["--text", "text.py", "--init-from", "lora", "--context", "32", "--batch-size", "4", "--steps", "2"]
    again += ["--steps-per-call", "2", "--trainable", "norm", "--no-progress", "--run-dir", "again"]
    main_entry(lm.main, lm.Config, again)
    tuned = named_arrays(load_run("again").model)
    assert sorted(n for n in start if not np.array_equal(start[n], tuned[n])) == sorted(n for n in start if "norm" in n)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-rank", "2", "--trainable", "head"], "--lora-rank trains its adapters alone: drop --trainable head"),
        (["--lora-rank", "2", "--lora-targets", "conv"], "--lora-targets 'conv' finds no linear layer"),
        (["--lora-rank", "2", "--lora-targets", "("], "--lora-targets '\\(' is not a regular expression"),
    ],
)
def test_lm_refuses_lora_options_that_cannot_work(tmp_path, monkeypatch, capsys, flags, message):
    from research.cli import main_entry
    from research.experiment import load_experiment

    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text(TEXT)
    lm = load_experiment("lm")
    with pytest.raises(SystemExit) as exit:
        main_entry(lm.main, lm.Config, ["--text", "text.txt", "--dim", "16", "--heads", "2", "--no-progress", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err
