"""DFlash draft parity against z-lab's reference `dflash.model.DFlashDraftModel` (fp32, tiny random models).

The target is a tiny random Qwen3-MoE; each draft is a tiny random `DFlashDraftModel` saved with
`save_pretrained` and read back with `convert.draft.load_hf_draft`. Context features are the target's
HF hidden states `h[i+1]` for i in `target_layer_ids`, as the reference's `extract_context_feature` builds them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from convert.draft import load_hf_draft  # noqa: E402
from convert.errors import CheckpointError  # noqa: E402
from convert import load_hf_target  # noqa: E402
from dflash_jax.config import ConfigError, from_hf_config  # noqa: E402
from dflash_jax.models.draft.config import DraftConfig, default_target_layer_ids  # noqa: E402
from dflash_jax.pair import check_pair  # noqa: E402
from dflash_jax.models import draft, qwen3  # noqa: E402
from tests.hf_reference import build_and_save, randomize_, tiny_qwen3_moe_config  # noqa: E402

FP32_TOL = 1e-4
B = 8
MASK = 159
TAPS = (0, 2)
TARGET_LAYERS = 4
PROMPT = 300
SEQ = 360  # tokens the target is run on once; rounds read their rows from it
CACHE_LEN = 512
PREFILL_CHUNK = 128

_SLIDING, _FULL = "sliding_attention", "full_attention"
DRAFTS = {
    "full": dict(layer_types=[_FULL, _FULL], attention_bias=False),
    "sliding_bias": dict(layer_types=[_SLIDING, _FULL, _SLIDING], sliding_window=6, use_sliding_window=True,
                         attention_bias=True),
    "sliding_noncausal": dict(layer_types=[_FULL, _SLIDING], sliding_window=20, use_sliding_window=True,
                              is_causal=False),
    "causal_bias": dict(layer_types=[_FULL, _FULL], attention_bias=True, is_causal=True),
    # The reference's optional embedding scale, logit multiplier and soft cap (read from dflash_config).
    "scaled": dict(layer_types=[_FULL, _SLIDING], sliding_window=5, use_sliding_window=True,
                   dflash_config={"mask_token_id": MASK, "target_layer_ids": list(TAPS), "block_size": B,
                                  "input_embedding_scale": 1.7, "output_multiplier": 0.5,
                                  "final_logit_softcapping": 2.0}),
}


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The HF target, its directory, a token stream and the HF hidden states over it."""
    d = tmp_path_factory.mktemp("target")
    hf = build_and_save(tiny_qwen3_moe_config(num_hidden_layers=TARGET_LAYERS), d, seed=11)
    tokens = np.random.default_rng(0).integers(0, MASK, SEQ).astype(np.int64)
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens[None]), output_hidden_states=True)
    hidden = tuple(h.float() for h in out.hidden_states)
    features = reference.extract_context_feature(hidden, list(TAPS))[0].numpy()  # [SEQ, n_taps * H]
    embed = hf.get_input_embeddings().weight.detach().numpy()
    lm_head = hf.lm_head.weight.detach().numpy().T
    return dict(hf=hf, dir=d, tokens=tokens, hidden=hidden, features=features, embed=embed, lm_head=lm_head)


def _hf_draft_config(name: str):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_target_layers=TARGET_LAYERS,
        dflash_config={"mask_token_id": MASK, "target_layer_ids": list(TAPS), "block_size": B},
    )
    kw.update(DRAFTS[name])
    kw["num_hidden_layers"] = len(kw["layer_types"])
    return Qwen3Config(**kw)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """name -> (reference model, our config, our weights, directory); built on first use."""
    built = {}

    def get(name):
        if name not in built:
            d = tmp_path_factory.mktemp(f"draft_{name}")
            torch.manual_seed(0)
            hf = reference.DFlashDraftModel(_hf_draft_config(name)).float()
            randomize_(hf, seed=5 + list(DRAFTS).index(name))
            hf.eval()
            hf.save_pretrained(d)
            cfg, weights = load_hf_draft(d, "fp32")
            built[name] = (hf, cfg, weights, d)
        return built[name]

    return get


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

