"""The byte-level language model: the model, its text data, its loss and scale tools (gradient
accumulation, remat, bf16), its evaluator, and the experiment end to end. Tiny models: fast."""

import hashlib
import json
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

from research.cli import main_entry
from research.data import (
    Batch,
    DeviceLoader,
    next_byte_windows,
    read_text_bytes,
    reference_bits_per_byte,
    split_held_out,
)
from research.errors import ConfigError
from research.experiment import load_experiment, load_run
from research.nn import DecoderBlock, LanguageModel, LoRA, build_model, causal_attention, named_arrays
from research.train import GlobalBatch, NextTokenLoss, SupervisedStep, TrainState, take_step, train_step
from research.train.evaluation import evaluate_language_model
from research.train.fine_tuning import Frozen, check_trainable, only_trainable, trainable_pattern
from research.train.precision import LowPrecision

ROOT = Path(__file__).resolve().parents[1]

TINY = {"context": 16, "dim": 16, "depth": 2, "heads": 2}


def tiny_model(key, **overrides) -> LanguageModel:
    return build_model("lm", key=key, **{**TINY, **overrides})[0]


TEXT = np.frombuffer(
    b"the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40, np.uint8
)


def tiny_batch(rows: int, seed: int = 0) -> Batch:
    data = TEXT[seed * 7 :][: rows * 16 + 1]
    inputs, labels = next_byte_windows(data, 16)
    return Batch(jnp.asarray(inputs), jnp.asarray(labels))


@pytest.mark.slow
def test_model_shapes_causality_and_stacked_layers(getkey):
    model = eqx.filter_jit(tiny_model(getkey(), depth=3))  # one compiled call each (eager ops are slow)
    tokens = jnp.arange(16, dtype=jnp.int32)
    logits = model(tokens)
    assert logits.shape == (16, 256) and logits.dtype == jnp.float32
    changed = model(tokens.at[10].set(200))
    np.testing.assert_array_equal(changed[:10], logits[:10])  # position t sees only tokens <= t
    assert not np.allclose(changed[10:], logits[10:])
    assert model.__wrapped__.blocks.mlp_in.weight.shape == (3, 64, 16)  # one stacked array per parameter, depth first
    assert model(tokens[:5]).shape == (5, 256)  # shorter than the context is fine
    with pytest.raises(TypeCheckError):
        model(jnp.ones(16))  # floats are no tokens
    with pytest.raises(ValueError, match="at most 16 tokens"):
        model(jnp.zeros(17, jnp.int32))


@pytest.mark.slow
def test_untied_head_and_depth_do_not_grow_the_program(getkey):
    untied = tiny_model(getkey(), tied=False)
    assert untied.head is not None and eqx.filter_jit(untied)(jnp.zeros(4, jnp.int32)).shape == (4, 256)

    def equations(depth: int) -> int:
        model = tiny_model(getkey(), depth=depth)
        loss = lambda m: jnp.sum(m(jnp.zeros(16, jnp.int32)))  # noqa: E731
        return len(eqx.filter_make_jaxpr(eqx.filter_grad(loss))(model)[0].jaxpr.eqns)

    assert equations(2) == equations(16)  # lax.scan: the traced step is the same size at any depth


