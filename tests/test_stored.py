"""Stored programs (`dflash_jax.stored`): a program traced once is stored as StableHLO next to the compilation
cache, and a later process calls it without tracing; its results, donation and keys are those of `jax.jit`."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import compile_cache, stored
from dflash_jax.cache import KVCache
from dflash_jax.nn.attention import attention_tuning, get_attention_tuning
from tests.compile_cache_dir import temp_compile_cache


TRACES: list = []  # one entry per trace of `scaled_cache` (a Python side effect runs only while tracing)


def scaled_cache(cache: KVCache, scale, *, times: int):
    """A KVCache out (a node type of the package, a None field), a tuple and a dict around it."""
    TRACES.append(times)
    keys = tuple(k * scale * times for k in cache.keys)
    out = cache.replace(keys=keys, lengths=cache.lengths + times)
    return out, {"total": sum(k.sum() for k in keys), "n": jnp.int32(times)}


scaled_cache_jit = jax.jit(scaled_cache, static_argnames=("times",))
scaled_cache_stored = stored.stored_jit(scaled_cache, static_argnames=("times",))


def add_in_place(buffer, delta):
    return buffer + delta


add_in_place_stored = stored.stored_jit(add_in_place, donate_argnames=("buffer",))


def with_a_callback(x):
    jax.debug.callback(lambda v: None, x)
    return x * 2


with_a_callback_stored = stored.stored_jit(with_a_callback)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The compilation cache (and so the stored programs) in a temp dir for this test, off again after it."""
    monkeypatch.setattr(stored, "counts", {"stored": 0, "loaded": 0, "unstorable": 0})
    with temp_compile_cache(tmp_path / "cache") as directory:
        yield directory


def _new_process():
    """What a new process starts from: no program traced or memoized (the directory stays)."""
    stored.forget()
    jax.clear_caches()


def _cache():
    return KVCache(keys=(jnp.arange(6.0).reshape(1, 2, 3), jnp.ones((1, 2, 3))), values=(jnp.zeros((1, 2, 3)),) * 2,
                   lengths=jnp.array([2], jnp.int32))


def _programs(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("program-"))


def test_a_stored_program_gives_jits_results_and_a_new_process_calls_it_untraced(cache_dir, monkeypatch):
    want = scaled_cache_jit(_cache(), 1.5, times=3)
    got = scaled_cache_stored(_cache(), 1.5, times=3)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert stored.counts == {"stored": 1, "loaded": 0, "unstorable": 0}
    assert len(_programs(cache_dir)) == 1

    _new_process()
    TRACES.clear()
    monkeypatch.setattr(jax.export, "export", lambda *a, **k: pytest.fail("exported again"))
    again = scaled_cache_stored(_cache(), 1.5, times=3)
    assert stored.counts["loaded"] == 1 and not TRACES
    assert jax.tree.structure(again) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want)))


def test_keys_follow_static_arguments_shapes_dtypes_and_the_trace_context(cache_dir):
    scaled_cache_stored(_cache(), 1.5, times=3)
    scaled_cache_stored(_cache(), 2.5, times=3)  # another value of a traced argument: the same program
    assert len(_programs(cache_dir)) == 1
    scaled_cache_stored(_cache(), 1.5, times=4)  # a static argument
    scaled_cache_stored(_cache(), jnp.float32(1.5), times=3)  # a strong float32, not a weak Python float
    wide = _cache().replace(keys=(jnp.ones((1, 2, 5)), jnp.ones((1, 2, 5))))
    scaled_cache_stored(wide, 1.5, times=3)  # a shape
    with attention_tuning(chunk=get_attention_tuning().chunk * 2):  # what a trace reads besides its arguments
        scaled_cache_stored(_cache(), 1.5, times=3)
    assert len(_programs(cache_dir)) == 5 and stored.counts["stored"] == 5
    _new_process()
    out, extra = scaled_cache_stored(_cache(), 1.5, times=4)
    assert int(extra["n"]) == 4 and int(out.lengths[0]) == 6 and stored.counts["loaded"] == 1


