"""`curves.png`: a `CurveFigure` drawn again gives the pixels of a fresh one, and a `CurvePool`'s worker
processes draw the pixels this process draws; a worker's failure is raised, not lost."""

import math

import matplotlib.image
import numpy as np
import pytest

from research.curves import CurveFigure, CurvePool, draw_curves, panels_of, plot_processes
from research.experiment import plot_curves
from research.services import RunDir


def records(start_loss: float, end_loss: float, *, steps: int = 10, every: int = 100, tested: bool = True):
    """A run's logged records: the loss falling geometrically, the accuracy rising, a test point every other."""
    rows = []
    for i in range(1, steps + 1):
        loss = start_loss * (end_loss / start_loss) ** (i / steps)
        row = {"step": i * every, "train/loss": loss, "train/accuracy": 1 - loss / (2 * start_loss)}
        if tested and i % 2 == 0:
            row |= {"test/loss": 1.1 * loss, "test/accuracy": 1 - 1.1 * loss / (2 * start_loss)}
        rows.append(row)
    return rows


# One after another in one figure: nothing, a loss over orders of magnitude (log scale) then one that is not (back to
# linear), a run evaluated only at its end, non-finite values (left out), a longer run (other x ticks).
RUNS = {
    "nothing logged": [],  # as a CurvePool worker warms its figure up
    "falls far": records(0.7, 0.001),
    "falls a little": records(0.7, 0.4),
    "tested at the end": records(2.0, 1.0, tested=False)[:-1]
    + [{"step": 1000, "test/loss": 1.0, "test/accuracy": 0.6}],
    "with a nan": [*records(0.7, 0.01)[:4], {"step": 450, "train/loss": math.nan, "train/accuracy": "nan"}],
    "longer": records(0.9, 0.2, steps=40, every=250),
    "falls far again": records(0.7, 0.001),
}


def pixels(path):
    return matplotlib.image.imread(path)


def test_a_figure_drawn_again_gives_the_pixels_of_a_fresh_one(tmp_path):
    reused = CurveFigure(1)
    for i, (name, rows) in enumerate(RUNS.items()):
        reused.draw([(rows, name)], tmp_path / f"reused{i}.png", title=f"xor {name}")
        fresh = draw_curves([(rows, name)], tmp_path / f"fresh{i}.png", title=f"xor {name}")
        np.testing.assert_array_equal(pixels(tmp_path / f"reused{i}.png"), pixels(fresh), err_msg=name)
    several = [(rows, name) for name, rows in list(RUNS.items())[:3]]
    pair = CurveFigure(3)
    pair.draw(several[::-1], tmp_path / "first.png", title="three runs")
    pair.draw(several, tmp_path / "again.png", title="three runs")
    fresh = draw_curves(several, tmp_path / "fresh.png", title="three runs")
    np.testing.assert_array_equal(pixels(tmp_path / "again.png"), pixels(fresh))
    assert not np.array_equal(pixels(tmp_path / "reused1.png"), pixels(tmp_path / "reused2.png"))


def test_plot_curves_reads_the_run_directories_it_draws(tmp_path):
    for name in ("a", "b"):
        run = RunDir(tmp_path / name).create()
        run.write_config({"experiment": "xor"})
        for row in RUNS["falls far" if name == "a" else "longer"]:
            run.log(row)
    out = plot_curves([RunDir(tmp_path / "a"), RunDir(tmp_path / "b")], ["a", "b"], tmp_path / "both.png")
    expected = draw_curves([(RUNS["falls far"], "a"), (RUNS["longer"], "b")], tmp_path / "expected.png", title="xor")
    np.testing.assert_array_equal(pixels(out), pixels(expected))


@pytest.mark.parametrize("processes", [0, 1])
def test_a_pool_draws_what_this_process_draws(tmp_path, processes):
    jobs = [
        ([(rows, name)], tmp_path / "pool" / f"{i}" / "curves.png", f"xor {name}")
        for i, (name, rows) in enumerate(RUNS.items())
    ]
    with CurvePool(processes) as pool:
        for runs, out, title in jobs:
            pool.draw(runs, out, title=title)
    for runs, out, title in jobs:
        np.testing.assert_array_equal(pixels(out), pixels(draw_curves(runs, tmp_path / "here.png", title=title)))


def test_a_workers_failure_is_raised_when_the_pool_closes(tmp_path):
    (tmp_path / "a_file").write_text("")
    pool = CurvePool(1)
    pool.draw([(RUNS["longer"], "x")], tmp_path / "a_file" / "curves.png", title="x")  # taken by the worker at once
    with pytest.raises(RuntimeError, match=r"a process drawing curves.png failed \(exit status 1: FileExistsError"):
        pool.close()


def test_workers_only_for_enough_plots_and_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    assert [plot_processes(n) for n in (1, 7, 8, 16, 64)] == [0, 0, 1, 1, 1]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert [plot_processes(n) for n in (7, 16, 24, 64)] == [0, 2, 3, 4]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert plot_processes(64) == 0


def test_every_logged_metric_gets_a_panel_loss_and_accuracy_first(tmp_path):
    """A GAN logs no accuracy but two losses, gradient norms and a test fid: a panel each, in rows of
    three, drawn again by a reused figure to the same pixels."""
    gan = [
        {"step": s, "train/d_loss": 1 / s, "train/g_loss": 2 / s, "train/d_grad_norm": 0.5, "test/fid": 10 / s}
        for s in (1, 2, 4)
    ]
    classifier = [{**r, "train/grad_norm": 1.0, "test/member_accuracy": [0.5, 0.6]} for r in RUNS["falls far"]]
    assert panels_of([(gan, "g")]) == ("d_grad_norm", "d_loss", "fid", "g_loss")
    assert panels_of([(classifier, "c")]) == ("loss", "accuracy", "grad_norm")  # lists (members) are not curves
    assert panels_of([([], "nothing")]) == ("loss", "accuracy")
    reused = CurveFigure(1, panels_of([(gan, "g")]))
    reused.draw([(gan[:2], "g")], tmp_path / "first.png", title="gan")
    reused.draw([(gan, "g")], tmp_path / "again.png", title="gan")
    fresh = draw_curves([(gan, "g")], tmp_path / "fresh.png", title="gan")
    np.testing.assert_array_equal(pixels(tmp_path / "again.png"), pixels(fresh))
    assert pixels(fresh).shape[:2] == (int(110 * (4.2 + 3.6)), int(110 * 3 * 5.5))  # two rows of three panels
