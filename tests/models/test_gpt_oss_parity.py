"""gpt-oss against transformers' `GptOssForCausalLM` (fp32, eager) on a tiny random model.

The reference reads the release-layout (MXFP4) fixture itself, through transformers' CPU path
(`Mxfp4Config(dequantize=True)`), so both sides see the same packed bytes. The tiny model keeps the
release's structure: alternating sliding (window 16 here, 128 in the release) / full layers, YaRN RoPE,
sinks, biases everywhere, top-k-then-softmax routing and the clamped SwiGLU (expert weights scaled up so
that the +-7 clamp is active, which is asserted).
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dflash")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dflash_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from dflash_jax.models.gpt_oss.hf import deinterleave_index  # noqa: E402
from convert import load_hf_target  # noqa: E402
from dflash_jax.cache import rollback  # noqa: E402
from dflash_jax.config import ConfigError, MoEConfig, from_hf_config  # noqa: E402
from dflash_jax.models.draft.config import DraftConfig  # noqa: E402
from dflash_jax.models.gpt_oss.config import GptOssConfig  # noqa: E402
from dflash_jax.models import gpt_oss  # noqa: E402
from dflash_jax.nn.rope import inverse_frequencies  # noqa: E402
from dflash_jax.pair import check_pair  # noqa: E402
from dflash_jax.quant import MXFP4Tensor  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    build_and_save_draft, build_gpt_oss, hf_forward, load_gpt_oss_mxfp4_reference, save_gpt_oss_mxfp4_release,
    record_reference_proposals, tiny_draft_config, tiny_gpt_oss_config,
)

FP32_TOL = 1e-4
PROMPT = 300
WINDOW = 16
LAYERS = 4
CACHE = 384

# https://huggingface.co/openai/gpt-oss-20b config.json (layer_types: 12 x [sliding, full])
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                    layer_types=["sliding_attention", "full_attention"] * 18)
# z-lab/gpt-oss-20b-DFlash config.json
GPT_OSS_20B_DRAFT = {
    "architectures": ["DFlashDraftModel"], "attention_bias": True, "attention_dropout": 0.0, "block_size": 8,
    "bos_token_id": 199998, "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16", "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 7680,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_hidden_layers": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "vocab_size": 201088,
}


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """One randomized model in both layouts: `release` (MXFP4 blocks/scales + quantization_config) and
    `dense` (what save_pretrained writes: fused fp32 experts), plus transformers' model read from `release`."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = build_gpt_oss(tiny_gpt_oss_config(num_hidden_layers=LAYERS, sliding_window=WINDOW), seed=11)
    model.save_pretrained(root / "dense")
    save_gpt_oss_mxfp4_release(model, root / "release")
    ref = load_gpt_oss_mxfp4_reference(root / "release")
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    cfg, weights = load_hf_target(root / "release")
    return {"root": root, "ref": ref, "cfg": cfg, "weights": weights}


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _record_swiglu_inputs(model):
    """Wraps each expert block's activation to keep the (interleaved) gate_up rows it receives."""
    seen = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        original = experts._apply_gate

        def recording(gate_up, original=original):
            seen.append(gate_up.detach().clone())
            return original(gate_up)

        experts._apply_gate = recording
    return seen


def _close(ours, ref):
    """Max abs error, relative to the reference's scale where that is above 1 (deep hidden states grow)."""
    ref = np.asarray(ref)
    return float(np.abs(np.asarray(ours) - ref).max() / max(1.0, np.abs(ref).max()))


