"""The command-line tools behind `scripts/plot_runs`, `scripts/compare_runs`, `scripts/show_jaxpr`,
`scripts/sweep`, `scripts/export` and `scripts/sample`.

Each module has a `main(argv)` (run it as `python -m research.tools.NAME`) and a function that does
the work from Python: `plot_runs`, `compare_runs`, `show_jaxpr`, `sweep`, `export_weights`, `sample_bytes`.
"""
