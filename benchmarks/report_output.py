"""Where a benchmark writes its results: the output part of `harness` under its earlier name (kept for scripts
not yet moved to the harness; new code imports `harness`)."""

from harness import DEFAULT_OUT, DOCS, ROOT, add_output_args, output_dir, save_figure  # noqa: F401