def test_attention_is_equinox_multihead_attention_and_cudnns_to_float_rounding(getkey):
    """Off cuDNN the block computes what `eqx.nn.MultiheadAttention` under a causal mask does: to the bit on
    a CPU, to float32 rounding elsewhere (a GPU's XLA fuses the jitted block differently from its separately
    jitted pieces: 1 ulp was seen on an H200); `jax.nn.dot_product_attention` (the function cuDNN's kernel
    runs behind on a GPU) agrees to float32 rounding."""
    block = DecoderBlock(16, 4, 32, key=getkey())
    x = jax.random.normal(getkey(), (12, 16))
    h = jax.vmap(block.attention_norm)(x)
    after_attention = x + eqx.filter_jit(block.attention)(h, h, h, mask=jnp.tril(jnp.ones((12, 12), bool)))
    expected = after_attention + eqx.filter_jit(block.mlp)(after_attention)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(eqx.filter_jit(block)(x), expected)
    else:  # a few units in the last place of the largest output, not a looser bound
        ulp = float(jnp.finfo(expected.dtype).eps) * float(jnp.abs(expected).max())
        np.testing.assert_allclose(eqx.filter_jit(block)(x), expected, rtol=0, atol=4 * ulp)
    query, keys, values = jax.random.normal(getkey(), (3, 12, 4, 8))
    fused = partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    ours = jax.jit(causal_attention)(query, keys, values)
    np.testing.assert_allclose(ours, jax.jit(fused)(query, keys, values), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_bf16_computes_the_matrix_products_in_bf16_and_the_rest_in_float32(getkey):
    """Under bf16 the residual stream, embeddings, positions, norms and logits stay float32; the blocks'
    matrix products run in bf16. `--precision bf16` (`LowPrecision`) asks the model for that policy rather
    than casting every parameter, so it computes what a model built with `compute_dtype="bfloat16"` does."""
    model = tiny_model(getkey(), tied=False)
    low = model.with_compute_dtype("bfloat16").computing()
    assert low.blocks.mlp_in.weight.dtype == low.head.weight.dtype == jnp.bfloat16
    assert low.blocks.attention.query_proj.weight.dtype == jnp.bfloat16
    for kept in (low.token_embedding.weight, low.positions, low.norm.weight, low.blocks.mlp_norm.weight):
        assert kept.dtype == jnp.float32
    x = jax.random.normal(getkey(), (8, 16))
    block = jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, low.blocks)
    assert eqx.filter_jit(block)(x).dtype == jnp.float32  # the residual stream
    tokens = jnp.arange(8, dtype=jnp.int32)
    logits = eqx.filter_jit(model.with_compute_dtype("bfloat16"))(tokens)
    assert logits.dtype == jnp.float32 and model.compute_dtype == "float32"  # a copy: the model is unchanged
    np.testing.assert_array_equal(eqx.filter_jit(LowPrecision(model, "bfloat16"))(tokens), logits)
    assert not np.array_equal(logits, eqx.filter_jit(model)(tokens))


def test_the_learning_rate_warms_up_then_decays_at_any_number_of_steps():
    lm = load_experiment("lm")
    for steps in (1, 2, 40):
        schedule = lm.learning_rate(lm.Config(steps=steps))
        rates = [float(schedule(i)) for i in range(steps + 1)]
        assert all(np.isfinite(rates)) and max(rates) == pytest.approx(3e-3) and rates[-1] == pytest.approx(3e-4)
    assert lm.learning_rate(lm.Config(steps=40))(2) == pytest.approx(3e-3)  # the peak after 2 warmup steps


def test_text_windows_split_and_file_order(tmp_path):
    data = np.arange(50, dtype=np.uint8)
    inputs, labels = next_byte_windows(data, 8)
    assert inputs.shape == labels.shape == (6, 8) and inputs.dtype == np.int32
    np.testing.assert_array_equal(labels, inputs + 1)  # the next byte of every position
    train, held_out = split_held_out(data, 0.1)
    assert len(held_out) == 5 and held_out[0] == 45 and len(train) == 45
    for name in "abcdef":
        (tmp_path / f"{name}.txt").write_bytes(name.encode() * 10)
    whole = read_text_bytes(tmp_path)
    assert len(whole) == 60 and sorted(bytes(whole).decode()) == sorted("abcdef" * 10)
    np.testing.assert_array_equal(read_text_bytes(tmp_path, max_bytes=25), whole[:25])
    assert bytes(read_text_bytes(tmp_path / "a.txt")) == b"a" * 10
    reference = reference_bits_per_byte(whole[:30], whole[30:])
    assert 0 < reference["zlib"] and reference["unigram"] > 0


