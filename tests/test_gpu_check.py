"""scripts/gpu-check at its CPU size: the prepared GPU check must keep running where CI can run it, each part on its
own (a part that fails or hangs loses only itself), and its figures must be the ones they say they are."""

import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks import _gpu_report, _wheels
from benchmarks.gpu_check import PARTS, main, run_parts, write_partial

ROOT = Path(__file__).parent.parent
TINY = {"dim": 32, "depth": 2, "heads": 2, "context": 64, "batch": 4}


def lm_parameters(dim: int, depth: int, context: int, vocab: int = 256, bias: bool = True, **_) -> int:
    """Counted by hand: the embedding (the head is tied to it), the positions, per block two norms, qkv, the output
    projection and the MLP, then the final norm; `bias`: the norms' and the MLP's biases."""
    norm = 2 * dim if bias else dim
    block = 2 * norm + 3 * dim * dim + dim * dim + 2 * 4 * dim * dim + ((4 * dim + dim) if bias else 0)
    return vocab * dim + context * dim + depth * block + norm


def gpu_check(out: Path, *flags: str) -> tuple[dict, str]:
    result = subprocess.run(
        ["scripts/gpu-check", "--tiny", *flags, "--out", out],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},  # the GPU machine's Python; here this venv's
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "gpu-check.md").read_text() == result.stdout
    return json.loads((out / "gpu-check.json").read_text()), result.stdout


@pytest.mark.slow
def test_the_tiny_check_times_the_lm_and_attention_pairs_fresh_processes_and_runs_an_experiment(tmp_path):
    """The report's facts, each of which a broken part would change: every part ran and is listed (in the JSON and
    as a markdown section, in order), the LM has its hand-counted parameters and a loss it could have (random
    tokens), the deterministic pairs have the same bits, and each experiment exited 0 with finite, plausible test
    numbers."""
    parts = ["env", "lm", "attention", "bitwise", "experiments"]
    report, markdown = gpu_check(tmp_path, "--parts", ",".join(parts), "--experiments", "xor")
    assert report["env"]["backend"] == "cpu" and report["env"]["devices"] == "1 x cpu"
    assert {p: s["status"] for p, s in report["parts"].items()} == dict.fromkeys(parts, "ok")
    sections = [line[3:] for line in markdown.splitlines() if line.startswith("## ")]
    assert [s.rsplit(" (", 1)[0] for s in sections] == [_gpu_report.TITLES[p] for p in parts]  # less their (N s)
    lm = report["lm"]
    assert lm["parameters"] == lm_parameters(**TINY) and lm["tokens_per_s"] > 0 and lm["mfu"] is None  # CPU: no peak
    # 3 AdamW steps on uniformly random bytes: the loss of a guess among 256 (ln 256 = 5.55), a little below at most
    assert abs(lm["final_loss"] - math.log(256)) < 0.5, lm["final_loss"]
    attention = report["attention"]  # no cuDNN on a CPU: XLA's kernel, which the LM takes
    assert attention["xla_ms"] > 0 and attention["lm_ms"] > 0 and attention["lm_kernel"] == "xla"
    assert attention["cudnn_ms"].startswith("unavailable: ")
    assert [(p["deterministic_reduction"], p["statuses"], p["same_bits"]) for p in report["bitwise"]] == [
        (False, [0, 0], True),
        (True, [0, 0], True),
    ]
    assert markdown.count("exit [0, 0], same bits: True") == 2
    assert list(report["experiments"]) == ["xor"]
    for name, result in report["experiments"].items():
        assert result["status"] == 0 and result["error"] == "", (name, result)
        assert 0 < result["compile_s"] < result["seconds"], (name, result)  # summary.json's compile_seconds
        assert {"test_accuracy", "test_loss"} <= set(result["numbers"]), (name, result)
        assert all(math.isfinite(v) for v in result["numbers"].values()), (name, result)
    xor = report["experiments"]["xor"]["numbers"]
    # Its 8 steps barely train (56% at seed 0: not reliably above chance), so: a count of the 64 test examples, and
    # the two-class loss of a near guess (ln 2 = 0.693); a loss summed over the batch, or NaN, would be far from it.
    correct = xor["test_accuracy"] * 64
    assert correct == pytest.approx(round(correct), abs=1e-6)
    assert abs(xor["test_loss"] - math.log(2)) < 0.05, xor
    assert "| experiment | exit | seconds | compile s | test numbers |" in markdown
    ran = report["experiments"]["xor"]
    assert f"| xor | 0 | {ran['seconds']} | {ran['compile_s']} | test_accuracy" in markdown


