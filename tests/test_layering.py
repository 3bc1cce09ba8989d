"""Package layers: imports point one way (read from the source with `ast`, top-level and function-local).

Between the packages: `pallas_kernels` (kernels and the FP4 containers they read) <- `dflash_jax` (the
library) <- `convert` (HF checkpoints -> dflash_jax), and `study` (research code run from the checkout, not
installed) on top of the library. `pallas_kernels` imports neither sibling; `dflash_jax` never imports `convert`
or `study`; `convert` may import both of the first two.

Inside `dflash_jax`, a "unit" is a subpackage (`dflash_jax/nn/`) or a top-level module (`dflash_jax/pair.py`);
`""` is the package root (`dflash_jax/__init__.py`, the public facade). Units sit in LAYERS, lowest first; a
unit imports only units of its own layer or below, and the unit graph has no cycle (so two units of one
layer never import each other both ways). `train` is research code on top: no runtime unit imports it (nor
`study`). A new unit must be given a layer here (the test names it).

Function-local imports count like top-level ones: hiding an import inside a function does not change the
direction of a dependency, only when it is paid for.

Private names stay home: no module imports another module's `_name` (`from m import _x`, `import m._x`, or
`m._x` on a name bound to module `m`), its own package's `__init__` included; a helper two modules share is
public in its home module.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from functools import cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dflash_jax", "pallas_kernels", "convert", "study")

# Lowest first. Each layer may import its own layer (without cycles) and the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "config", "compile_cache", "quant", "timing"),  # leaves: user errors, configs, jit cache, FP4
    # formats, the paired timing method
    ("cache", "nn", "stored", "prefetch"),  # KV caches; family-independent building blocks (norms, rope, attention,
    # moe, DeltaNet); programs stored as StableHLO (`stored_jit`, which reads the attention tuning); compiled
    # programs loaded ahead of a warm start
    ("models",),  # the families, their registry, the decoder loop, the draft
    ("checkpoint", "pair", "testing", "sharding"),  # the pair, its checkpoints, random tiny weights, mesh placement
    ("spec",),  # the speculative round (begin / draft_round / verify_round) and its jitted loop
    ("decode", "offload", "serve", "pflash"),  # loops on top of the rounds: plain decoding, expert offload, serving,
    # prefill compression
    ("api", "cli", ""),  # entry points: `dflash_jax.generate`, the command line, the package facade (`load`, ...)
    ("train",),  # research: training, route-predictor fitting
)
RESEARCH = ("train",)
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


@dataclasses.dataclass(frozen=True)
class Import:
    path: str  # file, relative to the repository root
    line: int
    importer: str  # dotted module name
    target: str  # dotted module name imported (a module of ours, or the package it is an attribute of)
    local: bool  # inside a function

    def where(self) -> str:
        return f"{self.path}:{self.line}{' (in a function)' if self.local else ''}"


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def _our_modules() -> frozenset[str]:
    found = set()
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    found.add(_module_name(os.path.relpath(os.path.join(dirpath, name), ROOT)))
    return frozenset(found)


class _Collector(ast.NodeVisitor):
    def __init__(self, path: str, module: str, is_package: bool):
        self.path, self.module, self.is_package = path, module, is_package
        self.depth = 0
        self.found: list[Import] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, node, target: str):
        if target.split(".")[0] in PACKAGES:
            self.found.append(Import(self.path, node.lineno, self.module, target, self.depth > 0))

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        base = _from_base(node, self.module, self.is_package)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(node, sub if sub in _our_modules() else base)


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads (relative imports resolved against `module`'s package)."""
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return base


@cache
def _sources() -> tuple[tuple[str, str, bool, ast.Module], ...]:
    """(path, module, is_package, parsed tree) of every module of ours."""
    out = []
    for module in sorted(_our_modules()):
        rel = module.replace(".", os.sep)
        is_package = os.path.isdir(os.path.join(ROOT, rel))
        path = os.path.join(rel, "__init__.py") if is_package else rel + ".py"
        with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
            out.append((path, module, is_package, ast.parse(fh.read(), filename=path)))
    return tuple(out)


@cache
def _imports() -> tuple[Import, ...]:
    found = []
    for path, module, is_package, tree in _sources():
        collector = _Collector(path, module, is_package)
        collector.visit(tree)
        found.extend(collector.found)
    return tuple(found)


def _unit(module: str) -> str | None:
    """The dflash_jax unit of a module ("" for the package root); None outside dflash_jax."""
    parts = module.split(".")
    if parts[0] != "dflash_jax":
        return None
    return parts[1] if len(parts) > 1 else ""


def _label(unit: str) -> str:
    return "dflash_jax (the package root)" if unit == "" else f"dflash_jax.{unit}"


def _report(offenders: list[str], rule: str) -> None:
    if offenders:
        pytest.fail(f"{rule}:\n  " + "\n  ".join(offenders), pytrace=False)