def test_a_folders_files_come_in_the_order_of_their_paths_hashes_without_skipped_folders(tmp_path):
    """Every file of the folder and its subfolders, but none under a `__pycache__` or `site-packages` and
    none through a link to a folder, ordered by the SHA-256 of its path relative to the folder."""
    files = ["a.py", "b.txt", "sub/c.py", "sub/deeper/d.py", ".hidden/e"]
    for name in [*files, "__pycache__/x.py", "sub/site-packages/y.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "linked").symlink_to(tmp_path / "sub", target_is_directory=True)
    by_hash = sorted(files, key=lambda name: hashlib.sha256(name.encode()).hexdigest())
    assert bytes(read_text_bytes(tmp_path)) == "".join(by_hash).encode()


def test_default_text_is_the_standard_library():
    data = read_text_bytes(max_bytes=100_000)
    assert len(data) == 100_000 and b"def " in bytes(data) and b"import " in bytes(data)


@pytest.mark.slow
def test_loss_metrics_and_evaluator_agree(getkey):
    model, batch = tiny_model(getkey()), tiny_batch(8)
    loss, (metrics, _) = NextTokenLoss()(model, None, batch, getkey())
    expected = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(batch.inputs), batch.labels).mean()
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(metrics["bits_per_byte"], loss / np.log(2), rtol=1e-6)
    state = TrainState.create(model, optax.adam(1e-3), key=getkey())
    data = DeviceLoader(np.asarray(batch.inputs), np.asarray(batch.labels), 3, shuffle=False)  # a padded last batch
    evaluated = evaluate_language_model(state, data)
    np.testing.assert_allclose(evaluated["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(evaluated["accuracy"], metrics["accuracy"], rtol=1e-5)


def _one_step(model, step: SupervisedStep, batch, key) -> tuple[LanguageModel, dict]:
    # Adam's eps is raised from 1e-8: Adam divides by sqrt(v) + eps, so where a gradient is ~1e-8 a
    # float32 rounding difference (summing micro-batches instead of one batch) becomes a visible update.
    state = TrainState.create(model, optax.adam(1e-2, eps=1e-4), key=key)
    state, metrics = eqx.filter_jit(take_step)(step, state, batch, GlobalBatch())
    return state.model, metrics


@eqx.filter_jit
def value_and_grad(model: LanguageModel, batch: Batch, key, grad_accum: int):
    return GlobalBatch().value_and_grad(NextTokenLoss(), model, None, batch, key, grad_accum=grad_accum)


def _assert_same_model(a, b, tolerance: float) -> None:
    for x, y in zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)), strict=True
    ):
        np.testing.assert_allclose(x, y, atol=tolerance, rtol=tolerance)


def test_frozen_parameters_keep_their_weights_and_take_no_optimizer_state(getkey):
    """`--trainable head`: the head alone moves; Adam keeps moments for it alone; `grad_norm` is its gradient's."""
    model, batch = tiny_model(getkey(), tied=False), tiny_batch(8)
    pattern = trainable_pattern("head")
    full = TrainState.create(model, optax.adam(1e-2), key=getkey())
    part = TrainState.create(model, only_trainable(optax.adam(1e-2), pattern), key=full.key)
    state_bytes = lambda s: sum(x.nbytes for x in jax.tree.leaves(s.opt_state))  # noqa: E731
    assert state_bytes(part) == 2 * model.head.weight.nbytes + 4  # two moments of the head, and Adam's count
    assert state_bytes(full) == 2 * sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))) + 4
    new, metrics = eqx.filter_jit(lambda s, b: train_step(s, b, Frozen(NextTokenLoss(), pattern)))(part, batch)
    before, after = named_arrays(model), named_arrays(new.model)
    assert [name for name in before if not np.array_equal(before[name], after[name])] == ["head.weight"]
    (_, _), grads = value_and_grad(model, batch, part.key, 1)
    np.testing.assert_allclose(metrics["grad_norm"], jnp.linalg.norm(grads.head.weight), rtol=1e-5)
    with pytest.raises(ConfigError, match="--trainable head finds no parameter of the model"):
        check_trainable(tiny_model(getkey()), pattern, "head")  # a tied head is the embedding
    with pytest.raises(ConfigError, match="is not a regular expression"):
        trainable_pattern("blocks.(")


