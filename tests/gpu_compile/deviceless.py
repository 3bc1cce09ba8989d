"""Deviceless compiles for an NVIDIA H200: XLA:GPU compiles (through ptxas) on a machine without a GPU.

Needs the `gpu-compile` extra (`jax-cuda12-plugin` / `jax-cuda12-pjrt` of the installed jax version, and
`triton`, whose wheel ships `ptxas` and libdevice). The CUDA plugin registers only when jax does not validate
CUDA runtime libraries, i.e. with `JAX_PLATFORMS=cpu` on a machine without a GPU (`tests/conftest.py` sets it
there); the compile then targets a topology built from `h200_target_config()` instead of a device.

`compile_for_h200(fn, *abstract_args)` lowers a fresh `jax.jit(fn)` for that device inside
`pallas_kernels.target.compiling_for("gpu")` (so "auto" takes the Pallas kernel, compiled, not interpreted),
compiles it and returns a `Compiled` record: `memory_analysis()` (arguments, outputs, temporaries), the cost
analysis (flops, bytes accessed) and, for every Pallas/Triton kernel, its launch grid, threads, shared memory,
registers (ptxas -v) and the MMA instructions of its PTX (read from XLA's dump of the compile).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax

from pallas_kernels import target

# The H200 SXM as XLA's GPU target description (GpuTargetConfigProto text). Figures: NVIDIA H200 Tensor Core
# GPU datasheet (141 GB HBM3e, 4.8 TB/s) and the Hopper architecture's per-SM limits (CUDA C++ Programming
# Guide, compute capability 9.0: 228 KB shared memory per SM, 227 KB per block with opt-in, 64K registers per
# SM and per block, 2048 threads per SM); 132 SMs at 1.98 GHz boost and a 50 MB L2 as on the H100 SXM, whose
# die the H200 shares.
H200 = {
    "name": "NVIDIA H200",
    "sms": 132,
    "memory_bytes": 141 * 10**9,
    "hbm_bytes_per_s": 4.8e12,
    "l2_bytes": 50 * 2**20,
    "clock_ghz": 1.98,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_block_optin": 227 * 1024,
    "shared_memory_per_sm": 228 * 1024,
    "registers_per_sm": 65536,
    "threads_per_sm": 2048,
}


def h200_target_config() -> str:
    """The text GpuTargetConfigProto of an H200 (sm_90a)."""
    h = H200
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {h['shared_memory_per_block']}
  shared_memory_per_core: {h['shared_memory_per_sm']}
  threads_per_core_limit: {h['threads_per_sm']}
  core_count: {h['sms']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(h['hbm_bytes_per_s'])}
  l2_cache_size: {h['l2_bytes']}
  clock_rate_ghz: {h['clock_ghz']}
  device_memory_size: {h['memory_bytes']}
  shared_memory_per_block_optin: {h['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: {h['registers_per_sm']}
  registers_per_block_limit: {h['registers_per_sm']}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{h['name']}"
"""


def plugin_available() -> bool:
    """The CUDA PJRT plugin and triton's ptxas are installed (the `gpu-compile` extra)."""
    return (importlib.util.find_spec("jax_plugins") is not None
            and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
            and importlib.util.find_spec("triton") is not None)


@functools.cache
def cuda_data_dir() -> str:
    """A directory laid out as XLA expects a CUDA install (`bin/ptxas`, `nvvm/libdevice/libdevice.10.bc`),
    linking the triton wheel's copies, found at run time."""
    spec = importlib.util.find_spec("triton")
    nvidia = Path(spec.origin).parent / "backends" / "nvidia"
    ptxas, libdevice = nvidia / "bin" / "ptxas", nvidia / "lib" / "libdevice.10.bc"
    for f in (ptxas, libdevice):
        if not f.exists():
            raise FileNotFoundError(f"the triton wheel has no {f.name} at {f}")
    root = Path(tempfile.mkdtemp(prefix="dflash-cuda-data-"))
    (root / "bin").mkdir()
    (root / "nvvm" / "libdevice").mkdir(parents=True)
    (root / "bin" / "ptxas").symlink_to(ptxas)
    (root / "nvvm" / "libdevice" / "libdevice.10.bc").symlink_to(libdevice)
    return str(root)


