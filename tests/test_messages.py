"""The library's messages go through `logging`; the command line shows them as bare lines on stderr."""

import contextlib
import io
import logging

from research.messages import messages_to_stderr

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


def test_as_a_library_info_lines_are_left_to_the_application():
    assert not logger.isEnabledFor(logging.INFO)  # the root logger's WARNING, until the application says
    assert logger.isEnabledFor(logging.WARNING)
