#!/usr/bin/env bash
# The GPU checks in one command, for the first machine with an NVIDIA GPU (installs nothing):
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR]          # default OUT_DIR: bench_out/gpu_suite-<UTC time>
#   SUITE_BUDGET=540 bash benchmarks/gpu_suite.sh   # the whole suite within 540 s (a lent GPU's call limit)
#   SUITE_STEPS=fp4_grouped_matmul,tiny_pair_qwen3_5 bash benchmarks/gpu_suite.sh   # only these steps
#
# Runs, each step timed, bounded by `timeout` ($STEP_SCALE scales every limit) and allowed to fail without
# stopping the rest, in this order (what the open goals need first, then the checks that passed on the last GPU):
#   1. fp4_grouped_matmul: the kernel benchmark at real shapes, each width checked against XLA's path
#      (benchmarks/fp4_grouped_matmul.py: the kernel's floor per call) -> fp4_grouped_matmul.{json,md}
#   2. tiny_pair_qwen3_5: the hybrid Qwen3.5-MoE pair, plain and block 8 (benchmarks/tiny_pair.py --pair
#      tiny_pair_qwen3_5: the goal of DFlash at block 8 >= 1.5x plain greedy with `dflash-generate`'s GPU defaults,
#      FP4 experts through the kernel, outputs checked equal) -> tiny_pair_qwen3_5.{json,md}
#   3. greedy_program: the greedy rows' program against the general one on the hybrid pair
#      (benchmarks/greedy_program.py: what the two conditionals a round cost where the host runs them)
#      -> greedy_program.{json,md}
#   4. kernel_tests: the kernel test suite on the GPU (tests/kernels: the compiled Triton kernel against XLA and the
#      reference, the non-finite / scale-edge / per-row-scale cases, the expert policy) -> kernel_tests.xml
#   5. tiny_pair: the shipped Qwen3-MoE pair, DFlash against plain greedy, blocks 1 / 4 / 8 / 16 -> tiny_pair.*
#   6. parity_tests: the fast parity tests of the decode loops and two model families -> parity_tests.xml
#   7. offload_overlap: expert copies against verify compute (benchmarks/offload.py --overlap) -> offload.*
# and writes suite.json: per step the command, exit code and seconds (or why it was skipped), the GPU's name
# (nvidia-smi) and the budget, and packs the folder into OUT_DIR.tar.gz (one file to carry back).
# SUITE_BUDGET (seconds, default none): every step's limit is cut to what is left of it after a reserve for the
# summary, and a step that cannot get 30 s is skipped ("budget"), so the run ends inside the budget with every
# finished step's files written. SUITE_STEPS: a comma-separated subset of the names above (an unknown name stops
# the suite before anything runs, naming the known ones).
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
BUDGET="${SUITE_BUDGET:-}"
RESERVE=20  # seconds kept for the summary and the archive
ALL_STEPS="fp4_grouped_matmul tiny_pair_qwen3_5 greedy_program kernel_tests tiny_pair parity_tests offload_overlap"
WANTED="${SUITE_STEPS:-${ALL_STEPS// /,}}"
for w in ${WANTED//,/ }; do
  case " $ALL_STEPS " in
    *" $w "*) ;;
    *) echo "gpu_suite: unknown step '$w' in SUITE_STEPS; the steps are: ${ALL_STEPS// /, }" >&2; exit 2 ;;
  esac
done
if [ -n "$BUDGET" ] && ! [[ "$BUDGET" =~ ^[0-9]+$ && "$BUDGET" -gt "$RESERVE" ]]; then
  echo "gpu_suite: SUITE_BUDGET must be a whole number of seconds above $RESERVE, got '$BUDGET'" >&2; exit 2
fi
T_START=$(date +%s%N)
STEPS="$OUT/.steps.tsv"
: > "$STEPS"

