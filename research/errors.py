"""The errors every layer raises, defined at the bottom so that any layer can raise or catch them.

A script turns `ResearchInputError`s (bad config, data, checkpoint or device request) into one
line on stderr and exit status 2, and a `NonFiniteError` into one line and exit status 1.
"""


class ResearchInputError(ValueError):
    """Input the run cannot use; the message says what was expected, what came, and what to do."""


class ConfigError(ResearchInputError):
    """A config value, or a combination of values, is invalid; the message names the option."""


class DeviceError(ConfigError):
    """The run asks for devices it cannot have, or a batch its devices cannot split evenly."""


class DataError(ResearchInputError):
    """Data that cannot be used as asked: a batch size larger than the data set, mismatched
    inputs and labels, or a batch that does not fit the model."""


class CheckpointError(ResearchInputError):
    """A checkpoint file is missing, truncated, corrupted or does not fit the skeleton."""


class NonFiniteError(FloatingPointError):
    """The training loss or gradient became NaN or infinite."""
