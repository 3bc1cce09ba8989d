"""convert-weights and load never destroy, never corrupt silently, and always answer in one line.

One test per class of bad input (docs/reliability.md lists them with their outcomes). Every CLI case checks
the exit code, that stderr is one line (no traceback), and that nothing was lost or left behind: the
directory tree around the run is byte-for-byte what it was (or, for a successful run, holds exactly the
new checkpoint). Fixtures are tiny numpy-written HF pairs (no torch).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

import dflash_jax
from convert.cli import main as convert_main
from convert.output import MARKER, SignalGuard, run_identity
from convert.pipeline import convert
from dflash_jax.checkpoint import MANIFEST, MANIFEST_DIGEST, manifest_verifies, seal_manifest
from dflash_jax.cli.errors import run_cli
from dflash_jax.config import ConfigError
from dflash_jax.errors import CheckpointError, Interrupted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------
# fixtures and helpers
# ----------------------------------------------------------------------------------------------------------


def write_hf_pair(root, *, layers: int = 2, seed: int = 0, dtype=np.float32):
    """A tiny Qwen3-MoE target + DFlash draft in the HF release layouts (the training exporter's writer), with
    numpy random weights in the shapes the families declare (traced, never compiled: fast)."""
    import jax

    from dflash_jax import testing
    from dflash_jax.train.export import save_hf_draft, save_hf_target

    rng = np.random.default_rng(seed)

    def draw(init, cfg):
        shapes = jax.eval_shape(lambda key: init(cfg, key), jax.random.key(0))
        return jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.1).astype(np.float32), shapes)

    cfg = testing.tiny_qwen3_moe_config(num_layers=layers, vocab_size=256)
    dcfg = testing.tiny_draft_config(cfg)
    save_hf_target(draw(testing.random_qwen3_weights, cfg), cfg, str(root / "target"))
    save_hf_draft(draw(testing.random_draft_weights, dcfg), dcfg, str(root / "draft"))
    if dtype != np.float32:
        from safetensors.numpy import load_file, save_file

        for d in ("target", "draft"):
            path = root / d / "model.safetensors"
            save_file({k: v.astype(dtype) for k, v in load_file(path).items()}, path)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_hf_pair(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "pair"
    convert(str(hf[0]), str(hf[1]), str(out), progress=False)
    return out


@pytest.fixture
def work(hf, tmp_path):
    """A private copy of the HF pair under tmp_path/src (tests edit it freely)."""
    shutil.copytree(hf[0], tmp_path / "src" / "target")
    shutil.copytree(hf[1], tmp_path / "src" / "draft")
    return tmp_path / "src" / "target", tmp_path / "src" / "draft"


def snapshot(root) -> dict[str, str]:
    """Every entry under root: files by sha256, directories, symlinks by target (nothing followed)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            elif os.path.isfile(path):
                out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
            else:
                out[rel] = "special"
    return out


def cli(capsys, *argv):
    code = convert_main([str(a) for a in argv] + ["--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *fragments, exit_code=2):
    assert code == exit_code, err
    assert err.count("\n") == 1 and err.startswith("convert-weights: error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err)


def assert_refused(capsys, tmp_path, argv, *fragments, exit_code=2):
    """The run fails in one line and leaves the whole tree as it was."""
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, *argv)
    assert_one_line_error(code, err, *fragments, exit_code=exit_code)
    assert out == ""
    assert snapshot(tmp_path) == before


def no_leftovers(parent, name):
    left = [p for p in os.listdir(parent) if p.startswith(f".{name}.")]
    assert not left, left


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def read_st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path, header, data):
    h = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)


def edit_config(directory, **fields):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------------------------
# --out and --overwrite: nothing but a previous checkpoint is ever replaced
# ----------------------------------------------------------------------------------------------------------


def _refusal_cases(tmp_path, target, draft, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "work.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"x" * 10)
    (tmp_path / "file.txt").write_text("a file")
    return {
        "empty": ("", [], "--out is empty"),
        "root": ("/", ["--overwrite"], "names no new directory"),
        "input-target": (target, ["--overwrite"], "is (or contains) the --target directory"),
        "input-draft": (draft, ["--overwrite"], "is (or contains) the --draft directory"),
        "parent-of-inputs": (target.parent, ["--overwrite"], "is (or contains) the --target directory"),
        "child-of-input": (target / "out", [], "is inside the --target directory"),
        "cwd": (".", ["--overwrite"], "it is (or contains) the current directory"),
        "home": (home, ["--overwrite"], "your home directory"),
        "not-a-checkpoint": (other, ["--overwrite"], "replaces only a dflash_jax checkpoint"),
        "a-file": (tmp_path / "file.txt", ["--overwrite"], "replaces only a dflash_jax checkpoint"),
        "exists": (other, [], "already exists; pass --overwrite"),
        "no-parent": (tmp_path / "missing" / "out", [], "parent directory of --out"),
    }


@pytest.mark.parametrize("case", ["empty", "root", "input-target", "input-draft", "parent-of-inputs",
                                  "child-of-input", "cwd", "home", "not-a-checkpoint", "a-file", "exists",
                                  "no-parent"])
def test_out_refusals_destroy_nothing(work, tmp_path, capsys, monkeypatch, case):
    target, draft = work
    out, extra, message = _refusal_cases(tmp_path, target, draft, monkeypatch)[case]
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", out, *extra], message)


def test_out_symlinks_are_refused(work, converted, tmp_path, capsys):
    target, draft = work
    good = tmp_path / "good"
    shutil.copytree(converted, good)
    (tmp_path / "link").symlink_to(good)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        for extra in ([], ["--overwrite"]):
            assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / name, *extra],
                           "is a symbolic link")