def test_lora_starts_as_its_base_model_and_trains_its_adapters_alone(getkey):
    """`LoRA`: at initialisation the adapted model computes the base's logits to the bit; one step moves the
    adapters' `b` alone (the base keeps its bits); Adam keeps moments for the adapters alone; `merged()` is a
    LanguageModel whose weights hold the update."""
    model, batch = tiny_model(getkey()), tiny_batch(8)
    adapted = LoRA(model, 2, "mlp_in|query_proj", key=getkey())
    assert sorted(adapted.adapters) == ["blocks.attention.query_proj", "blocks.mlp_in"]
    assert adapted.adapters["blocks.mlp_in"].a.shape == (2, 2, 16)  # depth, rank, fan in: one a block
    tokens = batch.inputs[0]
    np.testing.assert_array_equal(eqx.filter_jit(adapted)(tokens), eqx.filter_jit(model)(tokens))
    optimizer = only_trainable(optax.adam(1e-2), r"^adapters\.")
    state = TrainState.create(adapted, optimizer, key=getkey())
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapted.adapters))
    assert sum(x.nbytes for x in jax.tree.leaves(state.opt_state)) == 2 * adapter_bytes + 4
    new, _ = eqx.filter_jit(lambda s, b: train_step(s, b, Frozen(NextTokenLoss(), r"^adapters\.")))(state, batch)
    before, after = named_arrays(adapted), named_arrays(new.model)
    moved = [name for name in before if not np.array_equal(before[name], after[name])]
    assert moved == ["adapters.blocks.attention.query_proj.b", "adapters.blocks.mlp_in.b"]
    merged = new.model.merged()
    assert isinstance(merged, LanguageModel)
    update = new.model.adapters["blocks.mlp_in"].delta()
    np.testing.assert_allclose(merged.blocks.mlp_in.weight, model.blocks.mlp_in.weight + update, rtol=1e-6)
    with pytest.raises(ValueError, match="LoRA targets 'conv' find no linear layer"):
        LoRA(model, 2, "conv", key=getkey())


@pytest.mark.slow
def test_a_run_training_its_norms_alone_resumes_to_the_bits_of_an_uncut_one(tmp_path, monkeypatch):
    """`--trainable norm` with FSDP on 2 devices and an EMA: a run cut after step 4's checkpoint and resumed
    logs what the uncut run logs; the frozen parameters end as they started."""
    (tmp_path / "text.txt").write_bytes(b"sphinx of black quartz, judge my vow. " * 200)
    flags = "--text text.txt --steps 8 --context 16 --dim 16 --depth 1 --heads 2 --batch-size 8 --steps-per-call 2"
    flags += " --log-every 2 --eval-every 4 --checkpoint-every 4 --trainable norm --ema-decay 0.9 --devices 2"
    flags += " --parallel fsdp --no-progress"

    def run(*extra: str) -> None:
        command = [sys.executable, str(ROOT / "experiments" / "lm.py"), *flags.split(), *extra]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]

    run("--run-dir", "straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut/checkpoints/step_000000008")
    (tmp_path / "cut/summary.json").unlink()
    run("--run-dir", "cut", "--resume", "auto")

    def untimed(name: str) -> list[dict]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "per_s" not in k} for line in lines]

    assert untimed("cut") == untimed("straight") and len(untimed("cut")) == 4
    monkeypatch.chdir(tmp_path)  # --text is relative
    run = load_run("straight")
    loaded, initial = run.model, load_experiment("lm").build_state(run.config).model
    moved = [n for n, a in named_arrays(initial).items() if not np.array_equal(a, named_arrays(loaded)[n])]
    assert moved == ["blocks.attention_norm.weight", "blocks.attention_norm.bias", "blocks.mlp_norm.weight",
                     "blocks.mlp_norm.bias", "norm.weight", "norm.bias"]  # fmt: skip


