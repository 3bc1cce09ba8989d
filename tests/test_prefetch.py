"""Prefetched programs (`dflash_jax.prefetch`): a context records the compilation cache's reads, and a later one of
the same label loads them ahead on a worker thread; what it hands over is what JAX would have read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import compile_cache, prefetch
from tests.compile_cache_dir import temp_compile_cache


def _programs():
    """Five programs of different shapes and argument counts (so their compile options differ)."""
    return [
        (jax.jit(lambda x: jnp.tanh(x) * 2.0), (jnp.arange(6.0),)),
        (jax.jit(lambda x, y: x @ y), (jnp.ones((3, 4)), jnp.ones((4, 2)))),
        (jax.jit(lambda x: jnp.cumsum(x) - 1.0), (jnp.arange(5.0),)),
        (jax.jit(lambda x, y, z: x * y + z), (jnp.ones(3), jnp.arange(3.0), jnp.full(3, 2.0))),
        (jax.jit(lambda x: x.sum(axis=0)), (jnp.arange(12.0).reshape(3, 4),)),
    ]


def _run(programs):
    return [np.asarray(fn(*args)) for fn, args in programs]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(prefetch.ENV, raising=False)
    with temp_compile_cache(tmp_path / "cache") as directory:
        yield directory


def _manifests(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefetch.MANIFEST_PREFIX))


def _process(label, programs):
    """What a new process does: nothing compiled in memory; the programs run in a prefetching context."""
    jax.clear_caches()
    with prefetch.prefetching(label) as live:
        out = _run(programs)
    return live, out


def test_a_later_context_is_served_its_programs_ahead_with_the_same_results(cache_dir):
    programs = _programs()
    first, expect = _process("test", programs)
    assert first is not None and first.prefetched == 0 and first.manifest is None
    assert len(first.read_keys) == len(programs)
    assert len(_manifests(cache_dir)) == 1

    second, out = _process("test", programs)
    assert second.manifest == first.read_keys  # found, unchanged: not written again
    assert second.prefetched == len(programs) - 1  # every program but the first, which starts the worker
    for a, b in zip(out, expect):
        np.testing.assert_array_equal(a, b)

    other, _ = _process("another label", programs)  # another label: its own manifest, nothing prefetched
    assert other.prefetched == 0 and len(_manifests(cache_dir)) == 2


def test_a_changed_sequence_rewrites_the_manifest_and_unlisted_programs_read_as_usual(cache_dir):
    programs = _programs()
    _process("test", programs[:3])
    live, out = _process("test", programs)  # two more programs than the manifest names
    assert live.prefetched == 2 and len(live.read_keys) == 5
    np.testing.assert_array_equal(out[4], np.arange(12.0).reshape(3, 4).sum(axis=0))
    again, _ = _process("test", programs)
    assert again.manifest == live.read_keys and again.prefetched == 4


def test_a_prefetched_program_whose_options_differ_is_not_used(cache_dir):
    programs = _programs()
    first, expect = _process("test", programs)
    key = prefetch.manifest_key("test", first.read_keys[0][0])
    path = cache_dir / compile_cache.entry_name(key)
    other = first.read_keys[1][1]  # the second program's options given to every program
    compile_cache.write_entry(str(path), key, prefetch.encode_manifest([(k, other) for k, _ in first.read_keys]))
    live, out = _process("test", programs)
    assert live.prefetched == 1  # only the second program's options match
    for a, b in zip(out, expect):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_manifest_is_ignored_and_written_again(cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(compile_cache, "_noted", set())  # notes are once per process
    programs = _programs()
    first, _ = _process("test", programs)
    (name,) = _manifests(cache_dir)
    raw = (cache_dir / name).read_bytes()
    (cache_dir / name).write_bytes(raw[:-7] + b"garbage")
    live, _ = _process("test", programs)
    assert live.manifest is None and live.prefetched == 0
    assert f"compilation cache entry {cache_dir / name}" in capsys.readouterr().err  # its checked header
    again, _ = _process("test", programs)
    assert again.prefetched == len(programs) - 1


def test_manifest_contents_are_data_and_bad_documents_are_refused():
    programs = [("a", b"\x00\x01options"), ("b", b"other"), ("c", b"\x00\x01options")]
    data = prefetch.encode_manifest(programs)
    assert prefetch.decode_manifest(data) == programs
    assert b"__" not in data and data.startswith(b"{")
    for bad in (b"not json", b"[]", b'{"format": 2, "options": [], "programs": []}',
                b'{"format": 1, "options": ["AA=="], "programs": [["a", 5]]}',
                b'{"format": 1, "options": ["!!"], "programs": []}'):
        assert prefetch.decode_manifest(bad) is None


def test_off_by_environment_when_nested_or_without_the_cache(cache_dir, monkeypatch):
    with prefetch.prefetching("outer") as outer, prefetch.prefetching("inner") as inner:
        assert outer is not None and inner is None
    monkeypatch.setenv(prefetch.ENV, "0")
    with prefetch.prefetching("test") as live:
        assert live is None
    monkeypatch.delenv(prefetch.ENV)
    compile_cache.disable()
    with prefetch.prefetching("test") as live:
        assert live is None
