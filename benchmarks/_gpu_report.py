"""gpu-check's report as markdown: one section a part, in the order the parts ran, a part that did not finish
shown by its status and its error's last line."""

TITLES = {
    "env": "Environment",
    "lm": "LM train step (bf16 compute, AdamW)",
    "peer": "Ours beside a PyTorch GPT of the same shape",
    "profile": "Profile: the top kernels of each step",
    "attention": "Causal attention, forward and backward (bf16)",
    "bitwise": "Bitwise pairs (two fresh processes, no compilation cache)",
    "experiments": "Experiments",
    "tests": "Tests",
    "bench": "Bench",
}


def markdown(report: dict, tests: tuple[str, ...]) -> str:
    tiny = " (--tiny: sizes for a CPU, figures meaningless)" if report["tiny"] else ""
    lines = [f"# gpu-check, {report['date']}{tiny}"]
    if report.get("wheels"):
        wheels = report["wheels"]
        lines += ["", f"- from {wheels['folder']}: installed {', '.join(wheels['installed']) or 'nothing'}"]
        lines += [f"- unmet (no wheel): {', '.join(wheels['unmet'])}"] if wheels["unmet"] else []
    for name, status in report.get("parts", {}).items():
        seconds = f" ({status['seconds']} s)" if "seconds" in status else ""
        lines += ["", f"## {TITLES.get(name, name)}{seconds}", ""]
        if status["status"] == "running":
            lines.append(f"- running since {status['since']} (or stopped there)")
        elif status["status"] in ("failed", "timed out"):
            lines.append(f"- {status['status']} after {status['seconds']} s: {status['error']}")
            if name in report:  # what it wrote before
                lines += ["- what it had done by then:", "", *RENDER.get(name, _items)(report[name], tests)]
        elif status["status"] == "skipped":
            lines.append(f"- skipped: {report[name]['skipped']}")
        else:
            lines += RENDER.get(name, _items)(report[name], tests)
    return "\n".join(lines) + "\n"


def _items(result: dict, tests: tuple[str, ...]) -> list[str]:
    return [f"- {k}: {v}" for k, v in result.items()]


def _lm(lm: dict, tests: tuple[str, ...]) -> list[str]:
    lines = [f"- shape: {lm['shape']}, {lm['parameters']:,} parameters"]
    return lines + [f"- {k}: {v}" for k, v in lm.items() if k not in ("shape", "parameters")]


def _peer(peer: dict, tests: tuple[str, ...]) -> list[str]:
    lines = [f"- shape: {peer['shape']}; {peer['steps']} steps a round, {peer['rounds']} rounds (median)"]
    lines += [f"- {side}: {peer[side]['setup']}" for side in ("ours", "pytorch")]
    lines += ["", "| | parameters | step ms | tokens/s | MFU | peak memory GiB |", "|---|---|---|---|---|---|"]
    for side in ("ours", "pytorch", "ratio"):
        r = peer[side]
        lines.append(
            f"| {side if side != 'ratio' else 'ours / PyTorch'} | {r.get('parameters', '')} | {r['step_ms']} | "
            f"{r['tokens_per_s']} | {r['mfu']} | {r['peak_memory_gib']} |"
        )
    return lines + ["", f"- {peer['models']}"]


def _profile(profile: dict, tests: tuple[str, ...]) -> list[str]:
    lines = []
    for side in ("ours", "pytorch"):
        p = profile[side]
        if "skipped" in p:
            lines += [f"- {side}: skipped: {p['skipped']}", ""]
            continue
        lines += [
            f"### {side}: {p['steps']} steps in {p['wall_ms']} ms traced; summed: {p['track']}",
            "",
            f"- listed: {p['listed_ms']} ms of {p['summed_ms']} ms summed ({p['events']} events on {p['tracks']} "
            f"track{'s' if p['tracks'] != 1 else ''}, the busiest {p['busiest_track_ms']} ms)",
            "",
            "| kernel | total ms | calls | share of the steps |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| `{k['name'][:90]}` | {k['total_ms']} | {k['calls']} | {k['share']:.1%} |" for k in p["top"]]
        lines.append("")
    return lines[:-1]


def _bitwise(pairs: list, tests: tuple[str, ...]) -> list[str]:
    return [
        f"- {p['experiment']}, --deterministic-reduction {p['deterministic_reduction']}: exit {p['statuses']}, "
        f"same bits: {p['same_bits']}"
        for p in pairs
    ]


def _experiments(experiments: dict, tests: tuple[str, ...]) -> list[str]:
    lines = ["| experiment | exit | seconds | compile s | test numbers |", "| --- | --- | --- | --- | --- |"]
    for name, r in experiments.items():
        numbers = ", ".join(f"{k} {v:.4g}" for k, v in r["numbers"].items()) or r["error"]
        compile_s = "-" if r["compile_s"] is None else r["compile_s"]
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {compile_s} | {numbers} |")
    return lines


def _tests(result: dict, tests: tuple[str, ...]) -> list[str]:
    return [f"- {' '.join(tests)}: exit {result['status']}, {result['summary']}"]


def _bench(result: dict, tests: tuple[str, ...]) -> list[str]:
    return [f"- cases {result['cases']}: exit {result['status']}: {result['report']}"]


RENDER = {
    "lm": _lm,
    "peer": _peer,
    "profile": _profile,
    "bitwise": _bitwise,
    "experiments": _experiments,
    "tests": _tests,
    "bench": _bench,
}
