#!/usr/bin/env bash
# The GPU checks in one command, for the first machine with an NVIDIA GPU (installs nothing):
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]          # default OUT_DIR: bench_out/gpu_suite-<UTC time>
#
# Runs, each step timed, bounded by `timeout` ($STEP_SCALE scales every limit) and allowed to fail without
# stopping the rest:
#   1. the kernel test suite on the GPU (tests/kernels: the compiled Triton kernel against XLA and the reference,
#      the non-finite / scale-edge / per-row-scale cases, the expert policy) -> kernel_tests.xml
#   2. the kernel benchmark at real shapes (benchmarks/fp4_grouped_matmul.py) -> fp4_grouped_matmul.{json,md}
#   3. the offload overlap measurement (benchmarks/offload.py --overlap), when that flag exists -> offload.*
#   4. the tiny-pair benchmark (benchmarks/tiny_pair.py: DFlash against plain greedy on the GPU, outputs checked
#      equal) -> tiny_pair.{json,md}
#   5. the same on the hybrid Qwen3.5-MoE pair (`--pair tiny_pair_qwen3_5`, plain and block 8: the goal of DFlash at
#      block 8 >= 1.5x plain greedy with `dflash-generate`'s GPU defaults, FP4 experts through the kernel)
#      -> tiny_pair_qwen3_5.{json,md}
#   6. the greedy rows' program against the general one on the hybrid pair (benchmarks/greedy_program.py: what the
#      two conditionals a round cost where the host runs them) -> greedy_program.{json,md}
#   7. the fast parity tests of the decode loops and two model families on the GPU -> parity_tests.xml
# and writes suite.json: per step the command, exit code and seconds, plus the GPU's name (nvidia-smi), and packs
# the folder into OUT_DIR.tar.gz (one file to carry back).
# Python: $PYTHON, else .venv/bin/python, else python3 (an environment with jax's CUDA plugin; the checkout is put
# on PYTHONPATH, so the package need not be installed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench_out/gpu_suite-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PY="$(command -v "$PY")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SCALE="${STEP_SCALE:-1}"
STEPS="$OUT/.steps.tsv"
: > "$STEPS"

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to OUT/NAME.log, record exit code and seconds
  local name="$1" limit="$2"; shift 2
  limit=$(awk "BEGIN { print int($limit * $SCALE) }")
  echo "== $name (limit ${limit} s): $*"
  local t0 t1 rc
  t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN { print ($t1 - $t0) / 1e9 }")" "$*" >> "$STEPS"
  echo "   exit $rc (log: $OUT/$name.log)"
}

"$PY" -c "import jax; b = jax.default_backend(); print('jax', jax.__version__, 'backend', b, jax.devices()); \
raise SystemExit(0 if b == 'gpu' else 3)" > "$OUT/backend.log" 2>&1 \
  || echo "warning: jax's default backend is not the GPU (see $OUT/backend.log); the steps below run anyway"

step kernel_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --junitxml="$OUT/kernel_tests.xml"
step fp4_grouped_matmul 120 "$PY" benchmarks/fp4_grouped_matmul.py --formats mxfp4,nvfp4 --widths 1,8,32 --out "$OUT"
if "$PY" benchmarks/offload.py --help 2>/dev/null | grep -q -- "--overlap"; then
  step offload_overlap 60 "$PY" benchmarks/offload.py --overlap --out "$OUT"
else
  printf 'offload_overlap\tskipped\t0\tbenchmarks/offload.py has no --overlap\n' >> "$STEPS"
fi
step tiny_pair 150 "$PY" benchmarks/tiny_pair.py --prompts 6 --max-new 128 --repeats 2 --blocks 1,4,8,16 --out "$OUT"
step tiny_pair_qwen3_5 150 "$PY" benchmarks/tiny_pair.py --pair tiny_pair_qwen3_5 --prompts 6 --max-new 128 \
  --repeats 2 --blocks 1,8 --out "$OUT"
step greedy_program 90 "$PY" benchmarks/greedy_program.py --pair tiny_pair_qwen3_5 --blocks 1,8 --prompts 4 \
  --repeats 2 --out "$OUT"
step parity_tests 90 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_decode.py \
  tests/models/test_qwen3_parity.py tests/models/test_draft_parity.py --junitxml="$OUT/parity_tests.xml"

"$PY" - "$OUT" <<'EOF'
import json, subprocess, sys
out = sys.argv[1]
steps = []
for line in open(f"{out}/.steps.tsv"):
    name, rc, seconds, cmd = line.rstrip("\n").split("\t", 3)
    steps.append({"step": name, "exit_code": None if rc == "skipped" else int(rc),
                  "skipped": rc == "skipped", "seconds": float(seconds), "command": cmd})
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
except (OSError, subprocess.SubprocessError):
    gpu = None
json.dump({"gpu": gpu, "steps": steps, "ok": all(s["skipped"] or s["exit_code"] == 0 for s in steps)},
          open(f"{out}/suite.json", "w"), indent=1)
print(f"wrote {out}/suite.json")
EOF
tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "packed $OUT.tar.gz"