def test_overwrite_replaces_a_checkpoint_atomically(work, converted, tmp_path, capsys):
    target, draft = work
    out = tmp_path / "pair"
    shutil.copytree(converted, out)
    (out / "old-note.txt").write_text("from the old checkpoint")
    inputs = snapshot(tmp_path / "src")
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", out, "--overwrite",
                            "--expert-format", "bf16")
    assert code == 0 and err == "" and stdout.count("\n") == 1 and "experts bf16 (rounded from float32)" in stdout
    assert not (out / "old-note.txt").exists() and not (out / MARKER).exists()
    assert json.loads((out / MANIFEST).read_text())["expert_format"] == "bf16"
    assert snapshot(tmp_path / "src") == inputs
    no_leftovers(tmp_path, "pair")
    assert dflash_jax.load(out).expert_format == "bf16"


def test_a_directory_that_appears_at_out_is_never_replaced(work, tmp_path, monkeypatch):
    """Another program creates --out while the conversion runs: it is kept, this run's output removed."""
    import convert.pipeline as pipeline

    target, draft = work
    out = tmp_path / "out"
    real_write = pipeline.write_json

    def intruder(path, data):
        out.mkdir()
        (out / "theirs.txt").write_text("keep me")
        real_write(path, data)

    monkeypatch.setattr(pipeline, "write_json", intruder)
    with pytest.raises(CheckpointError, match="was created by another program"):
        convert(str(target), str(draft), str(out), progress=False)
    assert sorted(os.listdir(out)) == ["theirs.txt"]
    no_leftovers(tmp_path, "out")


def test_a_concurrent_run_is_refused_and_its_work_kept(work, tmp_path, capsys):
    """Two conversions to one --out: the second is refused by the lock; the first's partial dir survives
    (even when both runs have the same pid, as two containers' PID 1 do)."""
    target, draft = work
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    partial = tmp_path / ".out.partial-running1"
    partial.mkdir()
    (partial / MARKER).write_text(json.dumps(run_identity()))  # same pid, host and boot as this process
    (partial / "layer").write_text("being written")
    try:
        assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", out],
                       "another convert-weights run is writing")
    finally:
        os.close(fd)


def test_stale_partial_dirs_are_cleaned_or_named(work, tmp_path, capsys):
    target, draft = work
    me = run_identity()
    dead = dict(me, pid=dead_pid())
    elsewhere = dict(me, host=me["host"] + "-elsewhere")
    for token, owner in (("dead1", dead), ("remote1", elsewhere), ("nomark1", None)):
        d = tmp_path / f".out.partial-{token}"
        d.mkdir()
        (d / "chunk").write_text("half written")
        if owner:
            (d / MARKER).write_text(json.dumps(owner))
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "out")
    assert code == 0 and "wrote" in stdout
    notes = err.splitlines()
    assert all(n.startswith("convert-weights: note: ") for n in notes) and len(notes) == 3
    assert "removed" in err and "dead1" in err and "did not finish" in err
    assert not (tmp_path / ".out.partial-dead1").exists()
    for token in ("remote1", "nomark1"):  # not provably dead: left, and named
        assert (tmp_path / f".out.partial-{token}" / "chunk").exists() and token in err
    assert not (tmp_path / ".out.lock").exists()


def test_an_interrupted_swap_is_completed_or_rolled_back(work, converted, tmp_path, capsys):
    target, draft = work
    dead = dict(run_identity(), pid=dead_pid())
    # killed after moving the old checkpoint aside, before moving the new one in: the old one comes back
    shutil.copytree(converted, tmp_path / ".out.partial-x1.old")
    (tmp_path / ".out.partial-x1").mkdir()
    (tmp_path / ".out.partial-x1" / MARKER).write_text(json.dumps(dead))
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "out")
    assert_one_line_error(code, err.splitlines()[-1] + "\n", "already exists")  # restored, so it exists now
    assert "restored" in err and snapshot(tmp_path / "out") == snapshot(converted)
    no_leftovers(tmp_path, "out")
    # killed after moving the new one in, before removing the old one: the old one goes, the new one stays
    shutil.copytree(converted, tmp_path / ".out.partial-x2.old")
    (tmp_path / "out" / MARKER).write_text(json.dumps(dead))
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "out", "--overwrite")
    assert code == 0 and "just replaced" in err
    no_leftovers(tmp_path, "out")
    assert not (tmp_path / "out" / MARKER).exists()


# ----------------------------------------------------------------------------------------------------------
# signals, OS errors and the CLI handler
# ----------------------------------------------------------------------------------------------------------


def test_signal_guard_defers_to_the_end_of_a_write():
    before = signal.getsignal(signal.SIGINT)
    guard = SignalGuard()
    guard.install()
    try:
        with pytest.raises(Interrupted) as e:
            with guard.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                finished = True  # the write goes on to its end
        assert finished and e.value.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # after the first signal, cleanup is never interrupted
    finally:
        guard.restore()
    assert signal.getsignal(signal.SIGINT) is before


