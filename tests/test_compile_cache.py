"""The persistent compilation cache: where it lives, how it is turned off, that a second process is served
from it, and the 'compiling' notice."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from dflash_jax import compile_cache
from dflash_jax.compile_cache import compile_notice

_SCRIPT = """
import jax, jax.numpy as jnp
from dflash_jax import compile_cache
from dflash_jax.compile_cache import CompileCounter
where = compile_cache.ensure_enabled()
with CompileCounter() as c:
    jax.jit(lambda x: jnp.sin(x) * 3 + jnp.cos(x))(jnp.arange(5.0)).block_until_ready()
print(where, c.compiles, c.cache_hits)
"""


def _run(env_value):
    env = dict(os.environ, DFLASH_JAX_CACHE_DIR=env_value, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
    where, compiles, hits = out.stdout.split()
    return where, int(compiles), int(hits)


def test_a_second_process_is_served_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    where, compiles, hits = _run(str(cache))
    assert where == str(cache) and compiles >= 1 and hits == 0
    assert any(files for _, _, files in os.walk(cache))  # small programs are cached too
    where, compiles, hits = _run(str(cache))
    assert hits == compiles >= 1
    where, _, hits = _run("off")
    assert where == "None" and hits == 0


def test_cache_directory_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    for off in ("off", "OFF", "0", "none"):
        monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", off)
        assert compile_cache.default_dir() is None
    monkeypatch.delenv("DFLASH_JAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "dflash_jax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" / "dflash_jax" / "jax")


def test_the_notice_speaks_only_while_a_compile_runs():
    said = []
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 7.0)
    x = jnp.ones((4, 4))
    with compile_notice(lambda: said.append(1), after_s=0.0):
        f(x).block_until_ready()
    assert said == [1]
    with compile_notice(lambda: said.append(2), after_s=0.0):
        f(x).block_until_ready()  # compiled already: nothing to say
    assert said == [1]


# ----------------------------------------------------------------------------------------------------------
# damaged caches: every entry is checked against its header, nothing but a regular file is opened, and an
# unusable cache path is named with its reason
# ----------------------------------------------------------------------------------------------------------

_PROGRAMS = """
import jax, jax.numpy as jnp
from dflash_jax import compile_cache
from dflash_jax.compile_cache import CompileCounter
where = compile_cache.ensure_enabled()
with CompileCounter() as c:
    a = jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(5.0))
    b = jax.jit(lambda x: (x @ x.T).sum(0))(jnp.ones((3, 4), jnp.int32))
    print(float(a.sum()), b.tolist(), type(compile_cache.jax_store()).__name__, c.compiles, c.cache_hits)
