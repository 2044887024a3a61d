"""Meta-learning the learning rate of SGD on MNIST-1D (Greydanus 2020, notebook "metalearn learn rate").

The inner problem: a 40-50-10 tanh MLP trained by plain SGD for `--inner-steps` steps of
`--batch-size` examples, taken in order from the first of the notebook's 8,000 training examples
(wrapping around), always from the same initial weights. The outer objective is the mean of the
inner minibatch losses over that whole run, a function of the inner learning rate alone; its exact gradient comes from
differentiating through the unrolled run (`jax.lax.scan` over the inner steps, `jax.grad` of the mean
loss with respect to the learning rate). The outer optimisation is the engine training a "model" that
holds the learning rate (`LearnedLearningRate`) with SGD at `--lr`, one outer step per unrolled
run; the starting learning rates of `--start-lrs` are the members of one population (a leading
vmapped axis), so both converge in the same compiled program, and `--devices` spreads the members over
a mesh. Evaluation trains the inner MLP with each member's current learning rate (with `--ema-decay`,
its average) and reports its test accuracy. Run `./scripts/run metalearn_lr --help`.
"""

import dataclasses
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from research.cli import TrainConfig, Training, group, main_entry, non_negative, option, positive
from research.data import (
    MNIST1D_CLASSES,
    MNIST1D_LENGTH,
    MNIST1D_TRAIN_SPLIT,
    Batch,
    DeviceLoader,
    HostLoader,
    load_mnist1d,
)
from research.errors import ConfigError
from research.experiment import Setup, run_experiment
from research.nn import MLP, build_model
from research.population import member, num_members
from research.services import Headline, RunDir
from research.train import (
    FitResult,
    SupervisedStep,
    TrainState,
    classification_metrics,
    evaluate,
    forward,
    model_evaluator,
)
from research.typing import Array, Float, Int, RowKeys, typecheck

# The notebook's result: from 1.5 and from 0.15 the learned rate ends at about 0.62 (0.6244 and 0.6218).
PUBLISHED_LR = 0.62
# The notebook read mnist1d_data.pkl, which held 8,000 training and 2,000 test signals (its printout): the
# package's generator at 10,000 samples and its default 80% split gives the same sizes.
NOTEBOOK_SAMPLES = 10_000


def _all_positive(values: tuple[float, ...]) -> str | None:
    return None if values and all(v > 0 for v in values) else "must be one or more positive numbers"


@dataclasses.dataclass(frozen=True)
class MetalearnTraining(Training):
    lr: float = option(0.3, "outer learning rate: SGD on the learned inner learning rate", check=positive)
    batch_size: int = option(50, "examples per inner SGD step", check=positive)
    log_every: int = option(1, "outer steps between logged metrics", check=positive, resumable=True)
    eval_every: int = option(
        10, "outer steps between test evaluations (0: only at the end)", check=non_negative, resumable=True
    )


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
    """Learn the SGD learning rate of an MNIST-1D MLP by gradient descent through an unrolled training run,
    from each of --start-lrs; print the learned rates beside the published ~0.62."""

    headline: ClassVar[Headline] = Headline("accuracy")
    batch_splits_over_devices = False  # --batch-size is the inner runs'; the members go on the devices
    training: MetalearnTraining = group(MetalearnTraining)
    start_lrs: tuple[float, ...] = option(
        (1.5, 0.15), "initial inner learning rates, one population member each", check=_all_positive
    )
    steps: int = option(
        50,
        "outer steps: one unrolled inner run and one SGD step on the learning rate each",
        check=positive,
        resumable=True,
    )
    clip_norm: float = option(
        0.0, "clip each outer gradient to this size (0: off, the notebook's plain SGD)", check=non_negative
    )
    inner_steps: int = option(200, "inner SGD steps of one unrolled run", check=positive)
    hidden: int = option(50, "hidden units of the inner 40-hidden-10 tanh MLP", check=positive)
    init: Literal["torch", "equinox"] = option(
        "torch",
        "the inner MLP's initial weights: torch: those torch.nn.Linear draws under torch.manual_seed(--seed), "
        "as the notebook does (seed 0 is its MLP); equinox: Equinox's draw of the same distribution from --seed",
    )
    num_samples: int = option(
        NOTEBOOK_SAMPLES,
        "MNIST-1D signals generated, the first 80% for training (the notebook's pickle: 8,000 training, 2,000 test)",
        check=positive,
    )
    data_dir: str = option("data", "where MNIST-1D is generated and cached")

    def __post_init__(self) -> None:
        check_devices(self)  # first: the shared checks would read --batch-size, the inner run's, as the rows
        super().__post_init__()


