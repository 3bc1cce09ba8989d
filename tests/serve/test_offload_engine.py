"""The offloaded serving engine: experts in host memory, one small device cache, the scheduler's demand driving
the prefetch. Greedy output of every request equals its output run alone on the resident target while
requests join and leave at different rounds; the prefetch set is exactly the admitted rows' projected union;
bytes moved, hits / misses and predicted vs used show in RoundInfo and in the Prometheus metrics."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.serve.engine import generate as serve_generate
from dflash_jax.spec import SamplingParams
from dflash_jax.spec import generate as spec_generate
from tests.serve.server_process import free_port, stop

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [7] * 12, list(range(40, 56)), [1, 2, 3, 4]]
BUDGETS = [20, 8, 24, 12, 16]
LATE = ([900, 17, 4], 10)  # submitted after a few rounds, while others decode
BLOCK = 8
CACHE_EXPERTS = 12  # of 4 layers x 8 experts: misses happen


@pytest.fixture(scope="module")
def served(pair):
    """One run of the offloaded engine (3 slots, row buckets 1 and 3, a 12-expert cache): five requests queue and
    join as others leave (the live rows compacted into the lowest slots), a sixth arrives mid-run. Returns
    (engine, requests, round infos, metrics text)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from dflash_jax.offload import HostExpertStore
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.offload_runner import OffloadedRunner, attach_metrics

    store = HostExpertStore(pair.target)
    budget = CACHE_EXPERTS * store.expert_bytes(store.layer_ids[0])
    engine = Engine(pair, experts="offload", budget_bytes=budget, slots=3, block_size=BLOCK, max_prompt_len=16,
                    max_new_tokens=64, store=store, bandwidth=1e9, round_seconds={BLOCK: 1.0},
                    row_buckets=(1, 3), prefill_chunk=8, defer_context=True)
    assert isinstance(engine.runner, OffloadedRunner)
    # the offloaded runner prefills long prompts by chunks (layer by layer, one chunk per round) and can hold the
    # draft's context in width-1 rounds, as the resident one does (this engine has no width 1: nothing to hold)
    assert engine.chunked_prefill and engine.prefill_chunk is not None
    assert engine.deferred_context and not engine.defer_context
    engine.warmup([16])
    assert engine.context_rows == BLOCK and engine.runner.state.context.shape[1] == BLOCK
    registry = CollectorRegistry()
    attach_metrics(engine, registry)
    infos = []
    engine.observers.append(infos.append)
    reqs = [engine.submit(p, max_new_tokens=m, stop_ids=[]) for p, m in zip(PROMPTS, BUDGETS)]
    for _ in range(3):
        engine.step()
    reqs.append(engine.submit(LATE[0], max_new_tokens=LATE[1], stop_ids=[]))
    engine.run_until_idle()
    return engine, reqs, infos, generate_latest(registry).decode()


def test_offloaded_greedy_equals_alone_with_joins_and_leaves(served, pair):
    engine, reqs, infos, _ = served
    prompts, budgets = PROMPTS + [LATE[0]], BUDGETS + [LATE[1]]
    assert all(r.finish_reason == "length" for r in reqs)
    # the resident target's greedy output of each request (one batched call: its rows are independent)
    alone = spec_generate(pair, prompts, max_new_tokens=budgets, block_size=BLOCK, stop_ids=[])
    for i, r in enumerate(reqs):
        assert r.tokens == alone.tokens[i], i
    assert sum(info.compiles for info in infos) == 0  # nothing compiled after warm-up
    # requests joined at different rounds (queued behind full slots, or submitted late) and left at others
    joined = [i for i, info in enumerate(infos) if info.admitted]
    left = [i for i, info in enumerate(infos) if info.finished]
    assert len(joined) >= 3 and len(left) >= 3
    assert {info.rows for info in infos if info.width} == {1, 3}  # rounds of one row once one request was left
    # the cache was too small: experts moved (prefetch and on demand), proposals were accepted
    totals = engine.runner.offload_summary()
    assert totals["prefetched_bytes"] > 0 and totals["on_demand_bytes"] > 0 and totals["misses"] > 0
    assert totals["hits"] > 0 and 0 < totals["covered"] <= min(totals["predicted"], totals["used"])
    assert engine.runner.pool.resident_bytes() <= engine.runner.pool.bytes <= engine.runner.budget_bytes
    assert max(max(r.acceptance) for r in reqs) > 1 and np.mean([np.mean(r.acceptance) for r in reqs]) > 1.2


