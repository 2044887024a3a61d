"""The services from a hand-written loop (docs/hand_written_loop.py): stopped by SIGTERM, it saves and
exits 143, and run again it resumes to the same bits as a run never stopped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from research.services import RunDir, checkpoint_digest

LOOP = Path(__file__).parent.parent / "docs" / "hand_written_loop.py"
STEPS = "3000"


def start(run_dir):
    env = {**os.environ, "CI": "true"}
    return subprocess.Popen(
        [sys.executable, str(LOOP), str(run_dir), STEPS], env=env, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_the_loop_stopped_by_sigterm_resumes_to_the_bits_of_an_uninterrupted_run(tmp_path):
    assert start(tmp_path / "straight").wait(timeout=300) == 0
    stopped = start(tmp_path / "stopped")
    deadline = time.monotonic() + 300
    while not (tmp_path / "stopped/checkpoints/step_000001000/commit_success.txt").exists():
        assert stopped.poll() is None and time.monotonic() < deadline, stopped.stderr.read()
        time.sleep(0.05)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 128 + signal.SIGTERM
    saved = RunDir(tmp_path / "stopped").checkpoint_paths()[-1]
    assert 1000 <= int(saved.name.split("_")[1]) < 3000  # it stopped between its regular saves, and saved there
    assert start(tmp_path / "stopped").wait(timeout=300) == 0
    straight, resumed = RunDir(tmp_path / "straight"), RunDir(tmp_path / "stopped")
    assert checkpoint_digest(resumed.checkpoint_paths()[-1]) == checkpoint_digest(straight.checkpoint_paths()[-1])
    assert resumed.read_metrics() == straight.read_metrics()
    assert resumed.read_config()["config"] == {"steps": 3000} and "jax" in resumed.read_config()["versions"]