def test_release_configs_parse():
    for raw, layers, experts in ((GPT_OSS_20B, 24, 32), (GPT_OSS_120B, 36, 128)):
        cfg = from_hf_config(raw)
        assert isinstance(cfg, GptOssConfig)
        assert cfg.moe == MoEConfig(num_experts=experts, top_k=4, intermediate_size=2880, norm_topk_prob=True,
                                    router="topk_softmax")
        assert cfg.num_layers == layers and cfg.layer_windows == (128, None) * (layers // 2)
        assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2880, 64, 8, 64)
        assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rms_norm_eps, cfg.attention_bias) == (1.702, 7.0, 1e-5, True)
        assert cfg.rope.kind == "yarn" and not cfg.rope.truncate and cfg.rope.factor == 32.0
        np.testing.assert_allclose(inverse_frequencies(cfg.rope)[:3], [1.0, 0.68904, 0.47478], atol=1e-5)
        hash(cfg)
    # transformers 5's schema (rope_parameters, num_experts alias) and class defaults give the same model
    new = {k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta", "experts_per_token",
                                                               "layer_types", "num_local_experts")}
    new.update(rope_parameters=dict(GPT_OSS_20B["rope_scaling"], rope_theta=150000.0), num_experts=32)
    assert from_hf_config(new) == from_hf_config(GPT_OSS_20B)
    # the z-lab draft pairs with the release target; its mask token 200000 lies in the vocabulary
    draft = from_hf_config(GPT_OSS_20B_DRAFT)
    assert isinstance(draft, DraftConfig) and draft.mask_token_id == 200000 and draft.attention_bias
    check_pair(from_hf_config(GPT_OSS_20B), draft)
    with pytest.raises(ConfigError, match="expects a target with 24 layers"):
        check_pair(from_hf_config(GPT_OSS_120B), from_hf_config(dict(GPT_OSS_20B_DRAFT, num_target_layers=24)))
    for patch, message in (
        ({"some_new_knob": 1}, "some_new_knob"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
        ({"experts_per_token": 8}, "disagree"),
        ({"layer_types": ["linear_attention"] * 24}, "linear_attention"),
        ({"sliding_window": None}, "sliding_window"),
    ):
        with pytest.raises(ConfigError, match=message):
            from_hf_config(dict(GPT_OSS_20B, **patch))


def test_prefill_matches_reference_on_release_layout(fixture):
    ref, cfg, weights = fixture["ref"], fixture["cfg"], fixture["weights"]
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)
    layer = weights.layers[0]
    assert isinstance(layer.mlp.gate_up, MXFP4Tensor) and isinstance(layer.mlp.down, MXFP4Tensor)
    assert layer.mlp.gate_up.blocks.dtype == jnp.uint8 and layer.input_norm.dtype == jnp.float32
    tokens = _tokens(PROMPT, cfg.vocab_size, 0)
    seen = _record_swiglu_inputs(ref)
    ref_logits, ref_hidden, ref_router = hf_forward(ref, tokens)
    gate_up = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])
    assert gate_up[:, ::2].max() > 7 and gate_up[:, 1::2].max() > 7 and gate_up[:, 1::2].min() < -7  # clamps bite
    out = gpt_oss.forward_jit(weights, jnp.asarray(tokens[None]), gpt_oss.init_cache(cfg, 1, CACHE), cfg,
                              tap_layers=tuple(range(LAYERS)), return_router_logits=True)
    err = float(np.abs(np.asarray(out.logits) - ref_logits).max())
    assert err < FP32_TOL, err
    for i in range(LAYERS):
        assert _close(out.taps[i], ref_hidden[i + 1]) < FP32_TOL, i
    for i, r in enumerate(ref_router):  # biased logits, then the same top-k sets
        assert _close(out.router_logits[i][0], r) < FP32_TOL
        ours = np.sort(np.asarray(out.router_experts[i])[0], axis=-1)
        np.testing.assert_array_equal(ours, np.sort(np.argsort(-r, axis=-1)[..., : cfg.moe.top_k], axis=-1))
    assert int(out.cache.lengths[0]) == PROMPT


