"""Where a benchmark writes its results.

Convention: a benchmark never overwrites the tracked reports in docs/benchmarks/ unless it is given
`--write-docs`; by default it writes to `--out` (default `bench_out/` at the repository root, which git
ignores), so a trial run leaves the working tree clean.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the research package `study` is run from the checkout, not installed
    sys.path.append(ROOT)
DOCS = os.path.join(ROOT, "docs", "benchmarks")
DEFAULT_OUT = os.path.join(ROOT, "bench_out")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help=f"directory for the results (default: {os.path.relpath(DEFAULT_OUT, ROOT)}/, ignored by git)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the tracked report in docs/benchmarks/ instead (the published numbers)")


def output_dir(args: argparse.Namespace) -> str:
    if args.write_docs and args.out is not None:
        raise SystemExit("--out and --write-docs exclude each other")
    path = DOCS if args.write_docs else (args.out or DEFAULT_OUT)
    os.makedirs(path, exist_ok=True)
    return path


def save_figure(fig, path: str) -> None:
    """Lays the figure out, writes it as a PNG at the reports' resolution and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
