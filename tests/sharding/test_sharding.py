"""Expert and tensor parallelism: mesh specs, shardings from the declarations, and generation on meshes of 8
CPU devices equal to one device (run in subprocesses: the device count is fixed before jax starts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from dflash_jax import testing as T
from dflash_jax.errors import UsageError
from dflash_jax.models.family import family_of
from dflash_jax.sharding import AXES, make_mesh, parse_mesh_spec, plan
from dflash_jax.spec.sampling import SamplingParams
from tests.sharding import mesh_checks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def abstract(expert: int, tensor: int, data: int = 1) -> AbstractMesh:
    return AbstractMesh((data, expert, tensor), AXES)


# ---------------------------------------------------------------------------------------------------------
# mesh specs and shardings (no devices needed)
# ---------------------------------------------------------------------------------------------------------

def test_mesh_spec_parses_and_names_bad_parts():
    assert parse_mesh_spec("expert=4,tensor=2") == {"data": 1, "expert": 4, "tensor": 2}
    assert parse_mesh_spec(" data=2 ") == {"data": 2, "expert": 1, "tensor": 1}
    for bad, says in [("experts=4", "'experts=4'"), ("expert=0", "positive integer"), ("expert=x", "positive"),
                      ("expert=2,expert=2", "twice"), ("", "names no axis"), ("tensor", "AXIS=SIZE")]:
        with pytest.raises(UsageError, match=says):
            parse_mesh_spec(bad)


def test_mesh_larger_than_the_devices_says_how_to_get_them():
    with pytest.raises(UsageError, match=r"needs 64 devices, 1 available.*xla_force_host_platform_device_count=64"):
        make_mesh("expert=8,tensor=8")


def test_declared_shardings_per_family():
    # 4 x 2 mesh: 8 experts over expert x tensor, whole GQA groups over tensor, vocab over tensor
    mesh = abstract(4, 2)
    qwen_cfg = T.tiny_qwen3_moe_config()  # 4 query heads, 2 KV heads of 16
    qwen = plan(family_of(qwen_cfg).sharded_declarations(qwen_cfg), mesh).specs
    assert qwen["layers.1.mlp.gate_up"] == P(("expert", "tensor"))
    assert qwen["layers.1.attn.q"] == P(None, "tensor") == qwen["layers.1.attn.k"]  # one KV head per shard
    assert qwen["layers.1.attn.o"] == P("tensor")
    assert qwen["embed"] == P("tensor") and qwen["lm_head"] == P(None, "tensor")
    assert qwen["layers.1.mlp.router"] == P() and qwen["layers.1.input_norm"] == P()
    # on tensor=4 the 2 KV heads do not divide: the whole attention stays replicated (q too: no split GQA group)
    qwen4 = plan(family_of(qwen_cfg).sharded_declarations(qwen_cfg), abstract(2, 4)).specs
    assert qwen4["layers.1.attn.q"] == P() == qwen4["layers.1.attn.k"] == qwen4["layers.1.attn.o"]
    assert qwen4["layers.1.mlp.down"] == P(("expert", "tensor")) and qwen4["embed"] == P("tensor")
    gpt_cfg = T.tiny_gpt_oss_config()
    gpt = plan(family_of(gpt_cfg).sharded_declarations(gpt_cfg), abstract(4, 2)).specs
    assert gpt["layers.0.mlp.gate_up#blocks"] == P(("expert", "tensor")) == gpt["layers.0.mlp.down_bias"]
    assert gpt["layers.0.attn.k"] == P(None, "tensor") and gpt["layers.0.attn.sinks"] == P("tensor")
    assert gpt["layers.0.attn.q_bias"] == P("tensor") and gpt["layers.0.attn.o_bias"] == P()
    q35_cfg = T.tiny_qwen3_5_config()
    q35 = plan(family_of(q35_cfg).sharded_declarations(q35_cfg), mesh).specs
    assert q35["layers.0.mixer.qkv"] == P()  # fused DeltaNet projection: replicated (docs/sharding.md)
    assert q35["layers.0.mlp.shared.gate"] == P(None, "tensor") and q35["layers.0.mlp.shared.down"] == P("tensor")
    # 8 experts on expert=8 x tensor=2: only expert divides; on expert=3: replicated
    assert plan(family_of(gpt_cfg).sharded_declarations(gpt_cfg), abstract(8, 2)).specs[
        "layers.0.mlp.gate_up#scales"] == P("expert")
    assert plan(family_of(gpt_cfg).sharded_declarations(gpt_cfg), abstract(3, 1)).specs[
        "layers.0.mlp.gate_up#scales"] == P()


def test_per_device_bytes_shrink_with_the_mesh():
    cfg = T.tiny_qwen3_moe_config()
    declared = family_of(cfg).sharded_declarations(cfg)
    one, eight = plan(declared, abstract(1, 1)), plan(declared, abstract(4, 2))
    assert one.device_bytes == one.total_bytes
    assert eight.device_bytes < one.total_bytes / 2  # experts / 8, vocab / 2, attention / 2


# ---------------------------------------------------------------------------------------------------------
# generation on meshes of 8 CPU devices (subprocesses)
# ---------------------------------------------------------------------------------------------------------

def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.pop("JAX_PLATFORMS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_checks(tmp_path, cases: list[str], quick: bool = False) -> dict:
    out = tmp_path / "mesh_checks.json"
    env = _env(8)
    if quick:  # the MoE layer's check on a subset of its dispatch x width x format grid (QUICK_MOE)
        env["MESH_CHECKS_QUICK"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mesh_checks.py"), str(out), *cases], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def assert_meaningful(single: dict) -> None:
    # the reference run must exercise the rounds: several distinct tokens, some proposals accepted
    tokens = [t for seq in single["tokens"] for t in seq]
    assert len(set(tokens)) >= 3, single
    assert max(max(a) for a in single["acceptance"]) >= 2, single


def assert_case(report: dict, case: str, *, experts_per_device: int) -> None:
    single, mesh = report[case]["single"], report[case]["mesh"]
    assert mesh["expert_rows_per_device"] == experts_per_device, mesh
    for mode in ("greedy", "sampled"):
        if mode in mesh:
            assert_meaningful(single[mode])
            assert mesh[mode]["tokens"] == single[mode]["tokens"], (case, mode)
            assert mesh[mode]["acceptance"] == single[mode]["acceptance"], (case, mode)


def assert_moe(report: dict) -> None:
    for spec, row in report["moe"].items():
        for key, diff in row.items():
            if key.count("/") != 2:
                continue
            dispatch, case, fmt = key.split("/")
            assert diff < 1e-5, (spec, key, row)  # fp32 tables: the same sums, at most reassociated
            if dispatch == "psum":
                assert row[key + "/all_reduce"] >= 1 and row[key + "/all_to_all"] == 0, (spec, key, row)
            else:  # the all-to-all returns the rows; the psum fallback is compiled beside it
                assert row[key + "/all_to_all"] >= 1 and row[key + "/all_reduce"] >= 1, (spec, key, row)
        from dflash_jax.nn.moe import all_to_all_capacity

        assert all_to_all_capacity(16, 2, 8, 1) == 8  # the overflow case's routing (16 rows to one owner) overflows
        # the all-to-all path combines each token's k products in the single-device order: equal within one
        # fp32 rounding of the sum at most (measured: bit-equal); the overflow case took the psum fallback
        assert row["all_to_all/12/dense"] <= 1e-6 and row["all_to_all/overflow/dense"] < 1e-5, (spec, row)


FAST_CASES = ["gpt_oss:expert=4,tensor=2", "qwen3_5:expert=4,tensor=2:a2a"]


def test_fast_mesh_generation_equals_one_device(tmp_path):
    """One subprocess, 8 CPU devices, mesh 4 x 2: gpt-oss (MXFP4 experts with biases, sinks, sliding windows)
    greedy on the psum dispatch, Qwen3.5 (DeltaNet, shared expert) greedy with every MoE layer on the
    all-to-all dispatch; equal to one device token for token. The MoE layer alone under both dispatches (its
    edge cases; the slow matrix runs the whole grid, and sampling)."""
    report = run_checks(tmp_path, FAST_CASES, quick=True)
    assert report["devices"] == 8
    gpt = report[FAST_CASES[0]]["mesh"]
    assert gpt["q_cols_per_device"] * 2 == gpt["q_cols"]  # 2 GQA groups (of 2 query heads) over tensor=2
    assert_moe(report)
    for case in FAST_CASES:
        assert_case(report, case, experts_per_device=1)


@pytest.mark.slow
def test_mesh_matrix_equals_one_device(tmp_path):
    """Meshes 1x8, 2x4, 8x1 (expert x tensor; the tiny models' 2 KV heads keep attention replicated there) and
    4x2, data=2 x 2 x 2 (attention split over tensor=2) for all three families (Qwen3 also with NVFP4 experts),
    greedy and sampled; the all-to-all dispatch on 8x1 (gpt-oss), data=2 x 2 x 2 (Qwen3) and 2x4 (NVFP4)."""
    cases = [f"{fam}:{mesh}:sample" for fam in ("qwen3", "gpt_oss", "qwen3_5")
             for mesh in ("expert=1,tensor=8", "expert=2,tensor=4", "expert=8,tensor=1")]
    cases += ["qwen3_nvfp4:expert=4,tensor=2:sample", "qwen3:data=2,expert=2,tensor=2:sample",
              "qwen3_5:expert=4,tensor=2:sample", "gpt_oss:expert=8,tensor=1:sample:a2a",
              "qwen3:data=2,expert=2,tensor=2:sample:a2a", "qwen3_nvfp4:expert=2,tensor=4:a2a"]
    report = run_checks(tmp_path, cases)
    assert_moe(report)
    for case in cases:
        per_device = 2 if case.startswith("qwen3:data=2") else 1
        assert_case(report, case, experts_per_device=per_device)


@pytest.mark.slow
def test_engine_and_tree_on_meshes_equal_one_device(tmp_path):
    """The serving engine (`Engine(mesh=)`, 2 slots, greedy and sampled requests) and tree verification
    (`generate_tree`, budget 8, branch 2) on meshes of 8 CPU devices: the same tokens and acceptance as on one
    device."""
    cases = ["qwen3:expert=4,tensor=2:engine", "gpt_oss:expert=2,tensor=4:engine", "gpt_oss:expert=8,tensor=1:tree",
             "qwen3_5:expert=4,tensor=2:tree"]
    report = run_checks(tmp_path, cases)
    for case in cases:
        single, mesh = report[case]["single"], report[case]["mesh"]
        assert set(single) == set(mesh) and single, case
        for mode in single:
            assert_meaningful(single[mode])
            assert mesh[mode] == single[mode], (case, mode)


@pytest.mark.slow
def test_offload_on_meshes_equals_one_device(tmp_path):
    """Offloaded generation with a 6-slot cache (passes, evictions across layers, poisoned free slots) on 2x4
    (gpt-oss) and 8x1 (Qwen3) with `ShardedExpertCache`: each device holds its share of the cache's slots, and
    greedy and sampled tokens equal the single-device offloaded run's."""
    cases = ["gpt_oss:expert=2,tensor=4:offload", "qwen3:expert=8,tensor=1:offload"]
    report = run_checks(tmp_path, cases)
    for case in cases:
        single, mesh = report[case]["single"], report[case]["mesh"]
        for mode in ("greedy", "sampled"):
            assert_meaningful(single[mode])
            assert mesh[mode] == single[mode], (case, mode)
            assert mesh[mode + "_fetched"] == single[mode + "_fetched"] > 0, case  # the same copies happened
            rows, per_device = mesh[mode + "_slab_rows"][0], mesh[mode + "_rows_per_device"][0]
            assert rows == 8 * per_device and rows >= 7, case  # 6 slots + the trap row, split over 8 devices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5"])
def test_two_processes_equal_one_device(tmp_path, family):
    """Two processes on 127.0.0.1 (jax.distributed, 4 CPU devices each) run one expert=4 x tensor=2 mesh;
    tokens equal the single-device run of the same pair."""
    port, out = _free_port(), tmp_path / "multihost.json"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_run.py"), str(port), "2", str(i), "4",
                               "expert=4,tensor=2", str(out), family], env=_env(4), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=1200)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    got = json.loads(out.read_text())
    pair = mesh_checks.case_pair(family)
    want = {"greedy": mesh_checks._generate(pair, mesh_checks.CASE_PROMPTS, SamplingParams()),
            "sampled": mesh_checks._generate(pair, mesh_checks.CASE_PROMPTS, mesh_checks.SAMPLED)}
    assert got["expert_rows_per_device"] == 1
    for mode in ("greedy", "sampled"):
        assert_meaningful(want[mode])
        assert got[mode] == want[mode], mode


