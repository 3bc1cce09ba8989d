"""`spec.round.flush_context`: the pending context rows of deferring width-1 rounds appended at once give the draft
the context an engine that appends every round gives it, and with `rows` only the first rows append (in place in
the full buffers) while the others keep their pending rows."""

from __future__ import annotations

import functools

import jax
import numpy as np

from dflash_jax.spec.round import Chain, catch_up_context, flush_context, round_step
from dflash_jax.spec.session import begin

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(100, 121)), [9, 8, 7, 6, 5, 4, 3, 2]]
ROUNDS = 3


@functools.partial(jax.jit, static_argnames=("spec", "proposer"))
def _round(tw, dw, state, spec, proposer):
    return round_step(tw, dw, state, spec, proposer)[0]


@functools.partial(jax.jit, static_argnames=("spec", "width", "rows"))
def _flush(dw, state, spec, width, rows):
    return flush_context(dw, state, spec, width=width, rows=rows)


def _valid_slots(cache, row):
    n = int(cache.lengths[row])
    return [np.asarray(k[row, :, :n]) for k in cache.keys + cache.values]


def _width1_rounds(pair, proposer, rounds: int, max_new_tokens: int):
    """(spec, the started state, it after `rounds` width-1 rounds of `proposer`, it after as many appending ones),
    the two outputs checked equal (the draft's context never changes the tokens)."""
    spec, start = begin(pair, PROMPTS, block_size=4, max_new_tokens=max_new_tokens, stop_ids=[])
    tw, dw = pair.target, pair.draft
    state, appended = start, start
    for _ in range(rounds):
        state = _round(tw, dw, state, spec, proposer)
        appended = _round(tw, dw, appended, spec, Chain(1))
    np.testing.assert_array_equal(state.output, appended.output)
    return spec, start, state, appended


