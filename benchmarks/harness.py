"""The benchmarks' shared harness: command line, workloads, paired timing, output checks and the report writer.

  command line   `parser(__doc__, **flags)`: the common flags by name (`COMMON`: --checkpoint, --prompts,
                 --prompt-len, --max-new, --repeats, --threads, ...) with this script's defaults, any other flag
                 from a `{"--name": default}` table (type from the default; `(default, help)` or
                 `(default, help, choices)`), and always --out / --write-docs / --quick; `parse(p, argv, quick=)`
                 applies --quick's small settings, checks them, sets XLA's one-thread flags and `args.out_dir`.
  workloads      `load_pair(args)` (--checkpoint / --pair, else the shipped pair), `prompts(pair, n, length)`
                 (token windows of the pair's held-out or training files), `prompt_sets` (named sets
                 "held_out:0,train:1"), `workdir` (--workdir / --keep),
                 `int_list`, `command` (the line that regenerates a report).
  timing         `dflash_jax.timing` (`paired_runs`, `Timings`, `timed`, `load_average`): paired, interleaved runs
                 of named modes, wall and process CPU seconds, load average, medians and ranges; `paired_items`
                 runs them per item (prompt) and checks every mode's output against a reference mode
                 (`Outputs`); `rate` sums per-item statistics into tokens/s.
  output         `Report(args, stem)`: JSON, markdown (a hand-written reading below `READING_MARK` survives a
                 rerun) and a matplotlib figure (skipped with a note when matplotlib is missing) through one
                 writer; `table` formats a markdown table; `machine()` describes the host.

Convention: a benchmark never overwrites the tracked reports in docs/benchmarks/ unless given --write-docs; by
default it writes to --out (default bench_out/, ignored by git), so a trial run leaves the working tree clean.
--quick runs the smallest settings (a smoke run; it refuses --write-docs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the research package `study` is run from the checkout, not installed
    sys.path.append(ROOT)

from dflash_jax.timing import Timings, load_average, paired_runs, timed  # noqa: E402

__all__ = ["DOCS", "DEFAULT_OUT", "ONE_THREAD", "READING_MARK", "ROOT", "Outputs", "Report", "Timings",
           "add_output_args", "batched_workload", "command", "int_list", "load_average", "load_pair", "load_span",
           "logger", "machine", "measure_modes", "output_dir", "paired_items", "paired_runs", "parse", "parser", "prompt_sets", "prompts", "rate",
           "save_figure", "table", "timed", "workdir"]

DOCS = os.path.join(ROOT, "docs", "benchmarks")
DEFAULT_OUT = os.path.join(ROOT, "bench_out")
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
READING_MARK = "<!-- reading: kept across --write-docs reruns -->"

# ---- command line ----------------------------------------------------------------------------------------------
COMMON = {  # name -> (flag, type, help)
    "checkpoint": ("--checkpoint", str, "a converted pair (default: the shipped pair)"),
    "pair": ("--pair", str, "a shipped pair by name (dflash_jax.SHIPPED_PAIRS)"),
    "prompts": ("--prompts", int, "prompts per set"),
    "prompt_len": ("--prompt-len", int, "tokens per prompt"),
    "max_new": ("--max-new", int, "new tokens per prompt"),
    "max_tokens": ("--max-tokens", int, "new tokens per request"),
    "repeats": ("--repeats", int, "timed runs per point and mode (interleaved)"),
    "seed": ("--seed", int, "random seed"),
    "blocks": ("--blocks", str, "block sizes, comma-separated"),
    "threads": ("--threads", str, "one: XLA's CPU runtime on one thread for every mode (process CPU time = the "
                                  "work done); all: XLA's defaults"),
}
POSITIVE = ("prompts", "prompt_len", "max_new", "max_tokens", "repeats")


def parser(doc: str, options: Mapping[str, Any] | None = None, **common) -> argparse.ArgumentParser:
    """An ArgumentParser described by the script's docstring: the `COMMON` flags named in `common` (name=default),
    then `options` ({"--flag": default | (default, help) | (default, help, choices)}: type from the default, a
    False default a switch, None a string), then --out, --write-docs and --quick."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for name, default in common.items():
        flag, kind, text = COMMON[name]
        extra = {"choices": ("one", "all")} if name == "threads" else {}
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})", **extra)
    for flag, spec in (options or {}).items():
        default, text, choices = (tuple(spec) + (None, None))[:3] if isinstance(spec, tuple) else (spec, None, None)
        if default is False:
            p.add_argument(flag, action="store_true", help=text)
        else:
            kind = str if default is None else type(default)
            p.add_argument(flag, type=kind, default=default, help=text, choices=choices)
    add_output_args(p)
    p.add_argument("--quick", action="store_true",
                   help="the smallest settings: a smoke run that checks the script end to end (never --write-docs)")
    return p


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help=f"directory for the results (default: {os.path.relpath(DEFAULT_OUT, ROOT)}/, ignored by git)")
    p.add_argument("--write-docs", action="store_true",
                   help="write the tracked report in docs/benchmarks/ instead (the published numbers)")


