"""The errors every layer raises, defined at the bottom so that any layer can raise or catch them.

A script turns `ResearchInputError`s (bad config, data, checkpoint or device request) into one
line on stderr and exit status 2, and a `NonFiniteError` into one line and exit status 1.
"""


class ResearchInputError(ValueError):
    """Input the run cannot use; the message says what was expected, what came, and what to do."""


class ConfigError(ResearchInputError):
    """A config value, or a combination of values, is invalid; the message names the option."""


class MissingExtra(ConfigError, ModuleNotFoundError):
    """What was asked for needs an optional package that is not installed (`research.install.require_extra`);
    the message names the package and the install that brings it (an extra of `research`)."""


class DeviceError(ConfigError):
    """The run asks for devices it cannot have, or a batch its devices cannot split evenly."""


class DataError(ResearchInputError):
    """Data that cannot be used as asked: a batch size larger than the data set, mismatched
    inputs and labels, or a batch that does not fit the model."""


class CheckpointError(ResearchInputError):
    """A checkpoint file is missing, truncated, corrupted or does not fit the skeleton."""


class NonFiniteError(FloatingPointError):
    """The training loss or gradient became NaN or infinite."""


class Preempted(Exception):
    """The run stopped on a signal (SIGTERM, SIGINT) after the compiled call in flight, having saved
    a checkpoint when it has a run directory; `status` is the exit status a script ends with
    (128 + the signal number: 143 for SIGTERM, 130 for SIGINT), `step` the step it stopped at."""

    def __init__(self, message: str, *, step: int, status: int):
        super().__init__(message)
        self.step, self.status = step, status
