"""The run tools (plot_runs, compare_runs, show_jaxpr) and the progress lines, on hand-made run directories."""

import json

import numpy as np
import pytest
from PIL import Image

from research.progress import Progress, format_duration, progress_iter
from research.services import RunDir
from research.tools import compare_runs, plot_runs, show_jaxpr


def make_run(path, lr, losses, *, hidden=8, finished=True, experiment="xor"):
    run = RunDir(path).create()
    config = {"seed": 0, "lr": lr, "hidden": hidden, "run_dir": str(path), "progress": False, "resume": False}
    run.write_config({"experiment": experiment, "config": config, "resolved": {"num_steps": 100}})
    for i, loss in enumerate(losses, 1):
        record = {"step": 50 * i, "train/loss": loss, "train/accuracy": 1 - loss / 2, "steps_per_s": 1000.0}
        if i == len(losses):
            record.update({"test/loss": loss * 1.1, "test/accuracy": 1 - loss})
        run.log(record)
    if finished:
        run.write_summary(
            {
                "experiment": experiment,
                "test_accuracy": 1 - losses[-1],
                "test_loss": losses[-1] * 1.1,
                "train_loss": losses[-1],
                "step": 50 * len(losses),
                "wall_seconds": 2.25,
            }
        )
    return run


@pytest.fixture
def runs(tmp_path):
    return [
        make_run(tmp_path / "runs/xor/lr0.1", 0.1, [0.7, 0.4]),
        make_run(tmp_path / "runs/xor/lr0.3", 0.3, [0.6, 0.05], hidden=8),
    ]


def test_compare_runs_prints_only_the_differing_options_and_the_final_numbers(runs):
    table = compare_runs.compare_runs([r.path for r in runs])
    assert table.splitlines() == [
        "| run | lr | test_accuracy | test_loss | train_loss | step | wall_seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        "| lr0.1 | 0.1 | 60.00% | 0.44 | 0.4 | 100 | 2.2 |",
        "| lr0.3 | 0.3 | 95.00% | 0.055 | 0.05 | 100 | 2.2 |",
    ]


def test_compare_runs_shows_an_unfinished_run_from_its_last_metrics_and_tells_same_names_apart(tmp_path):
    a = make_run(tmp_path / "a/run", 0.1, [0.5, 0.25])
    b = make_run(tmp_path / "b/run", 0.1, [0.5], finished=False, hidden=16)
    lines = compare_runs.compare_runs([a.path, b.path]).splitlines()
    assert lines[0] == "| run | hidden | test_accuracy | test_loss | train_loss | step | wall_seconds |"
    assert lines[2] == "| a/run | 8 | 75.00% | 0.275 | 0.25 | 100 | 2.2 |"
    assert lines[3] == "| b/run (unfinished) | 16 | 50.00% | 0.55 | 0.5 | 50 | – |"


def test_compare_runs_over_seeds_gives_mean_and_sample_std_per_group(tmp_path, capsys):
    def seeded(name, lr, seed, loss):
        run = make_run(tmp_path / name, lr, [0.9, loss])
        saved = run.read_config()
        saved["config"]["seed"] = seed
        run.write_config(saved)
        return str(run.path)

    paths = [seeded("a0", 0.1, 0, 0.2), seeded("a1", 0.1, 1, 0.4), seeded("b0", 0.3, 0, 0.1)]
    compare_runs.main(["--over", "seed", *paths])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| runs | lr | test_accuracy | test_loss | train_loss | step | wall_seconds |"
    # accuracies 80% and 60%: mean 70%, sample std 14.14%; equal numbers print once
    assert lines[2] == "| 2 | 0.1 | 70.00 ± 14.14% | 0.33 ± 0.16 | 0.3 ± 0.14 | 100 | 2.2 |"
    assert lines[3] == "| 1 | 0.3 | 90.00% | 0.11 | 0.1 | 100 | 2.2 |"
    with pytest.raises(SystemExit) as info:
        compare_runs.main(["--over", "sed", *paths])
    assert info.value.code == 2
    assert "--over sed: no run has that option" in capsys.readouterr().err


def test_tools_refuse_a_directory_that_is_not_a_run_with_one_line(tmp_path, capsys):
    for main in (compare_runs.main, plot_runs.main):
        with pytest.raises(SystemExit) as info:
            main([str(tmp_path)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path} is not a run directory" in err


def test_plot_runs_draws_one_line_per_run_per_panel_into_a_png(runs, tmp_path, capsys):
    out = tmp_path / "plots/both.png"
    plot_runs.main([str(r.path) for r in runs] + ["-o", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    image = Image.open(out)
    assert image.format == "PNG" and image.size == (1210, 462)
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    # matplotlib's first two colours (C0 blue, C1 orange) are both drawn.
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert (np.abs(pixels.astype(int) - colour).sum(axis=1) < 30).sum() > 200


def test_show_jaxpr_traces_one_step_of_an_experiment_with_its_flags_and_names_the_inputs():
    text = show_jaxpr.show_jaxpr("xor", ["--hidden", "3", "--batch-size", "16"])
    lines = text.splitlines()
    assert lines[0].startswith("# one train step of xor: ") and lines[0].endswith("equations; inputs in order:")
    assert "#   1: state.model.layers[0].weight float32[3,2]" in lines
    assert lines[1] == "#   0: state.step int32[]"
    names = [line.split(": ", 1)[1] for line in lines[1:] if line.startswith("#   ")]
    assert names[-2:] == ["batch.inputs float32[16,2]", "batch.labels int32[16]"]
    assert "stats.words uint32[6]" in names  # loss, accuracy, grad_norm, the weight and two counters, packed
    assert "{ lambda ; " in text and "f32[16,2]" in text and "dot_general" in text


def test_show_jaxpr_names_an_unknown_experiment(capsys):
    with pytest.raises(SystemExit) as info:
        show_jaxpr.main(["no_such_experiment"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no experiment 'no_such_experiment'" in err and "xor" in err


def test_progress_off_a_terminal_prints_steps_per_second_and_eta(monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    bar = Progress(1000, desc="train")
    bar.update(250)
    bar.report(250, {"train/loss": 0.5}, rate=125.0)
    bar.close()
    line = capsys.readouterr().err.strip()
    assert line.startswith("[train] step 250/1000 (25%) train/loss=0.5 | 125 steps/s, ETA 0:00:06, elapsed 0:00:0")
    assert format_duration(3725) == "1:02:05" and format_duration(float("inf")) == "?"


def test_progress_iter_yields_everything_and_reports_every_n_items_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    assert list(progress_iter(range(10), total=10, desc="generate", unit="example", report_every=4)) == list(range(10))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(") ")[0] + ")" for line in lines] == [
        "[generate] example 4/10 (40%)",
        "[generate] example 8/10 (80%)",
    ]
    assert all("examples/s, ETA " in line for line in lines)


def test_progress_is_silent_when_disabled(monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    bar = Progress(10, enabled=False)
    bar.update(10)
    bar.report(10, {"train/loss": 0.5})
    assert capsys.readouterr().err == ""


def test_run_summary_reads_back(tmp_path):
    run = make_run(tmp_path / "r", 0.1, [0.5])
    assert run.read_summary() == json.loads((tmp_path / "r/summary.json").read_text())
    assert RunDir(tmp_path / "empty").read_summary() is None