skip() {  # skip NAME WHY: record a step that did not run
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$STEPS"
  echo "== $1 skipped: $2"
}

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to OUT/NAME.log, record exit code and seconds
  local name="$1" limit="$2"; shift 2
  case ",$WANTED," in *",$name,"*) ;; *) return 0 ;; esac
  limit=$(awk "BEGIN { print int($limit * $SCALE) }")
  if [ -n "$BUDGET" ]; then
    local left
    left=$(awk "BEGIN { print int($BUDGET - $RESERVE - ($(date +%s%N) - $T_START) / 1e9) }")
    if [ "$left" -lt 30 ]; then skip "$name" "budget (${left} s left of SUITE_BUDGET=$BUDGET)"; return 0; fi
    if [ "$left" -lt "$limit" ]; then limit="$left"; fi
  fi
  echo "== $name (limit ${limit} s): $*"
  local t0 t1 rc
  t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN { print ($t1 - $t0) / 1e9 }")" "$*" >> "$STEPS"
  echo "   exit $rc (log: $OUT/$name.log)"
}

timeout -k 5 60 "$PY" -c "import jax; b = jax.default_backend(); print('jax', jax.__version__, 'backend', b, \
jax.devices()); raise SystemExit(0 if b == 'gpu' else 3)" > "$OUT/backend.log" 2>&1 \
  || echo "warning: jax's default backend is not the GPU (see $OUT/backend.log); the steps below run anyway"

step fp4_grouped_matmul 120 "$PY" benchmarks/fp4_grouped_matmul.py --formats mxfp4,nvfp4 --widths 1,8,32 --out "$OUT"
step tiny_pair_qwen3_5 150 "$PY" benchmarks/tiny_pair.py --pair tiny_pair_qwen3_5 --prompts 6 --max-new 128 \
  --repeats 2 --blocks 1,8 --out "$OUT"
step greedy_program 90 "$PY" benchmarks/greedy_program.py --pair tiny_pair_qwen3_5 --blocks 1,8 --prompts 4 \
  --repeats 2 --out "$OUT"
step kernel_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --junitxml="$OUT/kernel_tests.xml"
step tiny_pair 150 "$PY" benchmarks/tiny_pair.py --prompts 6 --max-new 128 --repeats 2 --blocks 1,4,8,16 --out "$OUT"
step parity_tests 90 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_decode.py \
  tests/models/test_qwen3_parity.py tests/models/test_draft_parity.py --junitxml="$OUT/parity_tests.xml"
case ",$WANTED," in
  *",offload_overlap,"*)
    if "$PY" benchmarks/offload.py --help 2>/dev/null | grep -q -- "--overlap"; then
      step offload_overlap 60 "$PY" benchmarks/offload.py --overlap --out "$OUT"
    else
      skip offload_overlap "benchmarks/offload.py has no --overlap"
    fi ;;
esac

"$PY" - "$OUT" "$BUDGET" "$WANTED" <<'EOF'
import json, subprocess, sys
out, budget, wanted = sys.argv[1], sys.argv[2], sys.argv[3]
steps = []
for line in open(f"{out}/.steps.tsv"):
    name, rc, seconds, cmd = line.rstrip("\n").split("\t", 3)
    skipped = rc == "skipped"
    steps.append({"step": name, "exit_code": None if skipped else int(rc), "skipped": skipped,
                  "seconds": float(seconds), "command": None if skipped else cmd,
                  "skip_reason": cmd if skipped else None})
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.SubprocessError):
    gpu = None
json.dump({"gpu": gpu, "budget_s": int(budget) if budget else None, "steps_requested": wanted.split(","),
           "steps": steps, "ok": all(s["skipped"] or s["exit_code"] == 0 for s in steps),
           "complete": not any(s["skipped"] and s["skip_reason"].startswith("budget") for s in steps)},
          open(f"{out}/suite.json", "w"), indent=1)
print(f"wrote {out}/suite.json")
EOF
tar czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "packed $OUT.tar.gz"
