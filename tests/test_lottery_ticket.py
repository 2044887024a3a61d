"""experiments/lottery_ticket.py: the sparsity schedule, magnitude masks, masks that stay applied through
training, rewinding to the initial weights, and rounds that prune from the previous round's weights."""

import jax
import numpy as np
import pytest

from research.experiment import load_experiment
from research.nn import Masked
from research.services import RunDir, load_checkpoint
from research.train import fit

lottery = load_experiment("lottery_ticket")
TINY = {"hidden": 8, "steps": 4, "steps_per_call": 4}  # one compiled train step shared by the tests that train


def layer_masks(masks):
    return [(np.asarray(layer.weight), np.asarray(layer.bias)) for layer in masks.layers]


def same_masks(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_sparsity_schedule_is_the_notebooks_linspace():
    assert lottery.sparsity_schedule(lottery.Config.from_options()) == pytest.approx(list(np.linspace(0, 1, 100)[:91]))
    assert lottery.sparsity_schedule(lottery.Config.from_options(rounds=5, schedule_length=4))[-2:] == [1.0, 1.0]


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


def test_rewinding_restores_the_initial_weights_bitwise():
    config = lottery.Config.from_options(hidden=8, seed=3)
    masks = lottery.magnitude_masks(lottery.initial_model(config), 0.5)
    initial = lottery.initial_model(config)
    rewound = lottery.build_state(config, masks).model
    for layer, start, (weight_mask, bias_mask) in zip(
        rewound.model.layers, initial.layers, layer_masks(masks), strict=True
    ):
        assert np.array_equal(np.asarray(layer.weight), np.where(weight_mask, start.weight, 0.0))
        assert np.array_equal(np.asarray(layer.bias), np.where(bias_mask, start.bias, 0.0))
    reinit = lottery.build_state(config, masks, reinit=True).model
    assert not np.array_equal(reinit.model.layers[0].weight, rewound.model.layers[0].weight)
    assert same_masks(reinit.masks, masks)


def test_pruned_weights_stay_exactly_zero_through_training(mnist1d_dir):
    config = lottery.Config.from_options(**TINY, data_dir=str(mnist1d_dir))
    masks = lottery.magnitude_masks(lottery.initial_model(config), 0.7)
    run = lottery.setup(config, masks)
    start = run.build_state()
    trained = fit(start, run.train_data, num_steps=12, steps_per_call=4, progress=False).state.model
    for layer, before, (weight_mask, _) in zip(
        trained.model.layers, start.model.model.layers, layer_masks(masks), strict=True
    ):
        weight = np.asarray(layer.weight)
        assert np.all(weight[~weight_mask] == 0.0)  # no gradient reaches them: Adam leaves them at zero
        assert np.mean(weight[weight_mask] != np.asarray(before.weight)[weight_mask]) > 0.5  # the others train


@pytest.mark.slow
def test_each_round_prunes_the_previous_rounds_trained_weights(mnist1d_dir, tmp_path):
    config = lottery.Config.from_options(
        **TINY,
        rounds=2,
        schedule_length=4,
        eval_every=2,
        data_dir=str(mnist1d_dir),
        run_dir=str(tmp_path / "run"),
        progress=False,
    )
    summary = lottery.main(config)

    def final_model(name):
        run = RunDir(tmp_path / "run" / name)
        skeleton = lottery.build_state(config)
        return load_checkpoint(run.latest_valid_checkpoint()[0], skeleton)[0].model

    names = ("round_000", "round_001", "round_002", "reinit_002", "random_002")
    dense, first, second, reinit, random = (final_model(n) for n in names)
    expected = lottery.magnitude_masks(first.masked_model(), 0.5)  # round 2 from round 1's trained weights
    assert same_masks(second.masks, expected)
    assert same_masks(reinit.masks, expected)
    kept = [[np.sum(w) + np.sum(b) for w, b in layer_masks(m)] for m in (random.masks, expected)]
    assert kept[0] == kept[1]  # the random mask is as sparse as the ticket's, layer by layer
    assert not same_masks(random.masks, expected)
    assert lottery.sparsity_of(dense.masks) == 0.0
    assert summary["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert summary["round_sparsity"][1] == pytest.approx(0.25, abs=0.01)
    assert summary["ticket_max_test_accuracy"] >= summary["ticket_test_accuracy"]
    assert (tmp_path / "run" / "lottery.png").stat().st_size > 0
