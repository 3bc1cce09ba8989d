"""The speculative loop end to end: lossless greedy output, the z-lab reference loop round by round,
lossless sampling (statistically), stop tokens and budgets, bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")


import dflash_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from dflash_jax.decode import greedy_generate  # noqa: E402
from convert import load_hf_pair  # noqa: E402
from dflash_jax.spec import Buckets, SamplingParams, generate, generate_stepping  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save, build_and_save_draft, hf_greedy, make_agreeable_, reference_with_experts, tiny_draft_config,
    record_reference_proposals, tiny_qwen3_moe_config,
)
from tests.spec.sampling_checks import chi_square_pvalue, exact_joint3  # noqa: E402

LAYERS = 3
B = 8


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=LAYERS), root / "t0", seed=1)
    draft = build_and_save_draft(tiny_draft_config(target_layers=LAYERS, block_size=B), root / "d0", seed=2)
    make_agreeable_(target, draft)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return target, draft, root / "target", root / "draft"


@pytest.fixture(scope="module")
def pair(hf_pair):
    return load_hf_pair(hf_pair[2], hf_pair[3])


@pytest.fixture(scope="module")
def converted(hf_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "pair"
    convert(str(hf_pair[2]), str(hf_pair[3]), str(out), expert_format="mxfp4", dtype="fp32", progress=False)
    return dflash_jax.load(out)


def _prompts(n, lengths=(300, 317, 64)):
    return [np.random.default_rng(i).integers(0, 159, lengths[i % len(lengths)]).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def plain_greedy(pair, hf_pair):
    prompts = _prompts(3)
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=48)
    assert plain[0][:24] == hf_greedy(hf_pair[0], prompts[0], 24)  # the baseline is HF's own greedy
    return prompts, plain


@pytest.mark.slow
def test_greedy_output_is_the_targets_own_for_the_other_block_sizes(pair, plain_greedy):
    """The fast test below covers blocks 1, 3 and B; this one the rest (each size is its own compile)."""
    prompts, plain = plain_greedy
    for block in sorted(set(range(1, B + 1)) - {1, 3, B}):
        result = generate(pair, prompts, max_new_tokens=48, block_size=block)
        assert result.tokens == plain, f"block size {block}"
        assert all(sum(a) == 47 for a in result.acceptance_lengths)
        assert result.stats["mean_acceptance"] > 1.0


def test_greedy_output_is_the_targets_own_for_every_block_size(pair, plain_greedy):
    prompts, plain = plain_greedy
    for block in (1, 3, B):
        result = generate(pair, prompts, max_new_tokens=48, block_size=block)
        assert result.tokens == plain, f"block size {block}"
        assert all(sum(a) == 47 for a in result.acceptance_lengths)  # first token + per-round emissions
        if block == 1:
            assert result.stats["mean_acceptance"] == 1.0
    assert result.stats["mean_acceptance"] > 1.3  # the pair accepts something: the test is not vacuous
    stepped = generate_stepping(pair, prompts, max_new_tokens=48, block_size=B, trace=True)
    assert stepped.tokens == plain
    for rows in stepped.trace:
        for row in rows:
            if row is not None:  # the last round of a sequence may be cut by the budget
                full_round = row["proposal"][: row["accepted"]] + [row["bonus"]]
                assert row["emitted"] == full_round[: len(row["emitted"])]


@pytest.mark.parametrize("block", [B, 5])
def test_rounds_equal_reference_dflash_generate(converted, hf_pair, block, monkeypatch):
    """Per-round proposals and acceptance lengths equal z-lab's loop (run on our dequantized experts)."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # return_stats without CUDA
    target_ref = reference_with_experts(hf_pair[0], converted)
    draft_ref = hf_pair[1]
    proposals = record_reference_proposals(monkeypatch, draft_ref)
    prompt = _prompts(1)[0]
    n = 40
    with torch.no_grad():
        ref = reference.dflash_generate(draft_ref, target_ref, torch.tensor([prompt]), max_new_tokens=n,
                                        stop_token_ids=None, temperature=0.0, block_size=block, return_stats=True)
    ours = generate_stepping(converted, [prompt], max_new_tokens=n, block_size=block, trace=True)
    assert ours.tokens[0] == ref.output_ids[0, len(prompt):].tolist()
    # The reference narrows the block in its last rounds (verify width = min(B, tokens left)); compare the
    # rounds it ran at full width, which are all but the last few.
    start, full = 0, 0
    for round_, (ref_acc, our_acc) in enumerate(zip(ref.acceptance_lengths, ours.acceptance_lengths[0])):
        if len(prompt) + start + block > len(prompt) + n:
            break
        assert our_acc == ref_acc, f"round {round_}"
        assert ours.trace[round_][0]["proposal"] == proposals[round_], f"round {round_}"
        start += ref_acc
        full += 1
    assert full >= 8 and max(ref.acceptance_lengths[:full]) > 1


