"""Errors a user can cause, and the one file check every reader of user files goes through.

Light on purpose (standard library only): the CLIs import it before anything heavy, so even an error or a
Ctrl-C during the first imports ends in one line.
"""

from __future__ import annotations

import os
import signal
import stat


class ConfigError(ValueError):
    """A configuration the library cannot run exactly; the message names the cause and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the file, the cause and the fix."""


class UsageError(ValueError):
    """An argument that cannot work (a path, a format, a combination of options); the message says which and why."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `signum` says which (the CLIs exit with 128 + signum)."""

    def __init__(self, signum: int = signal.SIGINT, note: str = ""):
        super().__init__(note)
        self.signum = int(signum)
        self.note = note


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, error: type[Exception] = CheckpointError, *, what: str = "file",
                 fix: str | None = None):
    """Opens `path` for binary reading if it is a regular file (following symlinks); anything else (a
    directory, a FIFO that would block forever, a device) raises `error` naming the path. `fix`: what the
    message tells the user to do (default: point at the file / replace it with the real file).

    The file is opened non-blocking and checked with fstat on the open descriptor, so a FIFO is refused
    without hanging and nothing can be swapped in between the check and the read."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a {what}; "
                    f"{fix or 'point at the file (or remove the directory)'}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path} is {file_kind(mode)}, not a {what}; {fix or 'replace it with the real file'}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def safe_relpath(rel: object) -> bool:
    """A file name from a user's file (an index's weight_map, a manifest) that stays inside its directory:
    relative, `/`-separated, no `..`, no empty parts."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or "\\" in rel or "\x00" in rel:
        return False
    if len(rel) > 1 and rel[1] == ":":  # a Windows drive
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def fsync_dir(path: str) -> None:
    """Makes a rename or a new file in `path` durable (best effort: a filesystem without directory fsync is
    left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