_append_context_jit = jax.jit(draft.append_context, static_argnames=("cfg",))


def _block(anchor: int, width: int = B) -> np.ndarray:
    return np.array([anchor] + [MASK] * (width - 1), np.int64)


@torch.no_grad()
def _reference_call(hf_draft, target, ctx_rows: np.ndarray, block: np.ndarray, start: int, cache):
    """One draft call exactly as `dflash_generate` makes it: context rows end at `start`, positions
    `[start - C, start + B)`, then the draft cache is cropped back to `start`. Returns (hidden, logits)."""
    scale = float(reference._draft_value(hf_draft.config, "input_embedding_scale", 1.0))
    noise = torch.as_tensor(target["embed"])[torch.as_tensor(block)][None] * scale
    positions = torch.arange(start - len(ctx_rows), start + len(block))[None]
    hidden = hf_draft(
        target_hidden=torch.as_tensor(ctx_rows)[None], noise_embedding=noise, position_ids=positions,
        past_key_values=cache, use_cache=True,
    )
    reference._crop_to(cache, start)
    assert cache.get_seq_length() == start  # the draft cache keeps context K/V only
    logits = hf_draft.compute_logits(hidden, target["hf"].lm_head)
    return hidden[0].numpy(), logits[0].numpy()


def _padded(rows: np.ndarray, width: int, rng) -> np.ndarray:
    """`rows` followed by large garbage rows up to `width`: padding must never be visible."""
    garbage = 5.0 * rng.standard_normal((width - len(rows), rows.shape[1])).astype(np.float32)
    return np.concatenate([rows.astype(np.float32), garbage], axis=0)


def _ours(cfg, weights, target, *, block, features, num_context, cache):
    return draft.draft_forward_jit(
        weights, cfg, embed=jnp.asarray(target["embed"]), lm_head=jnp.asarray(target["lm_head"]),
        block_tokens=jnp.asarray(block, jnp.int32), context_features=jnp.asarray(features),
        num_context=jnp.asarray(num_context, jnp.int32), cache=cache,
    )


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# ------------------------------------------------------------------------------------------------
# (1) one block after a long context
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DRAFTS))
def test_block_after_long_context(name, target, drafts):
    hf_draft, cfg, weights, _ = drafts(name)
    assert cfg.layer_causal == tuple(l.self_attn.is_causal for l in hf_draft.layers)
    assert cfg.layer_windows == tuple(l.self_attn.sliding_window for l in hf_draft.layers)
    block = _block(int(target["tokens"][PROMPT]))
    ref_hidden, ref_logits = _reference_call(
        hf_draft, target, target["features"][:PROMPT], block, PROMPT, reference._make_cache(hf_draft.config)
    )
    rng = np.random.default_rng(1)
    features = _padded(target["features"][:PROMPT], PROMPT + 20, rng)[None]
    logits, hidden, cache = _ours(
        cfg, weights, target, block=block[None], features=features, num_context=[PROMPT],
        cache=draft.init_draft_cache(cfg, 1, CACHE_LEN),
    )
    assert logits.shape == (1, B, 160) and logits.dtype == jnp.float32
    assert _max_err(logits[0], ref_logits) < FP32_TOL
    assert _max_err(hidden[0], ref_hidden) < FP32_TOL
    assert int(cache.lengths[0]) == PROMPT
    assert np.ptp(ref_logits) > 1.0  # the comparison is not between near-constant outputs


# ------------------------------------------------------------------------------------------------
# (2) incremental rounds: the context arrives in chunks, the cache grows (batch of two sequences)
# ------------------------------------------------------------------------------------------------

# (prompt length, rows committed per round) per sequence; each round commits 1..B rows (anchor + accepted).
SCHEDULES = ((PROMPT, (3, 1, 8, 5, 2)), (PROMPT + 7, (1, 6, 2, 8, 4)))


