"""The one top-level error handler of the command-line tools (`dflash-generate`, `convert-weights`).

Every way a run can end, as a user sees it:

  success                                   exit 0
  a known error (bad input, bad config,     one line `PROG: error: MESSAGE` on stderr, exit 2
    bad checkpoint, bad flag combination)
  an OS error (read-only or full disk,      one line `PROG: error: STRERROR: PATH` on stderr, exit 1
    permission denied, missing file)
  out of memory                             one line on stderr, exit 1
  stdout closed early (`| head -c1`)        quiet, exit 141 (128 + SIGPIPE, what the shell reports for
                                            a tool killed by the broken pipe)
  Ctrl-C / SIGTERM                          one line `PROG: interrupted (SIGINT)`, exit 130 / 143
  anything else                             a bug: Python's traceback, exit 1

The handler also flushes stdout itself, so a write error at the very end (`> /dev/full`) is reported like
any other instead of as "Exception ignored" at interpreter exit. Only the standard library is imported
here: the tools import their heavy dependencies inside `body`, so a Ctrl-C during those imports is
handled too.

`run_interruptibly` runs work that must stop at once on Ctrl-C / SIGTERM (dflash-generate's whole run,
dflash-serve's loading and warm-up) in a worker thread and ends the process from the main thread: see its
docstring for why that is the only safe way out of a run with XLA work in flight.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Callable, TypeVar

from dflash_jax.errors import CheckpointError, ConfigError, Interrupted, UsageError

EXIT_OK, EXIT_OS_ERROR, EXIT_USAGE, EXIT_BROKEN_PIPE = 0, 1, 2, 128 + 13
KNOWN_ERRORS: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, UsageError)
T = TypeVar("T")
R = TypeVar("R")


def one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's last flush of a broken or full stdout is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def describe_os_error(e: OSError) -> str:
    reason = e.strerror or (errno.errorcode.get(e.errno, "") if e.errno else "") or str(e)
    if e.filename is None:
        return f"cannot write the output: {reason}"
    where = os.fsdecode(e.filename)
    if e.filename2 is not None:
        where += f" -> {os.fsdecode(e.filename2)}"
    return f"{reason}: {where}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def run_cli(prog: str, body: Callable[[], int], *, known: tuple[type[BaseException], ...] = ()) -> int:
    """Runs `body()` (which returns the exit code) under the rules above; returns the exit code."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    stdout_broken = False
    try:
        code = body()
        sys.stdout.flush()
        return code
    except (KNOWN_ERRORS + tuple(known)) as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        stdout_broken = True
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        note = getattr(e, "note", "")
        print(f"{prog}: interrupted ({_signal_name(signum)})" + (f"; {note}" if note else ""), file=sys.stderr)
        return 128 + signum
    except MemoryError:
        print(f"{prog}: error: out of memory; free memory or use a smaller model / budget", file=sys.stderr)
        return EXIT_OS_ERROR
    except OSError as e:
        if e.errno == errno.EPIPE:
            stdout_broken = True
            return EXIT_BROKEN_PIPE
        if e.filename is None:  # a failed write to stdout itself (`> /dev/full`)
            stdout_broken = True
        print(f"{prog}: error: {one_line(describe_os_error(e))}", file=sys.stderr)
        return EXIT_OS_ERROR
    finally:
        if stdout_broken:
            _silence_stdout()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------------------------------------
# interruptible runs (dflash-generate, dflash-serve's loading and warm-up)
# ----------------------------------------------------------------------------------------------------------

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_POLL_S = 0.05  # the main thread's wait slice: a signal is acted on within this, whichever thread it hit


def exit_interrupted(prog: str, signum: int) -> None:
    """Writes `PROG: interrupted (SIGNAME)` to stderr and ends the process at once with 128 + signum,
    without running the interpreter's finalisation (see `run_interruptibly`). Never returns."""
    line = f"{prog}: interrupted ({_signal_name(signum)})\n".encode("utf-8", "replace")
    try:
        os.write(2, line)  # not through sys.stderr, whose lock the worker may hold
    except OSError:
        pass
    os._exit(128 + signum)


