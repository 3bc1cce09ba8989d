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
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Callable

from dflash_jax.config import ConfigError
from dflash_jax.errors import CheckpointError, Interrupted, UsageError

EXIT_OK, EXIT_OS_ERROR, EXIT_USAGE, EXIT_BROKEN_PIPE = 0, 1, 2, 128 + 13
KNOWN_ERRORS: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, UsageError)


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
