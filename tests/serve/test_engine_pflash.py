"""PFlash in the serving engine (`Engine(compress=pflash.Compressor(...))`): a long prompt is scored and compressed
as it is submitted, and its prefill (whole, or by chunks between the live rows' rounds) runs on the kept tokens at
their original positions. Each request's output equals the same prompt and kept tokens run alone by
`pflash.generate` (greedy: DFlash over a compressed prefill is plain greedy over it), short prompts are untouched
(their outputs equal `spec.generate`'s), proposals are accepted, and nothing compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax import pflash
from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine, generate as serve_generate
from dflash_jax.spec import TreeShape
from dflash_jax.spec import generate as spec_generate

RNG = np.random.default_rng(5)
LONG = [RNG.integers(0, 1000, n).tolist() for n in (300, 190)]
SHORT = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 56))]
PROMPTS = [LONG[0], SHORT[0], LONG[1], SHORT[1]]
BUDGETS = [24, 30, 20, 26]


@pytest.fixture(scope="module")
def compressor(pair):
    return pflash.Compressor(pflash.Scorer.from_pair(pair), keep_ratio=0.4, min_tokens=100)


def _served(pair, compressor, prompts, proposer=None, prefill_chunk=None, **kw):
    eng = Engine(pair, slots=len(prompts) - 1, max_prompt_len=320, max_new_tokens=32, compress=compressor,
                 proposer=proposer, prefill_chunk=prefill_chunk, **kw)
    # the prefill buckets these prompts use (the kept lengths of the long ones), the scorer's every bucket
    eng.warmup([len(p) if compressor(p) is None else len(compressor(p)) for p in prompts])
    with CompileCounter() as counter:
        reqs = serve_generate(eng, prompts, max_new_tokens=BUDGETS[:len(prompts)])
    assert counter.compiles == 0
    return eng, reqs


def _check(pair, compressor, eng, reqs, prompts):
    for i, r in enumerate(reqs):
        prompt = prompts[i]
        kept = compressor(prompt)
        if len(prompt) >= compressor.min_tokens:
            assert kept is not None and len(kept) < len(prompt)
            assert r.kept is not None and np.array_equal(r.kept, kept)
            alone = pflash.generate(pair, [prompt], [kept], max_new_tokens=BUDGETS[i]).tokens[0]
        else:
            assert kept is None and r.kept is None
            alone = spec_generate(pair, [prompt], max_new_tokens=BUDGETS[i]).tokens[0]
        assert r.tokens == alone, i
    assert max(max(r.acceptance) for r in reqs) > 1  # proposals were accepted
    assert eng.compressed_tokens == sum(len(p) - len(compressor(p)) for p in prompts if p in LONG)


def test_compressed_prompts_serve_as_pflash_alone(pair, compressor):
    """Whole prefills (no chunking): a long prompt compressed to 40% and a short one untouched, on one slot."""
    prompts = PROMPTS[:2]
    eng, reqs = _served(pair, compressor, prompts)
    _check(pair, compressor, eng, reqs, prompts)
    assert eng.prefill_tokens < sum(len(p) for p in prompts)


@pytest.mark.slow
def test_compressed_prompts_by_chunks_and_trees(pair, compressor):
    """Two long prompts and two short ones on three slots: the kept tokens join by 64-token chunks between the live
    rows' rounds, and every round verifies a token tree (whose rows sit at the compressed rows' positions too)."""
    eng, reqs = _served(pair, compressor, PROMPTS, proposer=TreeShape(16, 4), prefill_chunk=64)
    _check(pair, compressor, eng, reqs, PROMPTS)
    assert eng.prefill_chunks >= 2


@pytest.mark.slow
def test_compressed_prompts_with_offloaded_experts(pair, compressor):
    """The offloaded engine (experts in host memory, the smallest device cache that runs) prefills the kept
    tokens layer by layer at their positions: the same outputs."""
    import dflash_jax
    from dflash_jax.offload import HostExpertStore, min_budget_bytes

    offloaded = dflash_jax.load(expert_memory="pinned_host")
    store = HostExpertStore(offloaded.target)
    eng, reqs = _served(offloaded, compressor, PROMPTS[:3], experts="offload", budget_bytes=min_budget_bytes(store),
                        store=store, bandwidth=1e9)
    _check(pair, compressor, eng, reqs, PROMPTS[:3])


def test_bad_compressor_settings_fail_at_construction(pair):
    scorer = pflash.Scorer.from_pair(pair)
    with pytest.raises(ValueError, match="budget"):
        pflash.Compressor(scorer, budget=8)  # below the sink + window always kept
    with pytest.raises(ValueError, match="min_tokens"):
        pflash.Compressor(scorer, keep_ratio=0.5, min_tokens=0)
    with pytest.raises(TypeError, match="Scorer"):
        pflash.Compressor("scorer", keep_ratio=0.5)
    with pytest.raises(TypeError, match="Compressor"):
        Engine(pair, slots=1, compress=lambda p: None)


@pytest.mark.parametrize("argv,message", [
    (["--pflash-keep", "1.5"], "--pflash-keep must be a fraction in \\(0, 1\\)"),
    (["--pflash-keep", "0.5", "--pflash-min-tokens", "0"], "--pflash-min-tokens must be >= 1"),
    (["--pflash-keep", "0.5", "--pflash-scorer", "/nonexistent/scorer"], "is not a convert-weights checkpoint"),
    (["--pflash-scorer", "/nonexistent/scorer"], "only applies with --pflash-keep"),
])
def test_serve_pflash_flags(argv, message):
    from dflash_jax.cli.serve import build_parser, check_args
    from dflash_jax.errors import UsageError

    with pytest.raises(UsageError, match=message):
        check_args(build_parser().parse_args(argv))
