"""The library's messages go through `logging`; the command line shows them as bare lines on stderr; a missing
optional package is one line naming the install that fits where the user is."""

import contextlib
import importlib.util
import io
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from research import install
from research.cli import TrainConfig, parse_config
from research.data import GrainLoader, TextTokenizer, XORDataset, read_image_data
from research.errors import MissingExtra, ResearchInputError
from research.experiment import load_experiment
from research.install import EXTRAS
from research.messages import messages_to_stderr
from research.per_example import dp_sgd_epsilon
from research.services import RunDir
from research.tools import notebooks, sweep

logger = logging.getLogger("research.experiment")  # a module's logger, as `logging.getLogger(__name__)` makes it


def test_the_command_line_shows_info_and_warnings_as_bare_lines_on_the_current_stderr(capsys):
    with messages_to_stderr():
        logger.info("resuming r from step 8 (step_000000008)")
        logger.warning("warning: skipping a checkpoint")
        logger.debug("not shown")
        swapped = io.StringIO()
        with contextlib.redirect_stderr(swapped):  # the stream as it is at each message, as for a print
            logger.info("into the swapped stream")
    assert capsys.readouterr().err == "resuming r from step 8 (step_000000008)\nwarning: skipping a checkpoint\n"
    assert swapped.getvalue() == "into the swapped stream\n"


def test_the_messages_are_shown_once_and_the_logger_is_left_as_it_was(capsys, caplog):
    research = logging.getLogger("research")
    before = (list(research.handlers), research.propagate, research.level)
    with messages_to_stderr():
        with messages_to_stderr():  # a tool running an experiment in its process: only the outer one acts
            logger.warning("once")
    assert capsys.readouterr().err == "once\n"
    assert not [r for r in caplog.records if r.name.startswith("research")]  # not on to the root's handlers too
    assert (list(research.handlers), research.propagate, research.level) == before
    logger.warning("after")  # the library again: on to the root logger (pytest's caplog here)
    assert [r.getMessage() for r in caplog.records] == ["after"]


def test_a_level_set_beforehand_is_kept_and_it_works_as_a_decorator(capsys):
    research = logging.getLogger("research")

    @messages_to_stderr()
    def command() -> None:
        logger.info("resuming")
        logger.warning("warning: kept")

    research.setLevel(logging.WARNING)  # the application silenced the informational lines
    try:
        command()
    finally:
        research.setLevel(logging.NOTSET)
    assert capsys.readouterr().err == "warning: kept\n"
    command()
    assert capsys.readouterr().err == "resuming\nwarning: kept\n"


@pytest.mark.parametrize("command_line", [False, True])
def test_a_command_line_process_skips_the_last_garbage_collection_at_exit(command_line):
    """Once `messages_to_stderr` has run (every command does), the process ends without Python's last
    collection: garbage in a reference cycle is left for the ending process to drop; as a library, not."""
    code = f"""
import gc
from research.messages import messages_to_stderr
class Cycle:
    def __del__(self):
        print("collected", flush=True)
if {command_line}:
    with messages_to_stderr():
        pass
gc.disable()  # no collection before the exit's
cycle = Cycle()
cycle.itself = cycle
del cycle
"""
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0 and ended.stderr == "", ended.stderr
    assert ended.stdout == ("" if command_line else "collected\n")


def test_as_a_library_info_lines_are_left_to_the_application():
    assert not logger.isEnabledFor(logging.INFO)  # the root logger's WARNING, until the application says
    assert logger.isEnabledFor(logging.WARNING)


# Each optional package (research.install.EXTRAS) and the cheapest call that needs it: (the line's prefix at the
# command line, or None for a library call that raises MissingExtra; what asks for it; the call, in a scratch folder).
def xor_flags(*flags: str) -> Callable[[Path], object]:
    return lambda _: parse_config(TrainConfig, list(flags), prog="xor.py")


