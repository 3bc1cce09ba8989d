"""PFlash: the selection's guarantees, explicit RoPE positions and the position offset in every family, and
generation from a compressed prefill (keep ratio 1 is the full prefill exactly; DFlash equals plain greedy
over the same compressed prefill; the draft's context is the kept rows at their positions)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import pflash, testing
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.spec import Buckets, generate

# one cache bucket for every run here: the speculative loop compiles once per block size
BUCKETS = Buckets(cache=512)

FAMILIES = {"qwen3_moe": testing.tiny_qwen3_moe_config, "qwen3_5": testing.tiny_qwen3_5_config,
            "gpt_oss": testing.tiny_gpt_oss_config}


@pytest.fixture(scope="module")
def shipped():
    pair = dflash_jax.load(dequantize_experts="auto")
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 300).tolist()
    return pair, pflash.Scorer.from_pair(pair), prompt


# ---- selection --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_ratio,budget", [(0.5, None), (0.25, None), (0.1, None), (None, 100), (None, 37)])
def test_selection_keeps_sinks_window_and_whole_chunks_within_budget(keep_ratio, budget):
    n, window, sink, chunk = 300, 32, 4, 16
    scores = np.random.default_rng(0).random(n)
    kept = pflash.select_tokens(scores, keep_ratio=keep_ratio, budget=budget, window=window, sink=sink, chunk=chunk)
    k = pflash.keep_count(n, keep_ratio=keep_ratio, budget=budget, window=window, sink=sink)
    assert np.all(np.diff(kept) > 0) and kept.dtype == np.int32
    assert set(range(sink)) <= set(kept.tolist()) and set(range(n - window, n)) <= set(kept.tolist())
    assert len(kept) <= k and len(kept) > k - chunk  # within the budget, short of it by less than a chunk
    if budget is not None:
        assert len(kept) <= budget
    else:
        assert k == max(window + sink, int(np.ceil(keep_ratio * n)))
    rest = sorted(set(kept.tolist()) - set(range(sink)) - set(range(n - window, n)))
    for c in {i // chunk for i in rest}:  # every other kept token belongs to a whole aligned chunk
        span = set(range(c * chunk, min(n, (c + 1) * chunk)))
        assert span <= set(kept.tolist()), c


def test_selection_prefers_the_attended_chunks():
    scores = np.full(256, 1.0)
    scores[100:116] = 50.0  # one chunk the window attends to
    kept = pflash.select_tokens(scores, budget=4 + 32 + 16, window=32, sink=4, chunk=16)
    assert set(range(96, 112)) <= set(kept.tolist())  # the aligned chunk holding most of the mass
    assert len(kept) == 52


@pytest.mark.parametrize("kw,match", [({"keep_ratio": 0.0}, "keep_ratio"), ({"keep_ratio": 1.5}, "keep_ratio"),
                                      ({"budget": 10}, "below"), ({}, "exactly one"),
                                      ({"keep_ratio": 0.5, "budget": 100}, "exactly one")])
def test_selection_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        pflash.select_tokens(np.ones(200), **kw)


# ---- positions in every family --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                        pytest.param("gpt_oss", marks=pytest.mark.slow)])
def family_model(request):
    cfg = FAMILIES[request.param]()
    fam = family_of(cfg)
    return fam, cfg, fam.random_weights(cfg, jax.random.key(0))


def test_explicit_positions_and_offset_match_rope_positions(family_model):
    fam, cfg, w = family_model
    n = 48
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size - 1, (1, n)), jnp.int32)
    cache = fam.init_cache(cfg, 1, 64, verify_width=4)
    full = fam.forward_jit(w, toks, cache, cfg, logits="all")
    same = fam.forward_jit(w, toks, cache, cfg, logits="all", positions=jnp.arange(n)[None])
    np.testing.assert_array_equal(np.asarray(same.logits), np.asarray(full.logits))  # nothing dropped: identical
    kept = np.r_[0:4, 20:36, 40:48]
    m = len(kept)
    sub = toks[:, kept]
    at_slots = fam.forward_jit(w, sub, cache, cfg, logits="last")
    at_pos = fam.forward_jit(w, sub, cache, cfg, logits="last", positions=jnp.asarray(kept)[None])
    assert not np.allclose(np.asarray(at_slots.logits), np.asarray(at_pos.logits), atol=1e-4)  # RoPE reads positions
    assert int(at_pos.cache.position_offset[0]) == n - m
    # a continuation through the offset equals one forward of the kept tokens + the next at explicit positions
    nxt = jnp.array([[5, 6, 7]], jnp.int32)
    stepped = fam.forward_jit(w, nxt, at_pos.cache, cfg, logits="all")
    once = fam.forward_jit(w, jnp.concatenate([sub, nxt], 1), cache, cfg, logits="all",
                       positions=jnp.asarray(np.r_[kept, n:n + 3])[None])
    np.testing.assert_allclose(np.asarray(stepped.logits), np.asarray(once.logits)[:, m:], rtol=2e-4, atol=2e-4)
    assert int(stepped.cache.position_offset[0]) == n - m and int(stepped.cache.lengths[0]) == m + 3


# ---- generation from a compressed prefill -----------------------------------------------------------------

def test_keep_ratio_one_reproduces_the_full_prefill(shipped):
    pair, scorer, prompt = shipped
    kept = pflash.compress(scorer, prompt, keep_ratio=1.0)
    np.testing.assert_array_equal(kept, np.arange(len(prompt)))
    full = generate(pair, [prompt], max_new_tokens=24, buckets=BUCKETS)
    again = pflash.generate(pair, [prompt], [kept], max_new_tokens=24, buckets=BUCKETS)
    assert again.tokens == full.tokens and again.acceptance_lengths == full.acceptance_lengths
    s = again.stats  # the prefill timed apart, in wall and process CPU seconds
    assert 0 < s["prefill_s"] <= s["seconds"] and 0 < s["prefill_cpu_s"] <= s["cpu_s"]


def test_dflash_over_a_compressed_prefill_equals_plain_greedy_over_it(shipped):
    pair, scorer, prompt = shipped
    kept = pflash.compress(scorer, prompt, keep_ratio=0.25)
    assert 75 - 16 < len(kept) <= 75 and kept[-1] == len(prompt) - 1
    spec = pflash.generate(pair, [prompt], [kept], max_new_tokens=48, buckets=BUCKETS)
    plain = pflash.generate(pair, [prompt], [kept], max_new_tokens=48, block_size=1, buckets=BUCKETS)
    assert spec.tokens == plain.tokens
    assert spec.stats["mean_acceptance"] > 1.0, spec.stats  # proposals were really accepted
    assert spec.stats["pflash"] == {"prompt_tokens": [300], "kept_tokens": [len(kept)]}
    slots = pflash.generate(pair, [[prompt[i] for i in kept]], max_new_tokens=48, block_size=1, buckets=BUCKETS)
    assert slots.tokens != plain.tokens  # the original positions matter (not a prefill of the kept text alone)


@pytest.mark.parametrize("proposer,driver", [("tree", "jit"), ("head-chain", "stepping"),
                                             pytest.param("chain", "capacity", marks=pytest.mark.slow)])
def test_every_proposer_and_driver_runs_over_a_compressed_prefill(shipped, proposer, driver):
    """Compression is a prefill strategy (`prepare(kept=)`), so every proposer and driver runs over it: a token
    tree in the jitted loop, the branch head's chain stepped from Python, and the chain in capacity mode (the kept
    tokens prefilled by chunks of a fixed buffer, one program for any prompt): each equals plain greedy over the
    same compressed prefill, with proposals accepted (the tree off the chain too)."""
    from dflash_jax.api import make_proposer
    from dflash_jax.spec import generate_stepping
    from dflash_jax.spec.loop import LOOP_BUCKETS

    pair, scorer, prompt = shipped
    kept = pflash.compress(scorer, prompt, keep_ratio=0.25)
    buckets = LOOP_BUCKETS if driver == "capacity" else BUCKETS
    plain = pflash.generate(pair, [prompt], [kept], max_new_tokens=48, block_size=1, buckets=buckets)
    run = generate_stepping if driver == "stepping" else generate
    out = run(pair, [prompt], max_new_tokens=48, proposer=make_proposer(pair, proposer), buckets=buckets, kept=[kept])
    assert out.tokens == plain.tokens
    assert out.stats["mean_acceptance"] > 1.0, out.stats
    assert out.stats["pflash"] == {"prompt_tokens": [300], "kept_tokens": [len(kept)]}


def test_the_draft_context_is_the_kept_rows_at_their_positions(shipped):
    pair, scorer, prompt = shipped
    kept = pflash.compress(scorer, prompt, keep_ratio=0.25)  # the programs of the test above
    batch = pflash.prepare_compressed(pair, [prompt], [kept], max_new_tokens=8, buckets=BUCKETS)
    state = pflash.begin_compressed(pair, batch)
    spec, m = batch.spec, len(kept)
    dc = state.draft_cache
    assert int(dc.lengths[0]) == m and int(dc.position_offset[0]) == len(prompt) - m
    assert int(state.target_cache.lengths[0]) == m and int(state.target_cache.position_offset[0]) == len(prompt) - m
    # the same rows built by hand: the target's taps of the kept tokens at their positions, projected at them
    fam = family_of(spec.target)
    cache = fam.init_cache(spec.target, 1, spec.max_len, verify_width=spec.block_size)
    toks = jnp.asarray(np.asarray(prompt)[kept])[None]
    out = fam.forward(pair.target, toks, cache, spec.target, tap_layers=spec.taps, logits="last",
                      positions=jnp.asarray(kept)[None])
    ref = draft_model.append_context(pair.draft, spec.draft, context_features=draft_model.context_features(out.taps),
                                     num_context=jnp.array([m]), positions=jnp.asarray(kept)[None],
                                     cache=draft_model.init_draft_cache(spec.draft, 1, spec.max_len, jnp.float32))
    for got, want in zip(dc.keys, ref.keys):
        np.testing.assert_allclose(np.asarray(got)[0, :, :m], np.asarray(want)[0, :, :m], rtol=1e-4, atol=1e-4)
    at_slots = draft_model.append_context(
        pair.draft, spec.draft, context_features=draft_model.context_features(out.taps), num_context=jnp.array([m]),
        cache=draft_model.init_draft_cache(spec.draft, 1, spec.max_len, jnp.float32))
    assert not np.allclose(np.asarray(dc.keys[0])[0, :, 4:m], np.asarray(at_slots.keys[0])[0, :, 4:m], atol=1e-3)


@pytest.mark.slow
def test_hybrid_target_dflash_equals_plain_over_a_compressed_prefill():
    pair = testing.random_pair(testing.tiny_qwen3_5_config())
    scorer = pflash.Scorer.from_pair(pair)
    prompt = np.random.default_rng(2).integers(0, 500, 200).tolist()
    kept = pflash.compress(scorer, prompt, keep_ratio=0.5)
    spec = pflash.generate(pair, [prompt], [kept], max_new_tokens=40, block_size=4)
    plain = pflash.generate(pair, [prompt], [kept], max_new_tokens=40, block_size=1)
    assert spec.tokens == plain.tokens
    assert spec.stats["mean_acceptance"] > 1.0, spec.stats


def test_compressed_positions_must_fit_the_target(shipped):
    pair, _, prompt = shipped
    with pytest.raises(ValueError, match="positions"):
        pflash.generate(pair, [prompt], [np.arange(len(prompt))], max_new_tokens=4000)
    with pytest.raises(ValueError, match="last token"):
        pflash.generate(pair, [prompt], [np.arange(10)], max_new_tokens=4)


@pytest.mark.parametrize("argv,match", [
    (["--pflash-keep", "0"], "fraction in \\(0, 1\\]"), (["--pflash-keep", "1.5"], "fraction in \\(0, 1\\]"),
    (["--pflash-keep", "nan"], "fraction"), (["--pflash-scorer", "somewhere"], "only applies with --pflash-keep"),
    (["--pflash-keep", "0.5", "--pflash-scorer", "no_such_dir"], "not a convert-weights checkpoint")])
def test_cli_refuses_bad_pflash_flags_before_loading(argv, match, capsys):
    from dflash_jax.cli.generate import main

    assert main(["--prompt-ids", "1,2,3"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


@pytest.mark.slow
def test_cli_generates_from_a_compressed_prefill(shipped, capsys):
    from dflash_jax.cli.generate import main

    _, _, prompt = shipped
    ids = ",".join(map(str, prompt))
    # with a token tree stepped from Python: compression is a prefill strategy of every proposer and driver
    assert main(["--prompt-ids", ids, "--pflash-keep", "0.25", "--max-new-tokens", "16", "--json", "--proposer", "tree",
                 "--tree-budget", "8", "--loop", "python"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["pflash"] == {"prompt_tokens": [300], "kept_tokens": [len(pflash.compress(
        pflash.Scorer.from_pair(shipped[0]), prompt, keep_ratio=0.25))]}
    assert len(out["tokens"]) == 16 or out["tokens"][-1] in shipped[0].target_cfg.eos_token_ids


@pytest.mark.slow
def test_offloaded_generation_from_a_compressed_prefill_equals_the_resident_one(shipped):
    from dflash_jax.offload import OffloadedGenerator

    pair, scorer, prompt = shipped
    kept = pflash.compress(scorer, prompt, keep_ratio=0.25)
    host_pair = dflash_jax.load(expert_memory="pinned_host")
    for block in (1, None):
        gen = OffloadedGenerator(host_pair, budget_bytes=int(0.5e6), prefetcher="none", block_size=block,
                                 buckets=BUCKETS)
        session = gen.prefill([prompt], max_new_tokens=32, kept=[kept])
        while not session.done:
            gen.round(session)
        got = gen.result(session)
        want = pflash.generate(pair, [prompt], [kept], max_new_tokens=32, block_size=block, buckets=BUCKETS)
        assert got.tokens == want.tokens
        off = got.stats["offload"]
        assert 0 < off["prefill_routed_bytes"] <= off["prefill_bytes"]
