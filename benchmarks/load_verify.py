"""Benchmark: what checksums cost - hashing at conversion and verifying at `dflash_jax.load`.

  python benchmarks/load_verify.py [--gb 1] [--workdir DIR] [--keep] [--quick] [--out DIR]

Writes a synthetic bf16 Qwen3-MoE checkpoint of about GB GiB (benchmarks/convert_weights.py's writer),
converts it with `--expert-format bf16` (so the output is about as large as the source), then times
`dflash_jax.load` with and without `verify` (interleaved, the faster of two each), and sha256 over the output
files alone. Prints one JSON object and writes it as load_verify.json to --out (default bench_out/);
docs/reliability.md quotes the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import harness as h
from convert_weights import convert, synthetic_pair


def timed_load(out: str, verify: bool) -> float:
    """Seconds of `dflash_jax.load` alone, in a fresh process (the page cache warm)."""
    code = (f"import time, dflash_jax; t = time.perf_counter(); dflash_jax.load({out!r}, verify={verify}); "
            "print(time.perf_counter() - t)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--gb": 1.0, "--workdir": None, "--keep": False})
    args = h.parse(p, argv, quick=dict(gb=0.05))
    with h.workdir(args, "load_verify_") as work:
        synthetic_pair(work, args.gb)
        convert_s = convert(work, "--expert-format", "bf16", "--quiet")
        from dflash_jax.checkpoint import read_manifest, verify_files

        out = os.path.join(work, "out")
        manifest = read_manifest(out)
        size = sum(e["bytes"] for e in manifest["checksums"]["files"].values())
        t0 = time.perf_counter()
        verify_files(out, manifest, checksums=True)
        hash_s = time.perf_counter() - t0
        loads = h.paired_runs({v: (lambda v=v: timed_load(out, v)) for v in (False, True)}, 2, seconds_of=float)
        load_plain, load_verified = loads.stat(False), loads.stat(True)
    row = {
        "checkpoint_bytes": size, "convert_s": round(convert_s, 2), "sha256_s": round(hash_s, 2),
        "sha256_s_per_gib": round(hash_s / (size / 2**30), 2),
        "load_verify_false_s": round(load_plain, 2), "load_verify_true_s": round(load_verified, 2),
        "verify_cost_s_per_gib": round((load_verified - load_plain) / (size / 2**30), 2),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (page cache warm)",
    }
    print(json.dumps(row, indent=1))
    h.Report(args, "load_verify").json(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
