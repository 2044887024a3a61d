"""Case (e): DP-SGD at the cost of ordinary training (issue 18). One train step (the engine's
`CompiledTrainer.step`, Adam, batch 256) with `DPSGDLoss` clipping by ghost norms and by
vmap(grad), against the ordinary step and against Opacus' ghost clipping (DP-Adam in PyTorch, when
Opacus is installed), on the MNIST-1D CNN and the 784-1024-1024-10 MLP; and the temporary memory
XLA plans for each step's gradient computation (`memory_analysis()` of the compiled function:
deterministic, nothing is run)."""

import functools
import warnings

import equinox as eqx
import jax
import numpy as np
import optax

from research.data import Batch
from research.nn import MLP, CNN1d
from research.per_example import DPSGDLoss, clipped_gradient_sum
from research.train import SupervisedStep, TrainState, classification_loss, compiled_trainer

from ._frameworks import OPACUS_MISSING, at_best_thread_count, have_opacus
from ._timing import interleave, timed

BATCH, LR, CLIP, SIGMA = 256, 1e-3, 1.0, 1.0
MODELS = {
    "MNIST-1D CNN": (lambda key: CNN1d(key=key), 40),
    "MLP 784-1024-1024-10": (lambda key: MLP(784, 10, hidden=(1024, 1024), activation="relu", key=key), 784),
}
ORDINARY, VMAP, OPACUS = "ordinary step", "DP-SGD, vmap(grad)", "Opacus ghost clipping (PyTorch eager)"
LOSSES = {
    ORDINARY: classification_loss,
    "DP-SGD, ghost clipping": DPSGDLoss(CLIP, SIGMA, BATCH, method="ghost"),
    "DP-SGD, ghost clipping, no noise (sigma 0)": DPSGDLoss(CLIP, 0.0, BATCH, method="ghost"),
    VMAP: DPSGDLoss(CLIP, SIGMA, BATCH, method="vmap"),
}


def _batch(features: int) -> Batch:
    rng = np.random.default_rng(0)
    return Batch(rng.normal(size=(BATCH, features)).astype(np.float32), rng.integers(0, 10, BATCH).astype(np.int32))


def step_candidate(model_name: str, loss_name: str, steps: int):
    """`steps` engine steps per call, on a device-resident batch."""
    make_model, features = MODELS[model_name]
    state = TrainState.create(make_model(jax.random.key(0)), optax.adam(LR), key=jax.random.key(1))
    trainer = compiled_trainer(SupervisedStep(LOSSES[loss_name]), state)
    batch = jax.device_put(_batch(features))
    leaves = trainer.leaves(state)
    carry = [leaves, trainer.init_stats(leaves, batch)]

    def run():
        leaves, sums = carry
        for _ in range(steps):
            leaves, sums = trainer.step(leaves, sums, batch)
        jax.block_until_ready(leaves)
        carry[:] = leaves, sums

    run()  # compile
    return functools.partial(timed, run, steps)


def opacus_step(model_name: str, steps: int):
    """Opacus' ghost clipping (`grad_sample_mode="ghost"`: per-sample gradient norms from activations and
    output gradients for its Linear layers, per-sample gradients for the others, then a second backward
    pass of the clipped loss) with its DPOptimizer around Adam: DP-Adam on the same batch, the same
    model (the MLP, or MNIST-1D's reference CNN), clip and noise. `steps` steps a call."""
    import opacus
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ._cnn import torch_model as torch_cnn

    # Not a production run (secure_mode off is what makes it fast), and the hooks' notice fires every backward.
    warnings.filterwarnings("ignore", "Secure RNG turned off")
    warnings.filterwarnings("ignore", "Full backward hook is firing")

    _, features = MODELS[model_name]
    batch = _batch(features)
    x, y = torch.from_numpy(batch.inputs), torch.from_numpy(batch.labels).long()
    if "CNN" in model_name:
        module, x = torch_cnn(), x[:, None, :]
    else:
        torch.manual_seed(0)
        nn = torch.nn
        module = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    module, optimizer, criterion, _ = opacus.PrivacyEngine().make_private(
        module=module,
        optimizer=torch.optim.Adam(module.parameters(), lr=LR),
        criterion=torch.nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,
        grad_sample_mode="ghost",
    )

    def run():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            criterion(module(x), y).backward()
            optimizer.step()

    return run


def gradient_memory(model_name: str, loss_name: str) -> dict[str, int]:
    """Bytes XLA plans for the gradient of one step (the loss's `value_and_grad`, or the plain gradient)."""
    make_model, features = MODELS[model_name]
    params, static = eqx.partition(make_model(jax.random.key(0)), eqx.is_inexact_array)
    loss = LOSSES[loss_name]

    def gradient(params, batch, key):
        model = eqx.combine(params, static)
        if hasattr(loss, "value_and_grad"):
            return loss.value_and_grad(model, None, batch, key)[1]
        return eqx.filter_grad(lambda m: loss(m, None, batch, key)[0])(model)

    def clipped_sum(params, batch):  # the DP gradient without its noise (which is parameter-sized)
        return clipped_gradient_sum(eqx.combine(params, static), None, batch, None, clip_norm=CLIP, method=loss.method)[
            0
        ]

    batch = _batch(features)
    analysis = jax.jit(gradient).lower(params, batch, jax.random.key(2)).compile().memory_analysis()
    memory = {
        "temp": int(analysis.temp_size_in_bytes),
        "arguments": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
    }
    if hasattr(loss, "method"):
        memory["clipped_sum_temp"] = int(
            jax.jit(clipped_sum).lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        )
    return memory


def run(quick: bool) -> dict:
    repeats = 2 if quick else 7
    results, notes = {}, {}
    for model_name in list(MODELS)[: 1 if quick else None]:  # quick: the CNN (the MLP's vmap(grad) is 1.8 GiB)
        steps = 1 if quick else 5 if "MLP" in model_name else 10
        candidates = {name: step_candidate(model_name, name, steps) for name in LOSSES if name != VMAP}
        if have_opacus():
            label, opacus_run = at_best_thread_count(OPACUS, opacus_step(model_name, steps))
            candidates[label] = functools.partial(timed, opacus_run, steps)
        else:
            notes[OPACUS] = OPACUS_MISSING
        timings = interleave(candidates, repeats)
        # vmap(grad) allocates and frees its per-example gradients (1.8 GiB on the MLP) every step, which
        # slowed whatever ran next when interleaved (the ordinary MLP step's IQR reached 12-150 ms); it
        # is timed on its own, after the others.
        timings |= interleave({VMAP: step_candidate(model_name, VMAP, 1 if "MLP" in model_name else steps)}, repeats)
        for name, timing in timings.items():
            timing.extra["memory"] = {} if name.startswith(OPACUS) else gradient_memory(model_name, name)
        results[model_name] = list(timings.values())
    return {"models": results, "batch": BATCH, "notes": notes}