"""


def _run_programs(cache):
    env = dict(os.environ, DFLASH_JAX_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _PROGRAMS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    *values, store, compiles, hits = out.stdout.split()
    return " ".join(values), store, int(compiles), int(hits), out.stderr.strip().splitlines()


def test_damaged_entries_are_misses_with_a_note_and_a_fifo_never_hangs(tmp_path):
    """Entries whose contents were swapped between names (JAX's own store then runs another program's
    executable and fails deep inside jax), a truncated entry and a FIFO in place of an entry: the run
    recompiles them with one note per kind naming the cache, and the recompiled programs replace the damaged
    entries (the FIFO is left alone, never opened)."""
    cache = tmp_path / "cache"
    values, store, compiles, hits = _run_programs(cache)[:4]
    assert store == "GuardedCache" and hits == 0 and compiles >= 3
    entries = sorted(p for p in cache.iterdir() if p.name.endswith(compile_cache.ENTRY_SUFFIX))
    assert len(entries) == compiles and not [p for p in cache.iterdir() if p not in entries]
    data = [p.read_bytes() for p in entries]
    for p, d in zip(entries, data[1:] + data[:1]):  # every entry now holds its neighbour's program
        p.write_bytes(d)
    entries[0].write_bytes(entries[0].read_bytes()[:-7])
    entries[1].unlink()
    os.mkfifo(entries[1])
    os.mkfifo(cache / ("jit_x-0" + "-cache"))  # a JAX-named file is never read at all
    again, _, _, hits, notes = _run_programs(cache)
    assert again == values and hits == 0
    assert len(notes) == 2, notes
    assert any("is skipped:" in n and f"empty the cache directory {cache}" in n for n in notes), notes
    assert any("is a FIFO (named pipe), not a file" in n and f"rm {entries[1]}" in n for n in notes), notes
    assert os.path.exists(entries[1]) and not os.path.isfile(entries[1])  # left for the user, not replaced
    for p in entries[:1] + entries[2:]:  # replaced by the recompiled programs: the next run is served
        key = p.name[:-len(compile_cache.ENTRY_SUFFIX)]
        assert compile_cache.read_entry(str(p), key) is not None


def test_entries_are_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compile_cache, "_noted", set())
    path = str(tmp_path / ("k-1" + compile_cache.ENTRY_SUFFIX))
    assert compile_cache.write_entry(path, "k-1", b"payload" * 100)
    assert compile_cache.read_entry(path, "k-1") == b"payload" * 100
    assert compile_cache.read_entry(path, "k-2") is None  # another key's entry
    assert compile_cache.read_entry(str(tmp_path / "absent"), "k-1") is None
    assert "another program's entry" in capsys.readouterr().err
    for damage, why in ((lambda b: b[:-1], "truncated"), (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "sha256"),
                        (lambda b: b[20:], "no dflash_jax entry header")):
        monkeypatch.setattr(compile_cache, "_noted", set())
        bad = tmp_path / "bad"
        bad.write_bytes(damage(open(path, "rb").read()))
        assert compile_cache.read_entry(str(bad), "k-1") is None
        assert why in capsys.readouterr().err
        bad.unlink()

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_cache.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        compile_cache.write_entry(str(tmp_path / "k-3"), "k-3", b"x" * 10)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary file, no half entry
    monkeypatch.undo()
    stale = tmp_path / ".dflash-tmp-old"
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))
    compile_cache.remove_stale_temporaries(str(tmp_path))
    assert not stale.exists() and os.path.exists(path)


@pytest.mark.parametrize("kind", ["file", "under_a_file", "fifo", "read_only"])
def test_an_unusable_cache_path_is_named_with_its_reason(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setattr(compile_cache, "_state", {"resolved": False, "dir": None, "reason": None})
    monkeypatch.setattr(compile_cache, "_noted", set())
    before = jax.config.jax_compilation_cache_dir
    target = tmp_path / "cache"
    if kind == "file":
        target.write_text("x")
        want = f"{target} is a file, not a directory"
    elif kind == "under_a_file":
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "cache"
        want = "a part of its path is a file"
    elif kind == "fifo":
        os.mkfifo(target)
        want = "is a FIFO (named pipe), not a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        target.mkdir()
        target.chmod(0o555)
        want = "is not writable (Permission denied)"
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(target))
    assert compile_cache.ensure_enabled() is None
    assert jax.config.jax_compilation_cache_dir == before  # nothing else changed
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0] and "DFLASH_JAX_CACHE_DIR=off" in err[0], err
    assert want in compile_cache.off_reason()
    if before is None:
        compile_cache.print_notice("dflash-generate")()
        line = capsys.readouterr().err
        assert want in line and "not set" not in line and "to enable" not in line


def test_the_notice_says_why_the_cache_is_off(monkeypatch, capsys):
    monkeypatch.setattr(compile_cache, "_state", {"resolved": False, "dir": None, "reason": None})
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", "off")
    assert compile_cache.enable() is None
    assert compile_cache.off_reason() == "compilation cache off: DFLASH_JAX_CACHE_DIR=off"
    compile_cache.disable()
    assert compile_cache.off_reason() == "compilation cache off: turned off for this run"
    if jax.config.jax_compilation_cache_dir is None:
        compile_cache.print_notice("dflash-generate")()
        assert "compilation cache off: turned off for this run" in capsys.readouterr().err
