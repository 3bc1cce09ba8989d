"""Rounds of greedy rows run the program without the sampling work (`Engine(greedy_programs=True)`, the default
on a GPU: `SpecConfig.greedy_only`, no conditional for the host to run); a round with a sampled live row runs the
general one. The engine's choice is checked on `serve.runner.FakeRunner` (no compile), the tokens on the shipped
pair: the same as an engine with one program, greedy and sampled, and nothing compiled after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.compile_cache import CompileCounter
from dflash_jax.serve.engine import Engine
from dflash_jax.serve.runner import FakeRunner, fake_pair
from dflash_jax.spec.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.9, top_k=30)


class GreedyFake(FakeRunner):
    """A fake runner whose rounds would run the greedy program: records the spec of each round's draft / call."""

    greedy_rounds = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.specs = []

    def draft(self, proposer, rows):
        self.specs.append(self.round_spec.greedy_only)
        return super().draft(proposer, rows)

    def burst(self, proposer, active, rows, count, until_finish=False):
        self.specs.append(self.round_spec.greedy_only)
        return super().burst(proposer, active, rows, count, until_finish)


def _fake(**kw) -> Engine:
    eng = Engine(fake_pair(vocab_size=256), runner=GreedyFake, slots=4, max_prompt_len=64, max_new_tokens=40,
                 prefill_chunk=None, widths=[1, 2, 4], round_seconds={1: 1.0, 2: 1.2, 4: 1.5}, **kw)
    eng.warmup([16])
    return eng


def test_the_engine_runs_the_greedy_program_while_every_live_row_is_greedy():
    eng = _fake(greedy_programs=True)
    assert eng.greedy_programs and eng.runner.greedy_rounds
    assert {False, True} <= set(eng.runner.specs)  # warm-up ran both programs
    eng.runner.specs.clear()
    greedy = [eng.submit([i + 1, 2, 3], max_new_tokens=30) for i in range(2)]
    for _ in range(3):
        eng.step()  # greedy rows alone: the greedy program
    assert eng.greedy_rounds > 0 and eng.runner.specs and all(eng.runner.specs)
    before = len(eng.runner.specs)
    sampled = eng.submit([7, 8], max_new_tokens=6, sampling=SAMPLED)
    eng.step()  # admitted: a sampled row is live, the general program
    assert eng.runner.specs[before:] and not any(eng.runner.specs[before:])
    for _ in range(100):
        if sampled.finish_reason is not None:
            break
        assert not eng.runner.specs[-1]  # while it is live, every round
        eng.step()
    assert sampled.finish_reason is not None
    mark = len(eng.runner.specs)
    eng.run_until_idle()
    assert all(eng.runner.specs[mark:])  # the sampled row gone: greedy again
    for i, r in enumerate(greedy):
        assert r.tokens == FakeRunner.alone([i + 1, 2, 3], 30, 256)


def test_one_program_where_asked_or_where_the_platform_runs_conditionals_on_the_device():
    for eng in (_fake(greedy_programs=False), _fake()):  # a CPU: None is off
        assert not eng.greedy_programs
        eng.submit([1, 2, 3], max_new_tokens=20)
        eng.run_until_idle()
        assert eng.greedy_rounds == 0 and not any(eng.runner.specs)
    assert not Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, max_prompt_len=64,
                      max_new_tokens=40, greedy_programs=True).greedy_programs  # a runner without the program
    with pytest.raises(TypeError, match="greedy_programs must be True, False or None"):
        Engine(fake_pair(vocab_size=256), runner=FakeRunner, slots=2, greedy_programs="yes")


@pytest.mark.slow
def test_the_greedy_program_serves_the_same_tokens(pair):
    """The shipped pair, block 4 and width 1 chosen per round: greedy requests alone (the greedy program), then a
    sampled one among them (the general program); every token equal to an engine with one program (resident and
    offloaded experts alike), proposals accepted, and nothing compiled once the engines are warm."""
    def engine(greedy):
        eng = Engine(pair, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=40,
                     row_buckets=None, round_seconds={1: 1.0, 4: 1.2}, greedy_programs=greedy, lanes=1)
        eng.warmup([16])
        return eng

    engines = [engine(False), engine(True)]
    from dflash_jax.offload import HostExpertStore

    store = HostExpertStore(pair.target)  # the offloaded runner's rounds run the same programs' commit
    offloaded = Engine(pair, experts="offload", budget_bytes=12 * store.expert_bytes(store.layer_ids[0]), store=store,
                       bandwidth=1e9, slots=2, block_size=4, widths=[1, 4], max_prompt_len=16, max_new_tokens=40,
                       row_buckets=None, round_seconds={1: 1.0, 4: 1.2}, greedy_programs=True)
    offloaded.warmup([16])
    assert offloaded.greedy_programs
    engines.append(offloaded)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 56))]
    outs = []
    with CompileCounter() as counter:
        for eng in engines:
            first = [eng.submit(p, max_new_tokens=40) for p in prompts]
            eng.run_until_idle()
            mixed = [eng.submit(prompts[0], max_new_tokens=24),
                     eng.submit(prompts[1], max_new_tokens=24, sampling=SAMPLED, seed=5)]
            eng.run_until_idle()
            outs.append([r.tokens for r in first + mixed])
            assert max(max(r.acceptance) for r in first) > 1  # proposals accepted
    assert counter.compiles == 0, counter.compiles
    assert outs[0] == outs[1] == outs[2]
    assert engines[0].greedy_rounds == 0 and engines[1].greedy_rounds > 0 and engines[2].greedy_rounds > 0
    assert np.all([len(t) == n for t, n in zip(outs[1], (40, 40, 24, 24))])