def test_dense_reexport_is_the_same_model(fixture):
    """save_pretrained's layout (fused dense experts [E, H, 2I] with interleaved gate/up, [E, I, H]) loads to
    the de-interleaved dense form of the very same tables."""
    cfg, packed = fixture["cfg"], fixture["weights"]
    cfg_dense, dense = load_hf_target(fixture["root"] / "dense")
    assert cfg_dense == cfg
    for a, b in zip(dense.layers, packed.layers):
        np.testing.assert_array_equal(np.asarray(a.mlp.gate_up),
                                      np.swapaxes(np.asarray(b.mlp.gate_up.dequantize(jnp.float32)), 1, 2))
        np.testing.assert_array_equal(np.asarray(a.mlp.down),
                                      np.swapaxes(np.asarray(b.mlp.down.dequantize(jnp.float32)), 1, 2))
        np.testing.assert_array_equal(np.asarray(a.mlp.gate_up_bias), np.asarray(b.mlp.gate_up_bias))
    # gate half first: column c < I of the stored table is the release's gate column 2c
    hf_gate_up = fixture["ref"].model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    inter = cfg.moe.intermediate_size
    np.testing.assert_array_equal(np.asarray(dense.layers[1].mlp.gate_up)[:, :, :inter], hf_gate_up[:, :, 0::2])
    np.testing.assert_array_equal(np.asarray(dense.layers[1].mlp.gate_up)[:, :, inter:], hf_gate_up[:, :, 1::2])
    tokens = _tokens(96, cfg.vocab_size, 1)
    a = gpt_oss.forward_jit(dense, jnp.asarray(tokens[None]), gpt_oss.init_cache(cfg, 1, 128), cfg)
    b = gpt_oss.forward_jit(packed, jnp.asarray(tokens[None]), gpt_oss.init_cache(cfg, 1, 128), cfg)
    assert float(np.abs(np.asarray(a.logits) - np.asarray(b.logits)).max()) < 1e-5


def test_block_extensions_with_rollbacks_across_the_window(fixture):
    """Prefill, then width-B verify blocks with random acceptance; every block straddles a window edge
    (positions > 16), and rollbacks leave stale rows inside the next block's window."""
    ref, cfg, weights = fixture["ref"], fixture["cfg"], fixture["weights"]
    rng = np.random.default_rng(3)
    committed = list(_tokens(PROMPT - 7, cfg.vocab_size, 2))
    out = gpt_oss.forward_jit(weights, jnp.asarray([committed]), gpt_oss.init_cache(cfg, 1, CACHE), cfg,
                              logits="last")
    cache = out.cache
    width = 5
    errs = []
    for round_ in range(4):
        block = list(rng.integers(0, cfg.vocab_size, width))
        out = gpt_oss.forward_jit(weights, jnp.asarray([block], jnp.int32), cache, cfg, tap_layers=(1,))
        ref_logits, ref_hidden, _ = hf_forward(ref, np.array(committed + block))
        errs.append(float(np.abs(np.asarray(out.logits[0]) - ref_logits[0, -width:]).max()))
        assert _close(out.taps[0][0], ref_hidden[2][0, -width:]) < FP32_TOL
        keep = (1, 3, 5, 2)[round_]
        committed += block[:keep]
        cache = rollback(out.cache, jnp.asarray([len(committed)]))
    nxt = [int(rng.integers(0, cfg.vocab_size))]
    out = gpt_oss.forward_jit(weights, jnp.asarray([nxt], jnp.int32), cache, cfg, logits="last")
    ref_logits, _, _ = hf_forward(ref, np.array(committed + nxt))
    errs.append(float(np.abs(np.asarray(out.logits[0]) - ref_logits[0, -1]).max()))
    assert max(errs) < FP32_TOL, errs


