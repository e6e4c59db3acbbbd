"""omniload's benchmarks and long checks, a package run from the repository root:
`python -m scripts.bench_throughput --help`. What they share is in `scripts.harness`; their
results go to JSON (`--json`) and `python -m scripts.render_results` writes them into
docs/benchmarks.md's summary table."""