NEEDED_BY: dict[str, tuple[str | None, str, Callable[[Path], object]]] = {
    "tensorboardX": ("xor.py", "--tensorboard", xor_flags("--tensorboard")),
    "wandb": ("xor.py", "--tracker wandb", xor_flags("--tracker", "wandb")),
    "mlflow": ("xor.py", "--tracker mlflow", xor_flags("--tracker", "mlflow")),
    "optuna": ("sweep", "--search random", lambda _: sweep.main(["xor", "lr=0.1,0.3", "--search", "random"])),
    "submitit": ("sweep", "--executor slurm", lambda _: sweep.main(["xor", "lr=0.1", "--executor", "slurm"])),
    "jupytext": ("notebooks", "a Jupytext notebook", lambda where: notebooks.main([str(where / "n.md")])),
    "nbclient": ("notebooks", "a Jupytext notebook", lambda where: notebooks.main([str(where / "n.md")])),
    "ipykernel": ("notebooks", "a Jupytext notebook", lambda where: notebooks.main([str(where / "n.md")])),
    "grain": (None, "--loader grain", lambda _: GrainLoader(XORDataset(8, seed=0), 2, seed=0)),
    "dp_accounting": (
        None,
        "privacy accounting",
        lambda _: dp_sgd_epsilon(
            noise_multiplier=1.0, dataset_size=100, expected_batch_size=10, max_batch_size=20, steps=1, delta=1e-5
        ),
    ),
    "tokenizers": (None, "reading {where}", lambda where: TextTokenizer(where)),
    "datasets": (None, "{where} (a Hugging Face datasets directory)", lambda where: read_image_data(where)),
    "gymnax": (None, "ppo", lambda _: load_experiment("ppo").environment.__wrapped__("CartPole-v1")),
    "six": (None, "ppo", lambda _: load_experiment("ppo").environment.__wrapped__("CartPole-v1")),
    "pandas": (None, "RunDir.metric_frame (not metric_columns)", lambda where: RunDir(where).metric_frame()),
}


def test_every_optional_package_has_a_call_that_needs_it_below():
    assert set(NEEDED_BY) == set(EXTRAS)


@pytest.mark.parametrize("where", ["checkout", "installed"])
@pytest.mark.parametrize("module", list(NEEDED_BY))
def test_a_missing_optional_package_is_one_line_naming_the_install_that_fits(module, where, tmp_path, monkeypatch):
    """Each optional package blocked in turn (`import` of it fails): what needs it says so in one line naming the
    install, `pip install 'research[EXTRA]'` for an installed package and the checkout's own in a checkout; at the
    command line that line and exit status 2, from Python a `MissingExtra` (an `ImportError` and a `ConfigError`)."""
    prefix, what, call = NEEDED_BY[module]
    checked_first = list(NEEDED_BY)[: list(NEEDED_BY).index(module)]  # in the order the calls check them
    for other in checked_first:
        if NEEDED_BY[other][1] == what and importlib.util.find_spec(other) is None:
            pytest.skip(f"{other}, which {what} needs before {module}, is not installed")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dataset_dict.json").write_text("{}")  # a datasets directory, told by its file names
    monkeypatch.setitem(sys.modules, module, None)
    if where == "installed":
        monkeypatch.setattr(install, "checkout", lambda: None)
    package, extra = EXTRAS[module]
    hint = (
        f"pip install {package}"
        if extra is None
        else f"pip install 'research[{extra}]'"
        if where == "installed"
        else f"in this checkout, .venv/bin/pip install -c requirements/constraints.txt -e '.[{extra}]'"
    )
    expected = f"{what.format(where=tmp_path)} needs the {module} package, which is not installed: {hint}"
    if prefix is None:
        with pytest.raises(MissingExtra) as info:
            call(tmp_path)
        assert str(info.value) == expected and isinstance(info.value, (ImportError, ResearchInputError))
        return
    err = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(err):
        call(tmp_path)
    assert info.value.code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith(f"{prefix}: error: {expected}"), err.getvalue()