@pytest.mark.slow
def test_grad_accum_step_equals_one_step_on_the_whole_batch(getkey):
    """4 parts of 4 give the gradient of the batch of 16, and the same Adam step, to 1e-5
    (tests/test_grad_accum.py checks every kind of loss, device axes and micro-batches)."""
    model, batch, key = tiny_model(getkey()), tiny_batch(16), getkey()
    (loss, _), grads = value_and_grad(model, batch, key, 1)
    (accumulated_loss, _), accumulated_grads = value_and_grad(model, batch, key, 4)
    np.testing.assert_allclose(accumulated_loss, loss, rtol=1e-6)
    _assert_same_model(accumulated_grads, grads, 1e-5)
    whole, whole_metrics = _one_step(model, SupervisedStep(NextTokenLoss()), batch, key)
    accumulated, metrics = _one_step(model, SupervisedStep(NextTokenLoss(), grad_accum=4), batch, key)
    _assert_same_model(whole, accumulated, 1e-5)
    for name in ("loss", "accuracy", "bits_per_byte", "grad_norm"):
        np.testing.assert_allclose(metrics[name], whole_metrics[name], rtol=1e-5)
    with pytest.raises(ConfigError, match="--grad-accum 3 must divide the 16 rows"):
        value_and_grad(model, batch, key, 3)


@pytest.mark.slow
def test_fsdp_with_grad_accum_splits_micro_batches_where_the_rows_live(tmp_path):
    """Four FSDP devices, two micro-batches: the micro-batch split keeps the batch's row sharding, so XLA
    compiles it without resharding ("Involuntary full rematerialization ... replicate the tensor")."""
    (tmp_path / "text.txt").write_bytes(b"sphinx of black quartz, judge my vow. " * 200)
    flags = [
        "--text",
        "text.txt",
        "--steps",
        "2",
        "--context",
        "16",
        "--dim",
        "32",
        "--depth",
        "1",
        "--heads",
        "2",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--devices",
        "4",
        "--parallel",
        "fsdp",
        "--no-progress",
        "--run-dir",
        "r",
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "lm.py"), *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rematerialization" not in result.stderr, result.stderr[-2000:]
    assert "4 cpu devices" in result.stdout


@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients_with_less_memory(getkey):
    key, batch = getkey(), tiny_batch(8)
    plain, remat = tiny_model(key, depth=4), tiny_model(key, depth=4, remat=True)
    (loss, _), grads = value_and_grad(plain, batch, key, 1)
    (remat_loss, _), remat_grads = value_and_grad(remat, batch, key, 1)
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
    _assert_same_model(remat_grads, grads, 1e-6)

    def temp_bytes(model) -> int:
        params, static = eqx.partition(model, eqx.is_array)
        step = jax.jit(lambda p: value_and_grad(eqx.combine(p, static), batch, key, 1))
        return step.lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(remat) < temp_bytes(plain)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_block_keeps_its_input_its_products_outputs_and_the_residual_stream(precision):
    """What the backward pass keeps, a token and a block, read from the jaxpr (no program runs): the block's
    input and the residual stream between its halves in float32 (d floats each), q/k/v (3d), the attention (d)
    and the MLP's hidden layer (4d) in the compute dtype; as on a GPU, cuDNN's softmax statistics (a float32 a
    head) in place of the named attention. `--remat` keeps the input alone. Both fewer than nanoGPT's block keeps
    in PyTorch (autocast for bf16): its norms' inputs (2d float32), q/k/v, the attention and the MLP's hidden
    layer, and the inputs of its other three products (d, d, 4d) besides."""
    from benchmarks.lm_anatomy import as_on_a_gpu, nanogpt_saved_per_token, ours_saved_per_token

    dim, heads = 32, 2
    shape = {"dim": dim, "depth": 2, "heads": heads, "context": 24, "batch": 2}
    width = 2 if precision == "bf16" else 4
    assert ours_saved_per_token(shape, precision, remat=False)["block"] == 4 * 2 * dim + width * 8 * dim
    with as_on_a_gpu():
        fused = ours_saved_per_token(shape, precision, remat=False)["block"]
    assert fused == 4 * 2 * dim + width * 8 * dim + (4 * heads if precision == "bf16" else 0)
    assert ours_saved_per_token(shape, precision, remat=True)["block"] == 4 * dim
    nanogpt, _ = nanogpt_saved_per_token(shape, precision)
    assert fused < nanogpt


