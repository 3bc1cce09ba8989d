"""Chunked prefill in the engine: a long prompt joins one chunk per round while the live rows keep decoding,
then takes a free slot. Lossless (its greedy output equals it run alone, one-shot prefill, by `spec.generate`;
the others' outputs are unchanged), nothing compiles while serving, a cancellation mid-prefill frees its
slot, and `max_prompt_len` beyond the target's context is one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.spec import generate as spec_generate

CHUNK = 16
LONG = [int(t) for t in np.random.default_rng(5).integers(3, 1000, 70)]  # 5 chunks: 4 x 16 and a ragged 6
SHORT = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300]]


@pytest.fixture(scope="module")
def chunk_engine(pair):
    from dflash_jax.serve.engine import Engine

    # the chunk mechanics with every chunk run (the prefix cache would skip the chunks of a prompt seen before)
    eng = Engine(pair, slots=3, max_prompt_len=96, max_new_tokens=64, max_queue=8, prefill_chunk=CHUNK, widths=None,
                 row_buckets=None, prefix_cache_bytes=0)
    eng.warmup()
    return eng


# the last chunk's program donates the prefill's caches, not its logits (the engine keeps them): a donated buffer
# no result could reuse was a warning in every server log, and a buffer freed under the engine had it been reused
@pytest.mark.filterwarnings("error:Some donated buffers were not usable")
def test_long_prompt_joins_by_chunks_while_others_decode(chunk_engine, pair):
    eng = chunk_engine
    infos = []
    eng.observers.append(infos.append)
    before = eng.prefill_chunks, eng.prefill_tokens
    try:
        with CompileCounter() as counter:
            short = [eng.submit(p, max_new_tokens=64, stop_ids=[]) for p in SHORT]
            eng.step()
            eng.step()
            long = eng.submit(LONG, max_new_tokens=24, stop_ids=[])
            eng.run_until_idle()
    finally:
        eng.observers.remove(infos.append)
    assert counter.compiles == 0 and all(i.compiles == 0 for i in infos)
    chunks = [i for i in infos if i.prefill_chunks]
    assert len(chunks) == 5 and all(i.prefill_chunks == 1 for i in chunks)  # one chunk per round
    assert sum(i.prefill_tokens for i in chunks) == len(LONG)
    assert (eng.prefill_chunks - before[0], eng.prefill_tokens - before[1]) == (5, len(LONG) + sum(map(len, SHORT)))
    assert all(i.verified >= 2 for i in chunks)  # the live rows kept decoding meanwhile (3: the long one joined)
    assert chunks[-1].admitted == 1 and not eng.queue and not eng.requests and eng._prefilling is None
    assert all(r.finish_reason == "length" for r in short + [long])
    # the long request equals itself run alone with a one-shot prefill (`spec.generate`); the others equal
    # themselves run alone on the engine (the same programs)
    assert long.tokens == spec_generate(pair, [LONG], max_new_tokens=24, stop_ids=[]).tokens[0]
    for req, prompt in zip(short, SHORT):
        alone = eng.submit(prompt, max_new_tokens=64, stop_ids=[])
        eng.run_until_idle()
        assert req.tokens == alone.tokens
    assert np.mean(long.acceptance) > 1.3  # the draft drafted well from the context its chunks fed it


def test_cancel_mid_prefill_frees_its_slot(chunk_engine):
    eng = chunk_engine
    req = eng.submit(LONG, max_new_tokens=8, stop_ids=[])
    eng.step()  # the first chunk
    assert eng._prefilling is not None and eng._prefilling.req is req and eng.queue_depth == 0
    behind = eng.submit(SHORT[1], max_new_tokens=30, stop_ids=[])
    eng.step()  # the second chunk; the request behind takes a free slot meanwhile (one stays reserved)
    assert eng._prefilling.done == 2 * CHUNK and behind.tokens and behind.slot is not None
    eng.cancel(req)
    eng.step()
    assert req.finish_reason == "cancelled" and not req.tokens
    assert eng._prefilling is None and not eng.queue and list(eng.requests.values()) == [behind]
    eng.run_until_idle()
    assert behind.finish_reason == "length" and len(behind.tokens) == 30


def test_prefill_metrics():
    from dflash_jax.serve.engine import RoundInfo
    from dflash_jax.serve.metrics import Metrics

    m = Metrics()
    m.on_round(RoundInfo(prefill_chunks=1, prefill_tokens=16), queue_depth=0, slots_in_use=1)
    text = m.render()[0].decode()
    assert "dflash_prefill_chunks_total 1.0" in text and "dflash_prefill_tokens_total 16.0" in text


def test_max_prompt_len_beyond_the_context_is_a_clear_error(pair):
    from dflash_jax.serve.engine import Engine, RequestError

    with pytest.raises(ValueError, match="exceeds the target's context"):
        Engine(pair, slots=1, max_prompt_len=pair.target_cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(pair, slots=1, prefill_chunk=0)
    # a prompt up to the context is accepted; with max_tokens it must still fit the (capped) cache
    eng = Engine(pair, slots=1, max_prompt_len=4000, max_new_tokens=256)
    eng.validate([1] * 3800, max_new_tokens=256)
    with pytest.raises(RequestError, match="exceed this server's context"):
        eng.validate([1] * 4000, max_new_tokens=256)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_chunked_admission_on_the_other_families(family):
    """The engine's chunked admission on the hybrid (DeltaNet state carried across chunks, then inserted into a
    slot) and on gpt-oss (sliding window 16 < the prompt): greedy output equals each request alone."""
    from dflash_jax import testing
    from dflash_jax.serve.engine import Engine, generate as serve_generate

    cfg = testing.tiny_qwen3_5_config() if family == "qwen3_5" else testing.tiny_gpt_oss_config()
    pair = testing.random_pair(cfg, seed=3, block_size=8, mask_token_id=cfg.vocab_size - 1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 100, n).tolist() for n in (9, 45, 5, 38)]
    engine = Engine(pair, slots=2, max_prompt_len=64, max_new_tokens=32, prefill_chunk=16, widths=None,
                    row_buckets=None)
    engine.warmup()
    with CompileCounter() as counter:
        reqs = serve_generate(engine, prompts, max_new_tokens=20, stop_ids=[])
    assert counter.compiles == 0 and engine.prefill_chunks == 6
    for p, r in zip(prompts, reqs):
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=20, stop_ids=[]).tokens[0]


def test_prefill_chunk_flag():
    from dflash_jax.cli.serve import build_parser, check_args
    from dflash_jax.errors import UsageError

    assert build_parser().parse_args([]).prefill_chunk == 256
    args = build_parser().parse_args(["--prefill-chunk", "-1"])
    with pytest.raises(UsageError, match="--prefill-chunk must be >= 0"):
        check_args(args)
