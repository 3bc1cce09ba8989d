"""CPU kernels compiled on first use and called from jitted code through XLA's FFI (`jax.ffi`).

`mxfp4_rows(x, w, expert)`: rows times their own expert's MXFP4 matrix, the codes read once as stored and decoded in
registers (`cpu_fp4_rows.cc`): y[r] = W[expert[r]] @ x[r] for W an `MXFP4Tensor` of logical shape [E, N, K]. XLA
cannot express this as one pass on a CPU: it materializes the decoded table (16x the bytes of the codes) before
reducing it, or packs it for a GEMM (docs/benchmarks/moe_cpu.md).

`dense_rows(x, w, expert)`: the same for a float32 or bfloat16 table [E, K, N] (y[r] = x[r] @ W[expert[r]]): only the
routed experts read, in place, each run of rows of one expert multiplied in register blocks; a call of about 2M
multiply-adds or more is split over XLA's intra-op thread pool (whole runs; column ranges where there are few
runs; the same sums). XLA's CPU has
no form of this that stays cheap inside a decode loop: a batched product over all experts does E / k times the
routed work, and a gather of the routed tables is materialized on every call (docs/benchmarks/moe_cpu.md).

The source is compiled once per machine with the system C++ compiler (`CXX`, else `c++`) against the FFI headers
jaxlib ships (`jax.ffi.include_dir()`), `-O3 -march=native`, into a cache directory (DFLASH_KERNEL_CACHE, else
~/.cache/dflash_jax/kernels), keyed by the source, the flags, jaxlib's version and the CPU. Where that fails (no
compiler, no source, another platform) `available()` is False and callers take their XLA path; DFLASH_CPU_KERNELS=0
turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.formats import MXFP4Tensor, NVFP4Tensor

ENV = "DFLASH_CPU_KERNELS"
CACHE_ENV = "DFLASH_KERNEL_CACHE"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_fp4_rows.cc")
TARGET = "dflash_mxfp4_rows"
DENSE_TARGET = "dflash_dense_rows"
DENSE_BF16_TARGET = "dflash_dense_rows_bf16"
ATTENTION_TARGET = "dflash_kv_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict = {}


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def vector_path() -> str:
    """The vector instructions the kernels are compiled for on this machine (`-march=native`): "avx512" (AVX-512
    F, BW and VL), "avx2" (AVX2 and FMA) or "portable" (the scalar loops, which the compiler may vectorize)."""
    flags = set(_cpu_id().split(":", 1)[-1].split())
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "portable"


def _build() -> str | None:
    """The path of the compiled library (built now if missing), or None where it cannot be built."""
    if not os.path.exists(SOURCE) or platform.system() != "Linux":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None
    with open(SOURCE, "rb") as fh:
        source = fh.read()
    import jaxlib

    key = hashlib.sha256(source + repr((FLAGS, compiler, jaxlib.__version__, platform.machine(),
                                         _cpu_id())).encode()).hexdigest()[:16]
    cache = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax", "kernels")
    path = os.path.join(cache, f"cpu_fp4_rows-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is None or done.returncode != 0:
        os.unlink(tmp)
        return None
    os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    return path


def available() -> bool:
    """Whether the compiled CPU kernels can be called (built and registered with XLA on first call)."""
    if os.environ.get(ENV, "1") in ("0", "false", "no", "off"):
        return False
    with _lock:
        if "ok" not in _state:
            ok = False
            try:
                path = _build()
                if path is not None:
                    lib = ctypes.cdll.LoadLibrary(path)
                    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.DflashMxfp4Rows), platform="cpu")
                    jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(lib.DflashDenseRows), platform="cpu")
                    jax.ffi.register_ffi_target(DENSE_BF16_TARGET, jax.ffi.pycapsule(lib.DflashDenseRowsBf16),
                                                platform="cpu")
                    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.DflashKvAttention),
                                                platform="cpu")
                    _state["lib"] = lib
                    ok = True
            except Exception:  # noqa: BLE001 - any failure means: take the XLA path
                ok = False
            _state["ok"] = ok
        return _state["ok"]


def supports(w) -> bool:
    """Whether `mxfp4_rows` takes the weight `w` (an MXFP4 tensor of logical shape [E, N, K])."""
    return isinstance(w, MXFP4Tensor) and w.blocks.ndim == 4 and w.blocks.shape[-1] == 16


def mxfp4_rows(x: jax.Array, w: MXFP4Tensor, expert: jax.Array) -> jax.Array:
    """x [R, K] float32, w an MXFP4 tensor of logical shape [E, N, K], expert [R] int32 (rows of one expert
    adjacent: each run of equal experts decodes its blocks once) -> [R, N] float32, y[r] = W[expert[r]] @ x[r].
    Each weight is E2M1(code) x 2^(s - 127) as `dequantize` gives it (NaN for s = 255, inf on overflow); an
    expert no row names is never read; an expert id out of range gives a NaN row. Call `available()` first."""
    rows = x.shape[0]
    n = w.blocks.shape[1]
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))(
        x.astype(jnp.float32), w.blocks, w.scales, expert.astype(jnp.int32))


def supports_dense(w) -> bool:
    """Whether `dense_rows` takes the weight `w` (a float32 or bfloat16 array [E, K, N])."""
    return (not isinstance(w, (MXFP4Tensor, NVFP4Tensor)) and getattr(w, "ndim", 0) == 3
            and getattr(w, "dtype", None) in (jnp.float32, jnp.bfloat16))


def dense_rows(x: jax.Array, w: jax.Array, expert: jax.Array) -> jax.Array:
    """x [R, K] (read as float32), w float32 or bfloat16 [E, K, N], expert [R] int32 (rows of one expert adjacent:
    each run reads its expert's matrix once per block of rows) -> [R, N] float32, y[r] = x[r] @ W[expert[r]], each
    element summed over k in order with float32 fused multiply-adds (bf16 weights widened exactly; a row's result
    does not depend on the other rows). An expert no row names is never read; an expert id out of range gives a NaN
    row. Differentiable in x and w (the backward pass is XLA's: every expert's product, each row's selected; the
    table's gradient one product over the rows). Call `available()` first."""
    return _dense_rows(x, w, expert.astype(jnp.int32))


def _dense_rows_call(x, w, expert):
    name = DENSE_BF16_TARGET if w.dtype == jnp.bfloat16 else DENSE_TARGET
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))(
        x.astype(jnp.float32), w, expert)