@pytest.mark.parametrize("name", list(DRAFTS))
def test_incremental_rounds_match_reference(name, target, drafts):
    hf_draft, cfg, weights, _ = drafts(name)
    feats, tokens = target["features"], target["tokens"]
    rounds = len(SCHEDULES[0][1]) + 1

    # Reference: one sequence at a time, called and cropped as dflash_generate does.
    ref = []
    for prompt, produced in SCHEDULES:
        cache = reference._make_cache(hf_draft.config)
        prev, start, per_round = 0, prompt, []
        for r in range(rounds):
            per_round.append(_reference_call(hf_draft, target, feats[prev:start], _block(int(tokens[start])),
                                             start, cache))
            if r < len(produced):
                prev, start = start, start + produced[r]
        ref.append(per_round)

    # Ours: both sequences batched; the prompt is fed in fixed chunks first, then each round's new rows
    # arrive padded to B inside draft_forward.
    rng = np.random.default_rng(2)
    padded_feats = _padded(feats, CACHE_LEN, rng)
    cache = draft.init_draft_cache(cfg, 2, CACHE_LEN)
    for lo in range(0, max(p for p, _ in SCHEDULES), PREFILL_CHUNK):
        chunk = np.stack([padded_feats[lo:lo + PREFILL_CHUNK]] * 2)
        num = [min(max(p - lo, 0), PREFILL_CHUNK) for p, _ in SCHEDULES]
        cache = _append_context_jit(weights, cfg, context_features=jnp.asarray(chunk),
                                    num_context=jnp.asarray(num, jnp.int32), cache=cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [p for p, _ in SCHEDULES])
    starts = [p for p, _ in SCHEDULES]
    prevs = list(starts)
    for r in range(rounds):
        ctx = np.stack([_padded(feats[prevs[s]:starts[s]], B, rng) for s in range(2)])
        num = [starts[s] - prevs[s] for s in range(2)]
        block = np.stack([_block(int(tokens[starts[s]])) for s in range(2)])
        logits, hidden, cache = _ours(cfg, weights, target, block=block, features=ctx, num_context=num, cache=cache)
        np.testing.assert_array_equal(np.asarray(cache.lengths), starts)
        for s in range(2):
            ref_hidden, ref_logits = ref[s][r]
            assert _max_err(logits[s], ref_logits) < FP32_TOL, (name, r, s)
            assert _max_err(hidden[s], ref_hidden) < FP32_TOL, (name, r, s)
        if r < rounds - 1:
            prevs = list(starts)
            starts = [starts[s] + SCHEDULES[s][1][r] for s in range(2)]


