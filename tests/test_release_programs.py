"""The program-release plugin, run in a child pytest: a module that compiled many programs leaves the next module
with fewer memory maps (past the threshold, here 0); within a module nothing is let go (a second call of the same
program compiles nothing)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIRST = '''
import json, os, jax, jax.numpy as jnp
from tests.release_programs import map_count

KEEP = []

def test_compiles_many():
    for i in range(100):
        f = jax.jit(lambda x, i=i: jnp.sin(x * i) @ x + i)
        f(jnp.ones((4, 4))).block_until_ready()
        KEEP.append(f)

def test_same_module_keeps_them():
    from dflash_jax.compile_cache import CompileCounter
    with CompileCounter() as counter:
        KEEP[0](jnp.ones((4, 4))).block_until_ready()
    assert counter.compiles == 0
    with open(os.environ["MAPS_FILE"], "w") as fh:
        json.dump(map_count(), fh)
'''

SECOND = '''
import json, os
from tests.release_programs import map_count

def test_fewer_maps_after_the_module():
    with open(os.environ["MAPS_FILE"]) as fh:
        before = json.load(fh)
    assert map_count() < before - 300, (map_count(), before)
'''


def test_programs_are_let_go_between_modules_past_the_threshold(tmp_path):
    (tmp_path / "test_a.py").write_text(FIRST)
    (tmp_path / "test_b.py").write_text(SECOND)
    env = dict(os.environ, PYTHONPATH=ROOT, MAPS_FILE=str(tmp_path / "maps.json"), DFLASH_TEST_MAP_FRACTION="0",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.release_programs", "-p", "no:cacheprovider",
         "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_a.py"), str(tmp_path / "test_b.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout + proc.stderr
