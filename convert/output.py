"""Where a conversion writes, so that it never destroys what it did not create.

The rules (docs/reliability.md has the full list and the cases tried):
- `--out` is refused when it is empty, a symbolic link, an input, inside an input, or contains one.
- An existing `--out` is replaced only with `overwrite=True` and only when it is itself a dflash_jax
  checkpoint (a directory whose `manifest.json` verifies its own `manifest_sha256`), and never `/`, the home
  or the current directory or a directory containing them.
- The output is built in a fresh `tempfile.mkdtemp` directory `.NAME.partial-XXXXXXXX` beside `--out`,
  holding a marker with this run's pid, host, boot id and process start time. The run that made it removes
  it on any failure, from the moment `mkdtemp` returns (a disk that is full before the marker is written
  included); no other run removes it while it may be running.
- An advisory lock (`flock` on `.NAME.lock` beside `--out`) admits one conversion per `--out` at a time;
  the lock file is removed when the run ends.
- The final step is a rename: `rename(partial, out)` with RENAME_NOREPLACE (a directory that appeared at
  `--out` meanwhile is never replaced); with overwrite: `rename(out, partial.old)`, `rename(partial, out)`,
  then the old tree is removed.
- Partial directories of dead runs (SIGKILL, power loss) are recognised by their marker and removed by the
  next run for the same `--out`; a half-done swap is completed or rolled back. What cannot be proven dead
  (another host) is named, never removed.
- SIGINT / SIGTERM never interrupt a chunk being written: they are deferred to the end of the write, then
  this run's partial directory is removed and `Interrupted` propagates (exit 130 / 143 in the CLI).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Callable

from dflash_jax.errors import CheckpointError, Interrupted, UsageError, fsync_dir

MARKER = ".dflash_jax_partial.json"
# a removed tree must stay gone this long before it counts as removed (`Output._remove`): a failed write's storage
# threads (tensorstore finishing operations the failed save had started) may create its directories again a moment
# after the removal. Measured: on a loaded 2-core machine, a full-disk conversion left a partial directory behind in
# 1 of 4 runs, recreated down to `0000.orbax-checkpoint-tmp/ocdbt.process_0/d` after it had been removed
REMOVE_SETTLE_S = 0.3
_TOKEN = r"[A-Za-z0-9_]+"


# ----------------------------------------------------------------------------------------------------------
# signals
# ----------------------------------------------------------------------------------------------------------


class SignalGuard:
    """SIGINT / SIGTERM raise `Interrupted` at once outside a `critical()` section and at its end inside one,
    so a chunk is never cut in the middle of its write. After the first signal has been raised, further
    ones are only recorded (the cleanup that follows must not be interrupted)."""

    def __init__(self):
        self.depth = 0
        self.pending: int | None = None
        self.raised = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; there, Python's defaults apply
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handler(self, signum, frame) -> None:
        if self.pending is None:
            self.pending = signum
        if self.depth == 0 and not self.raised:
            self.raised = True
            raise Interrupted(signum)

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.pending is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.pending)


# ----------------------------------------------------------------------------------------------------------
# run markers
# ----------------------------------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def run_identity() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "process_start": _process_start(pid), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "tool": "convert-weights"}


def _owner_is_dead(owner: dict) -> bool:
    """Whether the run that wrote `owner` can be proven gone. Called with the `--out` lock held, so a live
    run for the same `--out` on this machine is impossible; on another host (or another boot of this
    one) nothing is proven, and the directory is left for the user."""
    me = run_identity()
    if owner.get("host") != me["host"] or owner.get("boot_id") != me["boot_id"]:
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _process_start(pid)
    return start is not None and start != owner.get("process_start")  # the pid was reused


def _read_marker(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MARKER)) as fh:
            owner = json.load(fh)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _describe_owner(owner: dict) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"


# ----------------------------------------------------------------------------------------------------------
# paths
# ----------------------------------------------------------------------------------------------------------


def _inside(path: str, root: str) -> bool:
    """Whether real path `path` is `root` or below it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def not_a_checkpoint(path: str) -> str | None:
    """None when `path` is a dflash_jax checkpoint `overwrite` may replace: a real directory whose
    `manifest.json` (a regular file) carries a `manifest_sha256` that matches its content. Otherwise why it
    is not one, as a clause ("it has no manifest.json", ...). A manifest without the digest (an older
    convert-weights, or any JSON that happens to have a checkpoint's keys) is not enough."""
    from dflash_jax.checkpoint import MANIFEST, MANIFEST_DIGEST, manifest_verifies

    manifest = os.path.join(path, MANIFEST)
    if os.path.islink(path) or not os.path.isdir(path):
        return "it is not a directory"
    if os.path.islink(manifest) or not os.path.isfile(manifest):
        return f"it has no {MANIFEST}"
    try:
        with open(manifest, "rb") as fh:
            data = json.loads(fh.read(64 * 2**20).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return f"its {MANIFEST} is not readable JSON"
    verified = manifest_verifies(data)
    if verified is None:
        return (f"its {MANIFEST} has no {MANIFEST_DIGEST} (not written by convert-weights, or by a version before "
                "manifests carried one)")
    if not verified:
        return f"its {MANIFEST} does not match its {MANIFEST_DIGEST} (edited or damaged)"
    return None


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding a convert-weights manifest that verifies its own digest (the only thing
    `overwrite` may replace)."""
    return not_a_checkpoint(path) is None


@contextlib.contextmanager
def naming_os_errors(path: str):
    """Gives an OSError raised without a file name (a write or close on a full disk) the name `path`, so the
    one-line error says which file could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), path) from None
        raise