@pytest.mark.parametrize("name", ["full", "sliding_bias"])
def test_replays_reference_dflash_generate(name, target, drafts):
    """Records every draft call of the reference's own `dflash_generate` and replays it through ours."""
    hf_draft, cfg, weights, _ = drafts(name)
    calls = []
    original = hf_draft.forward

    def recording_forward(**kwargs):
        out = original(**kwargs)
        calls.append({k: kwargs[k].clone() for k in ("target_hidden", "noise_embedding", "position_ids")}
                     | {"hidden": out.clone()})
        return out

    hf_draft.forward = recording_forward
    try:
        output_ids = reference.dflash_generate(
            hf_draft, target["hf"], torch.as_tensor(target["tokens"][None, :PROMPT]), max_new_tokens=24,
            stop_token_ids=None, temperature=0.0, return_stats=False,
        )[0].numpy()
    finally:
        del hf_draft.forward
    assert len(calls) >= 3
    rng = np.random.default_rng(3)
    cache = draft.init_draft_cache(cfg, 1, CACHE_LEN)
    expected_len = 0
    for n, call in enumerate(calls):
        ctx = call["target_hidden"][0].numpy()
        positions = call["position_ids"][0].numpy()
        width = call["noise_embedding"].shape[1]
        start = int(positions[len(ctx)])
        np.testing.assert_array_equal(positions, np.arange(start - len(ctx), start + width))
        assert start - len(ctx) == expected_len  # the new rows continue the cropped cache
        block = _block(int(output_ids[start]), width)
        np.testing.assert_array_equal(call["noise_embedding"][0].numpy(), target["embed"][block])
        if n == 0:  # the whole prompt: fed in chunks, then the block with no new rows
            for lo in range(0, len(ctx), PREFILL_CHUNK):
                rows = _padded(ctx[lo:lo + PREFILL_CHUNK], PREFILL_CHUNK, rng)[None]
                cache = _append_context_jit(weights, cfg, context_features=jnp.asarray(rows),
                                            num_context=jnp.asarray([min(len(ctx) - lo, PREFILL_CHUNK)], jnp.int32),
                                            cache=cache)
            ctx = ctx[:0]
        logits, hidden, cache = _ours(cfg, weights, target, block=block[None], features=_padded(ctx, B, rng)[None],
                                      num_context=[len(ctx)], cache=cache)
        assert int(cache.lengths[0]) == start
        assert _max_err(hidden[0], call["hidden"][0].numpy()) < FP32_TOL, n
        with torch.no_grad():
            ref_logits = hf_draft.compute_logits(call["hidden"], target["hf"].lm_head)[0].numpy()
        assert _max_err(logits[0], ref_logits) < FP32_TOL, n
        expected_len = start


# ------------------------------------------------------------------------------------------------
# (3) the +1 tap offset
# ------------------------------------------------------------------------------------------------


def test_tap_offset_is_layer_output(target, drafts):
    hf_draft, cfg, weights, _ = drafts("full")
    tcfg, tweights = load_hf_target(target["dir"])
    check_pair(tcfg, cfg)
    tokens = jnp.asarray(target["tokens"][None, :PROMPT], jnp.int32)
    out = qwen3.forward_jit(tweights, tokens, qwen3.init_cache(tcfg, 1, CACHE_LEN), tcfg,
                            tap_layers=cfg.target_layer_ids, logits="none")
    hidden = [h[0, :PROMPT].numpy() for h in target["hidden"]]
    for tap, i in zip(out.taps, cfg.target_layer_ids):
        assert _max_err(tap[0], hidden[i + 1]) < FP32_TOL  # h[i+1] = output of layer i
        assert _max_err(tap[0], hidden[i]) > 0.1
    ours_features = draft.context_features(out.taps)[0]
    assert _max_err(ours_features, target["features"][:PROMPT]) < FP32_TOL
    off_by_one = np.concatenate([hidden[i] for i in cfg.target_layer_ids], axis=-1)

    block = _block(int(target["tokens"][PROMPT]))
    _, ref_logits = _reference_call(hf_draft, target, target["features"][:PROMPT], block, PROMPT,
                                    reference._make_cache(hf_draft.config))

    def run(features):
        logits, _, _ = _ours(cfg, weights, target, block=block[None], features=np.asarray(features)[None],
                             num_context=[PROMPT], cache=draft.init_draft_cache(cfg, 1, CACHE_LEN))
        return logits[0]

    assert _max_err(run(ours_features), ref_logits) < FP32_TOL
    assert _max_err(run(off_by_one), ref_logits) > 0.1


# ------------------------------------------------------------------------------------------------
# (4) config parsing and loading
# ------------------------------------------------------------------------------------------------

# The older schema (transformers 4.x save): block_size top level, rope_theta top level, window fields unset.
OLD_SCHEMA = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "dtype": "bfloat16",
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 9728, "layer_types": [_FULL] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5,
    "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "transformers_version": "4.57.3",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
# A gpt-oss draft (model_type gpt_oss, q/k/v/o biases, block_size top level).
GPT_OSS_SCHEMA = {
    "architectures": ["DFlashDraftModel"], "attention_bias": True, "attention_dropout": 0.0, "block_size": 8,
    "bos_token_id": 199998, "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16", "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 7680,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_hidden_layers": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "vocab_size": 201088,
}


