"""The package's layers import only downward, and no package reaches into another's private modules.

The layers are the `[tool.importlinter]` contract in pyproject.toml, checked by import-linter (a dev
dependency). Privacy has no import-linter contract, so it is checked here on the AST: a module or
name whose dotted path has a component starting with `_` (say `research.train._compiled`, or
`_copy` in `research.train`) belongs to the package holding that component, and only modules inside
that package may import it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import research.train

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "research"

# Private imports across packages that are still to be removed, as (file, what it imports). The test
# fails when one of them is gone too: delete its entry then, so the list only shrinks.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()


def test_layers_import_only_downward():
    # In a subprocess: lint_imports reconfigures logging (disabling every logger already made) and
    # prints to stdout. This venv's python, so it runs where `lint-imports` is not on the PATH too.
    lint = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    result = subprocess.run([sys.executable, "-c", lint], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _owner(name: str) -> str | None:
    """The package a dotted name is private to (None when it is public): the part before its
    first component that starts with one underscore."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of each import in `source` (the module `module`) of something in `research`
    private to a package that `module` is not inside. (Other libraries' privates, `jax._src`, are not
    this test's business.)"""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name)
            if owner is None or name.split(".")[0] != "research":
                continue
            if module != owner and not module.startswith(owner + "."):
                found.append((node.lineno, name))
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..train._compiled import static_key", [(1, "research.train._compiled.static_key")]),
        ("import research.train._keys", [(1, "research.train._keys")]),
        ("from research.train import _copy", [(1, "research.train._copy")]),
        ("from ..experiment import _versions", [(1, "research.experiment._versions")]),
        ("from ._devices import check_device_count\nfrom ..train import fit\nfrom jax._src import xla_bridge", []),
    ],
)
def test_private_imports_finds_imports_across_packages(source, expected):
    assert private_imports(source, "research.parallel._strategies", is_package=False) == expected


def test_no_package_imports_another_packages_private_modules():
    found = set()
    lines = []
    for path in sorted(PACKAGE.rglob("*.py")):
        file = str(path.relative_to(ROOT))
        for line, name in private_imports(path.read_text(), _module_name(path), path.name == "__init__.py"):
            found.add((file, name))
            if (file, name) not in KNOWN_PRIVATE_IMPORTS:
                lines.append(f"{file}:{line} imports {name}, private to {_owner(name)}")
    assert not lines, "private imports across packages:\n" + "\n".join(lines)
    gone = KNOWN_PRIVATE_IMPORTS - found
    assert not gone, f"no longer imported, remove from KNOWN_PRIVATE_IMPORTS: {sorted(gone)}"


def test_the_engine_exports_few_enough_names_to_read_at_once():
    # What an experiment or a step of its own needs; the rest lives in research.train's sub-namespaces
    # (evaluation, fine_tuning, precision, reduction). 56 names were more than a reader takes in.
    assert len(research.train.__all__) < 40, sorted(research.train.__all__)
    assert sorted(research.train.__all__) == sorted(set(research.train.__all__))