def test_prefetch_is_the_admitted_rows_union_and_stats_are_visible(served):
    engine, reqs, infos, metrics = served
    sat_out = 0
    for info in infos:
        rec = info.offload
        if not info.verified:
            continue
        admitted = sorted(info.how)
        assert set(admitted) <= set(rec.row_demand) and len(rec.row_demand) == info.live
        union = np.logical_or.reduce([rec.row_demand[s] for s in admitted])  # [L, E]
        for j, layer in enumerate(engine.moe_layers):
            assert sorted(rec.requested[layer].tolist()) == np.flatnonzero(union[j]).tolist()
        # RoundInfo.expert_bytes is that union's bytes; the scheduler priced the part not in the cache
        assert info.expert_bytes == pytest.approx(float(engine.expert_bytes[union].sum()))
        assert 0 <= rec.priced_bytes <= info.expert_bytes + 1e-6  # priced: the part not resident in the cache
        everyone = np.logical_or.reduce(list(rec.row_demand.values()))
        sat_out += int((everyone & ~union).any())  # a row sat out: its experts were not prefetched
        assert rec.predicted == int(union.sum()) and rec.used > 0
        assert rec.moved_bytes == rec.prefetched_bytes + rec.on_demand_bytes
    assert engine.budgets.expert_bytes == engine.runner.pool.bytes
    assert sat_out > 0  # the byte budget kept rows out, and their demand was not prefetched
    assert sum(r.rounds_waited for r in reqs) > 0
    moved = sum(i.offload.moved_bytes for i in infos)
    totals = engine.runner.offload_totals
    assert moved == totals["prefetched_bytes"] + totals["on_demand_bytes"] > 0
    for name in ("dflash_offload_round_bytes_moved_count", 'dflash_offload_bytes_moved_total{kind="prefetch"}',
                 'dflash_offload_expert_lookups_total{result="miss"}', 'dflash_offload_experts_total{set="covered"}'):
        line = next(line for line in metrics.splitlines() if line.startswith(name))
        assert float(line.split()[-1]) > 0, line


def test_server_metrics_show_the_offload(served):
    """`dflash-serve --offload` wiring: the server's /metrics registry gets the offload metrics."""
    pytest.importorskip("fastapi")
    from dflash_jax.serve.offload_runner import attach_server_metrics
    from dflash_jax.serve.server import create_app

    engine = served[0]
    before = list(engine.observers)
    try:
        create_app(engine)
        server = engine.observers[-1].__self__
        assert attach_server_metrics(engine) == 1
        serve_generate(engine, [PROMPTS[0]], max_new_tokens=6, stop_ids=[])
        text = server.metrics.render()[0].decode()
    finally:
        engine.observers[:] = before
    moved = [line for line in text.splitlines() if line.startswith("dflash_offload_round_bytes_moved_count")]
    assert moved and float(moved[0].split()[-1]) > 0
    assert "dflash_offload_cache_bytes" in text and "dflash_acceptance_length" in text


def test_offload_engine_errors(pair):
    from dflash_jax.offload import PoolTooSmall
    from dflash_jax.serve.engine import Engine

    with pytest.raises(PoolTooSmall, match="minimum"):
        Engine(pair, experts="offload", budget_bytes=10, slots=1, max_prompt_len=16, max_new_tokens=8, bandwidth=1e9)
    with pytest.raises(ValueError, match="predictor"):
        Engine(pair, experts="offload", budget_bytes=10**7, predictor="residual", slots=1, bandwidth=1e9)
    with pytest.raises(ValueError, match="one device"):
        Engine(pair, experts="offload", budget_bytes=10**7, slots=1, bandwidth=1e9, mesh=object())
    with pytest.raises(TypeError, match="budget_bytes: offload options need experts='offload'"):
        Engine(pair, budget_bytes=10**7, slots=1)
    with pytest.raises(ValueError, match="experts must be 'device' or 'offload'"):
        Engine(pair, experts="disk", slots=1)


@pytest.mark.slow
def test_offloaded_sampled_equals_alone(pair):
    """Sampled requests draw what they draw alone (same seed) under the offloaded engine, at the minimum budget
    (every layer in passes of one expert)."""
    from dflash_jax.offload import HostExpertStore, min_budget_bytes
    from dflash_jax.serve.engine import Engine

    store = HostExpertStore(pair.target)
    engine = Engine(pair, experts="offload", budget_bytes=min_budget_bytes(store), slots=2, block_size=BLOCK,
                    max_prompt_len=16, max_new_tokens=64, store=store, bandwidth=1e9, round_seconds={BLOCK: 1.0})
    sampling = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]
    reqs = serve_generate(engine, PROMPTS[:3], max_new_tokens=BUDGETS[:3], sampling=sampling, stop_ids=[],
                          seed=[3, 4, 5])
    for i, r in enumerate(reqs):
        alone = spec_generate(pair, [PROMPTS[i]], max_new_tokens=BUDGETS[i], block_size=BLOCK, sampling=sampling[i],
                              stop_ids=[], seed=3 + i)
        assert r.tokens == alone.tokens[0], i
    summary = engine.runner.offload_summary()
    assert summary["passes"] > summary["rounds"] * len(engine.moe_layers)