@functools.cache
def h200():
    """The deviceless H200 (a `jax.Device` of a topology, not a live device)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=h200_target_config(), topology="1x1x1")
    return topo.devices[0]


def abstract(tree: Any) -> Any:
    """The same pytree with every array leaf as a `jax.ShapeDtypeStruct` placed on the H200 (nothing
    allocated); leaves that already are ShapeDtypeStructs get the placement too."""
    sharding = jax.sharding.SingleDeviceSharding(h200())

    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, tree)


@dataclasses.dataclass
class Kernel:
    """One GPU kernel of a compiled program: XLA's launch and the PTX / ptxas facts."""

    name: str
    grid: tuple[int, int, int]
    threads: int
    shared_memory_bytes: int
    registers: int | None = None
    spill_bytes: int | None = None
    mma: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Launches:
    """How a compiled program runs on the GPU, from XLA's thunk sequence after its thunk passes (which gather
    runs of kernels into command buffers, CUDA graphs). Each thunk is counted once, a loop's body once.

    kernels: kernel launches and device copies outside conditionals (inside graphs or not); in_conditionals:
    those inside a conditional's branches (of which one runs); graphs: command buffers; host_loops: `while`
    thunks the host runs (outside every graph: each trip launches the condition, reads its predicate back and
    waits for it); host_conditionals: `conditional` thunks the host runs (a predicate read back each); outside:
    kernel launches and copies outside every graph and conditional (launched one by one)."""

    kernels: int
    in_conditionals: int
    graphs: int
    host_loops: int
    host_conditionals: int
    outside: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_LAUNCH_KINDS = ("kCustomKernel", "kKernel", "kCopy", "kMemset32BitValue", "kMemzero", "kDynamicSliceFusion",
                 "kCublasLtMatmul", "kGemm", "kCuDnn", "kTriangularSolve")


