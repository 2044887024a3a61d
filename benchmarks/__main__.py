"""`python -m benchmarks [--quick] [--cases a,b,...] [--out DIR]`: run the benchmark suite side by
side and write DIR/benchmarks.md, DIR/benchmarks.png and DIR/benchmarks.json."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

CASES = {
    "a": "xor",
    "b": "mlp",
    "c": "cnn",
    "d": "per_example",
    "e": "dp_sgd",
    "f": "population",
    "g": "fsdp",
    "h": "loaders",
    "i": "gpt",
    "j": "deterministic",
    "k": "generative",
    "l": "ppo",
    "m": "startup",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds a case (not a measurement)")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)} (default: all)"
    )
    parser.add_argument(
        "--out", default=None, help="output directory (default: docs, or runs/bench-quick with --quick)"
    )
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; expected a subset of {','.join(CASES)}")
    out = Path(args.out or ("runs/bench-quick" if args.quick else "docs"))
    out.mkdir(parents=True, exist_ok=True)

    from . import (
        _cnn,
        _deterministic,
        _dp_sgd,
        _frameworks,
        _fsdp,
        _generative,
        _gpt,
        _loaders,
        _mlp,
        _per_example,
        _population,
        _ppo,
        _report,
        _startup,
        _xor,
    )

    modules = {
        "xor": _xor,
        "mlp": _mlp,
        "cnn": _cnn,
        "per_example": _per_example,
        "dp_sgd": _dp_sgd,
        "population": _population,
        "fsdp": _fsdp,
        "loaders": _loaders,
        "gpt": _gpt,
        "deterministic": _deterministic,
        "generative": _generative,
        "ppo": _ppo,
        "startup": _startup,
    }
    start = time.perf_counter()
    info = _report.machine()
    info["load_before"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    info["torch_threads"] = (
        "PyTorch threads: calibrated per candidate, its default count or one thread, "
        "whichever ran it faster here (the count is in its name, with the other count's time "
        "as a ratio); the XOR candidates run on one thread (see (a))"
    )
    results = {}
    skipped = {}
    for case in cases:
        name = CASES[case]
        if name in ("cnn", "per_example", "population", "loaders", "deterministic") and not _frameworks.have_mnist1d():
            skipped[case] = "skipped: the mnist1d package is not installed (run scripts/setup)"
            print(f"case ({case}) {name}: {skipped[case]}", file=sys.stderr)
            continue
        if name == "generative" and not _frameworks.have_sklearn():
            skipped[case] = "skipped: scikit-learn (its bundled digits) is not installed (the `dev` extra)"
            print(f"case ({case}) {name}: {skipped[case]}", file=sys.stderr)
            continue
        if name == "ppo" and _ppo.missing():
            skipped[case] = f"skipped: {_ppo.missing()} is not installed (the `rl` extra)"
            print(f"case ({case}) {name}: {skipped[case]}", file=sys.stderr)
            continue
        case_start = time.perf_counter()
        results[name] = modules[name].run(args.quick)
        print(f"case ({case}) {name}: {time.perf_counter() - case_start:.0f} s", flush=True)
    info["skipped"] = skipped
    info["load_after"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    seconds = time.perf_counter() - start
    findings = (Path(__file__).parent / "findings.md").read_text()
    _report.write_markdown(out / "benchmarks.md", results, info, args.quick, seconds, findings)
    problem = _report.write_chart(out / "benchmarks.png", results)
    if problem:
        print(problem, file=sys.stderr)
    (out / "benchmarks.json").write_text(
        json.dumps(
            {
                "info": info,
                "quick": args.quick,
                "seconds": seconds,
                "results": {k: _jsonable(v) for k, v in results.items()},
            },
            indent=1,
        )
    )
    for row in _report.targets(results):
        print(" | ".join(str(x) for x in row))
    print(f"wrote {out / 'benchmarks.md'} in {seconds:.0f} s")
    return 0


def _jsonable(value):
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
