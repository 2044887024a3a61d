"""Play a trained reinforcement-learning run's policy (`./scripts/run ppo`) and print its returns.

    scripts/rollout RUN_DIR [--episodes N] [--seed S] [--sample] [--ema]

Restores the run's newest checkpoint (`research.load_run`) and plays `--episodes` episodes of its
environment with the policy acting greedily (the most probable action, a Gaussian's mean), or sampling its
actions with `--sample`; prints one line a policy (each member of a population) with the mean return, its
standard deviation, the lowest and highest, and the mean episode length. The episodes are those of
`--seed` (the same seed, the same episodes, whichever run plays them).
"""

from collections.abc import Sequence

import numpy as np

from .. import install
from ..cli import use_compilation_cache
from ..experiment import load_experiment, load_run
from ..messages import messages_to_stderr
from ..population import member, num_members
from ._runs import Parser, UsageError, fail, within


def _parser() -> Parser:
    parser = Parser(
        prog="rollout",
        usage=f"{install.command('rollout')} RUN_DIR [--episodes N] [--seed S] [--sample] [--ema]",
        description="Play a trained run's policy and print its returns.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a ppo run directory (with config.json and a checkpoint)")
    parser.add_argument("--episodes", type=within(1, 10**6, int), default=100, help="episodes to play (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the episodes (default 0)")
    parser.add_argument("--sample", action="store_true", help="sample the policy's actions instead of the greedy ones")
    parser.add_argument("--ema", action="store_true", help="the EMA policy (a run with --ema-decay)")
    return parser


def returns_line(name: str, returns: np.ndarray, lengths: np.ndarray) -> str:
    return (
        f"{name}: return {returns.mean():.2f} +- {returns.std():.2f} (min {returns.min():.1f}, max {returns.max():.1f})"
        f" over {len(returns)} episodes, mean length {lengths.mean():.1f}"
    )


@messages_to_stderr()
def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    use_compilation_cache()  # the episodes' program, compiled by an earlier rollout or the run
    try:
        run = load_run(args.run_dir)
        if run.experiment != "ppo":
            raise UsageError(f"{args.run_dir} is a run of {run.experiment}, not of an agent (ppo)")
        if args.ema and run.state.ema is None:
            raise UsageError(f"--ema: {args.run_dir} kept no EMA (it was trained without --ema-decay)")
        experiment = load_experiment(run.experiment)
        members = num_members(run.state)
        states = [member(run.state, k) for k in range(members)] if members else [run.state]
        env = run.config.to_dict()["env"]
        for k, state in enumerate(states):
            policy = state.ema.average[0] if args.ema and state.ema is not None else state.model
            returns, lengths = experiment.play_episodes(
                policy, env, args.episodes, seed=args.seed, greedy=not args.sample
            )
            name = f"{env}, member {k}" if members else env
            print(returns_line(name, returns, lengths))
    except ValueError as e:  # UsageError, ResearchInputError (a run that is missing or cannot load)
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
