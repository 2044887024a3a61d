"""The docs cannot rot: every command and code block in README.md and docs/*.md runs here, in order.

- ```bash blocks: each line is a `./scripts/...` or `research ...` command that must exit 0.
- ```console blocks: `$ command` lines; the lines after one must appear in its output, where `...`
  stands for any text.
- ```python blocks run as they are (a notebook's, a doc with a Jupytext header, run on a kernel in
  tests/test_notebooks.py); ```python file=PATH blocks, put together, must be that file.
- ```shell blocks are long reproductions (docs/results.md: hours of training) that are not run; each
  `./scripts/run` (or `research run`) command in them must still parse (its experiment and flags exist), with
  a loop variable read as its first value (`for seed in 0 1 2` -> `$seed` is 0); each `./scripts/sweep` (or
  `research sweep`) command must pass its `--dry-run` (every run's flags are checked, nothing starts).

Commands run in-process (no new interpreter per command: JAX takes seconds to import) in a fresh
directory per document, with `CI=true` so progress comes as plain lines. `./scripts/test` and
`./scripts/setup` are what CI itself runs, so they are not repeated here.
"""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from research import command as research_command
from research import run
from research.cli import main_entry, parse_config
from research.experiment import load_experiment
from research.tools import compare_runs, export, plot_runs, sample, show_jaxpr, sweep

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
RUN_BY_CI = {"./scripts/test", "./scripts/setup"}
TOOLS = {
    "./scripts/plot_runs": plot_runs.main,
    "./scripts/compare_runs": compare_runs.main,
    "./scripts/show_jaxpr": show_jaxpr.main,
    "./scripts/sweep": sweep.main,
    "./scripts/export": export.main,
    "./scripts/sample": sample.main,
}


def blocks(doc: Path) -> list[tuple[str, str, str]]:
    return [(lang, info.strip(), body) for lang, info, body in BLOCK.findall(doc.read_text())]


def run_command(line: str, monkeypatch) -> tuple[int, str] | None:
    """Run one documented command in this process; its exit status and its stdout + stderr."""
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    command, args = words[0], words[1:]
    if command == "research" and args[:1] == ["run"]:  # as ./scripts/run: the experiment in this process
        command, args = "./scripts/run", args[1:]
    if command in RUN_BY_CI:
        return None
    if command == "./scripts/launch" or (command == "./scripts/run" and "--devices" in args):
        # A new interpreter: simulated devices and jax.distributed must be set up before JAX starts.
        result = subprocess.run([str(ROOT / command), *args], capture_output=True, text=True, timeout=600)
        return result.returncode, result.stdout + result.stderr
    output = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            if command == "./scripts/run":  # research.run: NAME [flags] or --from RUN_DIR [flags]
                script, flags = run.command(args)
                module = load_experiment(str(script))
                monkeypatch.setattr(sys, "argv", [str(script), *flags])
                main_entry(module.main, module.Config, flags)
            elif command in TOOLS:
                TOOLS[command](args)
            elif command == "research":
                research_command.main(args)
            else:
                raise AssertionError(f"the docs show a command this test does not know how to run: {line}")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, output.getvalue()


def matches(expected: str, output: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return any(re.fullmatch(pattern, line.rstrip()) for line in output.splitlines())


def check_console(body: str, monkeypatch) -> None:
    command, expected = None, []
    for line in [*body.splitlines(), "$ "]:
        if line.startswith("$ "):
            if command:
                code, output = run_command(command, monkeypatch)
                for want in expected:
                    assert matches(want, output), f"`{command}` did not print\n{want}\nit printed:\n{output}"
                assert (code != 0) == any("error:" in want for want in expected), (command, code, output)
            command, expected = line[2:].strip(), []
        elif line.strip():
            expected.append(line)


def check_parses(body: str) -> None:
    """Every `./scripts/run EXPERIMENT FLAGS` in a shell block names an experiment and valid flags."""
    body = re.sub(r"\\\n", " ", body)
    first = {name: values.split()[0] for name, values in re.findall(r"for (\w+) in ([^;]+);", body)}
    for command in re.findall(r"(?:\./scripts/|research )sweep [^;&|\n]+", body):
        words = shlex.split(command, comments=True)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                sweep.main(["--dry-run", *words[2 if words[0] == "research" else 1 :]])
            except SystemExit:
                raise AssertionError(f"`{command}` does not pass --dry-run: {err.getvalue().strip()}") from None
    for command in re.findall(r"(?:\./scripts/|research )run [^;&|\n]+", body):
        words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: first.get(m[1], "0"), command), comments=True)
        script, flags = run.command(words[2 if words[0] == "research" else 1 :])
        module = load_experiment(str(script))
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parse_config(module.Config, flags, prog=script.name)
            except SystemExit:
                raise AssertionError(f"`{command}` does not parse: {err.getvalue().strip()}") from None


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_and_code_block_runs_as_shown(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")
    files: dict[str, list[str]] = {}
    notebook = "\n  jupytext:\n" in doc.read_text()
    for lang, info, body in blocks(doc):
        if lang == "bash":
            for line in body.splitlines():
                if line.split("#")[0].strip():
                    result = run_command(line, monkeypatch)
                    assert result is None or result[0] == 0, f"`{line}` failed:\n{result[1]}"
        elif lang == "console":
            check_console(body, monkeypatch)
        elif lang == "shell":
            check_parses(body)
        elif lang == "python" and info.startswith("file="):
            files.setdefault(info.removeprefix("file="), []).append(body)
        elif lang == "python" and not notebook:  # a notebook's cells run on a kernel: tests/test_notebooks.py
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(body, f"{doc.name} python block", "exec"), {"__name__": "__doc_block__"})
    for path, parts in files.items():
        shown = [line for part in parts for line in part.splitlines() if line.strip()]
        real = [line for line in (ROOT / path).read_text().splitlines() if line.strip()]
        assert shown == real, f"the code blocks of {doc.name} no longer match {path}"


def test_the_documented_experiment_is_under_70_lines():  # 60 before its options were nested in groups
    assert len((ROOT / "experiments/circles.py").read_text().splitlines()) < 70


def test_the_script_wrappers_run_their_tools():
    """scripts/plot_runs, compare_runs, show_jaxpr, sweep, export and sample are the same thin bash wrapper
    around `python -m research.tools.NAME`; check all six, and run one for real (each costs a JAX import)."""
    for name in ("plot_runs", "compare_runs", "show_jaxpr", "sweep", "export", "sample"):
        script = ROOT / "scripts" / name
        assert os.access(script, os.X_OK) and f"-m research.tools.{name} " in script.read_text(), name
    result = subprocess.run(
        ["scripts/show_jaxpr", "xor", "--hidden", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# one train step of xor: ")
    assert "#   1: state.model.layers[0].weight float32[2,2]" in result.stdout.splitlines()
