"""A training loop written by hand, without the engine, keeping the codebase's services: the run
directory and its record, checksummed checkpoints of any pytree saved in the background, resume from
the newest valid one, metrics.jsonl, the progress bar, and a stop on SIGTERM that saves first.

    python docs/hand_written_loop.py RUN_DIR [STEPS]    # run it again after a stop: it resumes
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from research.data import DeviceLoader, XORDataset
from research.nn import MLP
from research.progress import Progress
from research.provenance import git_state, machine, versions
from research.services import CheckpointWriter, JsonlTracker, RunDir, StopSignals, load_checkpoint

run, num_steps = RunDir(sys.argv[1]).create(), int(sys.argv[2]) if len(sys.argv) > 2 else 5000
data = XORDataset(1024, seed=0)
loader = DeviceLoader(data.inputs, data.labels, 32, seed=0)  # a step's batch is a function of the step
optimizer = optax.adam(1e-2)
model = MLP(2, 1, hidden=(16,), key=jax.random.key(0))
state = {"step": jnp.array(0), "model": model, "opt": optimizer.init(eqx.filter(model, eqx.is_array))}

checkpoint, damaged = run.latest_valid_checkpoint()  # `damaged`: the newer ones that failed their checksum
if checkpoint is None:
    run.write_config(
        {"config": {"steps": num_steps}, "versions": versions(), "git": git_state(), "machine": machine(1)}
    )
else:
    state, header = load_checkpoint(checkpoint, state)
    run.truncate_metrics(after_step=header["step"])


@eqx.filter_jit
def train_step(state, batch):
    def loss_fn(model):
        logits = jax.vmap(model)(batch.inputs)[:, 0]
        return optax.sigmoid_binary_cross_entropy(logits, batch.labels.astype(logits.dtype)).mean()

    loss, grads = eqx.filter_value_and_grad(loss_fn)(state["model"])
    updates, opt = optimizer.update(grads, state["opt"], eqx.filter(state["model"], eqx.is_array))
    return {"step": state["step"] + 1, "model": eqx.apply_updates(state["model"], updates), "opt": opt}, loss


step = saved = int(state["step"])
saver, tracker, bar = (
    CheckpointWriter(lambda _: run.prune_checkpoints(keep=2)),
    JsonlTracker(run),
    Progress(num_steps, step),
)
with StopSignals() as signals:
    while step < num_steps and not signals.received:
        state, loss = train_step(state, loader.step_batch(step))
        step += 1
        bar.update(1)
        if step % 500 == 0 or step == num_steps:
            tracker.log(step, {"train/loss": float(loss)})
            bar.report(step, {"train/loss": float(loss)})
        if step % 1000 == 0 or step == num_steps or (signals.received and step != saved):
            saver.save(run.checkpoint_path(step), state, {"step": step})  # returns once copied off the device
            saved = step
saver.close()  # waits for the last commit
bar.close()
sys.exit(128 + signals.received if signals.received else 0)  # 143 after SIGTERM: a scheduler requeues it
