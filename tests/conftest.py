"""Test-session settings: the persistent compilation cache stays off and the CPU kernels build in a temp folder
(tests never write to the user's cache directory; a test that needs the cache points DFLASH_JAX_CACHE_DIR at a temp
dir itself); jax runs on the CPU on a machine without an NVIDIA GPU; on a GPU, float32 matrix products run at full
float32 precision."""

import glob
import os
import tempfile

# a test whose xdist worker crashed runs once more; a process holding many compiled programs lets them go between
# modules (see the modules)
pytest_plugins = ["tests.crash_rerun", "tests.release_programs"]

os.environ["DFLASH_JAX_CACHE_DIR"] = "off"
# The CPU kernels (pallas_kernels/cpu_kernels.py) are compiled once into a folder of the system's temp dir shared by
# the test processes (the build is atomic and keyed by the source), never into the user's cache.
os.environ.setdefault("DFLASH_KERNEL_CACHE",
                      os.path.join(tempfile.gettempdir(), f"dflash_jax-test-kernels-{os.getuid()}"))
# Without an NVIDIA device the tests run on the CPU. Saying so up front also keeps an installed CUDA plugin (the
# `gpu-compile` extra, tests/gpu_compile) from failing jax's backend start-up on missing CUDA libraries; the
# plugin then only serves deviceless compiles for the H200 topology. A GPU machine keeps jax's own choice.
if "JAX_PLATFORMS" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
    os.environ["JAX_PLATFORMS"] = "cpu"
# On a GPU, jax multiplies float32 matrices in TF32 by default (10 mantissa bits). The parity tests check float32
# forwards against float32 references at float32 tolerances, so they ask for full precision, as a user checking
# parity would (docs/installation.md); a CPU multiplies in full float32 either way.
elif glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


def _count_cache_clears() -> None:
    """`jax.clear_caches` counted (`CACHE_CLEARS`): a test that changes the attention tuning, or a release of compiled
    programs between modules (`tests/release_programs.py`), drops every program a shared warmed engine loaded, so its
    next calls load them again (compile events a test proving "nothing compiles while serving" would count). The
    serving tests' shared engine warms again after a clear (`tests/serve/conftest.py`)."""
    import jax

    if getattr(jax.clear_caches, "counted", False):
        return
    clear = jax.clear_caches

    def clear_caches():
        CACHE_CLEARS[0] += 1
        clear()

    clear_caches.counted = True
    jax.clear_caches = clear_caches


CACHE_CLEARS = [0]
_count_cache_clears()
