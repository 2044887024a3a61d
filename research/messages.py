"""The library's messages: every module logs through `logging.getLogger(__name__)`, a logger under
`research`, so that whoever uses the library can silence, redirect or capture them with `logging`.

- **As a library** (`fit` or `run_experiment` called from a script of one's own), `research` installs
  no handler: the `logging` HOWTO's rule for libraries, since the application owns the output.
  Warnings still reach stderr (through Python's last-resort handler, or the handlers the application
  configured); informational lines ("resuming RUN from step N", where a profile was written) are left
  out, as any library's INFO records are, until the application asks for them:
  `logging.basicConfig(level=logging.INFO)`, or `with messages_to_stderr(): ...` for the command
  line's bare lines. `caplog` captures them in tests; `logging.getLogger("research").setLevel(
  logging.ERROR)` silences the warnings.
- **On the command line** (`research.cli.main_entry`, `python -m research.run`, the tools under
  `research.tools`), `messages_to_stderr` shows INFO and above as bare lines (`%(message)s`) on
  stderr: what the library printed before it logged, byte for byte (so a warning's text keeps its
  `warning: ` prefix, which a handler that formats the level too shows twice).

A command-line process also skips Python's last garbage collection at exit (`gc.freeze` registered with
`atexit` by `messages_to_stderr`): it walks every object the imports and JAX made, to free memory the ending
process gives back anyway, and was a large part of a small run's wall time (`scripts/bench` case (m)).

What stays a `print`: the command line's own output (a summary line on stdout, the one line
`prog: error: ...` before a non-zero exit, the tools' `sweep: ...` lines), and progress reports
(`research.progress`).
"""

import atexit
import contextlib
import gc
import logging
import os
import select
import sys
from collections.abc import Iterator

__all__ = ["messages_to_stderr", "quiet_when_stdout_closes"]


class _CurrentStderr(logging.Handler):
    """Writes each record to `sys.stderr` as it is when the record comes, not as it was when the handler
    was made (a `logging.StreamHandler` keeps its stream): pytest's `capsys` and
    `contextlib.redirect_stderr` swap `sys.stderr`, and the messages must follow, as a `print` would."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:  # as logging.StreamHandler does: a recursion is not the handler's to hide
            raise
        except Exception:
            self.handleError(record)


_exit_registered = False


def _skip_the_last_collection() -> None:
    """Register `gc.freeze` to run at exit, once a process. Frozen objects are left out of the collection
    Python makes as it ends; reference counting still frees the rest, and the exit handlers run as before."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(gc.freeze)
        _exit_registered = True


@contextlib.contextmanager
def messages_to_stderr() -> Iterator[None]:
    """While open, the `research` logger's messages of level INFO and above are written to the current
    `sys.stderr`, each as its bare message on a line, and only there (they do not also propagate to the
    root logger's handlers, which would print them a second time, formatted). Opened inside itself (a
    tool running an experiment's `main_entry` in its own process), only the outermost one acts. On
    closing, the logger is as it was, so that running a command in-process (the tests do) leaves no
    handler behind. A decorator too: `@messages_to_stderr()`.

    A level set on the `research` logger beforehand is kept (`WARNING` silences the INFO lines). The
    process, a command line's, skips Python's last garbage collection at exit (the module's docstring)."""
    _skip_the_last_collection()
    logger = logging.getLogger("research")
    if any(isinstance(handler, _CurrentStderr) for handler in logger.handlers):
        yield
        return
    handler = _CurrentStderr(logging.INFO)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    if level == logging.NOTSET:  # else the root logger's WARNING would leave the INFO lines out
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(level)  # (not `logger.level = level`: setLevel clears the loggers' cached levels)


@contextlib.contextmanager
def quiet_when_stdout_closes() -> Iterator[None]:
    """A reader that stops reading (`research --help | head`) ends the command, status 141 as a shell's
    SIGPIPE, without a traceback: Python's advice, stdout pointed at /dev/null so its last flush cannot
    fail again."""
    try:
        yield
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe (a worker's, a tracker's): a real error, shown as one
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, 0)
    return any(events & select.POLLERR for _, events in poller.poll(0))
