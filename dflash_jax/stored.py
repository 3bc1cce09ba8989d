"""Programs stored as StableHLO next to the compilation cache, so a warm start does not trace them again.

JAX's persistent compilation cache (`compile_cache`) saves the compile, but not what comes before it: every
program is traced to a jaxpr and lowered to StableHLO again in every process, to find its cache key. For the
serving engine's warm-up that was most of a warm start (the shipped pair: about 10 of 14 s, 59 programs).

`stored_jit(fun, static_argnames=..., donate_argnames=...)` is `jax.jit` with the same signature, arguments,
donation and results. When it traces, it looks the program up by a key (below) in the cache directory. A stored
program is a `jax.export` serialization (a flatbuffer holding the StableHLO) and a JSON description of the results'
tree: data, nothing is unpickled, evaluated or imported. The trace then only calls it. A program not stored yet is
exported (traced and lowered once, as `jax.jit` would) and stored, and the trace calls the exported program as
well, so the first process and every later one compile the same module (one compilation-cache entry).

The key: the function's module and name; the source of this package and of `pallas_kernels` (every `.py` and
`.cc` file, hashed once per process); jax's and jaxlib's versions and the backend; the static arguments' reprs;
the other arguments' tree structure, shapes, dtypes and weak types (and the value of an argument that is not
traced, a Python scalar); and what else a trace reads (`trace_context`: the JAX configuration the library's lanes
carry across threads, the attention tuning, the CPU kernels' availability and every DFLASH_ environment variable
but the cache directories and the switches of stored and prefetched programs). Traced as `jax.jit` traces it, not
stored: a static argument or tree node whose repr holds an address or is elided, a mesh in context, a process
with several devices (an exported program is for one device), a result tree with a node of another package, or a program `jax.export` refuses (host callbacks); each
such function is noted once on stderr.

Where: the compilation cache's directory (`compile_cache.program_directory()`), entries with the same checked
header and atomic writes (`compile_cache.read_entry` / `write_entry`). Nothing is stored when that cache is off or
was configured in JAX by the user, or with DFLASH_STORED_PROGRAMS=0. A stored program that cannot be read
(damaged, another format) is exported again and written over.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import struct
import sys
import threading
from typing import Callable

import jax

ENV = "DFLASH_STORED_PROGRAMS"
_FORMAT = 1
_lock = threading.Lock()
_memo: dict = {}  # key -> (Exported, out tree description) or None (not storable)
_source_hash: list = []
counts = {"stored": 0, "loaded": 0, "unstorable": 0}  # this process's programs, by where they came from


def forget() -> None:
    """Forgets this process's programs and notes (the next trace of each reads the directory again, as a new
    process would); the stored programs stay."""
    with _lock:
        _memo.clear()
        _noted.clear()


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _directory() -> str | None:
    from dflash_jax import compile_cache
    return compile_cache.program_directory()


def _jaxlib_version() -> str:
    import jaxlib
    return getattr(jaxlib, "__version__", "")


def source_hash() -> str:
    """sha256 over this package's and `pallas_kernels`' sources (path and bytes of every .py / .cc file)."""
    if _source_hash:
        return _source_hash[0]
    import pallas_kernels
    digest = hashlib.sha256()
    packages = (os.path.abspath(__file__), os.path.abspath(pallas_kernels.__file__))
    for package in map(os.path.dirname, packages):
        base = os.path.dirname(package)
        for root, dirs, files in os.walk(package):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".cc")):
                    path = os.path.join(root, name)
                    digest.update(os.path.relpath(path, base).encode())
                    with open(path, "rb") as fh:
                        digest.update(hashlib.sha256(fh.read()).digest())
    _source_hash.append(digest.hexdigest())
    return _source_hash[0]


_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
           "jax_default_prng_impl", "jax_threefry_partitionable", "jax_default_device")
_NOT_TRACED_ENVS = ("DFLASH_JAX_CACHE_DIR", "DFLASH_KERNEL_CACHE", ENV, "DFLASH_PREFETCH_PROGRAMS")


def trace_context() -> str:
    """What a trace reads besides its arguments (see the module's doc)."""
    from dflash_jax.nn.attention import get_attention_tuning
    from pallas_kernels import cpu_kernels
    parts = [f"{name}={getattr(jax.config, name, None)!r}" for name in _CONFIG]
    parts += [f"{k}={v!r}" for k, v in sorted(os.environ.items())
              if k.startswith("DFLASH_") and k not in _NOT_TRACED_ENVS]
    parts.append(repr(get_attention_tuning()))
    parts.append(f"cpu_kernels={cpu_kernels.available() if jax.default_backend() == 'cpu' else None}")
    return ";".join(parts)


def _aval_key(x) -> str:
    aval = x.aval
    return f"{aval.dtype}{list(aval.shape)}{'w' if getattr(aval, 'weak_type', False) else ''}"


_PACKAGES = ("dflash_jax.", "pallas_kernels.")


def _aux_json(value):
    """A node's aux data as JSON that `_aux_value` turns back into an equal value (None: not representable)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"f": repr(value)}
    if isinstance(value, (tuple, list)):
        items = [_aux_json(v) for v in value]
        if any(i is _NO for i in items):
            return _NO
        return {"t" if isinstance(value, tuple) else "l": items}
    return _NO


_NO = object()


def _aux_value(data):
    if isinstance(data, dict):
        if "f" in data:
            return float(data["f"])
        kind = "t" if "t" in data else "l"
        items = [_aux_value(v) for v in data[kind]]
        return tuple(items) if kind == "t" else items
    return data


def describe_tree(tree) -> object:
    """A JSON description of a tree structure (`rebuild_tree` turns it back), or None where a node is not one of
    Python's containers or a node type of this package with plain aux data."""
    desc = _describe(tree)
    return None if desc is _NO else desc


def _describe(tree) -> object:
    data = tree.node_data()
    if data is None:
        return "*"
    cls, aux = data
    children = [_describe(c) for c in tree.children()]
    if any(c is _NO for c in children):
        return _NO
    if cls in (tuple, list, type(None), dict):
        if cls is dict and not all(isinstance(k, str) for k in aux):
            return _NO
        return {"b": cls.__name__, "a": list(aux) if cls is dict else None, "c": children}
    if not cls.__module__.startswith(_PACKAGES):
        return _NO
    aux_data = _aux_json(aux)
    if aux_data is _NO:
        return _NO
    return {"n": f"{cls.__module__}:{cls.__qualname__}", "a": aux_data, "c": children}


_BUILTINS = {"tuple": tuple, "list": list, "NoneType": type(None), "dict": dict}


def rebuild_tree(desc):
    """The tree structure `describe_tree` described. A node type is looked up among the modules already imported
    (of this package only); nothing is imported or evaluated."""
    if desc == "*":
        return jax.tree.structure(0)
    children = [rebuild_tree(c) for c in desc["c"]]
    if "b" in desc:
        cls = _BUILTINS[desc["b"]]
        aux = desc["a"] if cls is dict else None
    else:
        module, qualname = desc["n"].split(":", 1)
        if not module.startswith(_PACKAGES) or module not in sys.modules:
            raise ValueError(f"node type {desc['n']} is not loaded")
        cls = sys.modules[module]
        for part in qualname.split("."):
            cls = getattr(cls, part)
        aux = _aux_value(desc["a"])
    treedef = type(jax.tree.structure(0))
    return treedef.from_node_data_and_children(jax.tree_util.default_registry, (cls, aux), children)


def _pack(desc, blob: bytes) -> bytes:
    head = json.dumps({"format": _FORMAT, "out": desc}).encode()
    return struct.pack("<I", len(head)) + head + bytes(blob)


def _unpack(data: bytes):
    (n,) = struct.unpack_from("<I", data)
    head = json.loads(data[4:4 + n].decode())
    if head.get("format") != _FORMAT:
        raise ValueError("another format")
    return head["out"], data[4 + n:]


def _custom_call_checks():
    from pallas_kernels import cpu_kernels
    names = (cpu_kernels.TARGET, cpu_kernels.DENSE_TARGET, cpu_kernels.DENSE_BF16_TARGET,
             cpu_kernels.ATTENTION_TARGET)
    return [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]


_depth = threading.local()
_noted: set = set()


def _note(name: str, why: str) -> None:
    with _lock:
        if name in _noted:
            return
        _noted.add(name)
    print(f"dflash_jax: {name} is traced in every process, not stored: {why}", file=sys.stderr)


def storable_here() -> bool:
    """Whether programs are stored in this process now: on (DFLASH_STORED_PROGRAMS), the compilation cache in a
    directory of this library's, one device and one process (a program is exported for a single device), no mesh in
    context, and traced for this process's backend (not inside `pallas_kernels.target.compiling_for` another
    platform: such a trace takes that platform's paths, and a program exported from it would be stored under this
    backend's key, for this backend's calls to find)."""
    from pallas_kernels import target

    return (enabled() and _directory() is not None and jax.process_count() == 1 and jax.local_device_count() == 1
            and jax.sharding.get_abstract_mesh().empty and target.platform() == jax.default_backend())


def stored_jit(fun: Callable | None = None, *, static_argnames=(), donate_argnames=()):
    """`jax.jit(fun, static_argnames=..., donate_argnames=...)` whose traces are stored (see the module's doc).
    `fun` is a module-level function (its source is in the key: a closure's captured values would not be)."""
    if fun is None:
        return functools.partial(stored_jit, static_argnames=static_argnames, donate_argnames=donate_argnames)
    static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    sig = inspect.signature(fun)
    name = f"{fun.__module__}.{fun.__qualname__}"
    if "<locals>" in fun.__qualname__ or getattr(fun, "__closure__", None):
        raise ValueError(f"stored_jit({name}): a module-level function without a closure is needed")

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        if getattr(_depth, "n", 0) or not storable_here():  # inside another stored program's trace: part of it
            return fun(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        statics = {k: v for k, v in bound.arguments.items() if k in static_argnames}
        names = [k for k in bound.arguments if k not in static_argnames]
        values = tuple(bound.arguments[k] for k in names)
        leaves, treedef = jax.tree.flatten(values)
        traced_at = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        consts = {i: x for i, x in enumerate(leaves) if not isinstance(x, jax.core.Tracer)}
        if any(not isinstance(x, (bool, int, float, str)) for x in consts.values()):
            _note(name, "an argument that is neither traced nor a Python scalar")
            return fun(*args, **kwargs)
        described = "\n".join([repr(sorted(statics.items())), str(treedef), repr(sorted(consts.items()))])
        if " at 0x" in described or "..." in described:
            _note(name, "a static argument or tree node whose repr is not its value (an address, or elided)")
            return fun(*args, **kwargs)
        text = "\n".join([name, source_hash(), jax.__version__, _jaxlib_version(), jax.default_backend(),
                          trace_context(), described,
                          ",".join(_aval_key(leaves[i]) for i in traced_at)])
        key = "program-" + hashlib.sha256(text.encode()).hexdigest()

        def flat(*xs):
            full = list(leaves)
            for i, x in zip(traced_at, xs):
                full[i] = x
            _depth.n = getattr(_depth, "n", 0) + 1
            try:
                out = fun(**dict(zip(names, jax.tree.unflatten(treedef, full))), **statics)
            finally:
                _depth.n -= 1
            out_leaves, flat.out_tree = jax.tree.flatten(out)
            return out_leaves

        xs = [leaves[i] for i in traced_at]
        entry = _lookup(name, key, flat, xs)
        if entry is None:
            return fun(*args, **kwargs)
        exported, out_tree = entry
        return jax.tree.unflatten(out_tree, exported.call(*xs))

    return jax.jit(traced, static_argnames=static_argnames, donate_argnames=donate_argnames)


def _lookup(name, key, flat, xs):
    """(the exported program, its results' tree) of `key`: from this process's memo, the cache directory, or
    exported now and stored; None where it cannot be exported (noted once per function)."""
    from dflash_jax import compile_cache
    with _lock:
        if key in _memo:
            return _memo[key]
    path = os.path.join(_directory(), compile_cache.entry_name(key))
    data = compile_cache.read_entry(path, key)  # checked against its header: a damaged entry reads as None
    entry = None
    if data is not None:
        try:
            desc, blob = _unpack(data)
            entry = (jax.export.deserialize(bytearray(blob)), rebuild_tree(desc))
            counts["loaded"] += 1
        except Exception:  # noqa: BLE001 - another format, or a node type not loaded: exported again below
            entry = None
    if entry is None:
        specs = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype, weak_type=getattr(x.aval, "weak_type", False))
                 for x in xs]
        try:
            exported = jax.export.export(jax.jit(flat), platforms=[jax.default_backend()],
                                         disabled_checks=_custom_call_checks())(*specs)
            desc = describe_tree(flat.out_tree)
            if desc is None or rebuild_tree(desc) != flat.out_tree:
                raise ValueError(f"its results' tree {flat.out_tree} has a node that cannot be written as data")
            compile_cache.write_entry(path, key, _pack(desc, exported.serialize()))
            entry = (exported, flat.out_tree)
            counts["stored"] += 1
        except Exception as e:  # noqa: BLE001 - an effect, a callback, a custom call: traced as jax.jit traces it
            _note(name, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            counts["unstorable"] += 1
    with _lock:
        _memo[key] = entry
    return entry