def test_deferred_rows_flushed_equal_appending_every_round(pair):
    spec, start, deferred, appended = _width1_rounds(pair, Chain(1, defer_context=True), ROUNDS, 16)
    dw = pair.draft
    assert np.all(np.asarray(deferred.num_context) == ROUNDS)  # every round's row pending
    assert np.all(np.asarray(appended.num_context) == 1)  # the last round's row pending
    width = spec.block_size
    flushed = _flush(dw, deferred, spec, width, len(PROMPTS))
    reference = _flush(dw, appended, spec, width, len(PROMPTS))
    assert np.all(np.asarray(flushed.num_context) == 0) and flushed.context.shape == deferred.context.shape
    np.testing.assert_array_equal(flushed.draft_cache.lengths, reference.draft_cache.lengths)
    np.testing.assert_array_equal(flushed.draft_cache.lengths, np.asarray(start.draft_cache.lengths) + ROUNDS)
    for row in range(len(PROMPTS)):
        for got, want in zip(_valid_slots(flushed.draft_cache, row), _valid_slots(reference.draft_cache, row)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # only the first two rows: theirs as the whole flush, the others' pending rows and lengths as they were
    head = _flush(dw, deferred, spec, width, 2)
    np.testing.assert_array_equal(head.num_context, [0, 0, ROUNDS, ROUNDS])
    np.testing.assert_array_equal(head.draft_cache.lengths[:2], flushed.draft_cache.lengths[:2])
    np.testing.assert_array_equal(head.draft_cache.lengths[2:], deferred.draft_cache.lengths[2:])
    np.testing.assert_array_equal(head.context[2:, :ROUNDS], deferred.context[2:, :ROUNDS])
    for row in range(2):
        for got, want in zip(_valid_slots(head.draft_cache, row), _valid_slots(flushed.draft_cache, row)):
            np.testing.assert_array_equal(got, want)


@functools.partial(jax.jit, static_argnames=("spec", "chunk"))
def _flush_chunks(dw, state, spec, chunk):
    return flush_context(dw, state, spec, chunk=chunk)


def test_held_context_flushed_by_chunks_then_drafted_equals_appending(pair):
    """A state holding more pending rows than a block (context columns past it, as the serving engine's width-1
    rounds hold them): flushed `chunk` columns at a time (several steps, the last one partial) it gives the draft's
    cache an appending state's, and the drafting round after it (which reads the block's columns) proposes and
    commits what the appending state's does, keeping the held width."""
    from dflash_jax.spec.tree import pad_cols

    held_rounds, held_width = 7, 12
    spec, start = begin(pair, PROMPTS, block_size=4, max_new_tokens=24, stop_ids=[])
    tw, dw = pair.target, pair.draft
    held = start.replace(context=pad_cols(start.context, held_width))
    appended = start
    for _ in range(held_rounds):
        held = _round(tw, dw, held, spec, Chain(1, defer_context=True))
        appended = _round(tw, dw, appended, spec, Chain(1))
    assert held.context.shape[1] == held_width
    assert np.all(np.asarray(held.num_context) == held_rounds) and held_rounds > spec.block_size
    whole = _flush_chunks(dw, held, spec, None)
    flushed = _flush_chunks(dw, held, spec, 3)  # 3 steps: 3 + 3 + 1 rows
    reference = _flush_chunks(dw, appended, spec, None)
    assert flushed.context.shape == held.context.shape and np.all(np.asarray(flushed.num_context) == 0)
    np.testing.assert_array_equal(flushed.draft_cache.lengths, reference.draft_cache.lengths)
    for row in range(len(PROMPTS)):
        for got, one, want in zip(_valid_slots(flushed.draft_cache, row), _valid_slots(whole.draft_cache, row),
                                  _valid_slots(reference.draft_cache, row)):
            np.testing.assert_allclose(got, one, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a drafting round on the flushed held state: the same tokens committed as on the appending state
    drafted = _round(tw, dw, flushed, spec, Chain(4))
    ref = _round(tw, dw, reference, spec, Chain(4))
    np.testing.assert_array_equal(drafted.output, ref.output)
    np.testing.assert_array_equal(drafted.last_accepted, ref.last_accepted)
    assert int(np.max(np.asarray(ref.last_accepted))) >= 1  # proposals were accepted
    assert drafted.context.shape[1] == held_width


def test_a_flush_leaves_the_held_columns_and_the_next_hold_overwrites_them(pair):
    """A flush resets the pending counts only (the flushed columns keep their rows: past `num_context` nothing reads
    them), so the hold after it writes over them: held again, flushed again, then drafted, the rows commit what an
    appending state's commit. And the flush compiles without a copy of the hold (zeroing it made XLA copy every
    slot's held columns twice a flush)."""
    from dflash_jax.spec.tree import pad_cols

    spec, start = begin(pair, PROMPTS, block_size=4, max_new_tokens=24, stop_ids=[])
    tw, dw = pair.target, pair.draft
    held, appended = start.replace(context=pad_cols(start.context, 12)), start
    for rounds in (6, 3):  # the second hold shorter than the first: the first's rows stay past it
        for _ in range(rounds):
            held = _round(tw, dw, held, spec, Chain(1, defer_context=True))
            appended = _round(tw, dw, appended, spec, Chain(1))
        held = _flush_chunks(dw, held, spec, 4)
        assert np.all(np.asarray(held.num_context) == 0)
    assert np.any(np.asarray(held.context[:, 3:6]) != 0)  # the first hold's rows, left in place
    reference = _flush_chunks(dw, appended, spec, None)
    drafted = _round(tw, dw, held, spec, Chain(4))
    ref = _round(tw, dw, reference, spec, Chain(4))
    np.testing.assert_array_equal(drafted.output, ref.output)
    assert int(np.max(np.asarray(ref.last_accepted))) >= 1  # proposals were accepted

    donating = jax.jit(flush_context, static_argnames=("spec", "rows", "chunk"), donate_argnames=("state",))
    hlo = donating.lower(dw, held, spec=spec, rows=1, chunk=4).compile().as_text()
    shape = "f32[%s]" % ",".join(str(d) for d in held.context.shape)
    copies = [line for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line]
    assert not copies, copies


@functools.partial(jax.jit, static_argnames=("spec", "chunk"))
def _flush_index(dw, state, index, spec, chunk):
    return flush_context(dw, state, spec, chunk=chunk, index=index)


def test_a_gathered_flush_appends_only_its_rows_as_the_whole_flush_does(pair):
    """`index`: rows 3 and 1 (out of order, with a padding index past the batch) flushed by chunks give those rows
    the whole flush's draft cache bit for bit (the same K/V from the same rows: a gathered row computes what it
    would in the batch), reset only their pending counts, and leave rows 0 and 2 (their cache rows, lengths and
    pending rows) untouched; a drafting round after it commits what the appending state commits. Donated, it
    compiles to a scatter into the cache, not a copy of it (the point: its cost follows the flushed rows)."""
    from dflash_jax.spec.tree import pad_cols

    held_rounds = 7
    spec, start = begin(pair, PROMPTS, block_size=4, max_new_tokens=24, stop_ids=[])
    tw, dw = pair.target, pair.draft
    held, appended = start.replace(context=pad_cols(start.context, 12)), start
    for _ in range(held_rounds):
        held = _round(tw, dw, held, spec, Chain(1, defer_context=True))
        appended = _round(tw, dw, appended, spec, Chain(1))
    whole = _flush_chunks(dw, held, spec, 3)
    index = np.array([3, 1, len(PROMPTS)], np.int32)
    got = _flush_index(dw, held, index, spec, 3)
    np.testing.assert_array_equal(got.num_context, [held_rounds, 0, held_rounds, 0])
    lengths, before = np.asarray(got.draft_cache.lengths), np.asarray(held.draft_cache.lengths)
    np.testing.assert_array_equal(lengths[[1, 3]], np.asarray(whole.draft_cache.lengths)[[1, 3]])
    np.testing.assert_array_equal(lengths[[0, 2]], before[[0, 2]])
    assert np.all(lengths[[1, 3]] == before[[1, 3]] + held_rounds)
    for row in (1, 3):
        for a, b in zip(_valid_slots(got.draft_cache, row), _valid_slots(whole.draft_cache, row)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves((got.draft_cache.keys, got.draft_cache.values)),
                    jax.tree.leaves((held.draft_cache.keys, held.draft_cache.values))):
        np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]])
    np.testing.assert_array_equal(got.context, held.context)

    # the other rows flushed after: a drafting round commits the appending state's tokens, accepting proposals
    rest = _flush_index(dw, got, np.array([0, 2], np.int32), spec, 3)
    reference = _flush_chunks(dw, appended, spec, None)
    drafted = _round(tw, dw, rest, spec, Chain(4))
    ref = _round(tw, dw, reference, spec, Chain(4))
    np.testing.assert_array_equal(drafted.output, ref.output)
    assert int(np.max(np.asarray(ref.last_accepted))) >= 1

    donating = jax.jit(flush_context, static_argnames=("spec", "chunk"), donate_argnames=("state",))
    hlo = donating.lower(dw, held, spec=spec, chunk=3, index=index).compile().as_text()
    cache = held.draft_cache.keys[0]
    shape = "f32[%s]" % ",".join(str(d) for d in cache.shape)
    copies = [line for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line]
    assert not copies, copies


