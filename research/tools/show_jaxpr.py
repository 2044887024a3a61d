"""Print the jaxpr of one compiled train step of an experiment, as `fit` would run it.

    scripts/show_jaxpr EXPERIMENT [the experiment's flags]

The experiment's `setup(config)` builds the state and the data (nothing is trained, no run directory
is made); the step traced is `CompiledTrainer.step` on the first training batch. The jaxpr's inputs
are listed first by name (TrainState leaves, then the step statistics, then the batch), since
the jaxpr itself calls them `a`, `b`, ...
"""

import sys
from collections.abc import Sequence

from .. import install
from ..cli import ConfigError, ema_of, parse_config
from ..debug import signature
from ..experiment import first_batch, initial_state, load_experiment
from ..messages import messages_to_stderr
from ..train import compiled_trainer
from ._runs import fail


def show_jaxpr(experiment: str, argv: Sequence[str] = ()) -> str:
    """The named inputs and the jaxpr of one train step of `experiment` configured by `argv`."""
    module = load_experiment(experiment)
    if not hasattr(module, "setup") or not hasattr(module, "Config"):
        raise ConfigError(
            f"experiment {experiment!r} defines no `Config` and `setup(config) -> Setup`; "
            "see docs/adding_an_experiment.md"
        )
    config = parse_config(module.Config, list(argv), prog=f"{install.command('show-jaxpr')} {experiment}")
    setup = module.setup(config)
    state = initial_state(setup, ema_of(config))
    trainer = compiled_trainer(setup.step, state, population=setup.population)
    leaves = trainer.leaves(state)
    batch = first_batch(setup.train_data)
    stats = trainer.init_stats(leaves, batch)
    jaxpr = trainer.step_jaxpr(leaves, stats, batch)
    inputs = signature(
        {**dict(zip(trainer.leaf_names(), trainer.unpack(leaves), strict=True)), "stats": stats, "batch": batch}
    )
    lines = [f"# one train step of {experiment}: {len(jaxpr.jaxpr.eqns)} equations; inputs in order:"]
    lines += [f"#   {i}: {name} {kind}" for i, (name, kind) in enumerate(inputs.items())]
    return "\n".join(lines) + "\n" + str(jaxpr)


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {install.command('show-jaxpr')} EXPERIMENT [the experiment's flags]", file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    try:
        print(show_jaxpr(argv[0], argv[1:]))
    except ConfigError as e:
        fail("show_jaxpr", e)


if __name__ == "__main__":
    main()