@pytest.fixture(scope="module")
def gpt_oss_pair(fixture, tmp_path_factory):
    """The release-layout target plus a tiny gpt_oss-type DFlash draft (q/k/v/o biases), as z-lab ships them."""
    root = tmp_path_factory.mktemp("gpt_oss_pair")
    ddir = root / "draft"
    build_and_save_draft(tiny_draft_config(target_layers=LAYERS, taps=(0, 2), attention_bias=True), ddir, seed=12)
    raw = json.loads((ddir / "config.json").read_text())
    raw.update(model_type="gpt_oss", initial_context_length=4096, bos_token_id=None, eos_token_id=None)
    (ddir / "config.json").write_text(json.dumps(raw))
    out = {}
    for fmt in ("mxfp4", "bf16"):
        out[fmt] = root / fmt
        convert(str(fixture["root"] / "release"), str(ddir), str(out[fmt]), expert_format=fmt, dtype="fp32",
                progress=False)
    return ddir, out


def test_convert_round_trip_keeps_experts_packed(fixture, gpt_oss_pair):
    ddir, converted = gpt_oss_pair
    cfg, loaded = fixture["cfg"], fixture["weights"]
    pair = dflash_jax.load(converted["mxfp4"])
    assert pair.target_cfg == cfg and pair.draft_cfg.model_type == "gpt_oss" and pair.draft_cfg.attention_bias
    e, h, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    # MXFP4 size: 4-bit codes plus one byte per 32 weights, i.e. 17/32 bytes per weight
    assert pair.expert_bytes == LAYERS * e * 3 * h * inter * 17 // 32 == pair.manifest["expert_bytes"]
    layer = pair.target.layers[1]
    assert isinstance(layer.mlp.gate_up, MXFP4Tensor)
    # the packed bytes are the release's, rows de-interleaved (gate rows first)
    from safetensors.numpy import load_file

    src = load_file(fixture["root"] / "release" / "model.safetensors")
    blocks = src["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    stored = np.asarray(layer.mlp.gate_up.blocks)
    np.testing.assert_array_equal(stored[:, deinterleave_index(inter)], blocks)
    np.testing.assert_array_equal(np.asarray(layer.mlp.down.blocks), src["model.layers.1.mlp.experts.down_proj_blocks"])
    # the same model as loading the HF directory directly, and the draft as z-lab stored it
    for a, b in zip(jax.tree.leaves(pair.target), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    draft_src = load_file(ddir / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(pair.draft.layers[0].attn.q_bias),
                                  draft_src["layers.0.self_attn.q_proj.bias"])
    tokens = _tokens(64, cfg.vocab_size, 4)
    ref_logits, _, _ = hf_forward(fixture["ref"], tokens)
    out = gpt_oss.forward_jit(pair.target, jnp.asarray(tokens[None]), gpt_oss.init_cache(cfg, 1, 128), cfg)
    assert float(np.abs(np.asarray(out.logits) - ref_logits).max()) < FP32_TOL

    # --expert-format bf16 dequantizes per layer: exact, since MXFP4 values are bf16 values
    bf16 = dflash_jax.load(converted["bf16"])
    assert bf16.expert_format == "bf16" and bf16.expert_bytes == LAYERS * e * 3 * h * inter * 2
    table = bf16.target.layers[1].mlp.gate_up
    assert table.dtype == jnp.bfloat16 and table.shape == (e, h, 2 * inter)
    np.testing.assert_array_equal(np.asarray(table, np.float32),
                                  np.swapaxes(np.asarray(layer.mlp.gate_up.dequantize(jnp.float32)), 1, 2))


def test_convert_refuses_to_requantize_mxfp4_experts(fixture, gpt_oss_pair, tmp_path):
    ddir, _ = gpt_oss_pair
    out = tmp_path / "nv"
    with pytest.raises(ValueError, match="quantize them twice"):
        convert(str(fixture["root"] / "release"), str(ddir), str(out), expert_format="nvfp4", progress=False)
    assert not out.exists()


def test_bad_release_checkpoints(fixture, tmp_path):
    from safetensors.numpy import load_file, save_file

    from convert.errors import CheckpointError

    src = fixture["root"] / "release"
    cases = [
        (lambda t: t.pop("model.layers.2.mlp.experts.down_proj_scales"),
         "missing tensors for layers.2.mlp.down#scales"),
        (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks":
                             t["model.layers.0.mlp.experts.gate_up_proj_blocks"].astype(np.float32)}), "packed uint8"),
        (lambda t: t.pop("model.layers.3.self_attn.sinks"), "missing tensors for layers.3.attn.sinks"),
    ]
    for i, (edit, message) in enumerate(cases):
        d = tmp_path / f"bad{i}"
        shutil.copytree(src, d)
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / "model.safetensors")
        with pytest.raises(CheckpointError) as e:
            load_hf_target(d)
        assert message in str(e.value)


