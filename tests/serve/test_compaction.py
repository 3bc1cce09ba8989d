"""Row buckets and compaction: live requests are kept within the smallest row bucket of as many rows (a row moves
down into a lower free slot when that shrinks the bucket), each round computes only the smallest compiled row bucket
holding them, and a request's greedy output is its output alone while others join, leave and move around it. Uses
the session engine (4 slots, row buckets 1, 2, 4; budgets unlimited, so the verify starts before the scheduler
runs)."""

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
            # compacted: the live requests lie within the smallest bucket of as many rows, and each knows its slot
            if engine.requests:
                n = len(engine.requests)
                assert max(engine.requests) < min(b for b in engine.row_buckets if b >= n)
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


def test_a_row_moves_only_where_the_bucket_shrinks():
    """A free slot inside the smallest bucket of as many rows is left for the next admission (a move would copy a
    row for nothing); once the highest live row lies past that bucket, it moves down into the lowest free slot."""
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.runner import FakeRunner, fake_pair

    eng = Engine(fake_pair(), runner=FakeRunner, slots=8, block_size=1, max_prompt_len=16, max_new_tokens=64,
                 rounds_per_call=1)
    eng.warmup([16])
    assert eng.row_buckets == (1, 2, 4, 8)
    reqs = [eng.submit([1, 2, 3 + i], max_new_tokens=n, stop_ids=[]) for i, n in enumerate((8, 2, 8, 30))]
    while reqs[1].finish_reason is None:
        eng.step()
    assert sorted(eng.requests) == [0, 2, 3] and eng.moves == 0  # slots 0, 2, 3: bucket 4 either way
    late = eng.submit([9, 9], max_new_tokens=4, stop_ids=[])
    eng.step()
    assert late.slot == 1 and eng.moves == 0  # the admission took the free slot
    while any(r.finish_reason is None for r in reqs[:3] + [late]):
        eng.step()
    assert list(eng.requests) == [0] and reqs[3].slot == 0 and eng.moves == 1  # alone past bucket 1: moved down
    eng.run_until_idle()
    assert reqs[3].finish_reason == "length" and len(reqs[3].tokens) == 30