BF16_TOLERANCE = 0.01  # nats after 30 Adam steps: bf16 rounding of weights and activations (measured 4e-4)


@pytest.mark.slow
def test_bf16_compute_trains_like_float32(getkey):
    """bf16 compute keeps float32 master weights and optimizer state, float32 logits, and after 30
    steps on the same batches a loss within BF16_TOLERANCE of float32's."""
    key, train_key = getkey(), getkey()
    losses = {}
    for dtype in ("float32", "bfloat16"):
        state = TrainState.create(tiny_model(key, compute_dtype=dtype), optax.adam(1e-2), key=train_key)
        step = eqx.filter_jit(lambda s, b: train_step(s, b, NextTokenLoss()))
        for i in range(30):
            state, metrics = step(state, tiny_batch(8, seed=i % 3))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(state, eqx.is_inexact_array)))
        losses[dtype] = float(metrics["loss"])
    assert losses["float32"] < 3.5  # it learned something (uniform over bytes is ln 256 = 5.55)
    assert abs(losses["bfloat16"] - losses["float32"]) < BF16_TOLERANCE, losses


@pytest.mark.slow
def test_experiment_trains_and_reports_bits_per_byte(tmp_path, monkeypatch, capsys):
    (tmp_path / "text.txt").write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    monkeypatch.chdir(tmp_path)
    module = load_experiment("lm")
    flags = [
        "--text",
        "text.txt",
        "--steps",
        "6",
        "--context",
        "16",
        "--dim",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--steps-per-call",
        "3",
        "--log-every",
        "3",
        "--run-dir",
        "r",
        "--no-progress",
    ]
    main_entry(module.main, module.Config, flags)
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["step"] == 6 and summary["bytes_per_s"] > 0
    assert abs(summary["test_bits_per_byte"] - summary["test_loss"] / np.log(2)) < 1e-6
    assert "bits/byte" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main_entry(module.main, module.Config, [*flags[:-3], "--grad-accum", "3", "--run-dir", "r2"])
    assert exit_info.value.code == 2


@pytest.mark.slow
def test_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    """The windows of a step are a pure function of (seed, step): a run resumed at step 4 logs what an
    uninterrupted one does."""
    (tmp_path / "text.txt").write_bytes(b"pack my box with five dozen liquor jugs. " * 200)
    monkeypatch.chdir(tmp_path)
    module = load_experiment("lm")
    flags = [
        "--text",
        "text.txt",
        "--context",
        "16",
        "--dim",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--batch-size",
        "8",
        "--steps-per-call",
        "2",
        "--log-every",
        "2",
        "--no-progress",
    ]
    main_entry(module.main, module.Config, [*flags, "--steps", "8", "--run-dir", "whole"])
    main_entry(module.main, module.Config, [*flags, "--steps", "8", "--run-dir", "parts", "--checkpoint-every", "4"])
    shutil.rmtree(tmp_path / "parts/checkpoints/step_000000008")  # as if killed between steps 4 and 8
    main_entry(
        module.main,
        module.Config,
        [*flags, "--steps", "8", "--run-dir", "parts", "--checkpoint-every", "4", "--resume"],
    )
    losses = {
        name: [json.loads(line)["train/loss"] for line in (tmp_path / name / "metrics.jsonl").open()]
        for name in ("whole", "parts")
    }
    assert len(losses["whole"]) == 4 and losses["whole"] == losses["parts"]