class LearnedLearningRate(eqx.Module):
    """The outer "model": the learning rate of an inner SGD run and the MLP that run starts from.

    `initial` is read through `jax.lax.stop_gradient`: it is part of the problem, not trained (its
    gradient is zero, so SGD leaves it exactly as it is)."""

    lr: Float[Array, ""]
    initial: MLP

    @typecheck
    def inner_run(
        self, inputs: Float[Array, "steps batch length"], labels: Int[Array, "steps batch"]
    ) -> tuple[MLP, Float[Array, " steps"]]:
        """SGD on `initial`, one step per row of `inputs`: the trained MLP and each step's minibatch
        loss (before its update), differentiable with respect to `lr`."""

        def step(mlp: MLP, batch: tuple[Array, Array]) -> tuple[MLP, Array]:
            loss, grads = eqx.filter_value_and_grad(_minibatch_loss)(mlp, *batch)
            return eqx.apply_updates(mlp, jax.tree.map(lambda g: -self.lr * g, grads)), loss

        return jax.lax.scan(step, jax.lax.stop_gradient(self.initial), (inputs, labels))


def _minibatch_loss(mlp: MLP, inputs: Array, labels: Array) -> Array:
    logits, _ = forward(mlp, None, inputs, key=None)
    return jnp.mean(classification_metrics(logits, labels)[0])


def meta_objective(model: LearnedLearningRate, model_state: None, batch: Batch, keys: RowKeys) -> tuple:
    """The loss the engine minimises: the mean inner loss over each unrolled run of the batch (a batch
    of inner runs, each `[inner steps, inner batch, ...]`); metrics add the last inner loss and the rate."""
    _, losses = jax.vmap(model.inner_run)(batch.inputs, batch.labels)
    loss = jnp.mean(losses)
    return loss, ({"loss": loss, "final_inner_loss": jnp.mean(losses[:, -1]), "learned_lr": model.lr}, model_state)


def inner_batches(train: Batch, steps: int, batch_size: int) -> Batch:
    """The inner run's data, as the notebook takes it: step `i` uses examples `i * batch_size ...`
    (modulo the training set size); one run, `[1, steps, batch_size, ...]`."""
    index = (np.arange(steps)[:, None] * batch_size + np.arange(batch_size)[None, :]) % len(train.labels)
    return Batch(train.inputs[index][None], train.labels[index][None])


@eqx.filter_jit
def _trained_inner_model(model: LearnedLearningRate, inputs: Array, labels: Array) -> MLP:
    return model.inner_run(inputs, labels)[0]


@dataclasses.dataclass(frozen=True)
class InnerRunEvaluator:
    """Evaluate each member by training the inner MLP with its learning rate (the first inner run of
    `runs`) and measuring that MLP on the test set: `loss`, `accuracy` (the members' means),
    `member_loss`, `member_accuracy`."""

    runs: Batch

    def __call__(self, states: TrainState, data: DeviceLoader | HostLoader, *, progress: bool = False) -> dict:
        def trained_inner_model(model: LearnedLearningRate, model_state: None, data, *, progress: bool) -> dict:
            return evaluate(_trained_inner_model(model, self.runs.inputs[0], self.runs.labels[0]), None, data)

        per_member = model_evaluator(trained_inner_model)
        return _of_members([per_member(member(states, k), data) for k in range(num_members(states))])


def _of_members(scores: list[dict]) -> dict:
    metrics = {name: float(np.mean([s[name] for s in scores])) for name in ("loss", "accuracy")}
    metrics.update({f"member_{name}": [s[name] for s in scores] for name in ("loss", "accuracy")})
    return metrics


def torch_initialised(mlp: MLP, seed: int) -> MLP:
    """`mlp` with the weights and biases `torch.nn.Linear` draws for its layers, in order, after
    `torch.manual_seed(seed)` (the notebook's `get_functional_mlp`); torch's global generator is left as it was."""
    import torch  # imported here: only this initialisation needs it

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(layer.in_features, layer.out_features) for layer in mlp.layers]
    arrays = [jnp.asarray(p.detach().numpy()) for layer in layers for p in (layer.weight, layer.bias)]
    return eqx.tree_at(lambda m: [p for layer in m.layers for p in (layer.weight, layer.bias)], mlp, arrays)


def build_state(config: Config) -> TrainState:
    """One member per starting rate, all starting their inner runs from the same MLP (seeded by --seed)."""
    inner_key, train_key = jax.random.split(jax.random.key(config.training.seed))
    initial, _ = build_model(
        "mlp",
        in_size=MNIST1D_LENGTH,
        out_size=MNIST1D_CLASSES,
        hidden=(config.hidden,),
        activation="tanh",
        key=inner_key,
    )
    if config.init == "torch":
        initial = torch_initialised(initial, config.training.seed)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=config.training.lr)
    if config.clip_norm:  # a chaotic unrolled run can make one meta-gradient huge (docs/results.md)
        optimizer = optax.chain(optax.clip_by_global_norm(config.clip_norm), optimizer)
    one = TrainState.create(LearnedLearningRate(jnp.float32(0.0), initial), optimizer, key=train_key)
    # The members differ only in their starting rate: copies of one state (cheaper than building each
    # under vmap, which compiles), with the starts put in.
    members = jax.tree.map(lambda x: jnp.stack([x] * len(config.start_lrs)), one)
    return eqx.tree_at(lambda s: s.model.lr, members, jnp.asarray(config.start_lrs, jnp.float32))