def test_head_variants_and_bf16(target, drafts):
    """Tied (None) and function heads equal the explicit [H, V] head; a bf16 load runs and stays close."""
    _, cfg, weights, d = drafts("sliding_bias")
    block = _block(int(target["tokens"][PROMPT]))[None]
    features = target["features"][None, :PROMPT]
    embed = jnp.asarray(target["embed"])

    def run(lm_head, fn=draft.draft_forward_jit):
        return fn(weights, cfg, embed=embed, lm_head=lm_head, block_tokens=jnp.asarray(block, jnp.int32),
                  context_features=jnp.asarray(features), num_context=jnp.asarray([PROMPT], jnp.int32),
                  cache=draft.init_draft_cache(cfg, 1, CACHE_LEN))[0]

    tied = run(None)
    assert _max_err(tied, run(embed.T)) < FP32_TOL  # same math, XLA may order the sums differently
    head = jnp.asarray(target["lm_head"])
    with_fn = jax.jit(lambda w: draft.draft_forward(
        w, cfg, embed=embed, lm_head=lambda h: h @ head, block_tokens=jnp.asarray(block, jnp.int32),
        context_features=jnp.asarray(features), num_context=jnp.asarray([PROMPT], jnp.int32),
        cache=draft.init_draft_cache(cfg, 1, CACHE_LEN))[0])(weights)
    assert _max_err(with_fn, run(head)) < FP32_TOL

    cfg16, w16 = load_hf_draft(d, "bf16")
    assert cfg16 == cfg and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(w16))
    logits16, hidden16, cache16 = draft.draft_forward_jit(
        w16, cfg, embed=embed.astype(jnp.bfloat16), lm_head=head.astype(jnp.bfloat16),
        block_tokens=jnp.asarray(block, jnp.int32), context_features=jnp.asarray(features, jnp.bfloat16),
        num_context=jnp.asarray([PROMPT], jnp.int32), cache=draft.init_draft_cache(cfg, 1, CACHE_LEN, jnp.bfloat16))
    assert logits16.dtype == jnp.float32 and hidden16.dtype == jnp.bfloat16
    assert cache16.keys[0].dtype == jnp.bfloat16
    ref = np.asarray(run(head))
    # bf16 keeps 8 mantissa bits; after 3 layers the logits (range ~10) agree to a few tenths.
    assert _max_err(logits16, ref) < 0.05 * np.ptp(ref)


def test_config_schemas(drafts):
    _, cfg, _, d = drafts("sliding_bias")  # the new schema, as transformers 5 saves it
    assert isinstance(cfg, DraftConfig)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (B, MASK, TAPS)
    assert cfg.layer_windows == (6, None, 6) and cfg.layer_causal == (True, False, True)
    assert cfg.attention_bias and cfg.rope.theta == 10000.0 and cfg.num_target_layers == TARGET_LAYERS

    old = from_hf_config(OLD_SCHEMA)
    assert (old.block_size, old.mask_token_id, old.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert old.rope.theta == 1e6 and old.layer_windows == (None,) * 5 and old.layer_causal == (False,) * 5
    assert old.num_taps * old.target_hidden_size == 5 * 2560

    gpt = from_hf_config(GPT_OSS_SCHEMA)
    assert gpt.model_type == "gpt_oss" and gpt.attention_bias and gpt.block_size == 8
    assert gpt.target_layer_ids == (1, 6, 11, 16, 21) and gpt.rope.theta == 150000 and gpt.rms_norm_eps == 1e-5

    # dflash_config wins over the top level, as in the reference's _draft_value.
    both = dict(OLD_SCHEMA, dflash_config=dict(OLD_SCHEMA["dflash_config"], block_size=10))
    assert from_hf_config(both).block_size == 10
    # Missing layer_types follow max_window_layers, and the window counts only with use_sliding_window.
    auto = dict(OLD_SCHEMA, use_sliding_window=True, sliding_window=64, max_window_layers=3)
    del auto["layer_types"]
    assert from_hf_config(auto).layer_windows == (None, None, None, 64, 64)
    assert from_hf_config(dict(auto, use_sliding_window=False)).layer_windows == (None,) * 5
    # YaRN from rope_scaling.
    yarn = dict(GPT_OSS_SCHEMA, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                              "truncate": False})
    assert from_hf_config(yarn).rope.kind == "yarn"