def test_the_scan_sees_the_imports_it_checks():
    """Guards the parser itself: known edges of the tree are found, with their kind (top-level / local)."""
    edges = {(i.importer, i.target) for i in _imports()}
    assert ("dflash_jax.nn.moe", "pallas_kernels.ops") in edges
    assert ("dflash_jax.quant.mxfp4", "pallas_kernels.formats") in edges
    assert any(a.startswith("convert.") and b.startswith("dflash_jax.") for a, b in edges)
    assert any(a.startswith("dflash_jax.spec.") and b.startswith("dflash_jax.models") for a, b in edges)
    assert any(i.local for i in _imports())  # function-local imports are part of the scan
    assert len(_our_modules()) > 50


def test_pallas_kernels_imports_neither_sibling():
    _report([f"{i.where()}: {i.importer} imports {i.target}" for i in _imports()
             if i.importer.split(".")[0] == "pallas_kernels" and i.target.split(".")[0] != "pallas_kernels"],
            "pallas_kernels must import nothing from dflash_jax or convert (it owns the formats its kernels read)")


def test_dflash_jax_never_imports_convert():
    _report([f"{i.where()}: {i.importer} imports {i.target}" for i in _imports()
             if i.importer.split(".")[0] == "dflash_jax" and i.target.split(".")[0] == "convert"],
            "dflash_jax must not import convert (convert builds on dflash_jax, not the reverse)")


def test_runtime_never_imports_train_or_study():
    offenders = []
    for i in _imports():
        src, dst = _unit(i.importer), _unit(i.target)
        if src is not None and src not in RESEARCH and (dst in RESEARCH or i.target.split(".")[0] == "study"):
            offenders.append(f"{i.where()}: {i.importer} imports {i.target}")
    _report(offenders, "the runtime must not import dflash_jax.train or study (research code on top)")


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _our_modules()} - {None}
    missing = sorted(u for u in units if u not in LAYER_OF)
    assert not missing, f"give these dflash_jax units a layer in tests/test_layering.py LAYERS: {missing}"


