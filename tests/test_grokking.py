"""Grokking's mechanism: the split of the p² pairs and the two steps the summary records, on a tiny
instance whose classifier (read at the "=" token) memorizes its pairs (the real runs: docs/results.md)."""

import json

import numpy as np
import pytest

from research.cli import main_entry
from research.data import DataError, modular_addition
from research.experiment import load_experiment
from research.tools import sweep

grokking = load_experiment("grokking")


def test_the_split_is_a_reproducible_partition_of_all_pairs():
    train, test = modular_addition(7, 0.3, seed=0)
    assert len(train.labels) == round(0.3 * 49) and len(train.labels) + len(test.labels) == 49
    pairs = np.concatenate([train.inputs, test.inputs])
    assert sorted(map(tuple, pairs[:, :2].tolist())) == [(a, b) for a in range(7) for b in range(7)]  # each once
    assert (pairs[:, 2] == 7).all()  # the "=" token
    np.testing.assert_array_equal(np.concatenate([train.labels, test.labels]), pairs[:, :2].sum(1) % 7)
    again, _ = modular_addition(7, 0.3, seed=0)
    other, _ = modular_addition(7, 0.3, seed=1)
    np.testing.assert_array_equal(again.inputs, train.inputs)
    assert not np.array_equal(other.inputs, train.inputs)
    with pytest.raises(DataError):
        modular_addition(7, 0.01, seed=0)  # no training pair


def test_steps_come_from_the_logged_metrics():
    records = [
        {"step": 100, "train/accuracy": 0.6, "test/accuracy": 0.1},
        {"step": 200, "train/accuracy": 0.995, "test/accuracy": 0.2},
        {"step": 300, "train/accuracy": 0.98},  # a dip after memorizing does not move the step
        {"step": 400, "train/accuracy": 1.0, "test/accuracy": 0.99},
        {"step": 500, "train/accuracy": 1.0, "test/accuracy": 0.97},
    ]
    assert grokking.grokking_steps(records) == {
        "memorization_step": 200,
        "grokking_step": 400,
        "best_test_accuracy": 0.99,
        "min_test_accuracy_after_grokking": 0.97,
    }
    never = grokking.grokking_steps(records[:2])
    assert never["grokking_step"] is None and never["best_test_accuracy"] == 0.2
    assert never["min_test_accuracy_after_grokking"] is None


# 25 training pairs, memorized within 60 steps.
TINY = (
    "--modulus 7 --train-fraction 0.5 --dim 16 --heads 2 --lr 1e-2 --steps 60 --eval-every 20 --log-every 20"
    " --steps-per-call 20"
)


def test_a_tiny_run_records_its_steps_and_plot(tmp_path, capsys):
    run_dir = tmp_path / "run"
    main_entry(grokking.main, grokking.Config, [*TINY.split(), "--run-dir", str(run_dir), "--no-progress"])
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {k: summary[k] for k in grokking.grokking_steps(records)} == grokking.grokking_steps(records)
    assert summary["memorization_step"] is not None
    assert (run_dir / "grokking.png").stat().st_size > 0
    assert f"train accuracy >= 99% at step {summary['memorization_step']}" in capsys.readouterr().out


@pytest.mark.slow
def test_runs_that_differ_in_adams_hyperparameters_train_as_one_population(tmp_path, capsys):
    """beta2, adam_eps (and lr, weight_decay) live in the optimizer's state: each member of a vmapped
    sweep over them ends where its run trained alone ends (after 20 steps: later, full-batch Adam at this
    rate amplifies the vmapped program's rounding into visible differences)."""
    short = [*TINY.split(), "--steps", "20"]
    sweep.main(
        [
            "grokking",
            "beta2=0.9,0.98",
            "adam_eps=1e-8,1e-2",
            "--vmapped",
            "--sweep-dir",
            str(tmp_path),
            "--",
            *short,
        ]
    )
    assert "4 members of" in capsys.readouterr().out  # one program
    losses = set()
    for run in sorted(tmp_path.glob("beta2=*")):
        config = json.loads((run / "config.json").read_text())["config"]
        alone = tmp_path / "alone" / run.name
        flags = ["--beta2", str(config["beta2"]), "--adam-eps", str(config["adam_eps"]), "--run-dir", str(alone)]
        main_entry(grokking.main, grokking.Config, [*short, *flags, "--no-progress"])
        member, single = (json.loads((path / "summary.json").read_text()) for path in (run, alone))
        assert member["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
        assert member["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
        losses.add(round(member["train_loss"], 6))
    assert len(losses) == 4  # each pair of hyperparameters trains differently


@pytest.mark.reproduction
def test_the_recipe_ends_grokked_on_five_seeds_without_a_late_collapse(tmp_path):
    """The default recipe in full (10,000 full-batch steps) on seeds 3-7, whose runs collapsed after grokking
    with the published Adam epsilon (docs/results.md: seed 3 ended at 75%), as one vmapped population (~30
    minutes on 2 cores): each seed groks and ends at >= 99% test accuracy, and no evaluation after its
    grokking step falls to the 42-89% of those collapses (seed 6 dips once, to 96.6%, 200 steps after grokking)."""
    sweep.main(["grokking", "seed=3,4,5,6,7", "--vmapped", "--sweep-dir", str(tmp_path)])
    summaries = {run.name: json.loads((run / "summary.json").read_text()) for run in sorted(tmp_path.glob("seed=*"))}
    assert len(summaries) == 5
    for name, summary in summaries.items():
        assert summary["grokking_step"] is not None, name
        assert summary["test_accuracy"] >= grokking.THRESHOLD, name
        assert summary["min_test_accuracy_after_grokking"] >= 0.95, name
