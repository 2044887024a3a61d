"""The three state-passing exercises of experiments/state_passing.py give the textbook values."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("state_passing", ROOT / "experiments" / "state_passing.py")
state_passing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(state_passing)


def test_counter_counts_one_to_five_and_returns_zero_to_four():
    assert state_passing.count(5) == ([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])


def test_running_mean_of_two_to_ten():
    assert state_passing.running_means([2, 4, 6, 8, 10]) == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_gradient_descent_on_x_squared():
    np.testing.assert_allclose(state_passing.gradient_descent(5.0, 0.1, 5), [4.0, 3.2, 2.56, 2.048, 1.6384], rtol=1e-6)


@pytest.mark.slow
def test_the_script_prints_every_step():
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "state_passing.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert [line for line in lines if line.startswith("update")] == [
        f"update {i}: count {i}, returned {i - 1}" for i in range(1, 6)
    ]
    assert [line.split("mean ")[1] for line in lines if line.startswith("value")] == ["2", "3", "4", "5", "6"]
    assert [line.split(",")[0] for line in lines if line.startswith("step")] == [
        "step 1: x = 4",
        "step 2: x = 3.2",
        "step 3: x = 2.56",
        "step 4: x = 2.048",
        "step 5: x = 1.6384",
    ]
    assert "as a lax.scan body: returned [0, 1, 2, 3, 4]" in lines
    assert "as a lax.scan body: means [2.0, 3.0, 4.0, 5.0, 6.0]" in lines
