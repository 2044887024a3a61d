"""Learning curves of one or more runs: loss and accuracy against step, one colour per run.

    scripts/plot_runs RUN_DIR... [-o out.png]

Training metrics are solid lines, test metrics dashed with dots (a run evaluated only at the end
has a single test dot). Drawn with matplotlib's Agg canvas: no display needed.
"""

from collections.abc import Sequence
from pathlib import Path

from .. import install
from ..messages import messages_to_stderr
from ..report import plot_curves
from ._runs import Parser, UsageError, fail, open_runs, run_labels


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the learning curves of `run_dirs` into the PNG file `out`; returns its path."""
    runs = open_runs(run_dirs)
    return plot_curves(runs, run_labels(runs), out, title=title)


@messages_to_stderr()  # the library's messages (research.messages) as lines on stderr
def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(
        prog="plot_runs",
        usage=f"{install.command('plot')} RUN_DIR... [-o OUT] [--title TITLE]",
        description="Plot the learning curves of run directories to a PNG.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    parser.add_argument("-o", "--out", default="curves.png", help="the PNG to write")
    parser.add_argument("--title", default=None, help="figure title (default: the experiments' names)")
    args = parser.parse_args(argv)
    try:
        print(plot_runs(args.runs, args.out, title=args.title))
    except UsageError as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
