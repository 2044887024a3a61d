"""`python -m benchmarks._startup_probe MARKS.json run|sample ARGS...`: one command of case (m), run as the
user runs it (`research run ARGS`, `research sample ARGS`) in this fresh process, with the moments its phases
end written to MARKS.json (`time.perf_counter()`, the system's monotonic clock, which the parent process
reads too).

Only the standard library is imported before the command's own imports start, so that what this process
imports is what the command imports.
"""

import functools
import json
import sys
import time


def _marked(marks: dict, name: str, fn):
    """`fn`, noting when its first call starts (`name`) and when it returns (`name + '_end'`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        marks.setdefault(name, time.perf_counter())
        result = fn(*args, **kwargs)
        marks.setdefault(f"{name}_end", time.perf_counter())
        return result

    return wrapper


def _run(marks: dict, argv: list[str]) -> None:
    """`research run ARGV`: the imports end where the experiment script calls `main_entry`."""
    import research.cli
    import research.experiment
    import research.run
    from research.train import Engine

    research.cli.main_entry = _marked(marks, "main_entry", research.cli.main_entry)
    research.experiment.run_experiment = _marked(marks, "run_experiment", research.experiment.run_experiment)
    fit = Engine.fit

    def timed_fit(self, *args, **kwargs):
        marks["fit"] = time.perf_counter()
        result = fit(self, *args, **kwargs)
        marks["fit_end"], marks["compile_seconds"] = time.perf_counter(), result.compile_seconds
        return result

    Engine.fit = timed_fit
    research.run.main(argv)


def _sample(marks: dict, argv: list[str]) -> None:
    """`research sample ARGV` of a language model's run."""
    from research.tools import sample

    marks["main_entry"] = time.perf_counter()
    sample.load_language_run = _marked(marks, "load", sample.load_language_run)
    sample_bytes = sample.sample_bytes

    def timed(*args, **kwargs):
        marks["generate"] = time.perf_counter()
        result = sample_bytes(*args, **kwargs)
        marks["generate_end"], marks["compile_seconds"] = time.perf_counter(), result.compile_seconds
        marks["generate_seconds"] = result.seconds
        return result

    sample.sample_bytes = timed
    sample.main(argv)


def main() -> None:
    marks = {"start": time.perf_counter()}
    out, command, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        {"run": _run, "sample": _sample}[command](marks, argv)
    finally:
        marks["end"] = time.perf_counter()
        with open(out, "w") as f:
            json.dump(marks, f)


if __name__ == "__main__":
    main()