@pytest.mark.parametrize("argv, message", [
    (["--offload"], "--experts offload needs --expert-budget-mb"),
    (["--offload", "--expert-budget-mb", "0.00001"], "below the minimum of 0.052224 MB"),
    (["--expert-budget-mb", "3"], "--expert-budget-mb only applies with --experts offload"),
    (["--offload", "--expert-budget-mb", "1", "--pin-experts", "x"], "--pin-experts must be auto, none or a count"),
    (["--offload", "--expert-budget-mb", "1", "--mesh", "expert=1"], "--experts offload serves on one device"),
])
def test_serve_offload_flag_errors_are_one_line(argv, message, capsys):
    from dflash_jax.cli.serve import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-serve: error:") and message in err and "\n" not in err


@pytest.mark.slow
def test_serve_offload_process_matches_generate_and_shows_metrics(tmp_path, capsys):
    """A real `dflash-serve --offload` process: a greedy completion equals `dflash-generate --offload`'s tokens for
    the same prompt and budget, /metrics shows the bytes moved, SIGTERM stops it."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from dflash_jax.cli.generate import main as generate_main

    assert generate_main(["--prompt", "def fib(n):", "--max-new-tokens", "12", "--block-size", "8", "--offload",
                          "--expert-budget-mb", "0.6", "--ignore-eos", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    port = free_port()
    env = dict(os.environ, DFLASH_JAX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--slots", "2",
                             "--block-size", "8", "--widths", "fixed", "--max-prompt-len", "16",
                             "--max-new-tokens", "16", "--offload", "--expert-budget-mb", "0.6",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5).read()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.time() < deadline, "dflash-serve --offload did not start"
                time.sleep(0.5)
        body = json.dumps({"model": "tiny_pair", "prompt": "def fib(n):", "max_tokens": 12, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"content-type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    finally:
        code = stop(proc)
    assert code == 128 + 15, proc.stderr.read()  # stopped by the SIGTERM: 143, as every signal ends a CLI
    assert out["choices"][0]["token_ids"] == want
    prefill = 'dflash_offload_bytes_moved_total{kind="prefill"}'
    moved = [line for line in metrics.splitlines() if line.startswith(prefill)]
    assert moved and float(moved[0].split()[-1]) > 0
    assert "dflash_offload_round_bytes_moved_count" in metrics


@pytest.mark.slow
def test_offloaded_chunked_prefill_equals_alone(pair):
    """Prompts longer than the chunk join the offloaded engine one chunk per round (each chunk layer by layer with
    whole tables), while a short request keeps decoding: every output equals the request alone, nothing compiles
    after warm-up, and the short request got tokens in rounds that also prefilled a chunk."""
    from dflash_jax.offload import HostExpertStore, min_budget_bytes
    from dflash_jax.serve.engine import Engine

    store = HostExpertStore(pair.target)
    engine = Engine(pair, experts="offload", budget_bytes=min_budget_bytes(store), slots=2, block_size=BLOCK,
                    max_prompt_len=48, max_new_tokens=32, store=store, bandwidth=1e9, round_seconds={BLOCK: 1.0},
                    prefill_chunk=16)
    assert engine.prefill_chunk == 16
    engine.warmup()
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [(3 * i) % 500 + 7 for i in range(33)]]
    budgets = [30, 20, 24]
    infos = []
    engine.observers.append(infos.append)
    reqs = serve_generate(engine, prompts, max_new_tokens=budgets, stop_ids=[])
    alone = spec_generate(pair, prompts, max_new_tokens=budgets, block_size=BLOCK, stop_ids=[])
    assert [r.tokens for r in reqs] == alone.tokens
    assert engine.prefill_chunks >= 5  # 40 and 33 tokens: three chunks each, the last ones maybe shorter
    assert sum(info.compiles for info in infos) == 0
    assert any(info.prefill_chunks and info.committed for info in infos)  # decoding went on beside a chunk


def test_offloaded_logprobs_and_samples(served, pair):
    """Log-probs of the committed tokens come from the layer-wise verify's logits as from the resident one's (equal
    to a plain forward's log-softmax), n samples fork one prefill; echo's prompt scores are refused in one line."""
    from dflash_jax.serve.engine import RequestError
    from tests.serve.logprob_checks import plain_log_softmax, tolerance

    engine = served[0]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    head = engine.submit(prompt, max_new_tokens=12, stop_ids=[], logprobs=2, n=2)
    engine.run_until_idle()
    a, b = head.samples
    assert a.tokens == b.tokens and len(a.token_logprobs) == len(a.tokens) == 12
    ref = plain_log_softmax(pair, prompt + a.tokens)
    n = len(prompt)
    np.testing.assert_allclose(a.token_logprobs, ref[np.arange(n - 1, n + 11), a.tokens], atol=tolerance(pair))
    assert [t for t, _ in a.top_logprobs[3]] == list(np.argsort(-ref[n + 2])[:2])
    with pytest.raises(RequestError, match="prompt log-probabilities"):
        engine.submit(prompt, max_new_tokens=2, logprobs=1, prompt_logprobs=True)
