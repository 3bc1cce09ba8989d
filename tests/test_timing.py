"""The paired, interleaved timing method (`dflash_jax.timing`): run order, statistics and paired ratios, on
callables that report their own seconds (no timed assertion)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.timing import Timings, load_average, paired_runs, timed


def test_modes_alternate_and_each_run_is_seen():
    order, seen = [], []

    def mode(name):
        return lambda: order.append(name) or name

    runs = paired_runs({"a": mode("a"), "b": mode("b"), "c": mode("c")}, 3,
                       on_run=lambda m, r, out: seen.append((m, r, out)))
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert seen[:3] == [("a", 0, "a"), ("b", 0, "b"), ("c", 0, "c")] and seen[3] == ("c", 1, "c")
    assert runs.modes == ["a", "b", "c"] and all(len(runs.wall[m]) == len(runs.cpu[m]) == 3 for m in "abc")
    assert len(runs.loads) == 3
    fixed = paired_runs({"a": mode("a"), "b": mode("b")}, 2, alternate=False)
    assert fixed.modes == ["a", "b"] and order[-4:] == ["a", "b", "a", "b"]


def test_statistics_and_paired_ratios_from_reported_seconds():
    # a busy spell doubles both modes in repeat 1: the paired ratio stays 2, the plain medians move
    seconds = {"base": iter([1.0, 2.0, 1.0]), "fast": iter([0.5, 1.0, 0.5])}
    runs = paired_runs({m: (lambda m=m: next(seconds[m])) for m in seconds}, 3, seconds_of=float)
    assert runs.spread("base") == {"min": 1.0, "median": 1.0, "max": 2.0}
    assert runs.stat("fast", "wall", "mean") == pytest.approx(2.0 / 3)
    np.testing.assert_allclose(runs.ratios("fast", "base"), [2.0, 2.0, 2.0])
    assert runs.ratio("fast", "base") == {"median": 2.0, "min": 2.0, "max": 2.0}
    assert runs.paired_seconds("fast", "base") == pytest.approx(0.5)
    assert runs.paired_seconds("base", "base") == pytest.approx(1.0)
    both = paired_runs({"m": lambda: (3.0, 2.0)}, 2, seconds_of=lambda res: res)  # (wall, CPU) a run reports
    assert both.wall == {"m": [3.0, 3.0]} and both.cpu == {"m": [2.0, 2.0]}
    with pytest.raises(ValueError, match="clock"):
        runs.stat("base", "gpu")
    with pytest.raises(ValueError, match="statistic"):
        runs.stat("base", "wall", "p99")
    with pytest.raises(ValueError, match="repeats"):
        paired_runs({"a": lambda: None}, 0)


def test_extend_and_load_summary():
    a = Timings({"x": [1.0]}, {"x": [0.5]}, [(2.0, 1.0, 1.0)])
    a.extend(Timings({"x": [3.0]}, {"x": [1.5]}, [None, (4.0, 1.0, 1.0)]))
    assert a.wall == {"x": [1.0, 3.0]} and a.cpu == {"x": [0.5, 1.5]}
    assert a.load_summary() == {"min": 2.0, "median": 3.0, "max": 4.0}
    assert Timings().load_summary() is None
    out, wall, cpu = timed(lambda: 7)
    assert out == 7 and wall >= 0 and cpu >= 0
    loads = load_average()
    assert loads is None or len(loads) == 3
