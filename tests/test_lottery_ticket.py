"""experiments/lottery_ticket.py: the sparsity schedule, magnitude masks, masks that stay applied through
training, rewinding to the initial weights; and the whole experiment as one run of the engine, whose
hook prunes each round from the previous round's trained weights, resumes bit for bit after SIGTERM,
and gives the same bits on two devices."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from research.cli import main_entry
from research.errors import ConfigError, Preempted
from research.experiment import load_experiment
from research.nn import Masked
from research.services import RunDir, checkpoint_digest, load_checkpoint
from research.train import Track

lottery = load_experiment("lottery_ticket")
TINY = {"hidden": 8, "steps": 4, "steps_per_call": 4}  # one compiled train step shared by the tests that train
# Two rounds and the two controls, 30 steps each (150 in all), evaluated every 12 steps of a round and at
# its end (not on multiples of 12 of the whole run); micro-batches summed in a fixed order, so that one
# device and two give the same bits.
RUN = {
    "rounds": 2,
    "schedule_length": 4,
    "steps": 30,
    "hidden": 32,
    "eval_every": 12,
    "log_every": 10,
    "steps_per_call": 10,
    "deterministic_reduction": True,
    "micro_batches": 4,
    "progress": False,
}
TIMING = {"steps_per_s", "wall_seconds", "compile_seconds", "peak_host_memory_bytes"}


def layer_masks(masks):
    return [(np.asarray(layer.weight), np.asarray(layer.bias)) for layer in masks.layers]


def same_masks(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def without_timing(path):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in RunDir(path).read_metrics()]


def test_sparsity_schedule_is_the_notebooks_linspace():
    assert lottery.sparsity_schedule(lottery.Config.from_options()) == pytest.approx(list(np.linspace(0, 1, 100)[:91]))
    assert lottery.sparsity_schedule(lottery.Config.from_options(rounds=5, schedule_length=4))[-2:] == [1.0, 1.0]


def test_evaluations_fall_on_multiples_of_eval_every_within_each_round_and_on_its_end():
    config = lottery.Config.from_options(rounds=1, steps=30, eval_every=12)
    assert lottery.evaluation_steps(config) == (12, 24, 30, 42, 54, 60, 72, 84, 90, 102, 114, 120)
    assert lottery.evaluation_steps(config.replace(eval_every=0)) == (30, 60, 90, 120)
    assert lottery.num_phases(config) * config.steps == 120
    assert [lottery.phase_of(s, config) for s in (1, 30, 31, 60, 120)] == [0, 0, 1, 1, 3]
    default = lottery.Config.from_options()
    assert len(lottery.evaluation_steps(default)) == 93 * 16  # 100, ..., 1500 and 1501 of each of 93 phases


def test_magnitude_masks_drop_the_smallest_of_each_layer_and_nest(getkey):
    model = lottery.initial_model(lottery.Config.from_options(hidden=8))
    first = lottery.magnitude_masks(model, 0.3)
    for layer, (weight_mask, bias_mask) in zip(model.layers, layer_masks(first), strict=True):
        keep = np.concatenate([weight_mask.ravel(), bias_mask.ravel()])
        scores = np.abs(np.concatenate([np.ravel(layer.weight), np.ravel(layer.bias)]))
        assert np.sum(~keep) == int(0.3 * keep.size)  # weights and bias pruned together, layer by layer
        assert scores[~keep].max() <= scores[keep].min()
    second = lottery.magnitude_masks(Masked(model, first).masked_model(), 0.6)  # zeros of round 1 go first
    for (w1, b1), (w2, b2) in zip(layer_masks(first), layer_masks(second), strict=True):
        assert not np.any(w2 & ~w1) and not np.any(b2 & ~b1)
    assert lottery.sparsity_of(second) == pytest.approx(0.6, abs=0.01)
    assert lottery.sparsity_of(second) == lottery.pruned_fraction(lottery.Config.from_options(hidden=8), 0.6)


def test_rewinding_restores_the_initial_weights_bitwise():
    config = lottery.Config.from_options(hidden=8, seed=3)
    masks = lottery.magnitude_masks(lottery.initial_model(config), 0.5)
    initial = lottery.initial_model(config)
    rewound = lottery.rewound(config, masks)
    for layer, start, (weight_mask, bias_mask) in zip(
        rewound.model.layers, initial.layers, layer_masks(masks), strict=True
    ):
        assert np.array_equal(np.asarray(layer.weight), np.where(weight_mask, start.weight, 0.0))
        assert np.array_equal(np.asarray(layer.bias), np.where(bias_mask, start.bias, 0.0))
    reinit = lottery.rewound(config, masks, reinit=True)
    assert not np.array_equal(reinit.model.layers[0].weight, rewound.model.layers[0].weight)
    assert same_masks(reinit.masks, masks)


@pytest.fixture(scope="module")
def straight(mnist1d_dir, tmp_path_factory):
    """The whole experiment, one run never stopped: its summary, its directory, and what the hook saw
    and made at each round's end: `(phase, trained state, next phase's start)`."""
    path = tmp_path_factory.mktemp("lottery") / "straight"
    config = lottery.Config.from_options(**RUN, data_dir=str(mnist1d_dir), run_dir=str(path))
    seen = []
    original = lottery.start_of_phase

    def recording(config, state, phase):
        start = original(config, state, phase)
        seen.append((phase, state, start))
        return start

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lottery, "start_of_phase", recording)
        summary = lottery.main(config)
    return config, summary, path, seen


@pytest.mark.slow
def test_each_round_prunes_the_last_ones_trained_weights_and_rewinds_the_survivors(straight):
    config, _, path, seen = straight
    assert [phase for phase, *_ in seen] == [1, 2, 3, 4]  # the rounds 1, 2, then "reinit" and "random"
    initial, other = lottery.initial_model(config), lottery.initial_model(config, reinit=True)
    schedule = lottery.sparsity_schedule(config)
    starts = [lottery.build_state(config)] + [start for _, _, start in seen]
    for (phase, trained, start), began in zip(seen, starts, strict=False):
        assert int(trained.step) == int(start.step) == phase * config.steps  # the step count goes on
        for layer, before, (weight_mask, _) in zip(
            trained.model.model.layers, began.model.model.layers, layer_masks(trained.model.masks), strict=True
        ):
            weight = np.asarray(layer.weight)
            assert np.all(weight[~weight_mask] == 0.0)  # no gradient reaches them: Adam leaves them at zero
            assert np.mean(weight[weight_mask] != np.asarray(before.weight)[weight_mask]) > 0.5  # the others train
        adam = start.opt_state[0]
        assert int(adam.count) == 0 and all(not np.any(m) for m in jax.tree.leaves(adam.mu))  # a fresh Adam
        masks = start.model.masks
        if phase <= config.rounds:  # from this round's trained weights, to the schedule, rewound
            assert same_masks(masks, lottery.magnitude_masks(trained.model.masked_model(), schedule[phase]))
            assert lottery.sparsity_of(masks) == pytest.approx(schedule[phase], abs=0.01)
        rewound_to = initial if phase <= config.rounds else other
        for layer, start_layer, (weight_mask, bias_mask) in zip(
            start.model.model.layers, rewound_to.layers, layer_masks(masks), strict=True
        ):
            assert np.array_equal(np.asarray(layer.weight), np.where(weight_mask, start_layer.weight, 0.0))
            assert np.array_equal(np.asarray(layer.bias), np.where(bias_mask, start_layer.bias, 0.0))
    ticket = seen[2][2].model.masks  # "reinit": the ticket's own mask, from the other initialisation
    assert same_masks(ticket, seen[2][1].model.masks)
    random = seen[3][2].model.masks  # "random": as many kept in every layer as the ticket, elsewhere
    kept = [[np.sum(w) + np.sum(b) for w, b in layer_masks(m)] for m in (random, ticket)]
    assert kept[0] == kept[1] and not same_masks(random, ticket)
    final, _ = load_checkpoint(RunDir(path).checkpoint_paths()[-1], lottery.build_state(config))
    assert same_masks(final.model.masks, random)  # the masks are in the checkpoint, applied to the end
    for layer, (weight_mask, bias_mask) in zip(final.model.model.layers, layer_masks(random), strict=True):
        assert np.all(np.asarray(layer.weight)[~weight_mask] == 0.0) and np.all(
            np.asarray(layer.bias)[~bias_mask] == 0.0
        )


@pytest.mark.slow
def test_one_run_directory_whose_summary_is_its_metrics_grouped_by_round(straight):
    config, summary, path, _ = straight
    run = RunDir(path)
    record = run.read_config()
    assert {"git", "versions", "machine", "command"} <= record.keys() and record["resolved"]["num_steps"] == 150
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["checkpoints"]
    assert (path / "lottery.png").stat().st_size > 0 and (path / "curves.png").exists()
    evaluations = [r for r in run.read_metrics() if "test/accuracy" in r]
    assert [r["step"] for r in evaluations] == list(lottery.evaluation_steps(config))
    by_phase = [[r for r in evaluations if lottery.phase_of(r["step"], config) == p] for p in range(5)]
    best = [max(r["test/accuracy"] for r in rs) for rs in by_phase]
    end = [rs[-1] for rs in by_phase]
    assert summary["round_max_test_accuracy"] == best[:3] and summary["round_test_accuracy"] == [
        r["test/accuracy"] for r in end[:3]
    ]
    for name, phase in (("dense", 0), ("ticket", 2), ("reinit_ticket", 3), ("random_pruning", 4)):
        assert summary[f"{name}_max_test_accuracy"] == best[phase]
        assert summary[f"{name}_test_accuracy"] == end[phase]["test/accuracy"]
    assert summary["test_accuracy"] == end[2]["test/accuracy"] and summary["test_loss"] == end[2]["test/loss"]
    ticket_losses = [r["train/loss"] for r in run.read_metrics() if "train/loss" in r and 60 < r["step"] <= 90]
    assert summary["train_loss"] == ticket_losses[-1]
    assert (
        summary["round_sparsity"] == pytest.approx([0.0, 0.25, 0.5], abs=0.01)
        and summary["sparsity"] == summary["round_sparsity"][-1]
    )
    assert summary["rounds"] == 2 and summary["step"] == 150 and run.read_summary() == summary


@pytest.mark.slow
def test_a_finished_run_reported_again_prints_the_same(straight, capsys):
    config, summary, _, _ = straight
    assert lottery.main(config.replace(resume="auto")) == summary
    out = capsys.readouterr().out
    assert lottery.report(summary) in out and f"ticket ({100 * summary['sparsity']:.1f}% sparse)" in out


@pytest.mark.slow
def test_stopped_by_sigterm_and_resumed_it_gives_the_bits_of_a_run_never_stopped(straight, tmp_path):
    """SIGTERM inside round 1 (step 50), resumed; SIGTERM again at its end (step 60, where the hook has
    just rewound the state: the checkpoint holds round 2's start), resumed to the end."""
    config, summary, path, _ = straight
    config = config.replace(run_dir=str(tmp_path / "stopped"))
    original = Track.__call__  # a hook that runs at every stop, after the one that prunes and rewinds
    for stop in (50, 60):

        def signal_there(self, info, stop=stop):
            original(self, info)
            if info.step == stop:
                os.kill(os.getpid(), signal.SIGTERM)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Track, "__call__", signal_there)
            with pytest.raises(Preempted, match=f"stopped by SIGTERM at step {stop} of 150; its checkpoint is saved"):
                lottery.main(config.replace(resume="auto" if stop == 60 else None))
        assert RunDir(tmp_path / "stopped").checkpoint_paths()[-1].name == f"step_{stop:09d}"
    resumed = lottery.main(config.replace(resume="auto"))
    assert without_timing(tmp_path / "stopped") == without_timing(path)
    final = [RunDir(p).checkpoint_paths()[-1] for p in (tmp_path / "stopped", path)]
    assert final[0].name == final[1].name == "step_000000150"
    assert checkpoint_digest(final[0]) == checkpoint_digest(final[1])
    assert {k: v for k, v in resumed.items() if k not in TIMING} == {
        k: v for k, v in summary.items() if k not in TIMING
    }


@pytest.mark.slow
def test_two_devices_give_the_bits_of_one(straight, tmp_path):
    config, summary, path, _ = straight
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RUN.items() if not isinstance(v, bool)]
    flags += ["--deterministic-reduction", "--no-progress", f"--data-dir={config.data_dir}"]
    script = Path(lottery.__file__)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run(
        [sys.executable, str(script), *flags, "--devices", "2", "--run-dir", str(tmp_path / "two")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "on 2 cpu devices" in done.stdout
    assert without_timing(tmp_path / "two") == without_timing(path)
    two = RunDir(tmp_path / "two").read_summary()
    ignored = TIMING | {"state_bytes_per_device"}
    assert {k: v for k, v in two.items() if k not in ignored} == {k: v for k, v in summary.items() if k not in ignored}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--early-stopping", "3"], "--early-stopping 3 would end the whole run inside one round"),
        (["--ema-decay", "0.9"], "--ema-decay is not an option of lottery_ticket"),
        (["--num-members", "2"], "--num-members is not an option of lottery_ticket"),
    ],
)
def test_options_that_make_no_sense_are_refused_before_any_work_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main_entry(
            lottery.main, lottery.Config, [*argv, "--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path)]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # no data generated, no run directory


def test_several_processes_are_refused_in_one_line():
    config = lottery.Config.from_options(num_processes=2, process_id=0)
    with pytest.raises(ConfigError, match="lottery_ticket trains in one process"):
        lottery.setup(config)
