"""`benchmarks/gpu_suite.sh`, the one command a lent GPU runs: its step selection, time budget and summary.

The suite's Python is a stand-in here (`PYTHON=`): a script that records each step's command, sleeps as told and
exits 0, answers the backend check as a CPU would, and runs the suite's summary with the real interpreter. What is
checked is the suite's own logic, which a GPU session has no minutes to debug: the order, the budget (a run ends
inside it, the steps that cannot get their 30 s recorded as skipped), the limits, `suite.json` and the archive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
ORDER = ["fp4_grouped_matmul", "tiny_pair_qwen3_5", "greedy_program", "kernel_tests", "tiny_pair", "parity_tests",
         "offload_overlap"]


@pytest.fixture
def fake_python(tmp_path):
    script = tmp_path / "fake_python"
    script.write_text(f"""#!/usr/bin/env bash
case "$1" in
  -c) exit 3 ;;
  -) exec {sys.executable} "$@" ;;
esac
if [ "$1" = benchmarks/offload.py ] && [ "$2" = --help ]; then echo "  --overlap"; exit 0; fi
echo "$*" >> "$FAKE_LOG"
sleep "${{FAKE_SLEEP:-0}}"
""")
    script.chmod(0o755)
    return script


def run_suite(tmp_path, fake_python, **env):
    out = tmp_path / "suite"
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.log"
    log.touch()
    full = {k: v for k, v in os.environ.items() if k not in ("SUITE_BUDGET", "SUITE_STEPS", "STEP_SCALE")}
    full.update(PYTHON=str(fake_python), FAKE_LOG=str(log), **env)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SUITE), str(out)], capture_output=True, text=True, env=full, timeout=120)
    return proc, out, log.read_text().splitlines(), time.monotonic() - t0


def summary(out):
    return json.loads((out / "suite.json").read_text())


def test_every_step_runs_in_priority_order_and_the_summary_is_packed(tmp_path, fake_python):
    proc, out, calls, _ = run_suite(tmp_path, fake_python)
    assert proc.returncode == 0, proc.stderr
    assert "not the GPU" in proc.stdout  # the stand-in answers the backend check as a CPU
    s = summary(out)
    assert [st["step"] for st in s["steps"]] == ORDER
    assert s["ok"] and s["complete"] and s["budget_s"] is None
    assert all(st["exit_code"] == 0 and not st["skipped"] for st in s["steps"])
    assert calls[0].startswith("benchmarks/fp4_grouped_matmul.py") and "--pair tiny_pair_qwen3_5" in calls[1]
    assert len(calls) == len(ORDER)
    with tarfile.open(f"{out}.tar.gz") as tar:
        assert "suite/suite.json" in tar.getnames()


def test_selected_steps_only_and_an_unknown_name_stops_before_anything_runs(tmp_path, fake_python):
    proc, out, calls, _ = run_suite(tmp_path, fake_python, SUITE_STEPS="tiny_pair,fp4_grouped_matmul")
    assert proc.returncode == 0, proc.stderr
    assert [st["step"] for st in summary(out)["steps"]] == ["fp4_grouped_matmul", "tiny_pair"]  # the suite's order
    assert len(calls) == 2
    bad, bad_out, bad_calls, _ = run_suite(tmp_path / "x", fake_python, SUITE_STEPS="fp4_grouped_matmul,kernels")
    assert bad.returncode == 2 and "unknown step 'kernels'" in bad.stderr and "kernel_tests" in bad.stderr
    assert bad_calls == [] and not (bad_out / "suite.json").exists()
    for budget in ("10", "soon"):
        bad, *_ = run_suite(tmp_path / f"b{budget}", fake_python, SUITE_BUDGET=budget)
        assert bad.returncode == 2 and "SUITE_BUDGET" in bad.stderr


def test_the_budget_skips_what_cannot_start_and_the_run_ends_inside_it(tmp_path, fake_python):
    # 56 s less the 20 s reserve: the first step gets 36 s, sleeps 8, and leaves under 30 s for the next
    proc, out, calls, wall = run_suite(tmp_path, fake_python, SUITE_BUDGET="56", FAKE_SLEEP="8")
    assert proc.returncode == 0, proc.stderr
    s = summary(out)
    assert [st["step"] for st in s["steps"]] == ORDER
    ran, skipped = s["steps"][0], s["steps"][1:]
    assert ran["exit_code"] == 0 and ran["seconds"] >= 8
    assert all(st["skipped"] and st["skip_reason"].startswith("budget") for st in skipped)
    assert s["ok"] and not s["complete"] and s["budget_s"] == 56
    assert len(calls) == 1 and wall < 56


def test_a_step_over_its_limit_is_stopped_and_recorded(tmp_path, fake_python):
    # STEP_SCALE 0.02: the kernel benchmark's 120 s become 2 s, and the stand-in sleeps 4
    proc, out, _, _ = run_suite(tmp_path, fake_python, SUITE_STEPS="fp4_grouped_matmul", STEP_SCALE="0.02",
                                FAKE_SLEEP="4")
    assert proc.returncode == 0, proc.stderr
    (step,) = summary(out)["steps"]
    assert step["exit_code"] == 124 and step["seconds"] < 4
    assert not summary(out)["ok"]