def check_input_dir(flag: str, path: str | os.PathLike) -> str:
    """The real path of an input directory, or one clear error."""
    path = os.fspath(path)
    if path == "":
        raise UsageError(f"{flag} is empty (an unset shell variable?); give the HuggingFace checkpoint directory")
    if not os.path.exists(path):
        raise CheckpointError(f"{flag} directory {path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path} is a file, not a directory; pass the HuggingFace checkpoint directory "
                              "(the folder holding config.json)")
    return os.path.realpath(path)


def _protected_dirs() -> list[tuple[str, str]]:
    out = [("the root directory", os.sep)]
    home = os.path.expanduser("~")
    if home and home != "~":
        out.append(("your home directory", os.path.realpath(home)))
    with contextlib.suppress(OSError):
        out.append(("the current directory", os.path.realpath(os.getcwd())))
    return out


_NOREPLACE = 1  # RENAME_NOREPLACE


def rename_noreplace(src: str, dst: str) -> None:
    """rename(src, dst) that fails with FileExistsError when dst exists (renameat2 RENAME_NOREPLACE on Linux;
    elsewhere an existence check right before the rename)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd = -100
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), src, None, dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)
    os.rename(src, dst)




# ----------------------------------------------------------------------------------------------------------
# the staged output
# ----------------------------------------------------------------------------------------------------------


class StagedOutput:
    """A context manager: `path` is this run's fresh partial directory; `commit()` swaps it in as `out`.

    Leaving the context without `commit()` (an error, a signal) removes the partial directory; leaving it
    in any way releases the lock and restores the signal handlers."""

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False, inputs: dict[str, str] | None = None,
                 log: Callable[[str], None] = lambda msg: None):
        out = os.fspath(out)
        if out == "":
            raise UsageError("--out is empty (an unset shell variable?); give the output directory")
        self.overwrite = overwrite
        self.log = log
        self.guard = SignalGuard()
        self.path: str | None = None
        self.committed = False
        self._lock_fd: int | None = None
        absolute = os.path.abspath(out)
        self.name = os.path.basename(absolute)
        if self.name in ("", ".", ".."):
            raise UsageError(f"--out {out} names no new directory; give a path like models/my-pair")
        if os.path.islink(absolute):
            raise UsageError(f"--out {out} is a symbolic link (to {os.readlink(absolute)}); give the real directory path")
        self.parent = os.path.realpath(os.path.dirname(absolute))
        if not os.path.isdir(self.parent):
            raise CheckpointError(f"the parent directory of --out ({os.path.dirname(absolute)}) does not exist; "
                                  "create it first")
        self.out = os.path.join(self.parent, self.name)
        self.inputs = {flag: os.path.realpath(p) for flag, p in (inputs or {}).items()}
        for flag, real in self.inputs.items():
            if _inside(real, self.out):
                raise UsageError(f"--out {out} is (or contains) the {flag} directory; write the output to a new "
                                 "directory outside the inputs")
            if _inside(self.out, real):
                raise UsageError(f"--out {out} is inside the {flag} directory {real}; write the output outside "
                                 "the inputs")
        self._check_existing(out)

    def _check_existing(self, shown: str) -> None:
        if not os.path.lexists(self.out):
            return
        if not self.overwrite:
            raise CheckpointError(f"--out {shown} already exists; pass --overwrite to replace a previous "
                                  "convert-weights output, or choose another directory")
        for what, real in _protected_dirs():
            if _inside(real, self.out):
                raise UsageError(f"--overwrite will not replace {self.out}: it is (or contains) {what}")
        why = not_a_checkpoint(self.out)
        if why is not None:
            raise UsageError(f"--overwrite replaces only a dflash_jax checkpoint (a directory whose convert-weights "
                             f"manifest.json verifies its own digest); {self.out} is not one ({why}): remove it "
                             "yourself or choose another --out")

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "StagedOutput":
        self.guard.install()
        try:
            with self.guard.critical():
                self._lock()
                self._recover()
                self._check_existing(self.out)
                # from here on self.path is ours: any failure below (ENOSPC while writing the marker, a
                # signal) removes it, by the name mkdtemp returned, not by its marker
                self.path = tempfile.mkdtemp(prefix=f".{self.name}.partial-", dir=self.parent)
                umask = os.umask(0o022)
                os.umask(umask)
                os.chmod(self.path, 0o777 & ~umask)  # mkdtemp's 0700 would make the output private
                self._write_marker()
        except BaseException:
            self.guard.raised = True  # the cleanup below is never interrupted by a signal
            try:
                if self.path is not None:
                    self._remove(self.path)
                    self.path = None
            finally:
                self._release()
            raise
        return self

    def _write_marker(self) -> None:
        marker = os.path.join(self.path, MARKER)
        with naming_os_errors(marker), open(marker, "w") as fh:
            json.dump(run_identity(), fh)
            fh.flush()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.guard.raised = True  # from here on signals are recorded, never raised
        try:
            if not self.committed and self.path is not None:
                self._remove(self.path)
        finally:
            self._release()
        if isinstance(exc, KeyboardInterrupt):
            kept = f"{self.out} is unchanged" if os.path.lexists(self.out) else "nothing was written"
            exc.note = f"{kept} (this run's partial output was removed)"  # type: ignore[attr-defined]

    def commit(self) -> None:
        """Moves the finished partial directory to `out` (atomically replacing an old checkpoint)."""
        with self.guard.critical():
            fsync_dir(self.path)
            aside = None
            if os.path.lexists(self.out):
                if not self.overwrite or not is_checkpoint_dir(self.out):
                    raise CheckpointError(f"{self.out} was created by another program while converting; it was "
                                          "left as it is and this run's output removed: choose another --out")
                aside = self.path + ".old"
                os.rename(self.out, aside)
            try:
                rename_noreplace(self.path, self.out)
            except FileExistsError:
                if aside is not None:
                    os.rename(aside, self.out)
                raise CheckpointError(f"{self.out} was created by another program while converting; it was left "
                                      "as it is and this run's output removed: choose another --out") from None
            except BaseException:
                if aside is not None:
                    os.rename(aside, self.out)
                raise
            self.committed = True
            self.path = self.out
            fsync_dir(self.parent)
            if aside is not None:
                self._remove(aside)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.out, MARKER))

    # ---- pieces -----------------------------------------------------------------------------------------------
    def _remove(self, path: str) -> None:
        # a writer's helper thread (orbax's lock files after a failed write) may still add or remove a file while
        # the tree is removed: a file that vanished is not a failure, and a tree that gained one is removed again;
        # and a late write may create the tree again after it is gone, so it counts as removed only once it has
        # stayed gone for `REMOVE_SETTLE_S`
        failed: list[str] = []
        removals, gone_since = 0, None
        while True:
            if os.path.lexists(path):
                if removals == 5:
                    break
                failed.clear()
                removals += 1
                shutil.rmtree(path, onerror=lambda fn, p, info: None if issubclass(info[0], FileNotFoundError)
                              else failed.append(f"{p} ({info[0].__name__})"))
                gone_since = None
            if not os.path.lexists(path):
                now = time.monotonic()
                gone_since = now if gone_since is None else gone_since
                if now - gone_since >= REMOVE_SETTLE_S:
                    return
                time.sleep(REMOVE_SETTLE_S / 6)
            else:
                time.sleep(0.05 * removals)
        self.log(f"could not remove {path} completely ({failed[0] if failed else 'it keeps changing'}); "
                 "remove it by hand")

    def _lock(self) -> None:
        path = os.path.join(self.parent, f".{self.name}.lock")
        for _ in range(5):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"another convert-weights run is writing {self.out} (it holds {path}); wait for it "
                                 "to finish or choose another --out") from None
            # the previous holder unlinks the file when it ends: our lock must be on the file still there
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self._lock_fd, self._lock_path = fd, path
                return
            os.close(fd)
        raise UsageError(f"could not lock {path}: other runs keep replacing it; try again")

    def _release(self) -> None:
        try:
            if self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._lock_path)
                os.close(self._lock_fd)
                self._lock_fd = None
        finally:
            self.guard.restore()

    def _recover(self) -> None:
        """Cleans what dead runs for this `--out` left behind (the lock is held, see `_owner_is_dead`)."""
        prefix = f".{self.name}.partial-"
        pattern = re.compile(re.escape(prefix) + _TOKEN + r"(\.old)?")
        final_owner = _read_marker(self.out) if os.path.isdir(self.out) else None
        for entry in sorted(os.listdir(self.parent)):
            m = pattern.fullmatch(entry)
            if not m:
                continue
            path = os.path.join(self.parent, entry)
            if os.path.islink(path) or not os.path.isdir(path):
                self.log(f"left {path}: not a directory convert-weights made; remove it if it is not yours")
            elif m.group(1):
                self._recover_swap(path, final_owner)
            else:
                owner = _read_marker(path)
                if owner is not None and _owner_is_dead(owner):
                    self._remove(path)
                    self.log(f"removed {path}, left by an earlier run ({_describe_owner(owner)}) that did not finish")
                elif owner is not None:
                    self.log(f"left {path}: written by {_describe_owner(owner)}, which may still be running; remove "
                             "it once that run is gone")
                else:
                    self.log(f"left {path}: it has no run marker (made by another tool, or a run killed while "
                             "starting); remove it if no conversion is running")
        if final_owner is not None and _owner_is_dead(final_owner):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.out, MARKER))

    def _recover_swap(self, aside: str, final_owner: dict | None) -> None:
        """`.NAME.partial-X.old` is an old checkpoint an interrupted --overwrite run had moved aside."""
        partial = aside[: -len(".old")]
        if not os.path.lexists(self.out):
            os.rename(aside, self.out)
            self.log(f"restored {self.out} from {aside} (an earlier --overwrite run stopped while replacing it)")
        elif not os.path.lexists(partial) and final_owner is not None and _owner_is_dead(final_owner):
            self._remove(aside)
            self.log(f"removed {aside}, the checkpoint an earlier --overwrite run had just replaced")
        else:
            self.log(f"left {aside}: an older checkpoint moved aside by another run; remove it if you do not need it")
