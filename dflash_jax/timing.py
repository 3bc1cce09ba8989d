"""Paired, interleaved timing of named callables: the one timing method of the benchmarks, the serving engine's
round table (`serve.engine.Engine.measure_rounds`) and the adaptive policy's calibration
(`spec.calibrate.calibrate_policy`).

A shared machine's load comes in spells: timing mode A for a while and then mode B lets a spell land on one mode
only. `paired_runs` runs every mode once per repeat, back to back, the order reversed every other repeat, so the
runs a ratio compares were made moments apart. Each run records its wall seconds and this process's CPU seconds
(all threads: the work done, which other jobs' load inflates far less than wall time); the 1-minute load average
is sampled after every repeat. `Timings` reduces them: per mode the min / median / max of either clock, and the
paired ratio to a reference mode (per repeat, then median and range).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping

import numpy as np

CLOCKS = ("wall", "cpu")
STATISTICS = {"min": np.min, "median": np.median, "max": np.max, "mean": np.mean}


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (rounded to 0.01), or None where the platform has none."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (OSError, AttributeError):
        return None


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, wall seconds, process CPU seconds) of one call of `fn`."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def _check(clock: str, statistic: str = "min") -> None:
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {tuple(STATISTICS)}, got {statistic!r}")


@dataclasses.dataclass
class Timings:
    """Seconds of every run by mode and clock (`wall`, `cpu`: {mode: [seconds per repeat]}) and the load
    averages sampled after each repeat (`loads`, each None where the platform has none)."""

    wall: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    cpu: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    loads: list = dataclasses.field(default_factory=list)

    @property
    def modes(self) -> list[str]:
        return list(self.wall)

    def seconds(self, mode: str, clock: str = "wall") -> np.ndarray:
        _check(clock)
        return np.asarray(getattr(self, clock)[mode], np.float64)

    def stat(self, mode: str, clock: str = "wall", statistic: str = "min") -> float:
        """One statistic (min, median, max, mean) of a mode's runs."""
        _check(clock, statistic)
        return float(STATISTICS[statistic](self.seconds(mode, clock)))

    def spread(self, mode: str, clock: str = "wall") -> dict[str, float]:
        """{min, median, max} of a mode's runs."""
        return {s: self.stat(mode, clock, s) for s in ("min", "median", "max")}

    def ratios(self, mode: str, base: str, clock: str = "wall") -> np.ndarray:
        """Per repeat: the base mode's seconds over this mode's, both of that repeat (> 1: this mode is faster)."""
        return self.seconds(base, clock) / self.seconds(mode, clock)

    def ratio(self, mode: str, base: str, clock: str = "wall") -> dict[str, float]:
        """{median, min, max} over repeats of the paired ratio `ratios`."""
        r = self.ratios(mode, base, clock)
        return {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}

    def paired_seconds(self, mode: str, base: str, clock: str = "wall") -> float:
        """A mode's seconds from paired runs: the base mode's median times the median over repeats of this mode's
        time over the base's time in the same repeat (a busy spell scales both and cancels out)."""
        return self.stat(base, clock, "median") * float(np.median(1.0 / self.ratios(mode, base, clock)))

    def load_summary(self) -> dict[str, float] | None:
        """{min, median, max} of the 1-minute load averages sampled, or None when none was."""
        ones = [x[0] for x in self.loads if x]
        if not ones:
            return None
        return {"min": min(ones), "median": round(float(np.median(ones)), 2), "max": max(ones)}

    def extend(self, other: "Timings") -> "Timings":
        """Appends another measurement's runs (the same modes) and loads to this one; returns self."""
        for clock in CLOCKS:
            for mode, secs in getattr(other, clock).items():
                getattr(self, clock).setdefault(mode, []).extend(secs)
        self.loads.extend(other.loads)
        return self


def paired_runs(modes: Mapping[str, Callable[[], Any]], repeats: int, *, alternate: bool = True,
                on_run: Callable[[str, int, Any], None] | None = None,
                on_repeat: Callable[[int, "Timings"], None] | None = None,
                seconds_of: Callable[[Any], float] | None = None) -> Timings:
    """Runs every mode (name -> a callable of no arguments, compiled or warmed up beforehand) `repeats` times,
    interleaved: each repeat runs every mode back to back, in reverse order every other repeat when `alternate`.
    on_run(mode, repeat, result) sees each run's result (output checks, per-run figures); on_repeat(repeat,
    timings) the figures so far after each repeat (progress lines). seconds_of(result): the wall seconds a run
    reports itself (its timed part, e.g. a loop's `stats["seconds"]`), or its (wall, CPU) seconds, instead of the
    call's. Returns the `Timings`; the load average is sampled after each repeat."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(modes)
    out = Timings({m: [] for m in names}, {m: [] for m in names}, [])
    for r in range(repeats):
        for mode in (names if not alternate or r % 2 == 0 else names[::-1]):
            result, wall, cpu = timed(modes[mode])
            if seconds_of is not None:
                own = seconds_of(result)
                wall, cpu = (own, cpu) if np.ndim(own) == 0 else own
            out.wall[mode].append(float(wall))
            out.cpu[mode].append(float(cpu))
            if on_run is not None:
                on_run(mode, r, result)
        out.loads.append(load_average())
        if on_repeat is not None:
            on_repeat(r, out)
    return out
