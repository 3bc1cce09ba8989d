"""The persistent compilation cache: where it lives, how it is turned off, that a second process is served
from it, and the 'compiling' notice."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp

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