def launches(sequence: str) -> Launches:
    """`Launches` of a thunk sequence's text (`*thunk_sequence_after_thunk_passes.txt` of an XLA dump): a thunk
    line is `NNN: kKind ...`, indented by its depth below the command buffer, loop or conditional holding it."""
    count = dict(kernels=0, in_conditionals=0, graphs=0, host_loops=0, host_conditionals=0, outside=0)
    open_ = []  # (depth, kind) of the containers the lines read are inside
    for line in sequence.splitlines():
        m = re.match(r"^(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        depth, kind = len(m.group(1)), m.group(2)
        while open_ and open_[-1][0] >= depth:
            open_.pop()
        kinds = {k for _, k in open_}
        in_graph, in_cond = "kCommandBuffer" in kinds, "kConditional" in kinds
        if kind == "kCommandBuffer":
            count["graphs"] += 1
        elif kind == "kWhile":
            count["host_loops"] += not in_graph
        elif kind == "kConditional":
            count["host_conditionals"] += not in_graph
        elif kind in _LAUNCH_KINDS:
            count["in_conditionals" if in_cond else "kernels"] += 1
            count["outside"] += not (in_graph or in_cond)
        if kind in ("kCommandBuffer", "kWhile", "kConditional"):
            open_.append((depth, kind))
    return Launches(**count)


@dataclasses.dataclass
class Compiled:
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    cost_source: str
    kernels: list[Kernel]
    compile_seconds: float
    launches: Launches | None = None

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, outputs aliased to (donated) arguments counted once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["peak_bytes"] = self.peak_bytes
        return d


def _cost(compiled) -> tuple[float, float, str]:
    """(flops, bytes accessed, where from): the compiled program's own cost analysis when the plugin gives
    one (deviceless compiles give None), else XLA's HLO cost analysis of the compiled (optimized, fused) GPU
    module run through the CPU client. A custom call (the Pallas kernel) counts its operands and outputs."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if cost:
        return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), "compiled.cost_analysis()"
    from jax._src.lib import xla_client

    module = compiled.runtime_executable().hlo_modules()[0]
    cost = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), "HLO cost analysis of the GPU module"


_THUNK = re.compile(r"kCustomKernel .*?\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                    r"\s+shared_memory: (\d+) bytes")


def _kernels(dump: Path, names: tuple[str, ...]) -> list[Kernel]:
    """The launches of kernels whose name contains one of `names` (from XLA's thunk sequence), with their
    PTX's MMA instructions and ptxas' register / spill report."""
    seq = sorted(dump.glob("*thunk_sequence.txt"))
    if not seq:
        return []
    found = {}
    for m in _THUNK.finditer(seq[-1].read_text()):
        name = m.group(1)
        if any(n in name for n in names) and name not in found:
            g = tuple(int(v) for v in m.group(2, 3, 4))
            t = int(m.group(5)) * int(m.group(6)) * int(m.group(7))
            found[name] = Kernel(name=name, grid=g, threads=t, shared_memory_bytes=int(m.group(8)))
    for ptx in dump.glob("*.ptx"):
        text = ptx.read_text()
        for name, k in found.items():
            if f".entry {name}(" not in text:
                continue
            k.mma = tuple(sorted(set(re.findall(r"\b(w?gmma\.[\w.]+|mma\.[\w.]+)", text))))
            k.registers, k.spill_bytes = _ptxas_report(ptx)
    return list(found.values())


def _ptxas_report(ptx: Path) -> tuple[int | None, int | None]:
    out = subprocess.run([os.path.join(cuda_data_dir(), "bin", "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o",
                          os.devnull], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, max(map(int, spills)) if spills else None)


def compile_for_h200(fn: Callable, *args: Any, name: str = "", kernel_names: tuple[str, ...] = (),
                     static_argnames: tuple[str, ...] = (), donate_argnums: tuple[int, ...] = (),
                     structure: bool = False, **kwargs: Any) -> Compiled:
    """Compiles `fn(*args, **kwargs)` for the deviceless H200. Array leaves of `args` become abstract arrays
    on the H200 (pass real arrays, ShapeDtypeStructs or `jax.eval_shape` results); `kwargs` are static.
    kernel_names: the kernels whose launch, registers and PTX to report (`Kernel`); structure (or any
    kernel_names): also how the program runs (`Launches`, from XLA's dump of the compile)."""
    import time

    jitted = jax.jit(functools.partial(fn, **kwargs), donate_argnums=donate_argnums)
    t0 = time.perf_counter()
    with target.compiling_for("gpu"), tempfile.TemporaryDirectory(prefix="dflash-xla-dump-") as dump:
        lowered = jitted.lower(*abstract(args))
        options = {"xla_gpu_cuda_data_dir": cuda_data_dir()}
        if kernel_names or structure:
            options["xla_dump_to"] = dump
        compiled = lowered.compile(compiler_options=options)
        seconds = time.perf_counter() - t0
        kernels = _kernels(Path(dump), kernel_names) if kernel_names else []
        passes = sorted(Path(dump).glob("*thunk_sequence_after_thunk_passes.txt"))
        runs = launches(passes[-1].read_text()) if passes else None
    mem = compiled.memory_analysis()
    flops, bytes_accessed, source = _cost(compiled)
    return Compiled(name=name or getattr(fn, "__name__", "program"), argument_bytes=int(mem.argument_size_in_bytes),
                    output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                    temp_bytes=int(mem.temp_size_in_bytes), flops=flops, bytes_accessed=bytes_accessed,
                    cost_source=source, kernels=kernels, compile_seconds=seconds, launches=runs)
