"""The GPU path compiled for an H200 without a GPU: XLA:GPU + ptxas on abstract arrays (nothing allocated).

Skipped unless the `gpu-compile` extra is installed (`pip install -e '.[gpu-compile]'`). The fast set compiles
the FP4 kernel at the verify shapes of the three target models (about a second each); the real-size verify
and draft rounds and the offloaded layer-wise pieces are `slow` (tens of seconds to minutes of XLA compile
each on two cores). `benchmarks/h200_compile.py` writes the same compiles' report.
"""

from __future__ import annotations

import jax
import pytest

from tests.gpu_compile import deviceless as dl

if not dl.plugin_available():
    pytest.skip("needs the gpu-compile extra (jax-cuda12-plugin, jax-cuda12-pjrt, triton)", allow_module_level=True)
if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present: the kernel suite runs on it instead", allow_module_level=True)

from tests.gpu_compile import programs as pg  # noqa: E402

GIB = 2**30
VERIFY_SHAPES = [s for s in pg.kernel_shapes(("verify",))]
PREFILL_SHAPES = [s for s in pg.kernel_shapes(("prefill",))]


def _compile_kernel(shape):
    return dl.compile_for_h200(pg.kernel_program, *pg.kernel_args(shape), name=shape.label,
                               kernel_names=("grouped_matmul",))