def test_bf16_within_dtype_tolerance(fixture):
    """A bf16 load keeps the norm weights fp32 and the experts packed; its error against the fp32 reference
    is no worse than transformers' own bf16 run (dequantized experts, bf16 activations) on the same input."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    cfg, ref = fixture["cfg"], fixture["ref"]
    _, w16 = load_hf_target(fixture["root"] / "release", dtype="bf16")
    assert w16.embed.dtype == jnp.bfloat16 and w16.layers[0].attn.sinks.dtype == jnp.bfloat16
    assert w16.final_norm.dtype == jnp.float32 and w16.layers[0].post_norm.dtype == jnp.float32
    assert isinstance(w16.layers[0].mlp.gate_up, MXFP4Tensor)
    tokens = _tokens(128, cfg.vocab_size, 5)
    ref32, _, _ = hf_forward(ref, tokens)
    hf16 = AutoModelForCausalLM.from_pretrained(
        fixture["root"] / "release", dtype=torch.bfloat16, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    ref16, _, _ = hf_forward(hf16, tokens)
    cache = gpt_oss.init_cache(cfg, 1, 128, dtype=jnp.bfloat16)
    ours = np.asarray(gpt_oss.forward_jit(w16, jnp.asarray(tokens[None]), cache, cfg).logits)
    err_ours, err_ref = np.abs(ours - ref32), np.abs(ref16 - ref32)
    assert err_ours.mean() <= 1.5 * err_ref.mean() and np.quantile(err_ours, 0.99) <= 1.5 * np.quantile(err_ref, 0.99)
    assert err_ours.mean() > 1e-5  # a bf16 run, not an fp32 one in disguise


def test_experts_are_dequantized_one_layer_at_a_time():
    """The XLA path dequantizes a layer's MXFP4 tables inside that layer's grouped matmul: the compiled
    forward's scratch memory holds about one layer's dense tables, not every layer's (XLA hoists weight-only
    work to the start of the program unless the tables depend on the layer's routing)."""
    from dflash_jax.testing import random_gpt_oss_weights, tiny_gpt_oss_config

    layers, e, h, inter = 4, 16, 64, 64
    cfg = tiny_gpt_oss_config(num_layers=layers, hidden_size=h, layer_windows=(16, None) * (layers // 2),
                              moe=MoEConfig(num_experts=e, top_k=2, intermediate_size=inter, norm_topk_prob=True,
                                            router="topk_softmax"))
    weights = random_gpt_oss_weights(cfg, jax.random.key(0))
    compiled = gpt_oss.forward_jit.lower(
        weights, jnp.zeros((1, 4), jnp.int32), gpt_oss.init_cache(cfg, 1, 32), cfg, implementation="xla").compile()
    stats = compiled.memory_analysis()
    dense_layer = e * 3 * h * inter * 4  # fp32 gate_up + down of one layer
    packed = sum(x.nbytes for layer in weights.layers for x in jax.tree.leaves((layer.mlp.gate_up, layer.mlp.down)))
    assert packed == layers * e * 3 * h * inter * 17 // 32  # the tables arrive packed
    assert stats.temp_size_in_bytes < 2 * dense_layer, (stats.temp_size_in_bytes, dense_layer)


def _agreeable(pair):
    """The converted pair with planted agreement (`testing.make_agreeable`: both final norms amplify hidden
    dim 0, whose sign picks token 7 or 9), so rounds accept a mix of proposals instead of none."""
    import dataclasses

    from dflash_jax import testing

    target, draft = testing.make_agreeable(pair.target, pair.draft)
    return dataclasses.replace(pair, target=target, draft=draft)


@pytest.mark.slow  # three compiled generation loops: ~20 s on 2 cores
def test_greedy_speculative_decoding_equals_plain_decoding(gpt_oss_pair):
    """The converted gpt-oss pair (agreement planted) runs the speculative loop; greedy output is the target's
    own greedy output, token for token, across the sliding window and rollbacks of every length, and
    proposals really are accepted (tau well above 1), so the equality is not that of a never-accepting loop."""
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec.loop import generate

    _, converted = gpt_oss_pair
    pair = _agreeable(dflash_jax.load(converted["mxfp4"]))
    prompts = [list(_tokens(40, pair.target_cfg.vocab_size, 6)), list(_tokens(23, pair.target_cfg.vocab_size, 7))]
    n = 40
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)
    flat = [t for seq in plain for t in seq]
    assert min(flat.count(7), flat.count(9)) > len(flat) // 4  # the planted tokens follow the context
    for block in (4, 8):
        spec = generate(pair, prompts, max_new_tokens=n, block_size=block)
        assert spec.tokens == plain, f"block size {block}"
        accepted = [a for seq in spec.acceptance_lengths for a in seq]
        assert spec.stats["mean_acceptance"] >= 1.6, (block, spec.stats["mean_acceptance"])  # measured 2.1
        assert min(accepted) == 1 and max(accepted) >= 4  # rejections at the first proposal and long accepts


