"""Benchmark: what checksums cost - hashing at conversion and verifying at `dflash_jax.load`.

  python benchmarks/load_verify.py [--gb 1] [--workdir DIR] [--keep]

Writes a synthetic bf16 Qwen3-MoE checkpoint of about GB GiB (benchmarks/convert_weights.py's writer),
converts it with `--expert-format bf16` (so the output is about as large as the source), then times
`dflash_jax.load` with and without `verify`, and sha256 over the output files alone. Prints one JSON object;
docs/reliability.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _timed_load(out: str, verify: bool) -> float:
    code = (f"import time, dflash_jax; t = time.perf_counter(); dflash_jax.load({out!r}, verify={verify}); "
            "print(time.perf_counter() - t)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from convert_weights import synthetic_config, write_checkpoint, write_draft

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="load_verify_")
    try:
        cfg = synthetic_config(args.gb)
        write_checkpoint(os.path.join(work, "target"), cfg)
        write_draft(os.path.join(work, "draft"), cfg)
        out = os.path.join(work, "out")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "convert", "--target", os.path.join(work, "target"), "--draft",
                        os.path.join(work, "draft"), "--out", out, "--expert-format", "bf16", "--quiet"], check=True)
        convert_s = time.perf_counter() - t0
        from dflash_jax.checkpoint import read_manifest, verify_files

        manifest = read_manifest(out)
        size = sum(e["bytes"] for e in manifest["checksums"]["files"].values())
        t0 = time.perf_counter()
        verify_files(out, manifest, checksums=True)
        hash_s = time.perf_counter() - t0
        load_plain = min(_timed_load(out, False) for _ in range(2))
        load_verified = min(_timed_load(out, True) for _ in range(2))
        row = {
            "checkpoint_bytes": size, "convert_s": round(convert_s, 2), "sha256_s": round(hash_s, 2),
            "sha256_s_per_gib": round(hash_s / (size / 2**30), 2),
            "load_verify_false_s": round(load_plain, 2), "load_verify_true_s": round(load_verified, 2),
            "verify_cost_s_per_gib": round((load_verified - load_plain) / (size / 2**30), 2),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (page cache warm)",
        }
        print(json.dumps(row, indent=1))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