def test_donation_is_kept(cache_dir):
    buffer = jnp.arange(8.0)
    out = add_in_place_stored(buffer, 1.0)
    assert buffer.is_deleted() and np.array_equal(out, np.arange(8.0) + 1)
    _new_process()
    again = add_in_place_stored(out, 1.0)
    assert out.is_deleted() and np.array_equal(again, np.arange(8.0) + 2) and stored.counts["loaded"] == 1


def test_a_damaged_program_is_exported_again(cache_dir, capsys):
    scaled_cache_stored(_cache(), 1.5, times=3)
    (name,) = _programs(cache_dir)
    path = cache_dir / name
    data = path.read_bytes()
    path.write_bytes(data[:-40] + bytes(40))  # its checksum no longer holds
    _new_process()
    out, _ = scaled_cache_stored(_cache(), 1.5, times=3)
    assert np.array_equal(out.keys[0], np.arange(6.0).reshape(1, 2, 3) * 4.5)
    assert stored.counts == {"stored": 2, "loaded": 0, "unstorable": 0}
    assert path.read_bytes() == data  # written over with the program again
    assert "is skipped" in capsys.readouterr().err


def test_what_cannot_be_stored_is_traced_as_jit_traces_it(cache_dir, capsys):
    assert float(with_a_callback_stored(jnp.float32(2.0))) == 4.0
    assert stored.counts["unstorable"] == 1 and not _programs(cache_dir)
    assert "with_a_callback is traced in every process, not stored" in capsys.readouterr().err
    factor = 3
    with pytest.raises(ValueError, match="module-level function without a closure"):
        stored.stored_jit(lambda x: x * factor)  # its captured values would not be in the key


def test_nothing_is_stored_when_the_cache_is_off_or_stored_programs_are(tmp_path, monkeypatch):
    stored.forget()
    monkeypatch.setattr(stored, "counts", {"stored": 0, "loaded": 0, "unstorable": 0})
    assert compile_cache.program_directory() is None  # the tests' cache is off
    out, _ = scaled_cache_stored(_cache(), 1.5, times=2)
    assert np.array_equal(out.keys[1], np.ones((1, 2, 3)) * 3)
    monkeypatch.setenv(stored.ENV, "0")
    compile_cache.enable(str(tmp_path / "cache"))
    try:
        jax.clear_caches()
        scaled_cache_stored(_cache(), 1.5, times=2)
        assert not _programs(tmp_path / "cache") and stored.counts == {"stored": 0, "loaded": 0, "unstorable": 0}
    finally:
        compile_cache.disable()
        jax.clear_caches()


def test_a_trace_for_another_platform_is_not_stored(cache_dir, capsys):
    """A program traced inside `compiling_for("gpu")` on a CPU (the deviceless compiles: the GPU's paths) is jit's
    trace, never a program stored under the CPU's key for this process's later calls to load."""
    from pallas_kernels import target

    with target.compiling_for("gpu"):
        assert not stored.storable_here()
        jax.jit(lambda c: scaled_cache_stored(c, 1.5, times=5)).lower(_cache())  # nested, as a deviceless compile
        scaled_cache_stored(_cache(), 1.5, times=6)
    assert not _programs(cache_dir) and stored.counts == {"stored": 0, "loaded": 0, "unstorable": 0}
    assert "not stored" not in capsys.readouterr().err
    scaled_cache_stored(_cache(), 1.5, times=7)  # this platform's own trace is stored as before (a new one: jit's
    assert len(_programs(cache_dir)) == 1  # cache keeps the trace above, `pallas_kernels.target`'s caveat)


def test_tree_descriptions_are_json_and_rebuild_the_same_structure():
    from dflash_jax.spec.round import Chain
    tree = jax.tree.structure((_cache(), [1, None, {"a": 1, "b": (2, 3)}], Chain(4)))
    desc = stored.describe_tree(tree)
    assert stored.rebuild_tree(json.loads(json.dumps(desc))) == tree
    Point = collections.namedtuple("Point", "x y")  # a node type of another package: not written
    assert stored.describe_tree(jax.tree.structure(Point(1, 2))) is None
    with pytest.raises(ValueError, match="not loaded"):
        stored.rebuild_tree({"n": "dflash_jax.not_a_module:Thing", "a": None, "c": []})


