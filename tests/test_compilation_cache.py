"""The persistent compilation cache every experiment script and the tools that load a run turn on
(`research.cli.use_compilation_cache`): a second run loads every program it compiles from the cache, and no
number changes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from research.cli import compilation_cache_dir
from research.services import RunDir, checkpoint_digest

ROOT = Path(__file__).parent.parent
ARGS = ["--no-progress", "--epochs", "4", "--log-every", "19", "--eval-every", "38"]
MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '[^']*' with key '([^']*)'")
CACHE_TROUBLE = re.compile(r"Error (reading|writing) persistent compilation cache|exceeds the maximum cache size")


def run_xor(cwd: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    return run_command(cwd, cache, str(ROOT / "experiments/xor.py"), *ARGS, *args)


def run_command(cwd: Path, cache: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python ARGV` in `cwd` with `cache` as its compilation cache, each program it compiles logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("RESEARCH_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["RESEARCH_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_EXPLAIN_CACHE_MISSES"] = "true"  # each program compiled afresh says so, with its cache key
    result = subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert not CACHE_TROUBLE.search(result.stderr), result.stderr
    return result


def compiled(run: subprocess.CompletedProcess) -> set[str]:
    """The cache keys of the programs a run compiled instead of loading."""
    return set(MISS.findall(run.stderr))


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*-cache")} if cache.exists() else set()


def numbers(run: Path) -> tuple[list[dict], str]:
    metrics = [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(run).read_metrics()]
    return metrics, checkpoint_digest(RunDir(run).checkpoint_paths()[-1])


def test_the_cache_lives_in_the_users_cache_directory(monkeypatch):
    monkeypatch.delenv("RESEARCH_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert compilation_cache_dir() == Path("/somewhere/research/jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compilation_cache_dir() == Path.home() / ".cache/research/jax"
    monkeypatch.setenv("RESEARCH_COMPILATION_CACHE_DIR", "/elsewhere")
    assert compilation_cache_dir() == Path("/elsewhere")


@pytest.mark.slow
def test_a_warm_cache_serves_every_program_and_changes_no_number(tmp_path):
    cache = tmp_path / "cache"
    cold = run_xor(tmp_path, cache, "--run-dir", "cold")
    written = {name.removesuffix("-cache") for name in entries(cache)}
    assert any(key.startswith("jit__run_impl-") for key in written), written  # the training loop was kept
    assert written <= compiled(cold)
    warm = run_xor(tmp_path, cache, "--run-dir", "warm")
    # The second run compiled none of the programs the first kept (they came from the cache), only programs the
    # first compiled too (same keys) but did not keep, under CACHE_MIN_COMPILE_SECONDS: which of those a busy
    # machine takes longer over, and so keeps on the second run, varies.
    assert compiled(warm) <= compiled(cold) - written
    off = run_xor(tmp_path, tmp_path / "unused", "--run-dir", "off", "--no-compilation-cache")
    assert not (tmp_path / "unused").exists() and off.returncode == 0
    assert numbers(tmp_path / "cold") == numbers(tmp_path / "warm") == numbers(tmp_path / "off")


@pytest.mark.slow
def test_the_tools_that_load_a_run_keep_their_programs_in_the_cache_too(tmp_path):
    """`research sample` of a finished run compiles its generation loop once: a second sample in a fresh
    process loads every program the first kept."""
    cache = tmp_path / "cache"
    (tmp_path / "text.txt").write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    shape = "--dim 16 --depth 1 --heads 2 --context 16 --batch-size 8 --steps 2 --steps-per-call 2 --log-every 2"
    run_command(tmp_path, cache, "-m", "research.run", "lm", *shape.split(), "--text", "text.txt", "--run-dir", "lm")
    trained = entries(cache)
    first = run_command(tmp_path, cache, "-m", "research.tools.sample", "lm", "--bytes", "16")
    written = {name.removesuffix("-cache") for name in entries(cache) - trained}
    assert written and written <= compiled(first)  # the sampling loop, new to the cache
    second = run_command(tmp_path, cache, "-m", "research.tools.sample", "lm", "--bytes", "16")
    assert not compiled(second) & written
    assert second.stdout == first.stdout  # the same bytes, from the same key