_SLOW_CHILD = r"""
import os, resource, signal, sys, time
if os.environ.get("TEST_FSIZE"):  # every write past this many bytes fails (EFBIG), as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["TEST_FSIZE"]),) * 2)
import orbax.checkpoint as ocp

save = ocp.StandardCheckpointer.save
def slow_save(self, *args, **kwargs):  # every chunk write takes a while, so a signal lands inside one
    time.sleep(float(sys.argv[1]))
    return save(self, *args, **kwargs)
ocp.StandardCheckpointer.save = slow_save
from convert.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start_conversion(tmp_path, target, draft, out, delay=0.6, env=None, **kwargs):
    env = dict(os.environ, **(env or {}), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _SLOW_CHILD, str(delay), "--target", str(target), "--draft",
                             str(draft), "--out", str(out), "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def _wait_for_partial(proc, parent, name, timeout=240):
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        parts = [p for p in os.listdir(parent) if p.startswith(f".{name}.partial-")]
        if parts and any(os.path.isdir(os.path.join(parent, p, "target")) for p in parts):
            return parts
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the conversion never started writing")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130),
                                       pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_interrupts_a_real_conversion_cleanly(work, tmp_path, sig, code):
    target, draft = work
    inputs = snapshot(tmp_path / "src")
    proc = _start_conversion(tmp_path, target, draft, tmp_path / "out")
    _wait_for_partial(proc, tmp_path, "out")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.count("\n") == 1 and f"interrupted ({signal.Signals(sig).name})" in stderr, stderr
    assert "nothing was written" in stderr and "Traceback" not in stderr and stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no partial dir, no lock file
    assert snapshot(tmp_path / "src") == inputs


@pytest.mark.slow
def test_sigkill_leaves_a_partial_dir_the_next_run_removes(work, tmp_path, capsys):
    target, draft = work
    proc = _start_conversion(tmp_path, target, draft, tmp_path / "out")
    parts = _wait_for_partial(proc, tmp_path, "out")
    proc.kill()
    proc.communicate(timeout=60)
    assert os.path.isdir(tmp_path / parts[0])  # SIGKILL cannot clean up ...
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "out")
    assert code == 0 and f"removed {tmp_path / parts[0]}" in err  # ... the next run does
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file(work, tmp_path):
    """RLIMIT_FSIZE makes every write past 4 KiB fail with EFBIG, as a full disk fails with ENOSPC."""
    target, draft = work
    proc = _start_conversion(tmp_path, target, draft, tmp_path / "out", delay=0, env={"TEST_FSIZE": "4096"})
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stderr
    assert stderr.count("\n") == 1 and "File too large: " in stderr and str(tmp_path) in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.slow
def test_a_disk_full_before_the_marker_is_written_leaves_nothing(work, tmp_path):
    """Writes past 64 bytes fail (RLIMIT_FSIZE): the run marker itself cannot be written. The run that made
    the partial directory removes it (it knows it from mkdtemp, not from the marker)."""
    target, draft = work
    proc = _start_conversion(tmp_path, target, draft, tmp_path / "out", delay=0, env={"TEST_FSIZE": "64"})
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stderr
    assert stderr.count("\n") == 1 and "File too large: " in stderr and MARKER in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


class _FullFile:
    """A file on a disk that fills up after `room` more bytes: the write that does not fit raises ENOSPC
    (without a file name, as Python's buffered writes do)."""

    def __init__(self, fh, room):
        self.fh, self.room = fh, room

    def write(self, data):
        if len(data) > self.room:
            self.fh.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def _disk_full_for(name, room=16):
    """An `open` (to shadow the builtin in one module) whose files called `name` hit a full disk."""
    import builtins

    def fake(path, mode="r", *args, **kwargs):
        fh = builtins.open(path, mode, *args, **kwargs)
        return _FullFile(fh, room) if "w" in mode and os.path.basename(os.fspath(path)) == name else fh

    return fake


def _inject_disk_full(monkeypatch, point):
    import orbax.checkpoint as ocp

    import convert.checkpoint as ckpt_writer
    import convert.output as output
    import convert.pipeline as pipeline

    if point == "marker":  # the very first write of the run, right after mkdtemp
        monkeypatch.setattr(output, "open", _disk_full_for(MARKER), raising=False)
    elif point == "tokenizer":
        monkeypatch.setattr(pipeline, "open", _disk_full_for("tokenizer.json"), raising=False)
    elif point == "manifest":  # the last file written
        monkeypatch.setattr(ckpt_writer, "open", _disk_full_for(MANIFEST), raising=False)
    elif point == "chunk":  # the target's second layer chunk, after the first was written
        real_save = ocp.StandardCheckpointer.save

        def save(self, directory, *args, **kwargs):
            if os.fspath(directory).endswith(os.path.join("target", "layers", "0001")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(directory))
            return real_save(self, directory, *args, **kwargs)

        monkeypatch.setattr(ocp.StandardCheckpointer, "save", save)
    elif point == "commit":  # the final rename (with --overwrite: after the old checkpoint was moved aside)
        def rename(src, dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src, None, dst)

        monkeypatch.setattr(output, "rename_noreplace", rename)


@pytest.mark.parametrize("point", ["marker", "tokenizer", "chunk", "manifest", "commit"])
def test_a_full_disk_at_any_write_leaves_the_tree_as_it_was(work, converted, tmp_path, capsys, monkeypatch, point):
    """ENOSPC at each write of a conversion, into a new --out and over a checkpoint with --overwrite: exit 1,
    one line naming the file, and the directory around the run byte-for-byte as before (no partial
    directory, no lock file, the old checkpoint intact)."""
    target, draft = work
    (target / "tokenizer.json").write_text('{"version": "1.0"}')
    shutil.copytree(converted, tmp_path / "pair")
    _inject_disk_full(monkeypatch, point)
    for out, extra in ((tmp_path / "new", []), (tmp_path / "pair", ["--overwrite"])):
        before = snapshot(tmp_path)
        code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", out, *extra)
        assert_one_line_error(code, err, "No space left on device: ", str(tmp_path), exit_code=1)
        assert stdout == "" and snapshot(tmp_path) == before, point


def test_overwrite_recognises_a_checkpoint_only_by_its_verifying_digest(work, converted, tmp_path, capsys):
    """A user's directory whose manifest.json happens to have a checkpoint's keys, a checkpoint whose manifest
    was edited, and one from before manifests carried their digest are all refused, untouched."""
    target, draft = work
    argv = ["--target", target, "--draft", draft, "--overwrite", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MANIFEST).write_text(json.dumps({"format_version": 2, "converter_version": "1", "tensors": {}}))
    (mine / "thesis.tex").write_text("years of work")
    assert_refused(capsys, tmp_path, [*argv, mine], "replaces only a dflash_jax checkpoint",
                   f"has no {MANIFEST_DIGEST}")
    edited = tmp_path / "edited"
    shutil.copytree(converted, edited)
    _edit_manifest(edited, lambda m: m.update(note="mine now"), digest="keep")
    assert_refused(capsys, tmp_path, [*argv, edited], f"does not match its {MANIFEST_DIGEST} (edited or damaged)")
    older = tmp_path / "older"
    shutil.copytree(converted, older)
    _edit_manifest(older, lambda m: None, digest="drop")
    assert_refused(capsys, tmp_path, [*argv, older], f"has no {MANIFEST_DIGEST}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_parent_is_one_line(work, tmp_path, capsys):
    target, draft = work
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        before = snapshot(tmp_path)
        code, _, err = cli(capsys, "--target", target, "--draft", draft, "--out", ro / "out")
        assert_one_line_error(code, err, "Permission denied", str(ro), exit_code=1)
        assert snapshot(tmp_path) == before
    finally:
        ro.chmod(0o755)


_HANDLER_CHILD = r"""
import sys
from dflash_jax.cli.errors import run_cli
sys.exit(run_cli("tool", lambda: print("x" * 200000) or 0))
"""


def test_stdout_closed_early_or_full(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", _HANDLER_CHILD]
    # `| head -c1`: the reader goes away; the tool exits quietly with the shell's SIGPIPE status
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141 and proc.stderr.read() == b""
    # `> /dev/full`: one line, exit 1
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert r.returncode == 1 and r.stderr == "tool: error: cannot write the output: No space left on device\n"


def test_handler_outcomes(monkeypatch, capsys):
    def raising(exc):
        def body():
            raise exc
        return body

    assert run_cli("t", raising(ConfigError("bad\nconfig"))) == 2
    assert capsys.readouterr().err == "t: error: bad config\n"
    assert run_cli("t", raising(PermissionError(13, "Permission denied", "/x/y"))) == 1
    assert capsys.readouterr().err == "t: error: Permission denied: /x/y\n"
    assert run_cli("t", raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "t: interrupted (SIGINT)\n"
    assert run_cli("t", raising(Interrupted(signal.SIGTERM, "nothing was written"))) == 143
    assert capsys.readouterr().err == "t: interrupted (SIGTERM); nothing was written\n"
    assert run_cli("t", raising(MemoryError())) == 1
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(ZeroDivisionError):  # a genuine bug keeps its traceback
        run_cli("t", raising(ZeroDivisionError()))
    # a Ctrl-C while the tool imports its heavy modules (they load inside the handler)
    import builtins

    real_import = builtins.__import__

    def interrupted_import(name, *args, **kwargs):
        if name == "convert.pipeline":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted_import)
    assert convert_main(["--target", "a", "--draft", "b", "--out", "c"]) == 130
    assert capsys.readouterr().err == "convert-weights: interrupted (SIGINT)\n"


# ----------------------------------------------------------------------------------------------------------
# load: checksums, manifest and config against the stored tensors
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(converted, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(converted, d)
    return d


def _largest_data_file(d):
    files = [p for p in d.rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _edit_manifest(d, edit, *, digest="drop"):
    """Edits the manifest. digest: "drop" removes its digest (a manifest from before digests, edited: the
    field-by-field checks are what catches it), "keep" leaves it stale (what a hand edit does), "reseal"
    recomputes it (a tool that rewrote the manifest)."""
    m = json.loads((d / MANIFEST).read_text())
    result = edit(m)
    result = m if result is None else result
    if isinstance(result, dict) and digest == "drop":
        result.pop(MANIFEST_DIGEST, None)
    elif isinstance(result, dict) and digest == "reseal":
        result = seal_manifest(result)
    (d / MANIFEST).write_text(json.dumps(result))


def test_flipped_byte_is_caught_by_the_checksum(ckpt):
    f = _largest_data_file(ckpt)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256") as e:
        dflash_jax.load(ckpt)
    assert str(f) in str(e.value)


def test_truncated_or_missing_file_is_caught_without_hashing(ckpt):
    f = _largest_data_file(ckpt)
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated or was replaced"):
        dflash_jax.load(ckpt, verify=False)
    f.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        dflash_jax.load(ckpt, verify=False)


def _drop_last_layer(m):
    m["target_config"]["num_hidden_layers"] -= 1
    m["draft_config"]["num_target_layers"] -= 1  # keep the pair check happy: only the tensors disagree


def _smaller_vocab(m):
    m["target_config"]["vocab_size"] -= 8
    m["draft_config"]["vocab_size"] -= 8
    m["draft_config"]["dflash_config"]["mask_token_id"] = 200


@pytest.mark.parametrize("edit, error, message", [
    (_drop_last_layer, CheckpointError, "does not match the stored tensors"),
    (_smaller_vocab, CheckpointError, "is stored with shape [256, 64], but the target config in it implies [248, 64]"),
    (lambda m: [], CheckpointError, "holds a list, not an object"),
    (lambda m: {k: v for k, v in m.items() if k != "tensors"}, CheckpointError, "field 'tensors'"),
    (lambda m: m.update(format_version=99), CheckpointError, "format version 99"),
    (lambda m: m["tensors"]["target"]["embed"].update(shape="big"), CheckpointError, "tensors.target.embed.shape"),
    (lambda m: m["checksums"]["files"].update({"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}),
     CheckpointError, "not a path inside the checkpoint"),
    (lambda m: m["target_config"].update(rms_norm_eps=-1.0), ConfigError, "rms_norm_eps must be > 0"),
    (lambda m: m.pop("checksums") and m.update(format_version=1), CheckpointError, "verify=False"),
], ids=["one-layer-fewer", "smaller-vocab", "list", "no-tensors", "version", "shape-type", "path-escape",
        "negative-eps", "v1-without-checksums"])
def test_edited_manifests_are_refused(ckpt, edit, error, message):
    _edit_manifest(ckpt, edit)
    with pytest.raises(error) as e:
        dflash_jax.load(ckpt)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit", [_drop_last_layer, _smaller_vocab,
                                  lambda m: m["target_config"].update(rms_norm_eps=-1.0),
                                  lambda m: m["sources"].update(target="elsewhere"),
                                  lambda m: m.update({MANIFEST_DIGEST: None})],
                         ids=["one-layer-fewer", "smaller-vocab", "negative-eps", "sources", "digest-null"])
def test_a_hand_edited_manifest_fails_its_own_digest(ckpt, edit):
    """Any edit of a manifest that carries its digest is one line naming the cause (edited or damaged),
    before any of its fields is trusted, with verify=False too."""
    assert manifest_verifies(json.loads((ckpt / MANIFEST).read_text())) is True
    _edit_manifest(ckpt, edit, digest="keep")
    for verify in (True, False):
        with pytest.raises(CheckpointError) as e:
            dflash_jax.load(ckpt, verify=verify)
        text = str(e.value)
        assert text.startswith(str(ckpt / MANIFEST)) and "was edited or damaged after convert-weights wrote it" in text
        assert MANIFEST_DIGEST in text and "\n" not in text and "another target" not in text


def test_config_errors_at_load_name_the_edit_not_another_target(ckpt):
    """The pair check at load: convert-weights checked the pair before writing, so configs that disagree
    mean the manifest was edited (or rewritten by another tool), never "trained for another target"."""
    def fewer_draft_layers(m):
        m["draft_config"]["num_target_layers"] = m["target_config"]["num_hidden_layers"] + 3

    _edit_manifest(ckpt, fewer_draft_layers)  # an older manifest (no digest), edited by hand
    with pytest.raises(CheckpointError) as e:
        dflash_jax.load(ckpt)
    text = str(e.value)
    assert "its draft_config does not fit its target_config (the draft expects a target with 5 layers" in text
    assert "the config was edited after convert-weights wrote the manifest" in text
    assert "another target" not in text and "--target/--draft" not in text
    _edit_manifest(ckpt, lambda m: None, digest="reseal")  # the same manifest, resealed by some tool
    with pytest.raises(CheckpointError, match="a tool other than convert-weights rewrote the manifest"):
        dflash_jax.load(ckpt)


def test_manifests_without_a_digest_still_load(ckpt):
    """Checkpoints written before manifests carried their digest load as before (format version 2)."""
    _edit_manifest(ckpt, lambda m: None)
    assert MANIFEST_DIGEST not in json.loads((ckpt / MANIFEST).read_text())
    assert dflash_jax.load(ckpt).expert_format == "mxfp4"


def test_shipped_manifests_verify_their_digest_and_cover_the_tokenizer():
    for name, path in dflash_jax.SHIPPED_PAIRS.items():
        m = json.loads(open(os.path.join(path, MANIFEST)).read())
        assert manifest_verifies(m) is True, name
        assert m["tokenizer_files"] == ["tokenizer.json"] and "tokenizer.json" in m["checksums"]["files"], name


TOKENIZER_CONFIG = '{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}'


@pytest.fixture(scope="module")
def converted_with_tokenizer(hf, tmp_path_factory):
    """A checkpoint converted from a target directory holding tokenizer and template files."""
    root = tmp_path_factory.mktemp("tok")
    shutil.copytree(hf[0], root / "target")
    (root / "target" / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "target" / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    (root / "target" / "chat_template.jinja").write_text("{{ messages }}")
    convert(str(root / "target"), str(hf[1]), str(root / "pair"), progress=False)
    return root / "pair"


def test_tokenizer_and_template_files_are_covered_and_verified(converted_with_tokenizer, tmp_path):
    from dflash_jax.checkpoint import verified_side_file

    d = tmp_path / "pair"
    shutil.copytree(converted_with_tokenizer, d)
    m = json.loads((d / MANIFEST).read_text())
    names = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(m["tokenizer_files"]) == names and set(names) <= set(m["checksums"]["files"])
    pair = dflash_jax.load(d)
    assert pair.side_file("tokenizer_config.json") == str(d / "tokenizer_config.json")
    assert pair.tokenizer_path == str(d / "tokenizer.json")
    assert verified_side_file(d, "special_tokens_map.json") is None  # none shipped: None, no error
    # an edit of the same size (so only the hash can tell), with verify=False too, and after the load
    (d / "tokenizer_config.json").write_text(TOKENIZER_CONFIG.replace("content", "CONTENT"))
    for verify in (True, False):
        with pytest.raises(CheckpointError) as e:
            dflash_jax.load(d, verify=verify)
        text = str(e.value)
        assert text.startswith(str(d / "tokenizer_config.json")) and "was edited or damaged" in text
        assert "add_side_file" in text and "\n" not in text
    with pytest.raises(CheckpointError, match="was edited or damaged"):
        pair.side_file("tokenizer_config.json")
    with pytest.raises(CheckpointError, match="was edited or damaged"):
        verified_side_file(d, "tokenizer_config.json")


def test_a_tokenizer_file_added_after_conversion_is_refused_until_recorded(converted, tmp_path, capsys):
    from convert.output import is_checkpoint_dir
    from dflash_jax.checkpoint import add_side_file, verified_side_file
    from dflash_jax.cli.generate import main as generate_main

    d = tmp_path / "pair"
    shutil.copytree(converted, d)
    (d / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    with pytest.raises(CheckpointError, match="is not covered by the checksums in manifest.json") as e:
        dflash_jax.load(d, verify=False)
    assert str(e.value).startswith(str(d / "tokenizer_config.json")) and "add_side_file" in str(e.value)
    with pytest.raises(CheckpointError, match="is not covered"):
        verified_side_file(d, "tokenizer_config.json")
    code = generate_main(["--checkpoint", str(d), "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is not covered" in err, err
    # recorded in the manifest (size, sha256, resealed): loads, and --overwrite still recognises the checkpoint
    m = add_side_file(d, "tokenizer_config.json")
    assert m["tokenizer_files"] == ["tokenizer_config.json"] and manifest_verifies(m) is True
    assert json.loads((d / MANIFEST).read_text()) == m and is_checkpoint_dir(str(d))
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in converted.iterdir()) + [
        "tokenizer_config.json"]  # no temporary file left beside the manifest
    assert dflash_jax.load(d, verify=False).side_file("tokenizer_config.json") == str(d / "tokenizer_config.json")
    for bad in (MANIFEST, "target", "../x", "sub/tokenizer.json"):
        with pytest.raises(ValueError, match="is not the name of a file beside"):
            add_side_file(d, bad)


def test_convert_names_a_mismatched_pair_and_its_directories(work, tmp_path, capsys):
    """A genuinely mismatched pair at conversion: the two config.json files disagree, the draft was made for
    another target; the message names both directories."""
    target, draft = work
    edit_config(draft, num_target_layers=7)
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / "out"],
                   "the draft expects a target with 7 layers, this target has 2",
                   f"the --draft {draft} was made for another target than --target {target}")


def test_edited_tensor_entry_and_damaged_chunk_metadata(ckpt):
    """With verify=False nothing is hashed, yet a tensor entry that lies about the stored array, or chunk
    metadata that orbax cannot read, is still one clear error."""
    _edit_manifest(ckpt, lambda m: m["tensors"]["target"]["final_norm"].update(dtype="bfloat16"))
    with pytest.raises(CheckpointError, match="final_norm is stored as"):
        dflash_jax.load(ckpt, verify=False)
    _edit_manifest(ckpt, lambda m: m["tensors"]["target"]["final_norm"].update(dtype="float32"))
    meta = ckpt / "target" / "globals" / "_METADATA"
    meta.write_bytes(b"{" * meta.stat().st_size)  # same size: only orbax's own read can notice
    with pytest.raises(CheckpointError, match="cannot be read"):
        dflash_jax.load(ckpt, verify=False)


def test_load_of_a_file_or_a_fifo_manifest(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        dflash_jax.load(tmp_path / "f")
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / MANIFEST)
    with pytest.raises(CheckpointError, match="FIFO"):
        dflash_jax.load(d)


# ----------------------------------------------------------------------------------------------------------
# inputs: safetensors headers, configs, untrusted paths
# ----------------------------------------------------------------------------------------------------------


def _header_edit(fn):
    def edit(directory):
        path = directory / "model.safetensors"
        header, data = read_st(path)
        result = fn(header, data)
        write_st(path, *(result if result is not None else (header, data)))
    return edit


def _first_float(header):
    return next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and len(v["shape"]) == 2)


def _negative_offset(h, d):
    k = _first_float(h)
    b, e = h[k]["data_offsets"]
    h[k]["data_offsets"] = [-64, e - b - 64]


def _past_the_end(h, d):
    k = _first_float(h)
    b, e = h[k]["data_offsets"]
    h[k]["data_offsets"] = [len(d) - (e - b) + 4, len(d) + 4]


def _overlap(h, d):
    names = [k for k, v in h.items() if k != "__metadata__" and v["dtype"] == "F32"]
    a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
    size_b = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size_b]


def _relabel_int(h, d):
    h[_first_float(h)]["dtype"] = "I32"


def _truncate(h, d):
    return h, d[: len(d) // 2]


SAFETENSORS_CASES = {
    "negative-offset": (_negative_offset, "data_offsets"),
    "past-the-end": (_past_the_end, "the file is truncated"),
    "overlap": (_overlap, "share bytes"),
    "float-as-int": (_relabel_int, "is stored as int32, but"),
    "header-list": (lambda h, d: ([1, 2], d), "header is a list"),
    "no-dtype": (lambda h, d: h[_first_float(h)].pop("dtype") and None, "has no dtype"),
    "bad-shape": (lambda h, d: h[_first_float(h)].update(shape="64x64"), "not a list of sizes"),
    "truncated": (_truncate, "the file is truncated"),
    "unknown-dtype": (lambda h, d: h[_first_float(h)].update(dtype="F4") and None, "unsupported dtype F4"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_damaged_safetensors_are_one_line(work, tmp_path, capsys, case):
    target, draft = work
    fn, message = SAFETENSORS_CASES[case]
    _header_edit(fn)(target)
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / "out"],
                   str(target / "model.safetensors"), message)


def test_short_header_length_and_garbage(work, tmp_path, capsys):
    target, draft = work
    (target / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / "out"],
                   "header length 1000000000000 does not fit")


CONFIG_CASES = {
    "negative-eps": ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be > 0"),
    "nan-eps": ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    "negative-theta": ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
                       "rope_parameters.rope_theta must be > 0"),
    "string-bool": ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false"),
    "int-bool": ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false"),
    "huge-layers": ({"num_hidden_layers": 1e9}, "num_hidden_layers = 1000000000.0 is outside [1, 1024]"),
    "huge-vocab": ({"vocab_size": 1e15}, "vocab_size = 1000000000000000.0 is outside"),
    "zero-hidden": ({"hidden_size": 0}, "hidden_size = 0 is outside"),
    "fractional": ({"hidden_size": 64.5}, "hidden_size must be a whole number"),
    "string-size": ({"intermediate_size": "128"}, "intermediate_size must be a whole number"),
    "layer-types": ({"layer_types": "full_attention"}, "layer_types must be a list"),
    "rope-list": ({"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
    "eos-string": ({"eos_token_id": "</s>"}, "eos_token_id must be a list of integers"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_values_are_one_line_naming_the_field(work, tmp_path, capsys, case):
    target, draft = work
    fields, message = CONFIG_CASES[case]
    edit_config(target, **fields)
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / "out"],
                   str(target / "config.json"), message)


@pytest.mark.parametrize("content, message", [
    ("null", "holds a JSON null"), ("[1, 2]", "holds a JSON array"), ("{", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"), ("dir", "is a directory"), ("fifo", "FIFO"),
], ids=["null", "list", "syntax", "not-utf8", "directory", "fifo"])
def test_config_json_that_is_not_a_config(work, tmp_path, capsys, content, message):
    target, draft = work
    path = target / "config.json"
    path.unlink()
    if content == "dir":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, "--out", tmp_path / "out"], message)


def test_untrusted_paths_are_refused(work, tmp_path, capsys):
    target, draft = work
    argv = ["--target", target, "--draft", draft, "--out", tmp_path / "out"]
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    # a tokenizer file that links outside the HF directory is not copied into the output
    (target / "tokenizer.json").symlink_to(secret)
    assert_refused(capsys, tmp_path, argv, str(target / "tokenizer.json"), "outside")
    (target / "tokenizer.json").unlink()
    # an index whose weight_map leaves the directory, names an absolute path, or names a FIFO
    shutil.copy(target / "model.safetensors", tmp_path / "outside.safetensors")
    header, _ = read_st(target / "model.safetensors")
    index = target / "model.safetensors.index.json"
    for shard, message in (("../outside.safetensors", "points outside"), (str(tmp_path / "outside.safetensors"),
                                                                           "points outside"),
                           ("pipe.safetensors", "FIFO")):
        index.write_text(json.dumps({"weight_map": {k: shard for k in header if k != "__metadata__"}}))
        if shard == "pipe.safetensors":
            os.mkfifo(target / shard)
        signal.alarm(60)  # a FIFO must be refused, not read forever
        try:
            assert_refused(capsys, tmp_path, argv, message)
        finally:
            signal.alarm(0)


def test_symlinks_inside_the_directory_and_the_hf_cache_layout_are_followed(hf, tmp_path, capsys):
    """HuggingFace's cache stores snapshots as links into `blobs/`: those are read (and hashed)."""
    repo = tmp_path / "models--tiny" / "snapshots" / "abc123"
    blobs = tmp_path / "models--tiny" / "blobs"
    repo.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf[0] / name, blobs / name)
        (repo / name).symlink_to(os.path.join("..", "..", "blobs", name))
    (repo / "tok.json").write_text('{"version": "1.0"}')
    (repo / "tokenizer.json").symlink_to("tok.json")
    code, stdout, err = cli(capsys, "--target", repo, "--draft", hf[1], "--out", tmp_path / "out")
    assert code == 0, err
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["tokenizer_files"] == ["tokenizer.json"]
    sha = hashlib.sha256((hf[0] / "model.safetensors").read_bytes()).hexdigest()
    assert m["sources"]["sha256"]["target/model.safetensors"] == sha


def test_inputs_that_are_files_or_the_wrong_family(work, tmp_path, capsys):
    target, draft = work
    argv_out = ["--out", tmp_path / "out"]
    assert_refused(capsys, tmp_path, ["--target", target / "config.json", "--draft", draft, *argv_out],
                   "is a file, not a directory")
    assert_refused(capsys, tmp_path, ["--target", "", "--draft", draft, *argv_out], "--target is empty")
    edit_config(draft, model_type="gpt_oss")  # a gpt-oss draft given a Qwen3-MoE target
    assert_refused(capsys, tmp_path, ["--target", target, "--draft", draft, *argv_out],
                   "was built for a gpt_oss target", "pass the draft trained for this target")


# ----------------------------------------------------------------------------------------------------------
# precision defaults (issue 13): nothing is lost unless asked, and the summary says when it is
# ----------------------------------------------------------------------------------------------------------


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        convert_main(["--help"])
    out = capsys.readouterr().out
    assert "(default: mxfp4)" in out and "(default: auto)" in out


def test_keep_is_lossless_and_auto_keeps_the_source_precision(work, tmp_path, capsys):
    import jax

    from convert import load_hf_target

    target, draft = work
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "keep",
                            "--expert-format", "keep")
    assert code == 0 and "experts fp32 (exact)" in stdout and "other weights float32" in stdout, stdout + err
    pair = dflash_jax.load(tmp_path / "keep")
    _, reference = load_hf_target(target, dtype="fp32")
    for got, want in zip(jax.tree.leaves(pair.target), jax.tree.leaves(reference)):
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))
    code, stdout, _ = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "fp4")
    assert code == 0 and "experts quantized to mxfp4 from float32 (lossy)" in stdout