def test_default_target_layer_ids():
    for n in range(4, 64):
        for k in range(1, 9):
            assert list(default_target_layer_ids(n, k)) == reference.build_target_layer_ids(n, k), (n, k)
    no_ids = dict(OLD_SCHEMA, dflash_config={"mask_token_id": 151669})
    assert from_hf_config(no_ids).target_layer_ids == (1, 9, 17, 25, 33)
    assert from_hf_config(dict(no_ids, num_hidden_layers=1, layer_types=[_FULL])).target_layer_ids == (18,)
    with pytest.raises(ConfigError, match="num_target_layers"):
        from_hf_config({k: v for k, v in no_ids.items() if k != "num_target_layers"})


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"rope_flavour": 1}, "rope_flavour"),
        # a DFlash 2 field on a DFlash 1 architecture, and a DFlash 2 architecture without its fields
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "conv_kernel_size": 4}},
         "conv_kernel_size is a DFlash 2 field, but architectures says DFlashDraftModel"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel config needs dflash_config.conv_kernel_size"),
        ({"architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}, "lists both"),
        ({"model_type": "llama"}, "llama"),
        ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id"),
        ({"layer_types": [_SLIDING] + [_FULL] * 4, "sliding_window": 128}, "use_sliding_window"),
        ({"layer_types": [_FULL] * 4}, "layer_types"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 36]}}, "reach past"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_configs_raise(patch, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(dict(OLD_SCHEMA, **patch))


def test_loader_layouts_and_errors(drafts, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, cfg, weights, d = drafts("full")
    tensors = load_file(os.path.join(d, "model.safetensors"))

    def write(name, tensors, config=None):
        out = tmp_path / name
        out.mkdir()
        shutil.copy(os.path.join(d, "config.json"), out / "config.json")
        if config is not None:
            (out / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(out / "model.safetensors"))
        return out

    prefixed = write("prefixed", {("model." + k if k.startswith(("layers", "norm")) else k): v
                                  for k, v in tensors.items()})
    _, w2 = load_hf_draft(prefixed)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(w2)))
    assert np.array_equal(weights.fc, tensors["fc.weight"].T)
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_hf_draft(write("stray", dict(tensors, **{"embed_tokens.weight": np.zeros((160, 64), np.float32)})))
    with pytest.raises(CheckpointError, match="hidden_norm"):
        load_hf_draft(write("missing", {k: v for k, v in tensors.items() if k != "hidden_norm.weight"}))
    config = json.loads((d / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_hf_draft(write("wrong_taps", tensors, config))
    target_like = {k: v for k, v in config.items() if k not in ("dflash_config", "num_target_layers")}
    with pytest.raises(ConfigError, match="not a DFlash draft"):
        load_hf_draft(write("target_like", tensors, dict(target_like, architectures=["Qwen3ForCausalLM"])))


def test_check_pair(drafts, target):
    _, cfg, _, _ = drafts("full")
    tcfg = from_hf_config(target["dir"])
    check_pair(tcfg, cfg)
    with pytest.raises(ConfigError, match="hidden size"):
        check_pair(dataclasses.replace(tcfg, hidden_size=32, num_heads=4, num_kv_heads=2), cfg)
    with pytest.raises(ConfigError, match="outside the target"):
        check_pair(tcfg, dataclasses.replace(cfg, target_layer_ids=(0, 5), num_target_layers=None))