@jax.custom_vjp
def _dense_rows(x, w, expert):
    return _dense_rows_call(x, w, expert)


def _dense_rows_fwd(x, w, expert):
    return _dense_rows_call(x, w, expert), (x, w, expert)


def _dense_rows_bwd(res, g):
    x, w, expert = res
    onehot = jax.nn.one_hot(expert, w.shape[0], dtype=jnp.float32)  # [R, E]; an out-of-range id: a zero row
    wide = w.astype(jnp.float32)
    dx = jnp.einsum("rn,ekn,re->rk", g, wide, onehot)
    dw = jnp.einsum("re,rk,rn->ekn", onehot, x.astype(jnp.float32), g)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_dense_rows.defvjp(_dense_rows_fwd, _dense_rows_bwd)


def supports_attention(q, k_buf, v_buf) -> bool:
    """Whether `kv_attention` takes these operands: float32 queries [B, T, Hq, D] and cache buffers [B' >= B, Hkv, S,
    D]."""
    return (q.ndim == 4 and k_buf.ndim == 4 and v_buf.ndim == 4 and k_buf.shape[0] >= q.shape[0]
            and all(x.dtype == jnp.float32 for x in (q, k_buf, v_buf)) and q.shape[2] % k_buf.shape[1] == 0)


def kv_attention(q, k_buf, v_buf, q_positions, kv_lengths, *, scale: float, causal: bool, extra=None,
                 window: int | None = None, sinks=None) -> jax.Array:
    """Softmax attention of q [B, T, Hq, D] (float32) over each row's live slots of k_buf, v_buf [B', Hkv, S, D]
    (B' >= B: the first B rows of larger buffers are read in place, the rest never):
    slots s < kv_lengths[b] and, causal, s <= q_positions[b, t] (a `window` W: q - s < W, and without causality
    s - q < W); query head h reads kv head h // (Hq / Hkv); extra: optional (k [B, X, Hkv, D], v, mask [B, T, X]
    bool), keys beside the cache (the draft's block) under their own mask, in the same softmax; sinks: optional [Hq]
    logits, one more softmax column per head whose probability reads no value (gpt-oss). Each query reads only its
    own row's visible keys, in order (the cost follows the live lengths, and a row's result does not depend on the
    other rows or the block's width); scores, softmax and sums in float32; a query with no visible key gets zeros.
    No gradient (`nn.attention` gives it the dense path's). Call `available()` first."""
    b, t, _, d = q.shape
    if extra is None:
        k_x = jnp.zeros((b, 0, k_buf.shape[1], d), jnp.float32)
        v_x, mask = k_x, jnp.zeros((b, t, 0), jnp.int32)
    else:
        k_x, v_x, mask = extra
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_buf, v_buf, q_positions.astype(jnp.int32), kv_lengths.astype(jnp.int32), k_x.astype(jnp.float32),
        v_x.astype(jnp.float32), mask.astype(jnp.int32),
        jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32), scale=np.float32(scale),
        causal=bool(causal), window=np.int64(window or 0))
