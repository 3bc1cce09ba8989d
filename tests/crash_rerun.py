"""pytest-xdist: a test whose worker process died under it runs once more, on a fresh worker.

XLA:CPU's compiler has crashed the process (SIGSEGV inside a compile) on rare runs of tests that pass on
every rerun; xdist then reports the test as failed and the whole run is red. This plugin re-queues a test
whose worker crashed, once: the crash shows in the summary as a rerun ("R"), and a second crash of the
same test fails it as xdist would. Failures that do not kill the worker (assertions, exceptions) are never
rerun. A test that hangs past pytest-timeout's limit (pyproject.toml: the `thread` method dumps every thread's
stack and ends the worker) is such a crash too: a native deadlock reruns once, a real hang fails in bounded time
instead of holding the run until CI's limit. Loaded from conftest.py; without `-n` it does nothing.
"""

from __future__ import annotations

import pytest

_crashed: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    if crashitem in _crashed:
        return  # the second crash: xdist's own failure report stands
    _crashed.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"  # type: ignore[assignment]
    report.longrepr = f"{report.longrepr}\n(the worker died; the test runs once more on a fresh worker)"


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN (worker crashed)", {"yellow": True})
    return None
