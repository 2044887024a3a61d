"""The command-line tools behind the `research` command's subcommands (`research plot`, `compare`, `show-jaxpr`,
`sweep`, `launch`, `export`, `sample`, `rollout`; `research/command.py`) and, in a checkout, behind the
scripts of the same names (`scripts/plot_runs`, ...).

Each module has a `main(argv)` (run it as `python -m research.tools.NAME`) and a function that does
the work from Python: `plot_runs`, `compare_runs`, `show_jaxpr`, `sweep`, `export_weights`, `sample_bytes`.
"""