def test_stop_tokens_and_budget(pair):
    prompts = _prompts(2)
    full = generate(pair, prompts, max_new_tokens=40).tokens
    stop = full[0][10]
    cut = generate(pair, prompts, max_new_tokens=40, stop_ids=[stop]).tokens
    for f, c in zip(full, cut):
        assert c == (f[: f.index(stop) + 1] if stop in f else f)
    assert [len(t) for t in generate(pair, prompts, max_new_tokens=1).tokens] == [1, 1]
    assert generate(pair, prompts, max_new_tokens=3).tokens == [f[:3] for f in full]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block size must be between 1 and the draft's trained block size 8"),
        ({"block_size": 9}, "block size must be between 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"prompts": [[]]}, "at least one token"),
        ({"prompts": [[3, 160]]}, "token id 160 outside the vocabulary"),
        ({"sampling": dict(temperature=-1.0)}, "temperature must be >= 0"),
        ({"sampling": dict(temperature=1.0, top_p=0.0)}, "top_p must be in (0, 1]"),
        ({"sampling": dict(temperature=1.0, top_p=1.5)}, "top_p must be in (0, 1]"),
        ({"sampling": dict(temperature=1.0, top_k=-1)}, "top_k must be >= 0"),
        ({"sampling": dict(temperature=1.0, mode="greedy")}, "mode must be 'exact_match' or 'rejection'"),
    ],
)
def test_bad_input(pair, kwargs, message):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError) as e:
        if "sampling" in args:  # bad settings are refused where they are made, before any generation
            args["sampling"] = SamplingParams(**args["sampling"])
        generate(pair, prompts, **args)
    assert message in str(e.value)


# --------------------------------------------------------------------------------------------------
# sampling is lossless: the emitted tokens have exactly the target's distribution
# --------------------------------------------------------------------------------------------------

V = 8
N_TOKENS = 3


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("smallvocab")
    build_and_save(tiny_qwen3_moe_config(vocab_size=V, num_hidden_layers=2, mlp_only_layers=[]), root / "t", seed=5)
    build_and_save_draft(tiny_draft_config(target_layers=2, taps=(0, 1), mask_token_id=V - 1, vocab_size=V,
                                           block_size=4), root / "d", seed=6)
    return load_hf_pair(root / "t", root / "d")


@pytest.mark.parametrize("mode", ["exact_match", "rejection"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)],
                         ids=["plain", "topk-topp"])
def test_sampling_reproduces_the_target_distribution(small_vocab_pair, mode, params):
    """The sampled sequences share their batch with greedy ones (per-sequence settings): the greedy ones
    still give the target's greedy output, the sampled ones the target's distribution."""
    _check_sampling(small_vocab_pair, mode, params)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact_match", "rejection"])
def test_head_chain_sampling_reproduces_the_target_distribution(small_vocab_pair, mode):
    """Proposals from a branch head, each drawn given the previous one (rejection: the head's conditional
    distributions are the proposal's q): still exactly the target's distribution."""
    import jax

    from dflash_jax.models.draft import init_branch_head
    from dflash_jax.pair import with_branch_head

    pair = small_vocab_pair
    fresh = init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(1))
    pair = with_branch_head(pair, fresh.replace(w_out=jax.random.normal(jax.random.key(2), fresh.w_out.shape) * 0.3))
    _check_sampling(pair, mode, dict(temperature=1.0), branch_head=True)


def _check_sampling(pair, mode, params, **kwargs):
    sampling = SamplingParams(mode=mode, **params)
    prompt = [3, 1, 4, 1, 5, 2]
    n, n_greedy = 6000, 16
    result = generate(pair, [prompt] * (n + n_greedy), max_new_tokens=N_TOKENS, block_size=4,
                      sampling=[sampling] * n + [SamplingParams(mode=mode)] * n_greedy, seed=7,
                      buckets=Buckets(prompt=8, output=4, cache=16, pad_batch=True), **kwargs)
    greedy = greedy_generate(pair.target, pair.target_cfg, [prompt], max_new_tokens=N_TOKENS)[0]
    assert result.tokens[n:] == [greedy] * n_greedy
    draws = np.array(result.tokens[:n])
    assert draws.shape == (n, N_TOKENS)
    # the speculative path is exercised: hundreds of first rounds accepted at least one proposal
    assert np.mean([a[0] >= 2 for a in result.acceptance_lengths]) > 0.05
    counts = np.bincount(draws[:, 0] * V * V + draws[:, 1] * V + draws[:, 2], minlength=V**3)
    exact = exact_joint3(pair, prompt, sampling).reshape(-1)
    assert chi_square_pvalue(counts, exact * n) > 1e-3
    # power: the same draws are rejected against a slightly different distribution
    wrong = exact_joint3(pair, prompt, SamplingParams(**dict(params, temperature=params["temperature"] * 1.25)))
    assert chi_square_pvalue(counts, wrong.reshape(-1) * n) < 1e-3
