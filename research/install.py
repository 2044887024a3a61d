"""Where the user is, so that messages name what they can type: a checkout of the repository (its
`scripts/`, its `.venv`) or an installed package (the `research` command, `pip install 'research[EXTRA]'`).

- `command("sweep")`: `research sweep` under the `research` command or in an installed package,
  `scripts/sweep` in a checkout.
- `require_extra(what, module)`: one line naming the install when an optional package is missing,
  the same for every optional import (`MissingExtra`: exit status 2 on the command line).

Light on purpose: `research --help` imports this and nothing heavier.
"""

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

from .errors import MissingExtra

__all__ = ["EXTRAS", "checkout", "command", "extra_problem", "require_extra", "the_command_runs"]

# Each optional package `research` imports: its name on PyPI and the extra of pyproject.toml that brings it
# (None: no extra does; tests/test_install.py checks this against pyproject.toml).
EXTRAS: dict[str, tuple[str, str | None]] = {
    "tensorboardX": ("tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow-skinny", "mlflow"),
    "grain": ("grain", "grain"),
    "dp_accounting": ("dp-accounting", "dp"),
    "optuna": ("optuna", "sweep"),
    "submitit": ("submitit", "slurm"),
    "tokenizers": ("tokenizers", "hf"),
    "datasets": ("datasets", "hf"),
    "gymnax": ("gymnax", "rl"),
    "six": ("six", "rl"),  # gymnax imports it without declaring it
    "jupytext": ("jupytext", "notebook"),
    "nbclient": ("nbclient", "notebook"),
    "ipykernel": ("ipykernel", "notebook"),
    "pandas": ("pandas", None),
}

# The subcommands whose script in scripts/ has another name.
SCRIPTS = {"compare": "compare_runs", "plot": "plot_runs", "show-jaxpr": "show_jaxpr"}

_ROOT = Path(__file__).resolve().parent.parent
_by_the_command = False  # the `research` command runs in this process (`the_command_runs`)


def checkout() -> Path | None:
    """The root of the repository's checkout this package runs from (an editable install, or the
    repository on `PYTHONPATH`), or None for an installed package (no `scripts/setup` beside it)."""
    return _ROOT if (_ROOT / "scripts" / "setup").is_file() and (_ROOT / "pyproject.toml").is_file() else None


@contextlib.contextmanager
def the_command_runs() -> Iterator[None]:
    """While open, `command` names the `research` command's subcommands, whatever the install: the user
    typed `research ...`, in a checkout too."""
    global _by_the_command
    before, _by_the_command = _by_the_command, True
    try:
        yield
    finally:
        _by_the_command = before


def command(sub: str) -> str:
    """What the user types to run the subcommand `sub` (`run`, `sweep`, `compare`, ...): `research sub`
    under the `research` command or in an installed package, `scripts/NAME` in a checkout."""
    if _by_the_command or checkout() is None:
        return f"research {sub}"
    return f"scripts/{SCRIPTS.get(sub, sub)}"


def _install(module: str) -> str:
    package, extra = EXTRAS[module]
    if extra is None:
        return f"pip install {package}"
    if checkout() is None:
        return f"pip install 'research[{extra}]'"
    return f"in this checkout, .venv/bin/pip install -c requirements/constraints.txt -e '.[{extra}]'"


def extra_problem(*modules: str) -> str | None:
    """`None` when each of `modules` (names in `EXTRAS`) can be imported, else what to do about the first
    that cannot: `needs the wandb package, which is not installed: pip install 'research[wandb]'`. Looked
    up without importing it (`importlib.util.find_spec`), so a check costs no import."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"needs the {module} package, which is not installed: {_install(module)}"
    return None


def require_extra(what: str, *modules: str) -> None:
    """Raise `MissingExtra` (`{what} needs the ... package, which is not installed: pip install ...`)
    unless each of `modules` can be imported; `what` names what asked for it (`--search random`)."""
    problem = extra_problem(*modules)
    if problem:
        raise MissingExtra(f"{what} {problem}")
