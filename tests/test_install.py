"""The package installs beside other packages: compatible ranges, the experiments inside it, a licence, the
`research` command; and a non-editable `pip install .` into a fresh virtual environment runs an experiment with
that command and loads it back, loads, compares and exports a run trained with trackers it lacks, and names
the installed package's commands and extras in its messages."""

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from research.command import COMMANDS
from research.install import EXTRAS

ROOT = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINNED_BEFORE = ("jax", "jaxlib", "equinox", "torch", "tyro", "orbax-checkpoint")


def test_core_dependencies_are_ranges_and_the_exact_versions_are_constraints():
    dependencies = {re.split("[<>=]", d)[0].strip(): d for d in PYPROJECT["project"]["dependencies"]}
    for name in PINNED_BEFORE:
        assert "==" not in dependencies[name] and ">=" in dependencies[name], dependencies[name]
    constraints = (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
    for name in PINNED_BEFORE[:3] + PINNED_BEFORE[4:]:  # torch: scripts/setup installs its CPU build first
        assert any(line.startswith(f"{name}==") for line in constraints), name
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_every_package_of_the_source_tree_is_installed():
    """pyproject.toml lists research's packages by hand (one of them, research.experiments, lives in
    experiments/): a new subpackage must be added there too."""
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "research").rglob("__init__.py")}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == found | {"research.experiments"}


def test_the_extras_the_install_hints_name_bring_those_packages():
    """research.install.EXTRAS says which extra brings each optional package: pyproject.toml must agree."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    for module, (package, extra) in EXTRAS.items():
        listed = [re.split("[<>=\\[]", requirement)[0] for requirement in extras.get(extra or "dev", [])]
        assert package in listed, (module, package, extra)


def test_the_research_command_is_installed_and_its_commands_exist():
    assert PYPROJECT["project"]["scripts"] == {"research": "research.command:main"}
    for name, (module, _) in COMMANDS.items():
        assert importlib.util.find_spec(module) is not None, name  # benchmarks: from this checkout


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_runs_an_experiment_and_loads_it_back(tmp_path):
    source = tmp_path / "source"  # a copy: pip builds in the tree it is given
    top_level = {".git", ".venv", "runs", "data", "build", ".pytest_cache"}  # the checkout's own, and what it made
    shutil.copytree(
        ROOT,
        source,
        ignore=lambda where, names: [
            n
            for n in names
            if (Path(where) == ROOT and n in top_level) or n == "__pycache__" or n.endswith(".egg-info")
        ],
    )
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    # --no-compile: no bytecode for the thousands of modules this test never imports (35 s -> 15 s of install)
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, capture_output=True)  # the CPU build on disk
    installed = subprocess.run(
        [*pip, "-c", str(ROOT / "requirements" / "constraints.txt"), str(source)], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    research = str(tmp_path / "venv" / "bin" / "research")  # the command pip made of [project.scripts]
    ran = subprocess.run(
        [research, "run", "xor", "--epochs", "1", "--run-dir", "r", "--no-progress"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("xor: MLP, 33 parameters")
    # A run tracked with W&B and MLflow (this suite's venv has them), looked at where neither is installed.
    tracked = subprocess.run(
        [sys.executable, "-m", "research.run", "xor", "--epochs", "1", "--run-dir", "tracked", "--no-progress"]
        + ["--tracker", "wandb,mlflow"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tracked.returncode == 0, tracked.stderr
    check = """
import importlib.util, json, pathlib, research, research.experiment
from research import load_run
from research.tools import compare_runs, export
assert importlib.util.find_spec("wandb") is None and importlib.util.find_spec("mlflow") is None
assert load_run("tracked").config.tracking.tracker == "jsonl"  # its trackers left out: loading tracks nothing
compare_runs.main(["r", "tracked"])
export.main(["tracked"])
assert pathlib.Path("tracked/model.safetensors").exists()
run = load_run("r")
assert run.step == 19 and run.summary is not None and type(run.model).__name__ == "MLP"
assert "site-packages" in research.__file__ and research.experiment.EXPERIMENTS_DIR.name == "experiments"
assert json.load(open("r/config.json"))["git"] == "not a git checkout"
from importlib.metadata import metadata
assert metadata("research")["License-Expression"] == "Apache-2.0"
"""
    loaded = subprocess.run([python, "-c", check], cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert "| tracked |" in loaded.stdout  # compare_runs' table
    swept = subprocess.run(
        [research, "sweep", "xor", "lr=0.1,0.3", "--dry-run"], cwd=elsewhere, capture_output=True, text=True, timeout=60
    )
    assert swept.returncode == 0 and len(swept.stdout.splitlines()) == 2, swept.stderr
    assert swept.stdout.startswith("research run xor "), swept.stdout  # the command this user has, not scripts/
    # Without Optuna (no extra was installed) a search is one line naming the extra; gpu-check is the repository's.
    for argv, needed in (
        (["sweep", "xor", "lr=0.1,0.3", "--search", "random"], "not installed: pip install 'research[sweep]'"),
        (["gpu-check"], "run scripts/gpu-check in a checkout of the repository"),
    ):
        refused = subprocess.run([research, *argv], cwd=elsewhere, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and needed in refused.stderr, refused.stderr
    assert_typed_downstream(python, elsewhere)


def assert_typed_downstream(python: str, where: Path) -> None:
    """The installed package is typed (PEP 561: it ships py.typed), and pyright, checking a downstream file
    against that install, reads research's annotations: a wrong use is an error naming the types."""
    marker = "import pathlib, research; assert (pathlib.Path(research.__file__).parent / 'py.typed').is_file()"
    subprocess.run([python, "-c", marker], cwd=where, check=True)
    pyright = [str(ROOT / ".venv" / "bin" / "pyright"), "--pythonpath", python]
    downstream = where / "downstream.py"
    downstream.write_text(
        "from research.services import RunDir\n\nsummary: int = RunDir('r').read_summary()\n", encoding="utf-8"
    )
    checked = subprocess.run([*pyright, str(downstream)], cwd=where, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 1 and "1 error" in checked.stdout, checked.stdout
    assert '"dict[str, Any] | None" is not assignable to declared type "int"' in checked.stdout, checked.stdout
