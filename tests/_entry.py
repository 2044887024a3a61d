"""Running an experiment's command line inside the test process."""

import sys

from research.cli import main_entry
from research.experiment import load_experiment


def run_entry(argv: list[str], name: str) -> int:
    """Experiment `name`'s entry point on `argv` in this process, named as its script (messages say
    `NAME.py: error: ...`); its exit status."""
    module = load_experiment(name)
    argv0, sys.argv[0] = sys.argv[0], f"{name}.py"
    try:
        main_entry(module.main, module.Config, argv)
    except SystemExit as e:
        return e.code
    finally:
        sys.argv[0] = argv0
    return 0