def exit_on_signals(prog: str) -> None:
    """From now on, SIGINT / SIGTERM end the process at once as during `run_interruptibly` (one line,
    128 + signum); signals that are ignored stay ignored. For a CLI process whose work is done and whose
    output is written, so that a signal during the interpreter's exit (JAX's atexit hooks, the final
    collection) cannot turn into a traceback or a half-finalised crash. Main thread only; never from a
    function others call in-process (it changes the process's handlers for good)."""
    for s in _STOP_SIGNALS:
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: exit_interrupted(prog, signum))


def run_interruptibly(prog: str, fn: Callable[[], T], *, finish: Callable[[T], R] | None = None) -> T | R:
    """Runs `fn()` so that SIGINT / SIGTERM end the process within a fraction of a second at any moment of
    it: imports, loading, compiling, a long jitted loop. Returns fn's result (or `finish(result)`); an
    exception from fn is raised again here (so `run_cli` turns it into one line as usual).

    How: fn runs in a daemon worker thread, with SIGINT and SIGTERM blocked in it (so they are delivered to
    the main thread, and every thread fn's libraries start inherits the block). The main thread only waits,
    in short slices, with handlers installed for both signals; a signal makes it write
    `PROG: interrupted (SIGNAME)` to stderr and call `os._exit(128 + signum)` (130 / 143).

    Why the process ends by `os._exit` and not by raising KeyboardInterrupt and returning: a
    KeyboardInterrupt raised in the thread that drives JAX lands at an arbitrary bytecode. Inside one of
    JAX's Python callbacks it is printed as "Exception ignored" and lost (the run goes on and exits 0).
    While JAX waits for a compile, it abandons the compile, which goes on in XLA's thread pool; the
    interpreter then finalises, its last garbage collection frees the PjRt client, and the compile thread,
    finishing, builds its executable on devices the client has destroyed: a segmentation fault (seen in a
    core dump: `xla::ifrt::SingleDeviceSharding::Create` on a freed device, called from
    `PjRtLoadedExecutable::Create` on the compile thread, while the main thread is in `~PjRtClient`
    joining that pool under `Py_FinalizeEx`). With a jitted loop in flight the same finalisation instead
    waits for the whole loop (tens of seconds). So the interrupted process never finalises: `os._exit`
    skips the atexit handlers, the C++ destructors and the final collection, and the kernel stops every
    thread at once, the in-flight computation included.

    That is safe only for work whose writes are atomic or disposable. fn must not write the final output
    itself: pass `finish`, which runs in the main thread after fn returns, with the two signals held until
    it returns (so output is written whole; a signal that came meanwhile then ends the process with the
    same line and code once stdout is flushed). dflash-generate writes nothing else but the compile
    cache, whose entries are written to a temporary file and renamed into place (a temporary left by
    `os._exit` is removed by a later run); dflash-serve's loading writes nothing. What fn has printed to
    stdout but not flushed is dropped (stderr notes are line-buffered and already out).

    Called from a thread other than the main one (only the main thread can install signal handlers), or
    where both signals are ignored (`nohup`, a background job's SIGINT), it runs fn (and finish) in place.
    A signal that is ignored when this starts (SIG_IGN) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        result = fn()
        return result if finish is None else finish(result)
    stops = [s for s in _STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN]
    if not stops:
        result = fn()
        return result if finish is None else finish(result)
    state: dict = {"holding": False, "pending": None}

    def on_signal(signum, frame):
        if not state["holding"]:
            exit_interrupted(prog, signum)
        state["pending"] = state["pending"] or signum

    done = threading.Event()
    box: dict = {}

    def work():
        try:
            if hasattr(signal, "pthread_sigmask"):
                signal.pthread_sigmask(signal.SIG_BLOCK, stops)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - carried to the main thread, raised there
            box["error"] = e
        finally:
            done.set()

    previous = {s: signal.signal(s, on_signal) for s in stops}
    try:
        worker = threading.Thread(target=work, name=f"{prog}-run", daemon=True)
        worker.start()
        while not done.wait(_POLL_S):
            pass
        worker.join()
        if "error" in box:
            raise box.pop("error")
        result = box.pop("value")
        if finish is None:
            return result
        state["holding"] = True
        return finish(result)
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if state["pending"] is not None:  # a signal held while `finish` wrote: the output is whole, then exit
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            exit_interrupted(prog, state["pending"])