@pytest.mark.parametrize("argv, says", [
    (["--mesh", "expert=4,tensr=2"], "--mesh part 'tensr=2' is not AXIS=SIZE"),
    (["--mesh", "expert=4,tensor=2"], "needs 8 devices, 1 available"),
    (["--mesh", "expert=2", "--offload", "--expert-budget-mb", "1", "--placement", "hybrid"],
     "--placement hybrid does not combine with --mesh"),
])
def test_cli_mesh_errors_name_cause_and_fix(capsys, argv, says):
    from dflash_jax.cli.generate import main

    code = main([*argv, "--prompt-ids", "5,6"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.slow
def test_cli_mesh_equals_one_device(tmp_path):
    """dflash-generate --mesh expert=4,tensor=2 on the shipped pair (restored into its shardings), and with
    --offload on one device and on the mesh (each device caching its share): the same tokens as without a mesh."""
    runs = {}
    offload = ["--offload", "--expert-budget-mb", "0.3"]
    for name, extra in {"single": [], "mesh": ["--mesh", "expert=4,tensor=2"], "offload": offload,
                        "offload_mesh": [*offload, "--mesh", "expert=4,tensor=2"]}.items():
        proc = subprocess.run([sys.executable, "-m", "dflash_jax.cli.generate", "--prompt-ids", "5,6,7,8",
                               "--max-new-tokens", "24", "--json", "--no-compile-cache", "--no-measure", *extra],
                              env=_env(8), capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(proc.stdout)
    assert runs["mesh"]["stats"]["mesh"] == "data=1,expert=4,tensor=2"
    for name in ("mesh", "offload", "offload_mesh"):
        assert runs[name]["tokens"] == runs["single"]["tokens"], name
        assert runs[name]["acceptance_lengths"] == runs["single"]["acceptance_lengths"], name
    assert runs["offload_mesh"]["stats"]["mesh"] == "data=1,expert=4,tensor=2"
    assert max(runs["single"]["acceptance_lengths"]) >= 2


def test_checkpoint_restores_into_mesh_shardings():
    """`dflash_jax.load(mesh=)` hands orbax sharded targets: every array arrives as a NamedSharding of the
    mesh, with the same values as the plain load (a one-device mesh here; 8 devices: the slow CLI test)."""
    import jax
    import numpy as np

    import dflash_jax

    mesh = make_mesh("expert=1")
    plain, placed = dflash_jax.load(verify=False), dflash_jax.load(verify=False, mesh=mesh)
    for model in ("target", "draft"):
        a, b = jax.tree.leaves(getattr(plain, model)), jax.tree.leaves(getattr(placed, model))
        assert len(a) == len(b) > 10
        for x, y in zip(a, b):
            assert isinstance(y.sharding, jax.sharding.NamedSharding) and y.sharding.mesh == mesh
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(UsageError, match="expert_memory='pinned_host' with a mesh"):
        dflash_jax.load(verify=False, mesh=mesh, expert_memory="pinned_host")