def output_dir(args: argparse.Namespace) -> str:
    if args.write_docs and args.out is not None:
        raise SystemExit("--out and --write-docs exclude each other")
    path = DOCS if args.write_docs else (args.out or DEFAULT_OUT)
    os.makedirs(path, exist_ok=True)
    return path


def parse(p: argparse.ArgumentParser, argv=None, quick: Mapping[str, Any] | None = None) -> argparse.Namespace:
    """Parses; with --quick the `quick` settings replace the defaults (not the flags given); checks the common
    counts are positive; with `--threads one` sets XLA's one-thread CPU flags (before jax starts); `args.out_dir` is
    where results go."""
    args = p.parse_args(argv)
    if args.quick:
        if args.write_docs:
            p.error("--quick runs are smoke runs: they never write the tracked reports (drop --write-docs)")
        for name, value in (quick or {}).items():  # a flag given on the command line keeps its value
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    bad = [COMMON[n][0] for n in POSITIVE if isinstance(getattr(args, n, None), int) and getattr(args, n) < 1]
    if bad:
        p.error(f"{', '.join(bad)} must be >= 1")
    if getattr(args, "threads", None) == "one" and ONE_THREAD not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ONE_THREAD).strip()
    args.out_dir = output_dir(args)
    return args


def int_list(p: argparse.ArgumentParser, text: str, flag: str, minimum: int = 1) -> list[int]:
    """Comma-separated integers of a flag, each >= minimum (else a one-line usage error)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag} must be comma-separated integers, not {text!r}")
    if not values or min(values) < minimum:
        p.error(f"{flag} must be integers >= {minimum}")
    return values


def command(script: str, args: argparse.Namespace, defaults: Mapping[str, Any], extra: str = "") -> str:
    """The command line that regenerates a report: the flags whose value differs from `defaults`, --write-docs."""
    flags = "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k, d in defaults.items()
                    if getattr(args, k) != d)
    return f"python benchmarks/{script}{flags}{extra} --write-docs"


def logger(tag: str, stream=sys.stdout) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{tag}] {msg}" if tag else msg, file=stream, flush=True)

    return log


# ---- workloads -------------------------------------------------------------------------------------------------
def load_pair(args: argparse.Namespace, **kw):
    """The pair of --checkpoint / --pair (a shipped pair by name), else the shipped pair; a bad choice ends in
    its one-line message."""
    import dflash_jax
    from dflash_jax.cli.generate import UsageError, resolve_pair

    try:
        directory = resolve_pair(getattr(args, "checkpoint", None), getattr(args, "pair", None))
    except UsageError as e:
        raise SystemExit(str(e))
    return dflash_jax.load(directory, **kw)


def prompts(pair, n: int, length: int, seed: int | None = None, split: str = "held_out") -> list[list[int]]:
    """`n` token windows of `length` from the pair's held-out (or training) standard-library files (split.json:
    never trained on); a pair without them ends in one line."""
    from dflash_jax.train.data import file_windows

    try:
        return file_windows(pair, split, n, length) if seed is None else file_windows(pair, split, n, length, seed)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e))


def batched_workload(args: argparse.Namespace, batches: Sequence[int], tag: str):
    """The by-batch benchmarks' start: (pair with tables as dflash-generate loads them, its name, a pool of
    max(--prompts, largest batch) held-out prompts of --prompt-len, a logger, the load average now)."""
    pair = load_pair(args, dequantize_experts="auto")
    pool = prompts(pair, max(args.prompts, max(batches)), args.prompt_len)
    return pair, args.pair or "tiny_pair", pool, logger(tag), load_average()


def measure_modes(modes: Mapping[str, Callable[[], Any]], batch: int, repeats: int, log):
    """Every mode run once (compiled before any timing), then `repeats` paired, interleaved runs: (the first run's
    outputs by mode, the `Timings`, a row {"batch", "load_1min", "modes": {}} for the script to fill)."""
    log(f"batch {batch}: compiling {len(modes)} modes")
    outputs = {m: fn() for m, fn in modes.items()}
    t = paired_runs(modes, repeats)
    row = {"batch": batch, "load_1min": t.loads[-1][0] if t.loads and t.loads[-1] else None, "modes": {}}
    return outputs, t, row


def prompt_sets(pair, spec: str, n: int, length: int) -> list[tuple[str, list[list[int]]]]:
    """Named prompt sets "split:seed,split:seed" (e.g. "held_out:0,train:1"): [(name, n windows of `length`)]."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        split, _, seed = item.partition(":")
        if split not in ("held_out", "train") or not seed.isdigit():
            raise SystemExit(f"prompt set {item!r}: write split:seed with split held_out or train (held_out:0)")
        out.append((item, prompts(pair, n, length, int(seed), split)))
    return out


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 (the compiled CPU kernels' widest loops), from
    /proc/cpuinfo: runs on two machines of one name may still differ, and a run's figures are its machine's."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                "unknown")
    return f"{name}{', AVX-512' if 'avx512f' in text else ''}"


def machine() -> dict:
    """The host: platform, architecture, CPU model and cores, the vector instructions the CPU kernels use, jax's
    version and backend."""
    import jax

    from pallas_kernels.cpu_kernels import vector_path

    return {"platform": platform.platform(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "cpu": cpu_model(), "cpus": os.cpu_count(), "simd": vector_path(), "jax": jax.__version__,
            "backend": jax.default_backend()}


@contextlib.contextmanager
def workdir(args: argparse.Namespace, prefix: str):
    """`--workdir` when given (kept), else a fresh temporary directory removed at the end unless `--keep`."""
    work = getattr(args, "workdir", None) or tempfile.mkdtemp(prefix=prefix)
    try:
        yield work
    finally:
        if not getattr(args, "keep", False) and not getattr(args, "workdir", None):
            shutil.rmtree(work, ignore_errors=True)


# ---- paired timing with output checks ----------------------------------------------------------------------------
class Outputs:
    """Output equality against a reference mode: each run's output (`key(result)`) is compared to the reference
    mode's output of the same item (whichever runs first); `lossless[mode]` stays True while every run matched,
    and a reference that disagrees with itself ends the run. `first[mode]` keeps each item's first result of
    every mode (per-run figures); `expected` the reference's output of the current item."""

    def __init__(self, reference: str, key: Callable[[Any], Any] = lambda r: r):
        self.reference, self.key = reference, key
        self.lossless: dict = {}
        self.first: dict = {}
        self.start()

    def start(self, expected=None) -> None:
        """A new item (its reference output, when known beforehand)."""
        self.expected, self._seen, self._pending = expected, set(), []

    def see(self, mode, repeat: int, result) -> None:
        if mode not in self._seen:
            self._seen.add(mode)
            self.first.setdefault(mode, []).append(result)
        out = self.key(result)
        if mode == self.reference and self.expected is None:
            self.expected = out
        self._pending.append((mode, out))
        if self.expected is None:
            return
        for m, o in self._pending:
            if m == self.reference and o != self.expected:
                raise SystemExit(f"the reference mode {m!r} disagrees with itself: the reference is ill-defined")
            self.lossless[m] = self.lossless.get(m, True) and o == self.expected
        self._pending = []


def paired_items(items: Sequence, modes: Callable[[Any], Mapping[str, Callable[[], Any]]], repeats: int, *,
                 outputs: Outputs | None = None, log: Callable[[int, Any, Timings], None] | None = None,
                 alternate: bool = False) -> list:
    """`paired_runs` per item (a prompt), each repeat in the same order (reversed every other one when
    `alternate`): `modes(item)` names the callables of that item; every run's output goes to `outputs`. Returns
    one `Timings` per item; `log(i, item, timings)` after each item."""
    out = []
    for i, item in enumerate(items):
        if outputs is not None:
            outputs.start()
        t = paired_runs(modes(item), repeats, alternate=alternate, on_run=outputs.see if outputs else None)
        out.append(t)
        if log:
            log(i, item, t)
    return out


def rate(per_item: Iterable[Timings], mode, tokens: int, clock: str = "wall", statistic: str = "min") -> float:
    """tokens over the sum over items of each item's statistic (min: its best run) of a mode's seconds."""
    return tokens / sum(t.stat(mode, clock, statistic) for t in per_item)


# ---- output ----------------------------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> list[str]:
    """Markdown table lines; align: one character per column ('l' left, 'r' right, '-' plain), default plain."""
    marks = {"l": ":---", "r": "---:", "-": "---"}
    rule = [marks[a] for a in (align or "-" * len(header))]
    def line(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(header).replace("|  |", "| |"), "|" + "|".join(rule) + "|"] + [line(row) for row in rows]


def save_figure(fig, path: str) -> None:
    """Lays the figure out, writes it as a PNG at the reports' resolution and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Report:
    """One benchmark's outputs, `<out_dir>/<stem>.{json,md,png}`, through one writer."""

    def __init__(self, args_or_dir, stem: str):
        self.dir = args_or_dir if isinstance(args_or_dir, str) else args_or_dir.out_dir
        self.stem = stem
        self.plotted = False

    def path(self, ext: str) -> str:
        return os.path.join(self.dir, f"{self.stem}.{ext}")

    def json(self, result: dict, suffix: str = "") -> str:
        path = os.path.join(self.dir, f"{self.stem}{suffix}.json")
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
        return path

    def plot(self, draw: Callable, ncols: int = 1, figsize=(10, 3.6), nrows: int = 1) -> bool:
        """draw(axes) on a new figure of nrows x ncols axes (one Axes when 1 x 1), saved as <stem>.png; False
        (with a note) when matplotlib is not installed."""
        try:
            import matplotlib
        except ImportError:
            print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
            return False
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(nrows, ncols, figsize=figsize)
        draw(axes)
        save_figure(fig, self.path("png"))
        self.plotted = True
        return True

    def markdown(self, lines: list[str], image: str | None = None) -> str:
        """Writes <stem>.md: the lines, the figure's image line when `image` (its alt text) is given and the figure
        was drawn, and the hand-written reading kept from the previous file below `READING_MARK`."""
        lines = list(lines)
        if image and self.plotted:
            lines += ["", f"![{image}]({self.stem}.png)"]
        path = self.path("md")
        if os.path.exists(path):
            with open(path) as fh:
                old = fh.read()
            if READING_MARK in old:
                lines += ["", READING_MARK + old.split(READING_MARK, 1)[1].rstrip("\n")]
        with open(path, "w") as fh:
            fh.write("\n".join(lines).rstrip("\n") + "\n")
        return path

    def write(self, result: dict | None, lines: list[str] | None, *, draw: Callable | None = None,
              image: str | None = None, **plot_kw) -> None:
        """JSON, then the figure (`draw`, `plot_kw` for `plot`), then markdown with the figure's line."""
        if result is not None:
            self.json(result)
        if draw is not None:
            self.plot(draw, **plot_kw)
        if lines is not None:
            self.markdown(lines, image)
        print(f"wrote {os.path.join(self.dir, self.stem)}.*", flush=True)


def load_span(rows, key: str = "load_1min") -> str:
    """"lo - hi" of the 1-minute load averages recorded in `rows` (dicts; missing or None entries skipped)."""
    loads = [r[key] for r in rows if r.get(key) is not None]
    return f"{min(loads, default=0):.1f} - {max(loads, default=0):.1f}"


def percentile(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def in_tree(tree: str, script: str, argv: Sequence[str]) -> dict:
    """Runs `script` (a benchmark's path) with `--worker` and `argv` in a fresh process that imports the library of
    the checkout `tree` (its `dflash_jax` and `pallas_kernels` first on the path); returns the JSON object the process
    prints on its last line (the `--against DIR` comparisons: another commit measured the same way)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    done = subprocess.run([sys.executable, os.path.abspath(script), "--worker", *argv], env=env, cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the measuring process for {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def revision(tree: str) -> str:
    """The short commit of the checkout `tree` ("+changes" when its tracked files differ; "unknown" without git)."""
    import subprocess

    try:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+changes" if dirty else "")


def check_checkout(p: argparse.ArgumentParser, tree: str | None) -> str | None:
    """`--against DIR`: the absolute path of a checkout of the library, or a parser error naming what is wrong."""
    if tree is not None and not os.path.isdir(os.path.join(tree, "dflash_jax")):
        p.error(f"--against {tree}: not a checkout of the library (no dflash_jax/ in it)")
    return None if tree is None else os.path.abspath(tree)
