"""Row buckets and compaction: live requests are kept in the lowest slots (a row moves down when a lower slot
frees), each round computes only the smallest compiled row bucket holding them, and a request's greedy output
is its output alone while others join, leave and move around it. Uses the session engine (4 slots, row
buckets 1, 2, 4; budgets unlimited, so the verify starts before the scheduler runs)."""

from __future__ import annotations

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.spec import generate as spec_generate

SHORT, LONG = [100, 200, 300], [5, 6, 7, 8, 9, 10, 11]
LATER = {2: ([7] * 12, 20), 3: ([1, 2, 3, 4], 30), 12: ([900, 17], 33)}  # round -> (prompt, budget) joining then


def test_rows_compacted_and_output_as_alone(engine, pair):
    """A round per call (calls of several rounds are sized by measured time: which rounds a call holds, and so
    when rows leave and move, would follow the machine's speed)."""
    assert engine.row_buckets == (1, 2, 4)
    engine.rounds_per_call = 1
    try:
        _compacted(engine, pair)
    finally:
        engine.rounds_per_call = "auto"


def _compacted(engine, pair):
    moves = engine.moves
    short = engine.submit(SHORT, max_new_tokens=20, stop_ids=[])  # slot 0, leaves early: `long` moves down
    long = engine.submit(LONG, max_new_tokens=40, stop_ids=[])
    reqs, infos, slots_of_long = [short, long], [], set()
    with CompileCounter() as counter:
        for i in range(200):
            if i in LATER:
                prompt, budget = LATER[i]
                reqs.append(engine.submit(prompt, max_new_tokens=budget, stop_ids=[]))
            if not (engine.queue or engine.requests):
                break
            info = engine.step()
            infos.append(info)
            # compacted: the live requests hold slots 0 .. n-1, and each knows its slot
            assert sorted(engine.requests) == list(range(len(engine.requests)))
            assert all(r.slot == s for s, r in engine.requests.items())
            if info.width:  # the round computed the smallest bucket holding the live rows
                assert info.rows == min(b for b in engine.row_buckets if b >= info.live)
            if long.slot is not None:
                slots_of_long.add(long.slot)
    assert counter.compiles == 0
    assert not engine.requests and not engine.queue
    assert engine.moves > moves and {0, 1} <= slots_of_long  # `long` really moved down a slot
    assert {i.rows for i in infos if i.width} >= {1, 4}  # rounds of one row and of all four
    budgets = [20, 40] + [LATER[k][1] for k in sorted(LATER)]
    prompts = [SHORT, LONG] + [LATER[k][0] for k in sorted(LATER)]
    for p, m, r in zip(prompts, budgets, reqs):
        assert r.finish_reason == "length" and len(r.tokens) == m
        assert r.tokens == spec_generate(pair, [p], max_new_tokens=m, stop_ids=[]).tokens[0]
    assert max(max(r.acceptance) for r in reqs) >= 3  # proposals were accepted (not a block-1 run)