def _check_kernel(shape, c):
    assert len(c.kernels) == 1, [k.name for k in c.kernels]
    k = c.kernels[0]
    assert k.name == "mxfp4_grouped_matmul"
    # the launch grid is (work items, N tiles) as the wrapper computes it
    from pallas_kernels import fp4_grouped_matmul as fgm

    t = fgm.default_tuning(shape.m, shape.k, shape.n)
    assert k.grid == (fgm.max_work_items(shape.m, shape.groups, t.block_m), -(-shape.n // t.block_n), 1)
    assert k.threads == 32 * t.num_warps
    # tensor cores, bf16 inputs with fp32 accumulation: the warp-level mma.sync at 16-row verify tiles,
    # Hopper's warpgroup wgmma at 64-row prefill tiles
    tensor_core = [m for m in k.mma if (m.startswith("mma.sync") or m.startswith("wgmma.mma_async"))
                   and ".f32.bf16.bf16" in m]
    assert tensor_core, k.mma
    # fits an SM: shared memory under the opt-in limit, registers under 64K per block
    assert 0 < k.shared_memory_bytes <= dl.H200["shared_memory_per_block_optin"]
    assert k.registers is not None and k.registers * k.threads <= dl.H200["registers_per_sm"]
    # arguments are the whole weight table plus activations; temporaries are activation-sized (the padded even /
    # odd activation columns, the output buffer), never a dequantized copy of the table
    table = shape.groups * shape.n * (shape.k // 2 + shape.k // 32)
    activations = 2 * (shape.m + t.block_m) * (shape.k + shape.n)  # bf16 x and y
    assert table <= c.argument_bytes < table + 4 * shape.m * shape.k + 4 * shape.groups + 1024
    assert c.temp_bytes < table / 8 + 2 * activations
    assert c.flops > 0 and c.bytes_accessed > 0


@pytest.mark.parametrize("shape", VERIFY_SHAPES, ids=[f"{s.model}-{s.matrix}" for s in VERIFY_SHAPES])
def test_fp4_kernel_compiles_for_h200_at_verify_shapes(shape):
    _check_kernel(shape, _compile_kernel(shape))


@pytest.mark.slow
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=[f"{s.model}-{s.matrix}" for s in PREFILL_SHAPES])
def test_fp4_kernel_compiles_for_h200_at_prefill_shapes(shape):
    _check_kernel(shape, _compile_kernel(shape))


def test_the_h200_is_a_cuda_sm90_target():
    dev = dl.h200()
    assert dev.platform in ("gpu", "cuda") and dev.device_kind == dl.H200["name"]


@pytest.mark.parametrize("pair_name", ["tiny_pair", "tiny_pair_qwen3_5"])
def test_a_shipped_pair_round_leaves_no_loop_to_the_host(pair_name):
    """One round of a shipped pair (FP4 experts through the kernel) runs as CUDA graphs and conditionals: no
    loop the host drives, whose every trip would read a predicate back (the kernel's tile schedule once had one,
    `jnp.searchsorted`'s scan, in every MoE layer). The program of greedy rows (`SpecConfig.greedy_only`, which
    `prepare` picks on a GPU) is one graph: no conditional, and nothing launched outside it (a DeltaNet rollback's
    slice update once ran as a copy of its own between graphs, one per layer)."""
    import dataclasses
    import functools

    import dflash_jax
    from dflash_jax.spec import session
    from dflash_jax.spec.round import Chain, round_step
    from pallas_kernels import target

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS[pair_name])
    prompt = [[5 + i % 50 for i in range(32)]]
    prep = session.prepare(pair, prompt, block_size=4, max_new_tokens=32)
    with target.compiling_for("gpu"):
        assert session.prepare(pair, prompt, block_size=4, max_new_tokens=32).spec.greedy_only
    state = jax.eval_shape(functools.partial(session.begin_arrays, spec=prep.spec), pair.target, pair.draft,
                           prep.tokens, prep.lengths, prep.params, prep.key_data, prep.key_fold)

    def one(target, draft, state, *, spec):
        return round_step(target, draft, state, spec, Chain(4))[0]

    general = dl.compile_for_h200(one, pair.target, pair.draft, state, structure=True, donate_argnums=(2,),
                                  spec=dataclasses.replace(prep.spec, greedy_only=False))
    assert general.launches is not None and general.launches.kernels > 50 and general.launches.graphs >= 1
    assert general.launches.host_loops == 0, general.launches
    assert general.launches.host_conditionals >= 1  # sampled rows may join: the sampling work is skipped at run time
    greedy = dl.compile_for_h200(one, pair.target, pair.draft, state, structure=True, donate_argnums=(2,),
                                 spec=dataclasses.replace(prep.spec, greedy_only=True))
    runs = greedy.launches
    assert (runs.graphs, runs.host_loops, runs.host_conditionals, runs.outside) == (1, 0, 0, 0), runs
    assert runs.kernels > 50


@pytest.mark.slow
def test_a_serving_call_of_greedy_rows_runs_each_round_as_one_graph():
    """The serving engine's call of several rounds (`serve.runner.burst_rounds`, the shipped pair, 4 slots, block 4): the
    host runs its loop over rounds (the loop's condition, two small kernels, and its predicate each round), and each
    round of greedy rows is one CUDA graph (`RoundRunner.round_spec`: `SpecConfig.greedy_only`); the general
    program's round is cut by its two conditionals."""
    import dataclasses

    import numpy as np

    import dflash_jax
    from dflash_jax.serve import runner as rn
    from dflash_jax.serve.engine import Engine

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    eng = Engine(pair, slots=4, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=64, row_buckets=None,
                 round_seconds={1: 1.0, 4: 1.2}, lanes=1)
    eng.warmup([16])
    r = eng.runner
    runs = {}
    for greedy in (False, True):
        c = dl.compile_for_h200(rn.burst_rounds, pair.target, pair.draft, r.state, np.zeros(r.slots, bool),
                                np.int32(4), np.bool_(False), structure=True,
                                spec=dataclasses.replace(r.spec, greedy_only=greedy), proposer=eng._proposer(4, False),
                                rows=r.slots, length=r.length_buckets[-1], in_place=r.in_place)
        runs[greedy] = c.launches
    # before the loop, its body, after it: three graphs; outside them only the loop's condition
    assert (runs[True].graphs, runs[True].host_loops, runs[True].host_conditionals) == (3, 1, 0), runs[True]
    assert runs[True].outside <= 2 and runs[True].in_conditionals == 0
    assert runs[False].host_conditionals == 2 and runs[False].graphs > runs[True].graphs, runs[False]


@pytest.mark.slow
@pytest.mark.parametrize("model", list(pg.MODELS))
def test_verify_and_draft_rounds_compile_at_real_size(model):
    spec, state, drafted = pg.round_inputs(model)
    target, draft = pg.abstract_weights(model)
    expert_bytes = pg.expert_bytes(model)
    verify = dl.compile_for_h200(pg.verify_program, target, state, drafted, spec=spec, name=f"{model} verify",
                                 kernel_names=("grouped_matmul",), donate_argnums=(1,))
    # the verify reads the FP4 experts through the kernel (one launch per MoE matrix shape), never a dense copy
    assert verify.kernels and all("grouped_matmul" in k.name for k in verify.kernels)
    assert verify.argument_bytes > expert_bytes
    assert verify.temp_bytes < 0.05 * expert_bytes, (verify.temp_bytes / GIB, expert_bytes / GIB)
    assert verify.peak_bytes < dl.H200["memory_bytes"]
    # attention over the 8192-row cache takes the dense path on a GPU: no loop the host drives (a wait per trip)
    assert verify.launches is not None and verify.launches.host_loops == 0, verify.launches
    drafted_c = dl.compile_for_h200(pg.draft_program, target, draft, state, spec=spec, name=f"{model} draft")
    assert drafted_c.peak_bytes < verify.peak_bytes and drafted_c.flops > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", list(pg.MODELS))
def test_offloaded_layerwise_pieces_compile(model):
    pieces = pg.offload_pieces(model)
    assert any(name.startswith("experts") for name in pieces)
    for name, (fn, args, kwargs) in pieces.items():
        c = dl.compile_for_h200(fn, *args, name=f"{model} {name}", kernel_names=("grouped_matmul",), **kwargs)
        if name.startswith("experts"):
            assert c.kernels, f"{name}: the pooled experts run through the FP4 kernel"
        assert c.peak_bytes < dl.H200["memory_bytes"]
