"""dflash-generate: the JSON contract, traces, text prompts, and one clear error per bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dflash")

import dflash_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from dflash_jax.cli.generate import main  # noqa: E402
from dflash_jax.spec import generate  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save, build_and_save_draft, make_agreeable_, tiny_draft_config, tiny_qwen3_moe_config,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=3, eos_token_id=5), root / "t0", seed=1)
    draft = build_and_save_draft(tiny_draft_config(target_layers=3), root / "d0", seed=2)
    make_agreeable_(target, draft)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    out = root / "pair"
    convert(str(root / "target"), str(root / "draft"), str(out), expert_format="mxfp4", dtype="fp32", progress=False)
    return out


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


PROMPT = ",".join(str(i % 150) for i in range(1, 120))


def test_json_contract(checkpoint, capsys):
    code, out, _ = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 24,
                        "--json", "--ignore-eos")
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"tokens", "acceptance_lengths", "stats"}
    assert len(result["tokens"]) == 24 and sum(result["acceptance_lengths"]) == 23
    for key in ("tokens_per_second", "mean_acceptance", "rounds", "block_size"):
        assert key in result["stats"]
    expected = generate(dflash_jax.load(checkpoint), [[int(t) for t in PROMPT.split(",")]], max_new_tokens=24)
    assert result["tokens"] == expected.tokens[0]


def test_sampling_edges(checkpoint, capsys):
    """Top-p / top-k at temperature 0 are named as doing nothing (one line); a positive temperature far
    below fp32's range is stable and gives the greedy output; neither compiles a new program."""
    args = ["--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 24, "--json", "--ignore-eos",
            "--no-measure"]  # the chain at every temperature (the measured default is greedy's)
    code, out, err = _run(capsys, *args)
    greedy = json.loads(out)["tokens"]
    assert code == 0 and "do nothing" not in err
    code, out, err = _run(capsys, *args, "--top-p", "0.5", "--top-k", "3")
    assert code == 0 and json.loads(out)["tokens"] == greedy
    assert err.count("note: --top-p / --top-k do nothing at --temperature 0") == 1
    from dflash_jax.compile_cache import CompileCounter

    with CompileCounter() as counter:
        code, out, _ = _run(capsys, *args, "--temperature", "1e-45", "--seed", "3")
    assert code == 0 and json.loads(out)["tokens"] == greedy
    assert counter.compiles == 0
    # seeds equal modulo 2^32 (all JAX's key keeps) draw differently: the high word is folded in
    drawn = {}
    for seed in (0, 2**32, -(2**32)):
        code, out, _ = _run(capsys, *args, "--temperature", "2", "--seed", str(seed))
        assert code == 0
        drawn[seed] = tuple(json.loads(out)["tokens"])
    assert len(set(drawn.values())) == 3, drawn


def test_trace_and_time_split(checkpoint, capsys):
    code, out, _ = _run(capsys, "--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 20,
                        "--json", "--trace", "--block-size", 4, "--ignore-eos")
    assert code == 0
    result = json.loads(out)
    assert len(result["trace"]) == len(result["acceptance_lengths"]) == result["stats"]["rounds"]
    for row, produced in zip(result["trace"], result["acceptance_lengths"]):
        assert len(row["proposal"]) == 3 and 0 <= row["accepted"] <= 3
        assert produced <= row["accepted"] + 1
    assert set(result["stats"]["time_split"]) == {"prefill_s", "draft_s", "verify_s", "host_s"}


