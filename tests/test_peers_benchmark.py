"""benchmarks/peers.py's command line and its process-tree CPU clock (no vLLM, no model: the benchmark itself is
run by hand, not in CI)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, _BENCH)  # peers.py imports its sibling harness.py by name
    try:
        spec = importlib.util.spec_from_file_location("benchmarks_peers", os.path.join(_BENCH, "peers.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(_BENCH)


def test_quick_refuses_write_docs_and_shrinks_the_run(peers, tmp_path):
    import harness as h

    p = peers.build_parser()
    with pytest.raises(SystemExit):
        h.parse(p, ["--quick", "--write-docs"], quick=peers.QUICK)
    args = h.parse(p, ["--quick", "--out", str(tmp_path)], quick=peers.QUICK)
    assert (args.prompts, args.max_new, args.batches, args.clients, args.processes) == (1, 16, "1,4", "1", 1)
    full = h.parse(p, ["--out", str(tmp_path)])
    assert (full.prompts, full.max_new, full.batches, full.blocks) == (10, 128, "1,4,16,32", "4,8,16")
    assert full.peers_venv.startswith(os.path.expanduser("~"))  # outside the checkout


def test_tree_cpu_counts_this_process(peers):
    before = peers.tree_cpu()
    sum(i * i for i in range(2_000_000))
    assert peers.tree_cpu() > before
    assert peers.rows([[1], [2], [3]], 5) == [[1], [2], [3], [1], [2]]
