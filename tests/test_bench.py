"""`scripts/bench --quick` runs end to end and writes a complete report (no timing assertions)."""

import importlib.util
import json
import math

import jax
import pytest

from benchmarks.__main__ import main


@pytest.mark.slow
def test_quick_benchmark_run_writes_the_report_with_every_case(tmp_path, capsys):
    with jax.numpy_rank_promotion("allow"):  # the other frameworks' idioms broadcast (x @ w + b)
        # (g) and (j) start processes with simulated devices (a minute each); tests/test_fsdp.py and
        # tests/test_deterministic_reduction.py cover what they run. (k) has its own test below.
        assert main(["--quick", "--cases", "a,b,c,d,e,f,h,i", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "benchmarks.md").read_text()
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    for heading in ["## Targets (issue 6)", "## (a) XOR MLP", "## (b) Compute-bound MLP"]:
        assert heading in report
    xor = results["results"]["xor"]
    names = {row["name"] for row in xor["step"]}
    assert {"ours: CompiledTrainer.step", "pure JAX (jit, donated)", "eqx.filter_jit", "PyTorch eager"} <= names
    assert all(row["median"] > 0 and row["repeats"] >= 2 for row in xor["step"] + xor["fit"])
    assert all(0.4 <= row["accuracy"] <= 1 for row in xor["fit"])  # 2 epochs: learning has started
    gpt = results["results"]["gpt"]  # (i): the same architecture in both frameworks, both timed
    assert "## (i) The language model against a PyTorch GPT of the same shape" in report and len(gpt) == 1
    for shape in gpt.values():
        assert shape["parameters"]["ours"] == shape["parameters"]["pytorch"]
        assert [row["name"].split(" ")[0] for row in shape["step"]] == ["ours", "PyTorch"]
        assert all(row["median"] > 0 and row["gflops"] > 0 for row in shape["step"])
    mlp = results["results"]["mlp"]
    assert mlp["peak_gflops"] > 0 and all(row["gflops"] > 0 for row in mlp["step"])
    if "cnn" in results["results"]:
        assert "## (c) MNIST-1D CNN" in report and "## (d) Per-example gradients" in report
        assert results["results"]["per_example"]["max_abs_difference"] < 1e-4  # ours equals torch.func
        grids = results["results"]["population"]["grids"]
        assert all(row["median"] > 0 for rows in grids.values() for row in rows)
        assert "## (f) Populations" in report
        assert "## (h) Host loaders: streaming from disk, resuming in O(1)" in report
        loaders = results["results"]["loaders"]
        assert all(row["median"] > 0 for key in ("training", "reading", "resume") for row in loaders[key])
        assert len(loaders["resume"]) == 6 and loaders["size"] == 6_000
    else:
        assert "skipped: the mnist1d package is not installed" in report


@pytest.mark.slow
def test_quick_generative_case_times_the_engine_against_hand_written_equinox(tmp_path):
    """(k): both experiments' steps, ours and by hand, timed and reported; both train (finite losses of
    the same size: the keys differ, so not the same values)."""
    pytest.importorskip("sklearn")
    assert main(["--quick", "--cases", "k", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "benchmarks.md").read_text()
    models = json.loads((tmp_path / "benchmarks.json").read_text())["results"]["generative"]["models"]
    assert "## (k) The generative experiments' steps against hand-written Equinox loops" in report
    assert set(models) == {"GAN", "diffusion"}
    for model, result in models.items():
        assert f"| (k) {model} step vs a hand-written Equinox loop of the same model | <= 1.0x the time |" in report
        ours, by_hand = result["step"]
        assert ours["name"].startswith("ours") and by_hand["name"].startswith("hand-written Equinox")
        assert all(row["median"] > 0 and row["repeats"] >= 2 for row in result["step"])
        for name, value in by_hand["losses"].items():
            assert math.isfinite(value) and math.isfinite(ours["losses"][name])
            assert 0.5 < ours["losses"][name] / value < 2, (model, name, ours["losses"], by_hand["losses"])


@pytest.mark.slow
def test_quick_ppo_case_times_the_engine_against_rejax(tmp_path):
    """(l): PPO through the engine and rejax's PPO, one agent and 16, timed and reported; ours trains (a
    finite, positive episode return). Without rejax (CI installs no `bench` extra), ours alone, said so."""
    pytest.importorskip("gymnax")
    have_rejax = importlib.util.find_spec("rejax") is not None
    assert main(["--quick", "--cases", "l", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "benchmarks.md").read_text()
    populations = json.loads((tmp_path / "benchmarks.json").read_text())["results"]["ppo"]["populations"]
    assert "## (l) PPO through the engine against rejax's PPO" in report
    assert set(populations) == {"1 agent", "16 agents"}
    assert ("- rejax is not installed (the `bench` extra): ours is timed alone" in report) != have_rejax
    for label, rows in populations.items():
        target = f"| (l) PPO on CartPole-v1, {label}: environment steps a second vs rejax (issue 43) |"
        assert (target in report) == have_rejax
        assert [row["name"].split(":")[0] for row in rows] == ["ours", "rejax"][: 1 + have_rejax]
        assert all(row["median"] > 0 and row["repeats"] >= 2 for row in rows)
        assert math.isfinite(rows[0]["episode_return"]) and rows[0]["episode_return"] > 0


@pytest.mark.slow
def test_quick_startup_case_breaks_each_commands_wall_time_into_its_phases(tmp_path):
    """(m): a second xor run and samples of a finished lm run, each a fresh process, timed phase by phase; the
    phases of each command follow one another, so they add up to its wall time; the targets are reported."""
    assert main(["--quick", "--cases", "m", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "benchmarks.md").read_text()
    startup = json.loads((tmp_path / "benchmarks.json").read_text())["results"]["startup"]
    assert "## (m) How fast a small run starts: a second run, and a sample of a finished one" in report
    assert "| (m) a second `xor --epochs 3` run: its wall time vs its training (issue 58) | <= 2x |" in report
    assert "| (m) `research sample` of a finished lm run (issue 58) | < 10 s |" in report
    assert startup["steps"] == 57
    for key, runs in (("run", 2), ("first_run", 1), ("sample", 2), ("first_sample", 1)):
        *phases, wall = startup[key]
        assert wall["name"] == "wall time" and wall["repeats"] == runs and wall["min"] > 0
        assert all(phase["min"] >= 0 for phase in phases), phases
        for i in range(runs):  # each run's phases, one after another, make its wall time
            total = sum(phase["seconds"][i] for phase in phases)
            assert math.isclose(total, wall["seconds"][i], rel_tol=1e-9), (key, i)