@pytest.mark.slow
def test_the_peer_has_our_parameters_and_the_profiles_sum_to_real_ops_within_the_traced_time(tmp_path):
    import torch

    from benchmarks.lm_scale import compiled_step

    report, markdown = gpu_check(tmp_path, "--parts", "peer,profile")
    peer = report["peer"]
    assert peer["ours"]["parameters"] == peer["pytorch"]["parameters"] == lm_parameters(**TINY)
    for side in ("ours", "pytorch"):
        assert peer[side]["step_ms"] > 0 and peer[side]["peak_memory_gib"] is None  # no device memory on a CPU
    assert "eager, float32" in peer["pytorch"]["setup"] and "| ours / PyTorch |" in markdown
    ours, pytorch = report["profile"]["ours"], report["profile"]["pytorch"]
    assert pytorch["tracks"] == 1  # PyTorch's CPU ops run on one thread; XLA's on several at once
    for profile in (ours, pytorch):
        totals = [k["total_ms"] for k in profile["top"]]
        assert totals == sorted(totals, reverse=True) and len(totals) == 25
        assert sum(totals) <= profile["summed_ms"] + 1e-3 <= profile["tracks"] * profile["busiest_track_ms"] + 1e-3
        assert 0.25 * profile["wall_ms"] < profile["busiest_track_ms"] <= profile["wall_ms"]  # its ops: most of it
    hlo = compiled_step(2, 32, 64, 4, 2, compute_dtype="bfloat16", donate=True)[0].as_text()
    assert re.search(rf"\b{re.escape(ours['top'][0]['name'])} = ", hlo), ours["top"][0]  # an op of our step
    assert "/host:CPU" in ours["track"] and "tf_XLA" in ours["track"]
    ops = [k["name"].removeprefix("aten::") for k in pytorch["top"] if k["name"].startswith("aten::")]
    assert all(hasattr(torch.ops.aten, op) for op in ops) and {"mm", "addmm"} & set(ops), ops  # a GPT: matmuls


