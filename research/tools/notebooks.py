"""Notebooks kept as Jupytext Markdown (`docs/first_hour.md`: readable, diffable, the source in git) written as
the `.ipynb` Jupyter opens, and run top to bottom on an IPython kernel (nbclient), as `scripts/notebooks` does.

    python -m research.tools.notebooks docs/first_hour.md             # docs/first_hour.ipynb beside it
    python -m research.tools.notebooks --execute docs/first_hour.md   # run it first, its outputs kept

Needs the `notebook` extra (`pip install 'research[notebook]'`).
"""

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import MissingExtra
from ..install import require_extra
from ._runs import Parser, UsageError, fail

NEEDS = ("jupytext", "nbclient", "ipykernel")
CELL_SECONDS = 600  # a cell that runs longer is stopped: a hung kernel fails the run instead of waiting forever


def _check_installed() -> None:
    require_extra("a Jupytext notebook", *NEEDS)


def read_notebook(path: str | Path) -> Any:
    """The notebook of a Jupytext file (`.md` with a `jupyter:` header, or percent `.py`) as nbformat's node."""
    _check_installed()
    import jupytext

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such notebook")
    notebook = jupytext.read(path)
    if not any(cell.cell_type == "code" for cell in notebook.cells):
        raise UsageError(f"{path} has no code cell: is it a Jupytext notebook (a `jupyter:` header)?")
    return notebook


def execute_notebook(notebook: Any, cwd: str | Path, env: Mapping[str, str] | None = None) -> Any:
    """Run every cell of `notebook` in order on a fresh IPython kernel started in `cwd` (with `env`, else this
    process's environment); the notebook with its outputs. nbclient's `CellExecutionError` names the first
    cell that raised, with its traceback."""
    _check_installed()
    from nbclient import NotebookClient

    client = NotebookClient(
        notebook,
        timeout=CELL_SECONDS,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        # the kernel's own log (a warning that a local kernel talks over TCP) is no output of the notebook
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    return client.execute(**({"env": dict(env)} if env is not None else {}))


def write_ipynb(notebook: Any, path: Path) -> Path:
    import nbformat

    target = path.with_suffix(".ipynb")
    nbformat.write(notebook, str(target))
    return target


def _executed(notebook: Any, path: Path) -> Any:
    from nbclient.exceptions import CellExecutionError

    try:
        return execute_notebook(notebook, Path.cwd())
    except CellExecutionError as e:
        print(f"notebooks: {path}: a cell failed; nothing written\n{e}", file=sys.stderr)
        raise SystemExit(1) from None


def _parser() -> Parser:
    parser = Parser(
        prog="notebooks",
        description="Write Jupytext notebooks (.md with a `jupyter:` header) as .ipynb files beside them.",
    )
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help="a Jupytext .md (or percent .py) file")
    parser.add_argument(
        "--execute",
        action="store_true",
        help="run each notebook top to bottom first (from the current directory) and keep its outputs",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        for path in map(Path, args.notebooks):
            notebook = read_notebook(path)
            if args.execute:
                cells = sum(cell.cell_type == "code" for cell in notebook.cells)
                print(f"notebooks: running {path} ({cells} code cells)", file=sys.stderr, flush=True)
                notebook = _executed(notebook, path)
            print(f"notebooks: wrote {write_ipynb(notebook, path)}", file=sys.stderr)
    except (UsageError, MissingExtra) as e:
        fail("notebooks", e)


if __name__ == "__main__":
    main()
