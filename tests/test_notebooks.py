"""The notebooks of docs/ (Jupytext Markdown: `first_hour.md`, `tutorial.md`) run top to bottom on an IPython
kernel as Jupyter runs them (nbclient), and show what they say they show: after a code cell, a ```text block
lists lines its output must hold (`...` stands for any text, as in tests/test_docs.py's console blocks).
Progress is tqdm's notebook bar, and the stop button (a kernel interrupt) checkpoints the run and names the
call that continues it."""

import itertools
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from test_docs import matches

from research.tools.notebooks import execute_notebook, read_notebook

ROOT = Path(__file__).parent.parent
NOTEBOOKS = [path for path in sorted((ROOT / "docs").glob("*.md")) if "\n  jupytext:\n" in path.read_text()]
SHOWN = re.compile(r"\A```text\n(.*?)^```", re.MULTILINE | re.DOTALL)
WIDGET = "application/vnd.jupyter.widget-view+json"


def kernel_env() -> dict[str, str]:
    """This environment, as a researcher's notebook has it: not CI (whose plain progress lines replace bars)."""
    return {k: v for k, v in os.environ.items() if k != "CI"}


def shown_outputs(notebook) -> list[tuple[int, list[str]]]:
    """(code cell index, the lines a ```text block right after it says it prints)."""
    shown = []
    for i, (cell, after) in enumerate(itertools.pairwise(notebook.cells)):
        found = SHOWN.match(after.source) if cell.cell_type == "code" and after.cell_type == "markdown" else None
        if found:
            shown.append((i, found[1].splitlines()))
    return shown


def text_of(cell) -> str:
    """What a cell printed and returned, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data") and WIDGET not in output.data:
            parts.append(output.data.get("text/plain", ""))
    return "\n".join(parts)


def check_shown(notebook, name: str) -> None:
    for index, lines in shown_outputs(notebook):
        printed = text_of(notebook.cells[index])
        for line in lines:
            assert matches(line, printed), f"{name}, cell {index}: did not print\n{line}\nit printed:\n{printed}"


def test_every_notebook_shows_some_output_to_check():
    assert {path.name for path in NOTEBOOKS} >= {"first_hour.md", "tutorial.md"}
    assert shown_outputs(read_notebook(ROOT / "docs/first_hour.md"))


def test_the_first_training_cell_draws_the_notebook_bar_and_prints_what_it_shows(tmp_path):
    """The quick tier's notebook: the first hour up to its first run (a few seconds of training)."""
    notebook = read_notebook(ROOT / "docs/first_hour.md")
    first_check = shown_outputs(notebook)[0][0]
    notebook.cells = notebook.cells[: first_check + 2]
    executed = execute_notebook(notebook, tmp_path, kernel_env())
    check_shown(executed, "first_hour.md")
    outputs = executed.cells[first_check].outputs
    assert any(WIDGET in output.get("data", {}) for output in outputs), "no tqdm notebook bar"
    assert not any(output.get("name") == "stderr" and "[train] step" in output.text for output in outputs)
    assert len(list((tmp_path / "runs/xor").iterdir())) == 1


@pytest.mark.slow
def test_scripts_notebooks_writes_the_ipynb_of_a_notebook_and_refuses_a_missing_one(tmp_path):
    source = tmp_path / "first_hour.md"
    shutil.copy(ROOT / "docs/first_hour.md", source)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    written = subprocess.run(
        [ROOT / "scripts/notebooks", "../first_hour.md"], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert written.returncode == 0, written.stderr
    notebook = nbformat.read(str(tmp_path / "first_hour.ipynb"), as_version=4)
    assert [cell.source for cell in notebook.cells] == [cell.source for cell in read_notebook(source).cells]
    missing = subprocess.run([ROOT / "scripts/notebooks", "nope.md"], cwd=tmp_path, capture_output=True, text=True)
    assert (missing.returncode, missing.stderr) == (2, f"notebooks: error: {tmp_path / 'nope.md'}: no such notebook\n")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_notebook_runs_top_to_bottom_as_shown(path, tmp_path):
    executed = execute_notebook(read_notebook(path), tmp_path, kernel_env())
    errors = [output for cell in executed.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    check_shown(executed, path.name)


@pytest.mark.slow
def test_the_stop_button_checkpoints_and_the_call_it_names_finishes_the_run(tmp_path):
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), env=kernel_env())
    try:
        metrics = tmp_path / "runs/xor/stopped/metrics.jsonl"

        def press_stop() -> None:
            while not (metrics.exists() and metrics.read_text().strip()):
                time.sleep(0.01)
            manager.interrupt_kernel()

        stop = threading.Thread(target=press_stop, daemon=True)
        stop.start()
        call = (
            'research.train_experiment("xor", epochs=400, steps_per_call=19, log_every=19, run_dir="runs/xor/stopped")'
        )
        reply = client.execute_interactive(f"import research\nrun = {call}", timeout=300)["content"]
        stop.join()
        assert (reply["status"], reply["ename"]) == ("error", "Preempted")
        stopped = re.fullmatch(
            r"stopped by SIGINT at step (\d+) of 7600; its checkpoint is saved: (.*) to continue", reply["evalue"]
        )
        assert stopped, reply["evalue"]
        assert 0 < int(stopped[1]) < 7600 and any((metrics.parent / "checkpoints").iterdir())
        assert stopped[2] == (
            "research.train_experiment('xor', epochs=400, steps_per_call=19, log_every=19, "
            "run_dir='runs/xor/stopped', resume='auto')"
        )
        reply = client.execute_interactive(f"run = {stopped[2]}\nprint(run.step, run.summary['step'])", timeout=300)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    steps = [line for line in metrics.read_text().splitlines() if '"step": 7600' in line]
    assert steps, "the continued run did not reach its last step"