def test_the_trace_is_summed_by_own_time_on_the_device_streams():
    """A GPU's trace: its kernels on a stream, the same time again on a derived `XLA Ops` line, the host's ops."""
    from benchmarks._profile import summed_by_name, table

    def track(pid: int, tid: int, process: str, thread: str) -> list[dict]:
        return [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}},
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}},
        ]

    def event(pid: int, tid: int, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [
        *track(1, 7, "/device:GPU:0", "Stream #7(Compute)"),
        *track(1, 8, "/device:GPU:0", "XLA Ops"),
        *track(2, 3, "/host:CPU", "tf_XLAPjRtCpuClient/1"),
        event(1, 7, "gemm", 0, 40),
        event(1, 7, "fusion.1", 50, 10),
        event(1, 7, "gemm", 70, 30),
        event(1, 8, "dot.3", 0, 100),
        event(2, 3, "host_op", 0, 100),
    ]
    totals, described, per_track = summed_by_name(events)
    assert dict(totals) == {"gemm": [70.0, 2], "fusion.1": [10.0, 1]} and per_track == [80.0]
    assert described == "/device:GPU:0: Stream #7(Compute)"
    host = [*track(2, 3, "/host:CPU", "tf_XLAEigen/1"), *track(2, 4, "/host:CPU", "python")]
    host += [
        event(2, 3, "while.1", 0, 100),
        event(2, 3, "dot.2", 10, 30),
        event(2, 3, "ThunkExecutor::Execute", 50, 40),
    ]
    host += [event(2, 3, "fusion.4", 50, 20), event(2, 3, "end: fusion.4", 70, 1), event(2, 4, "$python", 0, 100)]
    totals, described, per_track = summed_by_name(host)  # a loop's own time is less its body's ops
    assert dict(totals) == {"while.1": [50.0, 1], "dot.2": [30.0, 1], "fusion.4": [20.0, 1]} and per_track == [100.0]
    assert described.startswith("/host:CPU, XLA's runtime threads (1: tf_XLAEigen)")
    summary = table(totals, 200e-6, 2, described, per_track)
    assert [(k["name"], k["total_ms"], k["share"]) for k in summary["top"]] == [
        ("while.1", 0.05, 0.25),
        ("dot.2", 0.03, 0.15),
        ("fusion.4", 0.02, 0.1),
    ]
    assert summary["summed_ms"] == summary["listed_ms"] == summary["busiest_track_ms"] == 0.1


def test_the_pytorch_gpt_without_biases_is_nanogpts_and_with_them_ours():
    from benchmarks._gpt import TorchGPT

    for bias in (True, False):
        model = TorchGPT(32, 2, 2, 64, bias=bias)
        assert sum(p.numel() for p in model.parameters()) == lm_parameters(32, 2, 64, bias=bias)


def _answers(options: dict) -> dict:
    return {"answer": 42, "tiny": options["tiny"]}


def _sleeps(options: dict) -> dict:
    write_partial(options, {"done": ["a first piece"]})
    time.sleep(120)
    return {}


def _fails(options: dict) -> dict:
    raise ValueError("a planted failure")


def _reads_the_report(options: dict) -> dict:
    """What the report on disk held while this part ran."""
    return json.loads((Path(options["out"]) / "gpu-check.json").read_text())


@pytest.mark.slow  # waits out a part's 5-second timeout
def test_a_part_that_hangs_or_fails_loses_only_itself_and_each_is_written_as_it_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(ROOT)]))  # for the parts
    parts = {"first": _answers, "hangs": _sleeps, "fails": _fails, "sees": _reads_the_report, "last": _answers}
    options = {"tiny": True, "out": str(tmp_path), "work": str(tmp_path / "work")}
    start = time.perf_counter()
    report = run_parts(parts, options, tmp_path, {"date": "today", "tiny": True}, timeout=5)
    assert time.perf_counter() - start < 60  # the hanging part was stopped, not waited for
    assert report == json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = {name: status["status"] for name, status in report["parts"].items()}
    assert statuses == {"first": "ok", "hangs": "timed out", "fails": "failed", "sees": "ok", "last": "ok"}
    assert report["first"] == report["last"] == {"answer": 42, "tiny": True}
    assert report["parts"]["fails"]["error"] == "ValueError: a planted failure"
    assert "stopped at --part-timeout 5 s" in report["parts"]["hangs"]["error"]
    assert report["hangs"] == {"done": ["a first piece"]} and "fails" not in report  # what each had written
    seen = report["sees"]  # the earlier parts were on disk before this one ended, this one shown running
    assert seen["first"] == {"answer": 42, "tiny": True} and seen["parts"]["sees"]["status"] == "running"
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert "- timed out after" in markdown and "- failed after" in markdown and "ValueError: a planted" in markdown
    assert (tmp_path / "logs" / "fails.log").read_text().count("Traceback") == 1


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A wheel pip installs: one module and its metadata."""
    module, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    metadata = "".join(
        [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}.py", "PRESENT = True\n")
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return path


def test_the_wheels_follow_the_requirements_at_the_pinned_versions_and_stop_at_the_image(tmp_path, monkeypatch):
    requires = {  # what each fake wheel declares
        "dp-accounting": ("dm-tree~=0.1.8", "numpy", "scipy", 'pytest; extra == "test"'),
        "tyro": ("docstring-parser>=0.16", 'tomli; python_version < "3.12"', 'colorama; sys_platform == "win32"'),
        "docstring-parser": ('exceptiongroup; python_version >= "3.12"',),  # the GPU machine's Python: 3.12
    }

    def fake_download(folder: Path, pins: list[str]) -> None:
        for pin in pins:
            name, _, version = pin.partition("==")
            _wheel(folder, name, version or "9.9", requires.get(name, ()))

    monkeypatch.setattr(_wheels, "_pip_download", fake_download)
    manifest = _wheels.download(tmp_path)["requirements"]
    assert manifest == json.loads((tmp_path / "requirements.json").read_text())["requirements"]
    pins = _wheels.pinned_versions()
    for name in ("dp-accounting", "dm-tree", "mnist1d", "beartype", "docstring-parser"):  # dp_sgd's, and theirs
        assert manifest[name]["wheel"].startswith(f"{name.replace('-', '_')}-{pins[name]}-"), name
    assert manifest["dm-tree"]["specifier"] == "~=0.1.8"
    for name in ("jax", "jaxlib", "torch", "numpy", "scipy"):  # the image's, not downloaded
        assert manifest[name]["wheel"] is None and manifest[name]["on_the_image"], name
    assert not {"tomli", "colorama"} & set(manifest) and "exceptiongroup" in manifest  # 3.12 on Linux's only
    assert "pytest" in manifest and "tensorboardx" not in manifest  # the dev tool asked for, not dp's test extra
    assert {p.name for p in tmp_path.glob("*.whl")} == {e["wheel"] for e in manifest.values() if e["wheel"]}


def test_only_the_wheels_of_what_the_machine_lacks_are_installed(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    manifest = {
        "gpucheck-probe": {"specifier": "==1.0", "wheel": _wheel(wheels, "gpucheck-probe", "1.0").name},
        "pytest": {"specifier": ">=1", "wheel": _wheel(wheels, "pytest", "0.1").name},  # installed: kept
        "gpucheck-absent": {"specifier": ">=2", "wheel": None},
    }
    (wheels / "requirements.json").write_text(json.dumps({"requirements": manifest}))
    found = _wheels.install_missing(wheels, site)
    assert found == {"installed": ["gpucheck-probe==1.0"], "unmet": ["gpucheck-absent>=2 (installed: None)"]}
    assert (site / "gpucheck_probe.py").exists() and not (site / "pytest.py").exists()


def test_without_an_index_the_wheels_fail_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(SystemExit) as exit:
        main(["--wheels", str(tmp_path)])
    message = str(exit.value.code)
    assert message.startswith("gpu-check --wheels: pip could not download ") and "\n" not in message
    assert "reachable package index" in message


def test_unknown_parts_and_experiments_are_refused_in_one_line(capsys):
    for flags, message in ((["--parts", "env,gpu"], "--parts: unknown gpu"), (["--experiments", "xr"], "unknown xr")):
        with pytest.raises(SystemExit) as exit:
            main(["--tiny", *flags])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert PARTS == ("env", "lm", "peer", "profile", "attention", "bitwise", "experiments", "tests", "bench")
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    for option in ("--tiny", "--parts", "--experiments", "--lm-steps", "--part-timeout", "--out", "--wheels"):
        assert option in usage