def check_devices(config: "Config") -> None:
    """Refuse device options this run cannot honour: its members (the --start-lrs) spread over the devices
    of a mesh, each member's step being one unrolled run, with no rows to split or reduce."""
    devices, members = config.devices, len(config.start_lrs)
    if devices.num_processes not in (None, 1):
        raise ConfigError(f"--num-processes {devices.num_processes}: metalearn_lr runs in one process")
    if devices.deterministic_reduction:
        raise ConfigError(
            "--deterministic-reduction: metalearn_lr has no batch to split into micro-batches (a member's step is "
            "one unrolled run); on several devices it matches one device to float rounding"
        )
    if devices.devices > 1 and devices.parallel not in ("auto", "sharded"):
        raise ConfigError(
            f"--parallel {devices.parallel}: metalearn_lr spreads its members over the devices of a mesh; "
            "pass --parallel sharded (or auto)"
        )
    if members % devices.devices:
        raise ConfigError(
            f"--devices {devices.devices}: metalearn_lr puts its {members} --start-lrs members on the devices, "
            f"one unrolled run each; pick a device count that divides {members}"
        )


def setup(config: Config) -> Setup:
    """The population and the data of a run: one outer "example", the inner run's batches."""
    if config.training.grad_accum > 1:
        raise ConfigError(
            f"--grad-accum {config.training.grad_accum}: metalearn_lr's step is one unrolled inner run, "
            "which has no rows to take in parts"
        )
    if config.training.precision != "float32":
        raise ConfigError(
            f"--precision {config.training.precision}: metalearn_lr differentiates through its inner SGD run, "
            "which it does not compute in bf16; train it in float32"
        )
    train, test = load_mnist1d(config.data_dir, num_samples=config.num_samples)
    runs = inner_batches(train, config.inner_steps, config.training.batch_size)
    train_data = DeviceLoader(runs.inputs, runs.labels, 1, shuffle=False)
    return Setup(
        build_state=lambda: build_state(config),
        train_data=train_data,
        eval_data=DeviceLoader(test.inputs, test.labels, len(test.labels), shuffle=False),
        num_steps=config.steps,
        step=SupervisedStep(meta_objective),
        population=True,
        evaluator=InnerRunEvaluator(train_data.arrays),
        summarize_run=plot_learning_rates,
    )


def plot_learning_rates(run: RunDir, summary: dict) -> None:
    """`learned_lr.png`: each member's learning rate and outer objective against the outer step."""
    from matplotlib.figure import Figure  # imported here: only needed at the end of a run

    records = [r for r in run.read_metrics() if "train/member_learned_lr" in r]
    steps = [r["step"] for r in records]
    figure = Figure(figsize=(10, 4), layout="constrained", dpi=110)
    lr_axes, loss_axes = figure.subplots(1, 2)
    for k, start in enumerate(summary["start_lr"]):
        # a record holds the rate each step used (before its update); the last point is the learned one
        lrs = [r["train/member_learned_lr"][k] for r in records] + [summary["learned_lr"][k]]
        lr_axes.plot([s - 1 for s in steps] + [summary["step"]], lrs, color=f"C{k}", label=f"from {start:g}")
        loss_axes.plot(steps, [r["train/member_loss"][k] for r in records], color=f"C{k}", label=f"from {start:g}")
    lr_axes.axhline(PUBLISHED_LR, color="k", linestyle="--", linewidth=1, label=f"published ~{PUBLISHED_LR}")
    lr_axes.set(xlabel="outer step", ylabel="inner learning rate", title="learned learning rate")
    loss_axes.set(xlabel="outer step", ylabel="mean inner training loss", title="outer objective")
    for axes in (lr_axes, loss_axes):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=9)
    figure.savefig(run.path / "learned_lr.png")


def main(config: Config) -> dict:
    def learned(result: FitResult) -> dict:
        return {"start_lr": list(config.start_lrs), "learned_lr": [float(x) for x in result.state.model.lr]}

    summary = run_experiment("metalearn_lr", config, setup(config), summary_extra=learned)
    rates = ", ".join(
        f"{lr:.4f} (from {start:g})" for start, lr in zip(summary["start_lr"], summary["learned_lr"], strict=True)
    )
    print(
        f"metalearn_lr: learned learning rate {rates} after {summary['step']} outer steps; published: about "
        f"{PUBLISHED_LR} from both 1.5 and 0.15 (Greydanus 2020, 8,000 training examples; here "
        f"{int(config.num_samples * MNIST1D_TRAIN_SPLIT):,})"
    )
    return summary


if __name__ == "__main__":
    main_entry(main, Config)