def test_rounds_equal_reference_dflash_generate(fixture, gpt_oss_pair, monkeypatch):
    """z-lab's loop on transformers' gpt-oss (read from the same MXFP4 release files) with the gpt_oss-type
    draft: per-round proposals and acceptance lengths equal ours on the converted pair, outputs identical."""
    import time

    reference = pytest.importorskip("dflash.model")
    from dflash_jax.spec.loop import generate_stepping

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # return_stats without CUDA
    ddir, converted = gpt_oss_pair
    draft_ref = reference.DFlashDraftModel.from_pretrained(ddir).float().eval()
    proposals = record_reference_proposals(monkeypatch, draft_ref)
    pair = _agreeable(dflash_jax.load(converted["mxfp4"]))
    target_ref = copy.deepcopy(fixture["ref"])
    with torch.no_grad():  # the same planted agreement on the reference side, copied from ours
        target_ref.model.norm.weight.copy_(torch.from_numpy(np.array(pair.target.final_norm, np.float32)))
        target_ref.lm_head.weight.copy_(torch.from_numpy(np.array(pair.target.lm_head, np.float32).T))
        draft_ref.norm.weight.copy_(torch.from_numpy(np.array(pair.draft.final_norm, np.float32)))
    prompt = list(map(int, _tokens(60, pair.target_cfg.vocab_size, 8)))
    n, block = 24, 4
    with torch.no_grad():
        ref = reference.dflash_generate(draft_ref, target_ref, torch.tensor([prompt]), max_new_tokens=n,
                                        stop_token_ids=None, temperature=0.0, block_size=block, return_stats=True)
    ours = generate_stepping(pair, [prompt], max_new_tokens=n, block_size=block, trace=True)
    assert ours.tokens[0] == ref.output_ids[0, len(prompt):].tolist()
    start, compared = 0, 0
    for round_, (ref_acc, our_acc) in enumerate(zip(ref.acceptance_lengths, ours.acceptance_lengths[0])):
        if start + block > n:  # the reference narrows its last blocks
            break
        assert our_acc == ref_acc, f"round {round_}"
        assert ours.trace[round_][0]["proposal"] == proposals[round_], f"round {round_}"
        start += ref_acc
        compared += 1
    assert compared >= 4 and max(ref.acceptance_lengths[:compared]) > 1  # rounds that accepted proposals compared
