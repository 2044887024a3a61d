"""The `research` command (`[project.scripts]` in pyproject.toml): one command with subcommands, as git's.

    research run xor --epochs 5
    research sweep xor lr=0.1,0.3 -- --epochs 5
    research compare runs/xor/*

Each subcommand is a module's `main(argv)`, imported only when it runs: `research --help` imports no
JAX. In a checkout of the repository, `scripts/NAME` runs the same modules in its `.venv`.
"""

import difflib
import importlib
import sys
from collections.abc import Sequence

from . import install
from .messages import quiet_when_stdout_closes

# Subcommand: (the module whose `main(argv)` runs it, one line of help). gpu-check's module is the
# repository's (benchmarks/, which the package does not install).
COMMANDS = {
    "run": ("research.run", "train an experiment: run NAME [flags], or a run again: run --from RUN_DIR [flags]"),
    "sweep": ("research.tools.sweep", "many runs of one experiment: a grid, a random or a TPE search"),
    "launch": ("research.tools.launch", "one experiment in N local processes (jax.distributed)"),
    "compare": ("research.tools.compare_runs", "a markdown table of run directories: options that differ, results"),
    "plot": ("research.tools.plot_runs", "the learning curves of run directories, to a PNG"),
    "export": ("research.tools.export", "a run's weights as safetensors, .npz or a Hugging Face directory"),
    "sample": ("research.tools.sample", "text or images from a trained generative run (lm, gan, diffusion)"),
    "rollout": ("research.tools.rollout", "play a trained agent's policy (ppo) and print its returns"),
    "show-jaxpr": ("research.tools.show_jaxpr", "the jaxpr of one train step of an experiment"),
    "gpu-check": ("benchmarks.gpu_check", "a prepared check of this machine's JAX on a GPU (a checkout only)"),
}

EPILOG = """\
'research COMMAND --help' shows a command's options. In a checkout of the repository, scripts/ runs the
same commands in its .venv (scripts/run, scripts/sweep, scripts/compare_runs, ...), and also holds the
repository's own, which are not commands of the installed package: setup (the .venv), test (the test
suite), lint, bench (docs/benchmarks.md) and notebooks (docs/ as .ipynb)."""


def help_text() -> str:
    lines = ["usage: research COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<11} {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join([*lines, "", EPILOG])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"research {version('research')}"
    except PackageNotFoundError:  # the source tree on PYTHONPATH, not installed
        return "research (not installed: a source tree)"


def _gpu_check_main(argv: list[str]) -> None:
    root = install.checkout()
    if root is None or not (root / "benchmarks" / "gpu_check.py").is_file():
        print(
            "research gpu-check: error: the GPU check is the repository's (benchmarks/ and tests/, which the "
            "package does not install): run scripts/gpu-check in a checkout of the repository",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.path.insert(0, str(root))  # benchmarks/ beside research/, as scripts/gpu-check has it on PYTHONPATH
    importlib.import_module("benchmarks.gpu_check").main(argv)


@quiet_when_stdout_closes()
def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--version":
        print(_version())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"research: error: no command {name!r}{hint}; research --help lists them", file=sys.stderr)
        raise SystemExit(2)
    with install.the_command_runs():
        if name == "gpu-check":
            _gpu_check_main(rest)
        else:
            importlib.import_module(COMMANDS[name][0]).main(rest)