def test_auto_keeps_bf16_sources_bf16(tmp_path, capsys):
    target, draft = write_hf_pair(tmp_path, dtype=__import__("ml_dtypes").bfloat16)
    code, stdout, err = cli(capsys, "--target", target, "--draft", draft, "--out", tmp_path / "out",
                            "--expert-format", "bf16")
    assert code == 0 and "experts bf16 (exact)" in stdout and "other weights bfloat16" in stdout, stdout + err


# ----------------------------------------------------------------------------------------------------------
# layering: the runtime does not import the converter
# ----------------------------------------------------------------------------------------------------------


def test_dflash_jax_does_not_import_convert():
    code = ("import sys, dflash_jax, dflash_jax.pair, dflash_jax.checkpoint, dflash_jax.cli.generate; "
            "bad = sorted(m for m in sys.modules if m == 'convert' or m.startswith('convert.')); "
            "assert not bad, bad; assert not hasattr(dflash_jax, 'load_hf_target'); "
            "assert not hasattr(dflash_jax.pair, 'load_hf_pair')")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------------------------
# dflash-generate: the same handler, and the arguments that used to end in tracebacks
# ----------------------------------------------------------------------------------------------------------


def _generate(capsys, *argv):
    from dflash_jax.cli.generate import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", f"1,{2**63}"], f"token id {2**63} is far outside any vocabulary"),
    (["--prompt-ids", "1,2", "--stop-ids", str(-2**64)], "is far outside any vocabulary"),
    (["--prompt-ids", "1,2", "--seed", str(2**63)], "--seed must fit in 64 bits"),
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text"),  # how Python passes undecodable argv bytes
], ids=["id-2^63", "stop-id", "seed-2^63", "non-utf8-prompt"])
def test_generate_arguments_beyond_64_bits_or_utf8(capsys, argv, message):
    code, out, err = _generate(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_generate_on_a_damaged_checkpoint_is_one_line(converted, tmp_path, capsys):
    d = tmp_path / "pair"
    shutil.copytree(converted, d)
    f = _largest_data_file(d)
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 0x80]))
    code, out, err = _generate(capsys, "--checkpoint", d, "--prompt-ids", "1,2,3")
    assert code == 2 and out == "" and err.count("\n") == 1 and str(f) in err and "sha256" in err, err
