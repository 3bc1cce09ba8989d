"""`convert-weights`: a HuggingFace z-lab draft + its target -> one dflash_jax checkpoint.

  convert-weights --target HF_DIR --draft HF_DIR --out DIR [--expert-format mxfp4|nvfp4|bf16|fp32|keep]
                  [--dtype auto|bf16|fp32] [--overwrite]

The output is built in a fresh temporary directory beside DIR and renamed into place at the end: an
interrupted or failed run leaves DIR as it was. `--overwrite` replaces only a previous convert-weights
output. Errors are one line (exit 2; OS errors exit 1; Ctrl-C 130, SIGTERM 143); see docs/reliability.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dflash_jax.cli.errors import run_cli

EXPERT_FORMATS = ("mxfp4", "nvfp4", "bf16", "fp32", "keep")
DTYPES = ("auto", "bf16", "fp32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert-weights", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    required = dict(required=True, default=argparse.SUPPRESS)  # no "(default: None)" in --help
    p.add_argument("--target", **required, help="HF directory of the target model")
    p.add_argument("--draft", **required, help="HF directory of the z-lab DFlash draft")
    p.add_argument("--out", **required, help="output checkpoint directory (must not exist, see --overwrite)")
    p.add_argument("--expert-format", default="mxfp4", choices=EXPERT_FORMATS,
                   help="routed expert tables: mxfp4 / nvfp4 quantize (lossy unless the source is MXFP4 already); "
                        "bf16 / fp32 store them dense; keep = as in the source (lossless)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="non-expert weights: auto keeps each tensor's source precision (bf16 stays bf16, fp16 / "
                        "fp32 become fp32); bf16 / fp32 force one dtype")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a previous convert-weights output (nothing else is ever replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from convert.pipeline import convert, summary_line  # inside the handler: a Ctrl-C while jax loads is clean

        manifest = convert(args.target, args.draft, args.out, expert_format=args.expert_format, dtype=args.dtype,
                           overwrite=args.overwrite, progress=not args.quiet)
        print(summary_line(args.out, manifest))
        return 0

    return run_cli("convert-weights", body)


def __getattr__(name):  # `from convert.cli import convert` (older imports) without loading jax at CLI start
    if name == "convert":
        from convert.pipeline import convert

        return convert
    raise AttributeError(f"module 'convert.cli' has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
