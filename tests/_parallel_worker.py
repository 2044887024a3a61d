"""A small experiment script for tests/test_parallel.py, run in subprocesses (simulated devices must
be set before JAX starts) and under `scripts/launch`.

    python tests/_parallel_worker.py [flags] [+ [flags] ...]

Each `+`-separated group is one run (`research.cli` flags plus the ones below), all in this process,
one after the other; `--devices` of the group with the most devices sets up the process. Every run
goes through `research.experiment.run_experiment`, so it writes a normal run directory.
"""

import dataclasses
import functools
import sys
from typing import ClassVar, Literal

from jaxtyping import install_import_hook

with install_import_hook("research", "beartype.beartype"):  # the same shape checks as the test suite
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    from research.cli import ConfigError, TrainConfig, Training, devices_of, group, option, parse_config
    from research.data import ArrayDataset, DeviceLoader, GrainLoader, TorchLoader, XORDataset, dataset_arrays
    from research.errors import Preempted
    from research.experiment import Setup, run_experiment
    from research.messages import messages_to_stderr
    from research.nn import MLP, BatchNorm
    from research.parallel import batch_axis_name, exit_together, setup_devices
    from research.per_example import DPSGDLoss
    from research.services import Headline
    from research.train import SupervisedStep, TrainState, classification_loss
    from research.typing import Array, Float, PRNGKeyArray

jax.config.update("jax_numpy_rank_promotion", "raise")


class BatchNormNet(eqx.Module):
    """Linear -> BatchNorm (batch statistics over `axis_name`) -> tanh -> dropout -> Linear."""

    first: eqx.nn.Linear
    norm: BatchNorm
    dropout: eqx.nn.Dropout
    last: eqx.nn.Linear
    stateful = True

    def __init__(self, axis_name: str | tuple[str, ...], *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        # No bias before BatchNorm: its true gradient is zero, so Adam would amplify rounding noise.
        self.first = eqx.nn.Linear(2, 16, use_bias=False, key=k1)
        self.norm = BatchNorm(16, axis_name=axis_name)
        self.dropout = eqx.nn.Dropout(0.2)
        self.last = eqx.nn.Linear(16, 1, key=k2)

    def __call__(
        self, x: Float[Array, "2"], state: eqx.nn.State, *, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "1"], eqx.nn.State]:
        h, state = self.norm(self.first(x), state)
        h = self.dropout(jnp.tanh(h), key=key, inference=key is None)
        return self.last(h), state


@dataclasses.dataclass(frozen=True)
class WorkerTraining(Training):
    batch_size: int = option(32, "examples per step")
    lr: float = option(0.01, "Adam learning rate")
    log_every: int = option(1, "steps between logged metrics")


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    headline: ClassVar[Headline] = Headline("accuracy")
    training: WorkerTraining = group(WorkerTraining)
    model: Literal["mlp", "batchnorm", "dpsgd", "wide"] = option(
        "mlp",
        "mlp (stateless), batchnorm (BatchNorm + dropout), dpsgd (the mlp trained by DP-SGD with noise), or "
        "wide (an mlp with a 64x64 layer, which --parallel fsdp splits over the devices)",
    )
    loader: Literal["device", "torch", "grain"] = option("device", "device-resident batches, torch or Grain")
    steps: int = option(20, "training steps", resumable=True)


def build_state(config: Config) -> TrainState:
    return _build_state(
        config.model,
        config.devices.parallel,
        config.training.lr,
        config.training.seed,
        config.devices.deterministic_reduction,
    )


@functools.cache
def _build_state(model_name: str, parallel: str, lr: float, seed: int, deterministic: bool = False) -> TrainState:
    # One state object per setting: a fresh eqx.nn.State hashes differently each time, which would make
    # every run of this process compile its train step again (fit leaves the state it is given intact).
    model_key, train_key = jax.random.split(jax.random.key(seed))
    if model_name == "dpsgd":
        return TrainState.create(MLP(2, 1, hidden=(8,), key=model_key), optax.sgd(lr * 10), key=train_key)
    if model_name in ("mlp", "wide"):
        model, model_state = MLP(2, 1, hidden=(8,) if model_name == "mlp" else (64, 64), key=model_key), None
    else:
        model, model_state = eqx.nn.make_with_state(BatchNormNet)(
            batch_axis_name(parallel, deterministic), key=model_key
        )
    return TrainState.create(model, optax.adam(lr), key=train_key, model_state=model_state)


def main(config: Config) -> dict:
    train = XORDataset(256, seed=42)
    if config.loader == "device":
        train_data = DeviceLoader.from_dataset(train, config.training.batch_size, seed=config.training.seed)
    elif config.loader == "torch":
        train_data = TorchLoader(train, config.training.batch_size, seed=config.training.seed)
    else:  # two reading threads: each process reads only its rows of every batch
        train_data = GrainLoader(
            ArrayDataset(*dataset_arrays(train)), config.training.batch_size, seed=config.training.seed
        )
    test_data = DeviceLoader.from_dataset(XORDataset(100, seed=7), 50, shuffle=False)
    loss_fn = DPSGDLoss(1.0, 1.0, config.training.batch_size) if config.model == "dpsgd" else classification_loss
    setup = Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=test_data,
        num_steps=config.steps,
        step=SupervisedStep(loss_fn),
    )
    return run_experiment("worker", config, setup)


if __name__ == "__main__":
    groups, group = [], []
    for arg in sys.argv[1:]:
        if arg == "+":
            groups.append(group)
            group = []
        else:
            group.append(arg)
    configs = [parse_config(Config, g, prog="worker.py") for g in [*groups, group]]  # its runs are "worker"'s
    with exit_together("worker"), messages_to_stderr():  # the library's lines, as every command line shows them
        try:
            widest = max(configs, key=lambda c: devices_of(c).devices)
            setup_devices(devices_of(widest), widest.training.batch_size)
            for config in configs:
                main(config)
        except ConfigError as e:
            print(f"worker: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except Preempted as e:  # as research.cli.main_entry does
            print(f"worker: {e}", file=sys.stderr)
            raise SystemExit(e.status) from None