_GENERATE = """
import json, sys
import numpy as np
import dflash_jax
from dflash_jax import compile_cache, spec, stored
from dflash_jax.train.data import file_windows
compile_cache.ensure_enabled()
pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, dequantize_experts=True)
prompts = file_windows(pair, "held_out", 2, 48)
res = spec.generate(pair, [prompts[0], prompts[1][:20]], max_new_tokens=40, stop_ids=[], block_size=4)
print(json.dumps({"tokens": [list(map(int, t)) for t in res.tokens], "tau": float(res.mean_acceptance()),
                  "counts": stored.counts}))
"""


def _three_processes(script: str, tmp_path, min_stored: int):
    """`script` (printing a JSON line with "tokens" and "counts") run with the cache off, then twice on one cache
    directory: the first stores its programs, the second calls them all untraced; every run the same tokens."""
    def run(cache):
        env = dict(os.environ, DFLASH_JAX_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain, first, second = run("off"), run(str(tmp_path / "cache")), run(str(tmp_path / "cache"))
    assert plain["counts"] == {"stored": 0, "loaded": 0, "unstorable": 0}
    assert first["counts"]["stored"] >= min_stored and first["counts"]["unstorable"] == 0
    assert second["counts"]["loaded"] == first["counts"]["stored"] and second["counts"]["stored"] == 0
    assert first["tokens"] == plain["tokens"] == second["tokens"]
    return plain, first, second


def test_a_second_process_generates_the_same_tokens_from_stored_programs(tmp_path):
    """`spec.generate` (prefill and the compiled loop) in three processes: the cache off, a first one that stores
    its programs, a second that calls them untraced: the same tokens, with proposals accepted."""
    plain, first, second = _three_processes(_GENERATE, tmp_path, min_stored=2)
    assert first["counts"]["loaded"] == 0
    assert plain["tau"] > 1.5


_SERVE = """
import json
import dflash_jax
from dflash_jax import compile_cache, prefetch, stored
from dflash_jax.serve.engine import Engine
from dflash_jax.train.data import file_windows
compile_cache.ensure_enabled()
pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, dequantize_experts=True)
prompts = file_windows(pair, "held_out", 6, 40)
engine = Engine(pair, slots=4, max_prompt_len=64, max_new_tokens=48, block_size=4, widths=[1, 2, 4], lanes=2,
                round_seconds={1: 1.0, 2: 1.4, 4: 2.2})
engine.warmup()
reqs = [engine.submit(p[:20 + 4 * i], max_new_tokens=48, stop_ids=[]) for i, p in enumerate(prompts)]
engine.run_until_idle()
print(json.dumps({"tokens": [r.tokens for r in reqs], "accepted": sum(sum(r.acceptance) - len(r.acceptance)
                  for r in reqs), "widths": sorted(engine.width_rounds), "counts": stored.counts,
                  "prefetch": prefetch.counts}))
"""


@pytest.mark.slow
def test_a_second_serving_process_serves_the_same_tokens_from_stored_programs(tmp_path):
    """The serving engine (two lanes, widths 1 / 2 / 4 chosen by a fixed cost table, its row buckets, donated
    state) in three processes: the cache off, one storing its programs, one calling them untraced: the same tokens.
    The third's warm-up is also handed its programs by the prefetch worker (`dflash_jax.prefetch`)."""
    plain, first, second = _three_processes(_SERVE, tmp_path, min_stored=10)
    assert plain["accepted"] > 0 and len(plain["widths"]) >= 2  # proposals accepted, several widths served
    assert plain["prefetch"]["prefetched"] == first["prefetch"]["prefetched"] == 0
    assert second["prefetch"]["prefetched"] >= 10