def test_text_prompt_through_tokenizer(checkpoint, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"] * 20,
                            trainers.BpeTrainer(vocab_size=100, show_progress=False))
    assert tok.get_vocab_size() <= 150
    d = tmp_path / "with_tok"
    shutil.copytree(checkpoint, d)
    tok.save(str(d / "tokenizer.json"))
    from dflash_jax.checkpoint import add_side_file

    add_side_file(d, "tokenizer.json")  # a file put beside the weights by hand is recorded in the manifest
    code, printed, err = _run(capsys, "--checkpoint", d, "--prompt", "def fib(n):", "--max-new-tokens", 8)
    assert code == 0 and "tok/s" in err and "tau" in err
    code, out, _ = _run(capsys, "--checkpoint", d, "--prompt", "def fib(n):", "--max-new-tokens", 8, "--json")
    result = json.loads(out)
    # the prompt is the tokenizer's encoding, the output the pair's generation from it, decoded
    ids = tok.encode("def fib(n):", add_special_tokens=False).ids
    pair = dflash_jax.load(d)
    stops = [t for t in pair.target_cfg.eos_token_ids if 0 <= t < pair.target_cfg.vocab_size]
    want = generate(pair, [ids], max_new_tokens=8, stop_ids=stops).tokens[0]
    assert result["stats"]["prompt_tokens"] == len(ids) and result["tokens"] == want
    assert result["text"] == tok.decode(want) and printed == result["text"] + "\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-ids", "1,2,x"], "--prompt-ids must be comma-separated integers"),
        (["--prompt-ids", ","], "--prompt-ids is empty"),
        (["--prompt-ids", "1,2,999"], "token id 999 outside the vocabulary"),
        (["--prompt-ids", "1,2", "--block-size", "9"], "block size must be between 1 and the draft's trained"),
        (["--prompt-ids", "1,2", "--block-size", "0"], "block size must be between 1"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "hello"], "no tokenizer.json"),
        (["--prompt-ids", "1,2", "--trace", "--loop", "jit"], "--trace needs --loop python"),
        # numbers beyond what their traced int32 / float32 can hold: one line before anything loads
        (["--prompt-ids", "1,2", "--top-k", str(2**31)], "--top-k must be at most 2^31 - 1"),
        (["--prompt-ids", "1,2", "--top-k", "-1"], "--top-k must be >= 0"),
        (["--prompt-ids", "1,2", "--temperature", "1e308"], "--temperature must be at most 3.403e+38"),
        (["--prompt-ids", "1,2", "--temperature", "inf"], "--temperature must be >= 0 and finite"),
        (["--prompt-ids", "1,2", "--temperature", "nan"], "--temperature must be >= 0 and finite"),
        (["--prompt-ids", "1,2", "--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--prompt-ids", "1,2", "--max-new-tokens", str(2**31)], "--max-new-tokens must be at most 2^31 - 1"),
        (["--prompt-ids", "1,-2"], "token id -2 is negative"),
        (["--prompt-ids", "1,2", "--stop-ids", "3,-1"], "token id -1 is negative"),
        (["--prompt-ids", "1,2", "--tree-budget", str(2**31)], "--tree-budget must be at most 2^31 - 1"),
        (["--prompt-ids", "1,2", "--tree-budget", "4", "--tree-branch", str(2**40)], "--tree-branch must be at most"),
        (["--prompt-ids", "1,2", "--block-size", str(2**40)], "block size must be between 1 and the draft's"),
        (["--prompt-ids", "1,2", "--pflash-keep", "nan"], "--pflash-keep must be a fraction in (0, 1]"),
        (["--prompt-ids", "1,2", "--offload", "--expert-budget-mb", "inf"], "--expert-budget-mb must be a finite"),
        (["--prompt-ids", "1,2", "--offload", "--expert-budget-mb", "nan"], "--expert-budget-mb must be a finite"),
        (["--prompt-ids", "1,2", "--offload", "--expert-budget-mb", "-1"], "--expert-budget-mb must be a finite"),
        (["--prompt-ids", "1,2", "--offload", "--expert-budget-mb", "1", "--predictor-width", "0"],
         "--predictor-width must be >= 1"),
        (["--prompt-ids", "1,2", "--offload", "--expert-budget-mb", "1", "--pin-experts", str(2**40)],
         "--pin-experts must be at most 2^31 - 1"),
    ],
)
def test_bad_input_is_one_clear_error(checkpoint, capsys, argv, message):
    code, out, err = _run(capsys, "--checkpoint", checkpoint, *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1  # one line, no traceback


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = _run(capsys, "--checkpoint", tmp_path / "nope", "--prompt-ids", "1")
    assert code == 2 and "does not exist" in err
    code, _, err = _run(capsys, "--checkpoint", tmp_path, "--prompt-ids", "1")
    assert code == 2 and "not a dflash_jax checkpoint" in err


def test_sampling_params_ranges():
    """The rules every caller gets (the CLI and the server build SamplingParams): temperature in [0, 3.4e38]
    (float32's largest), finite; top_p in (0, 1]; top_k an integer in 0 .. 2^31 - 1 (>= the vocabulary: every token kept)."""
    from dflash_jax.spec.sampling import MAX_TEMPERATURE, MAX_TOP_K, RowSampling, SamplingParams

    assert MAX_TOP_K == 2**31 - 1 and MAX_TEMPERATURE == float(np.float32(3.4028235e38))
    edge = SamplingParams(temperature=MAX_TEMPERATURE, top_p=1e-50, top_k=MAX_TOP_K)
    rows = RowSampling.of(edge)  # every value fits its fp32 / int32 row, none becomes inf
    assert rows.top_k[0] == MAX_TOP_K and rows.temperature[0] == MAX_TEMPERATURE
    for bad, says in [(dict(top_k=2**31), "top_k must be at most 2^31 - 1"),
                      (dict(temperature=1e308), "temperature must be at most"),
                      (dict(temperature=10**400), "temperature is far beyond"),
                      (dict(temperature=float("inf")), "temperature must be >= 0 and finite")]:
        with pytest.raises(ValueError, match=says.replace("^", r"\^")):
            SamplingParams(**bad)


def test_default_measures_plain_decoding_against_the_chain(checkpoint, capsys):
    """With no proposer named, the run measures plain decoding against the chain on the prompt and runs the faster
    (`stats.measured_default`); its tokens are plain greedy's. `--no-measure` runs the chain as is."""
    args = ["--checkpoint", checkpoint, "--prompt-ids", PROMPT, "--max-new-tokens", 24, "--json", "--ignore-eos"]
    code, out, _ = _run(capsys, *args)
    result = json.loads(out)
    measured = result["stats"]["measured_default"]
    assert code == 0 and set(measured) == {"plain", "chain B=8", "chosen"} and measured["chosen"] in measured
    assert measured["plain"]["tokens_per_round"] == 1.0 and measured["chain B=8"]["ms_per_round"] > 0
    code, out, _ = _run(capsys, *args, "--block-size", 1)
    assert code == 0 and json.loads(out)["tokens"] == result["tokens"]
    assert "measured_default" not in json.loads(out)["stats"]
    code, out, _ = _run(capsys, *args, "--no-measure")
    chain = json.loads(out)
    assert chain["tokens"] == result["tokens"] and chain["stats"]["proposer"] == "chain"
