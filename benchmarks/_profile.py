"""gpu-check's `profile` part: the top kernels of our LM's train step and of the PyTorch GPT's, by total time.

Ours: `jax.profiler.trace(..., create_perfetto_trace=True)` around a few warm steps; the perfetto JSON's complete
events (`"ph": "X"`) summed by name over the device's tracks: on a GPU the streams of `/device:GPU:0` (its kernels and
copies), on a CPU XLA's runtime threads on `/host:CPU` (the HLO ops, less the runtime's own `A::B` events). Each event
counts its own time only (less the events nested in it on its track: a `while` loop's body ops are listed, not the
loop too). On a CPU several threads run ops at once, so the shares can add up to more than the steps' wall time (never
more than the number of tracks times it); a GPU's one compute stream cannot. PyTorch's: `torch.profiler` over the
same number of warm steps, `key_averages()` by device time (by self CPU time on a CPU).
"""

import gzip
import json
import os
import time
from collections import defaultdict
from pathlib import Path

TOP = 25
DERIVED = {"XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code", "Launch Stats"}


def perfetto_events(folder: Path) -> list[dict]:
    """The events of the one perfetto trace `jax.profiler.trace` wrote under `folder`."""
    paths = sorted(folder.rglob("perfetto_trace.json*"))
    if not paths:
        raise FileNotFoundError(f"jax.profiler.trace wrote no perfetto_trace.json(.gz) under {folder}")
    raw = paths[-1].read_bytes()
    data = json.loads(gzip.decompress(raw) if paths[-1].suffix == ".gz" else raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_tracks(events: list[dict]) -> tuple[set[tuple], str]:
    """The (pid, tid) tracks to sum, and how they were chosen, in words."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    gpus = {pid for pid, name in processes.items() if "/device:GPU" in name}
    if gpus:
        chosen = {k for k, name in threads.items() if k[0] in gpus and name.startswith("Stream")}
        # streams named otherwise: every device track but those derived from the streams' events (which repeat them)
        chosen = chosen or {k for k, name in threads.items() if k[0] in gpus and name not in DERIVED}
        where = ", ".join(sorted({processes[k[0]] for k in chosen}))
        return chosen, f"{where}: {', '.join(sorted(threads[k] for k in chosen))}"
    chosen = {k for k, name in threads.items() if name.startswith("tf_XLA")}
    names = sorted({threads[k].split("/")[0] for k in chosen})
    return chosen, f"/host:CPU, XLA's runtime threads ({len(chosen)}: {', '.join(names)}), HLO ops"


def self_times(events: list[dict]) -> list[tuple[str, float]]:
    """(name, microseconds) of each event, less the events nested in it (all on one track)."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    own = [float(e["dur"]) for e in ordered]
    stack: list[int] = []
    for i, event in enumerate(ordered):
        while stack and ordered[stack[-1]]["ts"] + ordered[stack[-1]]["dur"] <= event["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= event["dur"]
        stack.append(i)
    return [(e["name"], max(t, 0.0)) for e, t in zip(ordered, own, strict=True)]


def _kept(event: dict) -> bool:
    """A kernel or an HLO op, not the CPU runtime's bookkeeping (`ThunkExecutor::Execute`, `end: ...`)."""
    return "::" not in event["name"] and not event["name"].startswith("end: ")


def summed_by_name(events: list[dict]) -> tuple[dict[str, list], str, list[float]]:
    """{name: [microseconds, calls]} over the device tracks, how they were chosen, and the microseconds of each."""
    tracks, described = device_tracks(events)
    by_track: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in tracks and _kept(e):
            by_track[(e["pid"], e["tid"])].append(e)
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    per_track = []
    for track_events in by_track.values():
        own = self_times(track_events)
        per_track.append(sum(microseconds for _, microseconds in own))
        for name, microseconds in own:
            totals[name][0] += microseconds
            totals[name][1] += 1
    return totals, described, per_track


def table(totals: dict[str, list], wall_s: float, steps: int, track: str, per_track: list[float]) -> dict:
    """The top `TOP` of `totals` ({name: [microseconds, calls]}), in milliseconds and as shares of the wall time;
    `per_track`: the microseconds summed on each track (one track's events never overlap: at most the wall time)."""
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    top = [
        {"name": name, "total_ms": round(us / 1e3, 3), "calls": calls, "share": us / 1e6 / wall_s}
        for name, (us, calls) in ranked[:TOP]
    ]
    return {
        "steps": steps,
        "wall_ms": round(wall_s * 1e3, 3),
        "track": track,
        "tracks": len(per_track),
        "busiest_track_ms": round(max(per_track, default=0.0) / 1e3, 3),
        "events": sum(calls for _, calls in totals.values()),
        "summed_ms": round(sum(us for us, _ in totals.values()) / 1e3, 3),
        "listed_ms": round(sum(k["total_ms"] for k in top), 3),
        "top": top,
    }


def ours(shape: dict, steps: int, folder: Path) -> dict:
    import jax

    from ._peer import ours_step

    compiled, leaves, batch, _, _ = ours_step(shape)
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(steps):
            leaves, loss = compiled(leaves, batch)
        jax.block_until_ready(loss)
        wall = time.perf_counter() - start
    totals, track, per_track = summed_by_name(perfetto_events(folder))
    return table(totals, wall, steps, track, per_track)


def pytorch(shape: dict, steps: int) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch not installed"}
    from torch.profiler import ProfilerActivity, profile

    from ._peer import torch_step

    step, _, device, setup = torch_step(shape)
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    rows = profiler.key_averages()
    if cuda:  # the kernels' rows (an op's device time is its kernels', which would count them twice)
        kernels = [row for row in rows if row.device_type == torch.autograd.DeviceType.CUDA]
        track = "CUDA kernels (key_averages, self device time)"
        if not kernels:  # no kernel rows in this PyTorch: the ops' own device time
            kernels, track = list(rows), "ops (key_averages, self device time)"
        totals = {row.key: [float(row.self_device_time_total), row.count] for row in kernels}
    else:
        totals, track = {row.key: [float(row.self_cpu_time_total), row.count] for row in rows}, "CPU ops (self time)"
    totals = {name: total for name, total in totals.items() if total[0] > 0}
    return table(totals, wall, steps, f"{track}; {setup}", [sum(total for total, _ in totals.values())])


def profile(shape: dict, steps: int, work: Path) -> dict:
    from ._peer import MEMORY_FRACTION

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)
    return {"ours": ours(shape, steps, work / "jax-trace"), "pytorch": pytorch(shape, steps)}
