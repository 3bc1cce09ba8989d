"""The crash-rerun plugin, run in a child pytest with two xdist workers: a test that kills its worker once
passes on the rerun; one that kills it every time fails; an ordinary failure is not rerun; a test that hangs past
pytest-timeout's limit (the `thread` method: stacks dumped, the worker ended) is a crash too, and runs once more."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD_TESTS = '''
import os, signal, pathlib, time

def test_crashes_once():
    mark = pathlib.Path(os.environ["CRASH_MARK"])
    if not mark.exists():
        mark.write_text("crashed")
        os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_always():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_fails_plainly():
    assert os.environ.get("CRASH_COUNT_FAILS", "") == "never"

def test_hangs_once():
    mark = pathlib.Path(os.environ["HANG_MARK"])
    if not mark.exists():
        mark.write_text("hung")
        time.sleep(600)

def test_passes():
    assert True
'''


def test_a_crashed_worker_reruns_its_test_once(tmp_path):
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    env = dict(os.environ, CRASH_MARK=str(tmp_path / "mark"), HANG_MARK=str(tmp_path / "hang"), PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.crash_rerun", "-p", "no:cacheprovider",
         "-o", "addopts=", "-o", "timeout=8", "-o", "timeout_method=thread", "--rootdir", str(tmp_path),
         str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert (tmp_path / "mark").exists()  # the first run of test_crashes_once did crash its worker
    tail = proc.stdout.strip().splitlines()[-1]  # (the crashed workers' stacks go to stderr)
    assert (tmp_path / "hang").exists()  # the first run of test_hangs_once did hang (and was ended)
    # crashes_once and hangs_once: rerun then passed; crashes_always: rerun then failed; fails_plainly: failed, not
    # rerun
    assert "2 failed" in tail and "3 passed" in tail and "3 rerun" in tail, out
    assert "FAILED test_child.py::test_fails_plainly" in out and "test_crashes_always" in out, out
