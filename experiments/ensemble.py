"""An ensemble of seeds on MNIST-1D, all members trained in one compiled program.

K models are built from K keys with `eqx.filter_vmap` and trained by one vmapped `train_step`
(member k sees the batches a single run would); each member and the ensemble that averages their
predicted probabilities are evaluated on the test set. `--compare-sequential` also trains the K
members one after another with the ordinary `fit`, checks they end at the same parameters, and
prints both wall times. Run with `./scripts/run ensemble --help` for the options.
"""

import dataclasses
import sys
import time
from pathlib import Path
from typing import Literal

import jax
import numpy as np
import optax

from research.cli import ConfigError, TrainConfig, main_entry, option, positive
from research.data import MNIST1D_CLASSES, MNIST1D_LENGTH, DeviceLoader, load_mnist1d
from research.ensemble import evaluate_ensemble, fit_ensemble, member, stack_states
from research.experiment import RUNS_ROOT, _versions
from research.nn import build_model
from research.train import RunDir, TrainState, evaluate, fit, save_checkpoint


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Train --num-members MNIST-1D models from different seeds in one compiled program; print each
    member's test accuracy (mean +- std) and the averaged-prediction ensemble's."""

    num_members: int = option(8, "K: members, each with its own initialisation and training key", check=positive)
    model: Literal["mlp", "cnn"] = option(
        "mlp", "mlp: 40 -> hidden -> hidden -> 10 (ReLU); cnn: MNIST-1D's reference CNN (on CPU its vmapped "
        "convolutions become grouped convolutions, which XLA runs slower than K separate ones)")
    hidden: int = option(100, "hidden units of the mlp", check=positive)
    epochs: int = option(50, "passes over the 4000 training examples", check=positive)
    batch_size: int = option(100, "examples per training step", check=positive)
    lr: float = option(1e-2, "Adam learning rate", check=positive)
    compare_sequential: bool = option(False, "also train the members one by one with fit; compare results and time")
    data_dir: str = option("data", "where MNIST-1D is generated and cached")
    steps_per_call: int = option(125, "training steps per compiled call", check=positive)
    log_every: int = option(250, "steps between progress reports", check=positive)


def build_model_and_state(config: Config, key) -> TrainState:
    model_key, train_key = jax.random.split(key)
    if config.model == "cnn":
        model, _ = build_model("cnn", key=model_key)
    else:
        model, _ = build_model("mlp", in_size=MNIST1D_LENGTH, out_size=MNIST1D_CLASSES,
                               hidden=(config.hidden, config.hidden), activation="relu", key=model_key)
    return TrainState.create(model, optax.adam(config.lr), key=train_key)


def main(config: Config) -> dict:
    if config.resume:
        raise ConfigError("--resume: the ensemble experiment trains in one go and does not resume")
    path = Path(config.run_dir) if config.run_dir else RunDir.new_path(RUNS_ROOT, "ensemble")
    if (path / "config.json").exists():
        raise ConfigError(f"--run-dir {path} already holds a run; pick a new directory")
    run = RunDir(path).create()
    train, test = load_mnist1d(config.data_dir)
    train_data = DeviceLoader(train.inputs, train.labels, config.batch_size, seed=config.seed)
    test_data = DeviceLoader(test.inputs, test.labels, 500, shuffle=False)
    num_steps = config.epochs * train_data.steps_per_epoch
    run.write_config({"experiment": "ensemble", "config": config.to_dict(), "versions": _versions(),
                      "resolved": {"num_steps": num_steps, "steps_per_epoch": train_data.steps_per_epoch},
                      "command": [Path(sys.argv[0]).name, *sys.argv[1:]]})

    keys = jax.random.split(jax.random.key(config.seed), config.num_members)
    # Traced once under vmap: every member shares one optimizer object (static), so the sequential
    # comparison below compiles `fit` once for all members.
    states = stack_states(lambda key: build_model_and_state(config, key), keys)
    result = fit_ensemble(states, train_data, num_steps=num_steps, steps_per_call=config.steps_per_call,
                          log_every=config.log_every, progress=config.progress)
    scores = evaluate_ensemble(result.states.model, result.states.model_state, test_data)
    accuracy = scores["member_accuracy"]
    summary = {
        "experiment": "ensemble", "model": config.model, "num_members": config.num_members, "step": num_steps,
        "member_test_accuracy": [float(a) for a in accuracy],
        "member_test_accuracy_mean": float(np.mean(accuracy)),
        "member_test_accuracy_std": float(np.std(accuracy, ddof=1)) if len(accuracy) > 1 else 0.0,
        "ensemble_test_accuracy": scores["accuracy"], "ensemble_test_loss": scores["loss"],
        "vmapped_wall_seconds": result.wall_seconds,
    }
    print(
        f"ensemble of {config.num_members} {config.model}s, {num_steps} steps: member test accuracy "
        f"{100 * summary['member_test_accuracy_mean']:.2f}% +- {100 * summary['member_test_accuracy_std']:.2f}% "
        f"(mean +- std over members; min {100 * accuracy.min():.2f}%, max {100 * accuracy.max():.2f}%), "
        f"ensemble (mean of probabilities) {100 * scores['accuracy']:.2f}%\n"
        f"vmapped training of {config.num_members} members: {result.wall_seconds:.1f} s (compilation included)"
    )
    if config.compare_sequential:
        summary.update(compare_sequential(config, states, result.states, train_data, test_data, num_steps))
    save_checkpoint(run.checkpoint_path(num_steps), result.states,
                    {"experiment": "ensemble", "config": config.to_dict(), "step": num_steps})
    run.write_summary(summary)
    print(f"run directory: {run.path}")
    return summary


def compare_sequential(config: Config, start: TrainState, vmapped: TrainState, train_data: DeviceLoader,
                       test_data: DeviceLoader, num_steps: int) -> dict:
    """Train every member alone with `fit` (one compilation, reused), time it, and compare parameters
    and test accuracies. Over thousands of steps float rounding (a batched matmul sums in another
    order) makes the parameters drift apart while the accuracies stay alike; over a few hundred
    steps they agree to ~1e-6."""
    differences, accuracies, seconds = [], [], 0.0
    for k in range(config.num_members):
        begin = time.perf_counter()
        alone = fit(member(start, k), train_data, num_steps=num_steps, steps_per_call=config.steps_per_call,
                    log_every=num_steps, progress=False)
        seconds += time.perf_counter() - begin
        accuracies.append(evaluate(alone.state.model, alone.state.model_state, test_data)["accuracy"])
        pairs = zip(jax.tree.leaves(alone.state.model), jax.tree.leaves(member(vmapped, k).model))
        differences.append(max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs))
    mean, std = np.mean(accuracies), np.std(accuracies, ddof=1) if len(accuracies) > 1 else 0.0
    print(f"sequential training of {config.num_members} members with fit: {seconds:.1f} s; member test accuracy "
          f"{100 * mean:.2f}% +- {100 * std:.2f}% (largest parameter difference from the vmapped members: "
          f"{max(differences):.2g})")
    return {"sequential_wall_seconds": seconds, "max_parameter_difference": max(differences),
            "sequential_member_test_accuracy_mean": float(mean), "sequential_member_test_accuracy_std": float(std)}


if __name__ == "__main__":
    main_entry(main, Config)
