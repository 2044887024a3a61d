"""Run an experiment: `research run NAME [flags]` (in a checkout, `scripts/run`; `python -m research.run`
runs the same).

    research run xor --epochs 5
    research run --from runs/xor/20261125-101500 --seed 3   # that run again, in a new directory

`--from RUN_DIR` takes the experiment and every option from `RUN_DIR/config.json` (as `--config`
does: its run directory and resume mode left out), the flags after it override them, and the run
goes to a new directory (`--run-dir` names one). `--from RUN_DIR --resume` continues RUN_DIR itself
(`--run-dir RUN_DIR --resume`: the options come back from its config.json, as any resume's do).
"""

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from . import install
from .errors import ConfigError
from .experiment import experiment_names, experiment_script
from .messages import messages_to_stderr
from .services import RunDir


def command(argv: Sequence[str]) -> tuple[Path, list[str]]:
    """The experiment script and its flags that `argv` asks for (`NAME [flags]` or `--from RUN_DIR [flags]`);
    `ConfigError` when there is no such experiment or run."""
    argv = list(argv)
    if argv[0] == "--from" or argv[0].startswith("--from="):
        source = argv[0].partition("=")[2] if "=" in argv[0] else (argv[1] if len(argv) > 1 else "")
        rest = argv[1:] if "=" in argv[0] else argv[2:]
        run = RunDir(source)
        if not source or not run.config_file.is_file():
            raise ConfigError(f"--from: no run in {source or '(nothing given)'}: it has no config.json")
        script = experiment_script(run.read_config()["experiment"])
        if not _resumes(rest):
            return script, ["--config", str(run.config_file), *rest]
        if any(arg == "--run-dir" or arg.startswith("--run-dir=") for arg in rest):
            raise ConfigError(f"--from {source} --resume continues the run in {source}; leave out --run-dir")
        return script, ["--run-dir", source, *rest]
    return experiment_script(argv[0]), argv[1:]


def _resumes(flags: list[str]) -> bool:
    """Whether `flags` ask to resume: their last `--resume [auto|must|never]` or `--no-resume` says."""
    mode = "never"
    for i, flag in enumerate(flags):
        if flag == "--no-resume":
            mode = "never"
        elif flag.startswith("--resume="):
            mode = flag.partition("=")[2]
        elif flag == "--resume":
            mode = flags[i + 1] if flags[i + 1 : i + 2] in (["auto"], ["must"], ["never"]) else "must"
    return mode != "never"


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        usage = f"usage: {install.command('run')} NAME [flags] | --from RUN_DIR [flags]   (NAME --help: its flags)"
        print(f"{usage}\nexperiments: {' '.join(experiment_names())}", file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    try:
        script, flags = command(argv)
    except ConfigError as e:
        print(f"run: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = [str(script), *flags]  # the script reads its flags, and names itself, from sys.argv
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