def test_imports_point_down_the_layers():
    offenders = []
    for i in _imports():
        src, dst = _unit(i.importer), _unit(i.target)
        if src is None or dst is None or src == dst or src not in LAYER_OF or dst not in LAYER_OF:
            continue
        if LAYER_OF[dst] > LAYER_OF[src]:
            offenders.append(f"{i.where()}: {i.importer} ({_label(src)}, layer {LAYER_OF[src]}) imports "
                             f"{i.target} ({_label(dst)}, layer {LAYER_OF[dst]})")
    _report(offenders, "imports must point down the layers " + " -> ".join("/".join(u or "<root>" for u in layer)
                                                                            for layer in reversed(LAYERS)))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """Between dflash_jax units (the package-level directions have their own tests above)."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Import] = {}
    for i in _imports():
        src, dst = _unit(i.importer), _unit(i.target)
        if src is None or dst is None:
            continue
        a, b = _label(src), _label(dst)
        if a != b:
            edges.setdefault(a, set()).add(b)
            where.setdefault((a, b), i)
    offenders = []
    for component in _cycles(edges):
        members = set(component)
        links = [f"{a} -> {b} ({where[a, b].where()})" for a in component for b in sorted(edges.get(a, ()))
                 if b in members]
        offenders.append(f"cycle between {', '.join(component)}: " + "; ".join(links))
    _report(offenders, "import cycles between units")


def test_the_checks_catch_a_planted_violation(monkeypatch):
    """Each rule fails on a planted import (a runtime unit importing study, a kernel importing the library, a
    lower layer importing a higher one both ways), naming the file and line."""
    planted = (
        Import("dflash_jax/nn/planted.py", 7, "dflash_jax.nn.planted", "study.rounds", True),
        Import("pallas_kernels/planted.py", 3, "pallas_kernels.planted", "dflash_jax.quant", False),
        Import("dflash_jax/models/planted.py", 5, "dflash_jax.models.planted", "dflash_jax.nn", False),
        Import("dflash_jax/nn/planted2.py", 9, "dflash_jax.nn.planted2", "dflash_jax.models.qwen3", False),
    )
    monkeypatch.setattr(sys.modules[__name__], "_imports", lambda: planted)  # the planted edges alone
    for check, expected in ((test_runtime_never_imports_train_or_study, "dflash_jax/nn/planted.py:7 (in a function)"),
                            (test_pallas_kernels_imports_neither_sibling, "pallas_kernels/planted.py:3"),
                            (test_imports_point_down_the_layers, "dflash_jax/nn/planted2.py:9"),
                            (test_no_import_cycles, "cycle between dflash_jax.models, dflash_jax.nn")):
        with pytest.raises(pytest.fail.Exception, match=expected.replace("(", r"\(").replace(")", r"\)")):
            check()


# ---- private names ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrivateUse:
    path: str
    line: int
    importer: str  # dotted module name
    home: str  # the module that defines the private name
    name: str

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} uses {self.home}.{self.name}"


# (importer, home, name) still to be made public or moved: the command-line modules share option checks. Empty it
# as they go; an entry that no longer occurs fails too.
PRIVATE_ALLOWED: frozenset = frozenset()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: str, module: str, is_package: bool, tree: ast.Module) -> list[PrivateUse]:
    """Every use in `tree` (top level and inside functions) of a private name of another module of ours: imported
    (`from m import _x`, `import m._x`) or read as an attribute of a name bound to a module (`m._x`, `pkg.m._x`)."""
    ours = _our_modules()
    found: list[PrivateUse] = []
    bound: dict[str, str] = {}  # local name -> the module of ours it is bound to (anywhere in the file)

    def add(node, home: str, name: str):
        if home != module:
            found.append(PrivateUse(path, node.lineno, module, home, name))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in PACKAGES:
                    continue
                bound[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
                for i, part in enumerate(parts[1:], 1):
                    if _private(part):
                        add(node, ".".join(parts[:i]), part)
                        break
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in ours:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if _private(alias.name):
                    add(node, base, alias.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
            continue
        chain, value = [], node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound or not _private(node.attr):
            continue
        home = bound[value.id]
        for attr in reversed(chain[1:]):  # down the submodules to the module the private name is read from
            if f"{home}.{attr}" not in ours:
                break
            home = f"{home}.{attr}"
        else:
            add(node, home, node.attr)
    return found


def test_no_module_uses_another_modules_private_name():
    uses = [u for source in _sources() for u in _private_uses(*source)]
    _report([u.where() for u in uses if (u.importer, u.home, u.name) not in PRIVATE_ALLOWED],
            "a module uses another module's private name: make it public in its home module, or move it to its "
            "one user")
    seen = {(u.importer, u.home, u.name) for u in uses}
    _report(sorted(f"{a} -> {b}.{c}" for a, b, c in PRIVATE_ALLOWED - seen),
            "PRIVATE_ALLOWED entries that no longer occur (remove them)")


def test_tests_and_benchmarks_use_no_private_name_of_the_library():
    """The tests, benchmarks and examples exercise what the library makes public: a helper a test needs is public
    in its home module (the same scan as above, over the files outside the packages)."""
    uses = []
    for top in ("tests", "benchmarks", "examples"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(folder, name), ROOT)
                    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
                        tree = ast.parse(fh.read(), filename=path)
                    uses += _private_uses(path, path[:-3].replace(os.sep, "."), False, tree)
    _report([u.where() for u in uses if not u.name.startswith("_planted")],
            "a test or benchmark reads a private name of the library: make it public in its home module")


def test_the_private_name_scan_catches_every_form():
    planted = ("import dflash_jax\n"
               "import dflash_jax.spec.requests as rq\n"
               "from dflash_jax.spec.loop import _planted_a, generate\n"
               "from dflash_jax.spec import session\n"
               "\n"
               "def f():\n"
               "    from .tree import _planted_b\n"
               "    return rq._planted_c, session._planted_d, dflash_jax.spec.loop._planted_e, session.Draft._x\n"
               "\n"
               "def _own():\n"
               "    from dflash_jax.spec.planted import _own as again\n"
               "    return again\n")
    tree = ast.parse(planted)
    got = [(u.line, u.home, u.name) for u in _private_uses("dflash_jax/spec/planted.py", "dflash_jax.spec.planted",
                                                           False, tree)]
    assert sorted(got) == [(3, "dflash_jax.spec.loop", "_planted_a"), (7, "dflash_jax.spec.tree", "_planted_b"),
                           (8, "dflash_jax.spec.loop", "_planted_e"), (8, "dflash_jax.spec.requests", "_planted_c"),
                           (8, "dflash_jax.spec.session", "_planted_d")], got


def test_pallas_kernels_loads_no_sibling_at_run_time():
    """Importing the kernels (dispatcher included) loads no dflash_jax / convert module, and the FP4 containers
    the library re-exports are the kernels' own classes (one pytree registration each)."""
    code = ("import sys, pallas_kernels.ops, pallas_kernels.formats as f\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('dflash_jax', 'convert'))\n"
            "assert not bad, bad\n"
            "import dflash_jax.quant as q\n"
            "assert q.MXFP4Tensor is f.MXFP4Tensor and q.NVFP4Tensor is f.NVFP4Tensor\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_resident_engine_does_not_import_offload():
    """Routing is the family's (`ModelFamily.route_rows`, `ModelFamily.moe_layer_ids`): only the offloaded engine knows
    `offload`."""
    import ast
    import pathlib

    import dflash_jax

    path = pathlib.Path(dflash_jax.__file__).parent / "serve" / "engine.py"
    imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith("dflash_jax.offload")}, imported


def test_the_host_engine_runs_no_device_program():
    """`serve/engine.py` is the host side of serving (requests, queue, slots, emission); every jitted program and
    the state it runs on belong to a `serve.runner.RoundRunner`: no `jax.jit`, no `jax.numpy` there."""
    import pathlib

    import dflash_jax

    path = pathlib.Path(dflash_jax.__file__).parent / "serve" / "engine.py"
    source = path.read_text()
    tree = ast.parse(source)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "jax.jit" not in source and not {"jax", "jax.numpy"} & imported, imported