@functools.partial(jax.jit, static_argnames=("spec", "rows", "chunk"))
def _catch_up(tw, dw, state, tokens, back, spec, rows, chunk):
    return catch_up_context(tw, dw, state, tokens, back, spec, rows=rows, chunk=chunk)


def test_skipped_rows_caught_up_equal_appending_every_round(pair):
    """Width-1 rounds that compute no taps (`Chain(1, skip_context=True)`) commit the appending rounds' tokens and
    leave the pending rows (the prompts') and the target's cache as they are; the catch-up over the skipped
    positions' tokens (a wide forward per chunk, two chunks here, oldest first; one row left out: it only flushes)
    gives the draft's cache the appending state's rows, leaves the target's cache untouched, and the drafting round
    after it commits the same tokens, accepting proposals."""
    skipped_rounds = 7
    spec, start, skipped, appended = _width1_rounds(pair, Chain(1, skip_context=True), skipped_rounds, 24)
    tw, dw = pair.target, pair.draft
    np.testing.assert_array_equal(skipped.num_context, start.num_context)  # only the prompts' rows pending
    np.testing.assert_array_equal(skipped.draft_cache.lengths, start.draft_cache.lengths)
    # the skipped positions: each row's anchors of the rounds, the tokens before its current anchor (row 3 left out)
    back = np.array([skipped_rounds, skipped_rounds, skipped_rounds, 0], np.int32)
    out = np.asarray(skipped.output)
    n = np.asarray(skipped.num_generated)
    chunk = 4  # narrower than the longest run: two calls, the oldest positions first
    state = skipped
    left = back.copy()
    while left.any():
        tokens = np.zeros((len(PROMPTS), chunk), np.int32)
        for row in range(len(PROMPTS)):
            first = int(n[row]) - 1 - int(left[row])
            part = out[row, first: first + min(chunk, int(left[row]))]
            tokens[row, : len(part)] = part
        state = _catch_up(tw, dw, state, tokens, left, spec, len(PROMPTS), None)
        left = np.maximum(left - chunk, 0)
    assert np.all(np.asarray(state.num_context) == 0)
    for got, want in zip(jax.tree.leaves(state.target_cache), jax.tree.leaves(skipped.target_cache)):
        np.testing.assert_array_equal(got, want)  # the target's cache is read, never written
    reference = _flush(dw, appended, spec, spec.block_size, len(PROMPTS))
    full = [0, 1, 2]  # rows caught up over every skipped position
    lengths = np.asarray(state.draft_cache.lengths)
    np.testing.assert_array_equal(lengths[full], np.asarray(reference.draft_cache.lengths)[full])
    for row in full:
        for got, want in zip(_valid_slots(state.draft_cache, row), _valid_slots(reference.draft_cache, row)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert lengths[3] == int(np.asarray(start.draft_cache.lengths)[3]) + int(np.asarray(start.num_context)[3])

    # only the first two rows: the others keep their pending rows and the draft's cache as it was
    head = _catch_up(tw, dw, skipped, np.zeros((len(PROMPTS), chunk), np.int32), np.zeros(4, np.int32), spec, 2,
                     None)
    np.testing.assert_array_equal(head.num_context[2:], skipped.num_context[2:])
    np.testing.assert_array_equal(head.draft_cache.lengths[2:], skipped.draft_cache.lengths[2:])

    # a drafting round after the catch-up: the caught-up rows commit and accept what the appending rows do
    drafted = _round(tw, dw, state, spec, Chain(4))
    ref = _round(tw, dw, reference, spec, Chain(4))
    np.testing.assert_array_equal(np.asarray(drafted.output)[full], np.asarray(ref.output)[full])
    np.testing.assert_array_equal(np.asarray(drafted.last_accepted)[full], np.asarray(ref.last_accepted)[full])
    assert int(np.max(np.asarray(ref.last_accepted)[full])) >= 1  # proposals were accepted
