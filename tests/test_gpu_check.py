"""scripts/gpu-check at its CPU size: the prepared GPU check must keep running where CI can run it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import PARTS, main


@pytest.mark.slow
def test_the_tiny_check_times_the_lm_and_attention_pairs_fresh_processes_and_runs_an_experiment(tmp_path):
    out = tmp_path / "check"
    result = subprocess.run(
        [
            *("scripts/gpu-check", "--tiny", "--parts", "env,lm,attention,bitwise,experiments"),
            *("--experiments", "xor", "--out", out),
        ],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHON": sys.executable},  # the GPU machine's Python; here this venv's
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["env"]["backend"] == "cpu" and report["env"]["devices"] == "1 x cpu"
    lm = report["lm"]
    assert lm["parameters"] > 0 and lm["tokens_per_s"] > 0 and lm["mfu"] is None  # no bf16 peak for a CPU
    assert lm["tokens_per_s"] == pytest.approx(lm["shape"]["batch"] * lm["shape"]["context"] / lm["step_s"], rel=1e-3)
    attention = report["attention"]  # no cuDNN on a CPU: XLA's kernel, which the LM takes
    assert attention["xla_ms"] > 0 and attention["lm_ms"] > 0 and attention["lm_kernel"] == "xla"
    assert attention["cudnn_ms"].startswith("unavailable: ")
    assert [(p["deterministic_reduction"], p["statuses"], p["same_bits"]) for p in report["bitwise"]] == [
        (False, [0, 0], True),
        (True, [0, 0], True),
    ]
    assert report["experiments"]["xor"]["status"] == 0
    assert 0 <= report["experiments"]["xor"]["numbers"]["test_accuracy"] <= 1
    assert (out / "gpu-check.md").read_text() == result.stdout
    assert "| xor | 0 |" in result.stdout


def test_unknown_parts_and_experiments_are_refused_in_one_line(capsys):
    for flags, message in ((["--parts", "env,gpu"], "--parts: unknown gpu"), (["--experiments", "xr"], "unknown xr")):
        with pytest.raises(SystemExit) as exit:
            main(["--tiny", *flags])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert PARTS == ("env", "lm", "attention", "bitwise", "experiments", "tests", "bench")
