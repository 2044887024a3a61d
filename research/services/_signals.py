"""Stopping a run on SIGTERM or SIGINT without losing its work.

`StopSignals` catches the signals while a run trains; the engine looks at it after every compiled
call, and on a signal it stops there, lets its preemption hooks run (the checkpoint) and raises
`Preempted`. A second SIGINT interrupts at once (the impatient Ctrl-C).
"""

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered (in the main thread), SIGTERM and SIGINT ask the run to stop instead of killing it."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = number
