"""Qwen3.5-MoE against transformers' `Qwen3_5MoeForCausalLM` on a tiny random model saved to a temp dir.

Tolerances. This architecture amplifies float32 rounding: the DeltaNet output norm divides each head's output
by its RMS, which is tiny for a few heads of a random model, so two correct float32 implementations differ by
up to ~3e-4 in a few logits. Measured over 30 random 300-token prompts against the exact answer
(transformers' model run in float64, `Float64Reference`): transformers' float32 model is up to 2.5e-4 off
(mean 4.3e-6), ours up to 3.0e-4 (mean 4.0e-6); 99% of logits of either are within 5e-5. So every logit
comparison is against the exact answer: the worst logit within FP32_MAX, the mean error within FP32_MEAN,
and for whole prompts 99% of logits within FP32_TOL and a mean error no larger than 1.5x transformers' own
float32 error on the same tokens. The DeltaNet layer itself is checked against transformers' layer in float64.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from convert.errors import CheckpointError  # noqa: E402
from convert import load_hf_target  # noqa: E402
from dflash_jax import ConfigError, from_hf_config  # noqa: E402
from dflash_jax.cache import rollback as move_lengths  # noqa: E402
from dflash_jax.models.qwen3_5.config import Qwen3_5Config  # noqa: E402
from dflash_jax.models import qwen3_5  # noqa: E402
from tests.hf_reference import (  # noqa: E402
    Float64Reference, build_and_save, fast_torch_cpu, gated_delta_rule_float64, hf_forward,
    tiny_qwen3_5_moe_config,
)

FP32_TOL = 1e-4  # 99% of the logits of a whole prompt
FP32_MAX = 5e-4  # every logit: twice transformers' own worst float32 error
FP32_MEAN = 5e-5  # mean error of any set of rows (a few rows near an ill-conditioned head reach 3e-5)
PROMPT = 300
MAX_LEN = 512


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    hf = build_and_save(tiny_qwen3_5_moe_config(), d, seed=1)
    cfg, weights = load_hf_target(d)
    assert isinstance(cfg, Qwen3_5Config)
    return hf, Float64Reference(d), cfg, weights, d


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _hf32(hf, tokens):
    """transformers' float32 forward (`hf_forward`), run by `fast_torch_cpu`."""
    with fast_torch_cpu():
        return hf_forward(hf, tokens)


def _assert_near_exact(cases, hf, exact):
    """cases: [(ours, tokens, rows)], `ours` the logits of `tokens[rows]`; checks them against the float64
    answer (see the module docstring). One right-padded reference batch for all cases: attention is causal,
    so trailing padding changes no logit of the real tokens."""
    padded = np.zeros((len(cases), max(len(t) for _, t, _ in cases)), np.int64)
    for i, (_, tokens, _) in enumerate(cases):
        padded[i, : len(tokens)] = tokens
    truth_all, ref_all = exact(padded), None
    for i, (ours, tokens, rows) in enumerate(cases):
        truth = truth_all[i, : len(tokens)][rows]
        err = np.abs(np.asarray(ours) - truth)
        assert err.max() <= FP32_MAX and err.mean() <= FP32_MEAN, (i, err.max(), err.mean())
        if err.shape[0] >= 100:  # a whole prompt: the bulk, and no worse than transformers in float32
            ref_all = _hf32(hf, padded)[0] if ref_all is None else ref_all
            ref_err = np.abs(ref_all[i, : len(tokens)][rows] - truth)
            assert np.mean(err > FP32_TOL) <= 0.01, (i, np.mean(err > FP32_TOL))
            assert err.mean() <= 1.5 * ref_err.mean(), (i, err.mean(), ref_err.mean())


def _prefill(weights, tokens, cfg, **cache_kw):
    """[b, PROMPT] prefills share one compiled forward (all logits, every tap)."""
    assert tokens.shape[1] == PROMPT
    cache = qwen3_5.init_cache(cfg, tokens.shape[0], MAX_LEN, **cache_kw)
    return qwen3_5.forward_jit(weights, jnp.asarray(tokens), cache, cfg, tap_layers=tuple(range(cfg.num_layers)))


def test_prefill_logits_taps_and_routing(pair):
    hf, exact, cfg, weights, _ = pair
    tokens = _tokens(PROMPT, cfg.vocab_size, 0)
    taps = tuple(range(cfg.num_layers))
    out = _prefill(weights, tokens[None], cfg)
    _assert_near_exact([(out.logits[0], tokens, slice(None))], hf, exact)
    ref_logits, ref_hidden, ref_router = _hf32(hf, tokens)
    truth_logits, truth_hidden = exact(tokens, hidden_states=True)
    for i in taps:  # the taps h[i+1] follow the same rule, the tolerance scaled to their size
        truth = truth_hidden[i + 1]
        tol = FP32_TOL * np.abs(truth).max() / np.abs(truth_logits).max()
        err = np.abs(np.asarray(out.taps[i]) - truth)
        assert err.max() <= FP32_MAX * tol / FP32_TOL and np.mean(err > tol) <= 0.01, (i, err.max())
        assert err.mean() <= 1.5 * np.abs(ref_hidden[i + 1] - truth).mean(), i
    assert int(out.cache.lengths[0]) == len(tokens)
    assert len(ref_router) == cfg.num_layers
    for i, r in enumerate(ref_router):
        ours = np.sort(np.asarray(out.router_experts[i])[0], axis=-1)
        np.testing.assert_array_equal(ours, np.sort(np.argsort(-r, axis=-1)[:, : cfg.moe.top_k], axis=-1))


@pytest.mark.parametrize("width", [qwen3_5.DEFAULT_ROLLBACK_WIDTH, 0], ids=["rollback-width-16", "no-rollback"])
def test_decode_step_by_step_after_prefill(pair, width):
    hf, exact, cfg, weights, _ = pair
    tokens = _tokens(PROMPT + 8, cfg.vocab_size, 1)
    out = _prefill(weights, tokens[None, :PROMPT], cfg, rollback_width=width)
    rows = [out.logits[0, -1]]
    cache = out.cache
    for p in range(PROMPT, len(tokens) - 1):
        out = qwen3_5.forward_jit(weights, jnp.asarray(tokens[None, p : p + 1]), cache, cfg)
        rows.append(out.logits[0, 0])
        cache = out.cache
    assert int(cache.lengths[0]) == len(tokens) - 1
    _assert_near_exact([(np.stack(rows), tokens, slice(PROMPT - 1, len(tokens) - 1))], hf, exact)


def test_block_extensions_with_rollbacks(pair):
    """Prefill, then width-B blocks with a random number of rows kept after each (a speculative verify)."""
    hf, exact, cfg, weights, _ = pair
    rng = np.random.default_rng(3)
    committed = list(_tokens(PROMPT, cfg.vocab_size, 2))
    cache = _prefill(weights, np.asarray([committed]), cfg).cache
    width, cases = 6, []
    for round_ in range(5):
        block = list(rng.integers(0, cfg.vocab_size, width))
        out = qwen3_5.forward_jit(weights, jnp.asarray([block], jnp.int32), cache, cfg)
        cases.append((out.logits[0], np.array(committed + block), slice(-width, None)))
        keep = int(rng.integers(1, width + 1)) if round_ else 1  # first round keeps only the anchor
        committed += block[:keep]
        # the exact rollback, or only the lengths (the next forward replays the kept rows then)
        undo = qwen3_5.rollback_jit if round_ % 2 == 0 else move_lengths
        cache = undo(out.cache, jnp.asarray([len(committed)]))
        assert int(cache.lengths[0]) == len(committed)
    nxt = [int(rng.integers(0, cfg.vocab_size))]
    out = qwen3_5.forward_jit(weights, jnp.asarray([nxt], jnp.int32), cache, cfg)
    cases.append((out.logits[0], np.array(committed + nxt), slice(-1, None)))
    _assert_near_exact(cases, hf, exact)


def test_rollback_equals_fresh_prefill_of_committed_tokens(pair):
    """Many random (block, accept count) patterns, 3 sequences at once: after `rollback` every DeltaNet
    state, conv tail and the next token's logits equal those of a fresh prefill of the committed tokens
    (up to float32 rounding: the two runs reach the same hidden states by different paths)."""
    _, _, cfg, weights, _ = pair
    rng = np.random.default_rng(5)
    batch, width, rounds = 3, 4, 12
    seqs = [list(_tokens(int(n), cfg.vocab_size, 20 + i)) for i, n in enumerate(rng.integers(3, 40, batch))]

    def prefill(seqs):  # right-padded with junk, as a serving batch would be
        padded = rng.integers(0, cfg.vocab_size, (batch, PROMPT)).astype(np.int32)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        lengths = jnp.asarray([len(s) for s in seqs], jnp.int32)
        return qwen3_5.forward_jit(weights, jnp.asarray(padded), qwen3_5.init_cache(cfg, batch, MAX_LEN), cfg,
                                   num_valid=lengths).cache

    def assert_close(a, b, rel):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=rel * np.abs(b).max(), rtol=0)

    committed = jax.jit(qwen3_5.committed_linear_states)
    cache = prefill(seqs)
    accepted = []
    for round_ in range(rounds):
        block = rng.integers(0, cfg.vocab_size, (batch, width)).astype(np.int32)
        keep = rng.integers(0, width + 1, batch)
        keep[round_ % batch] = (0, width)[round_ % 2] if round_ % 3 == 0 else keep[round_ % batch]
        accepted += list(keep)
        out = qwen3_5.forward_jit(weights, jnp.asarray(block), cache, cfg)
        seqs = [s + list(block[i, : keep[i]]) for i, s in enumerate(seqs)]
        cache = qwen3_5.rollback_jit(out.cache, jnp.asarray([len(s) for s in seqs]))
        fresh = prefill(seqs)
        np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(fresh.lengths))
        for (state, tail), (state_ref, tail_ref) in zip(committed(cache), committed(fresh)):
            assert_close(state, state_ref, 1e-4)
            assert_close(tail, tail_ref, 1e-4)
        for lin, lin_ref in zip(cache.linear, fresh.linear):  # rollback rebuilt the carried state itself
            assert_close(lin.state, lin_ref.state, 1e-4)
        nxt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
        ours = qwen3_5.forward_jit(weights, nxt, cache, cfg).logits
        ref = qwen3_5.forward_jit(weights, nxt, fresh, cfg).logits
        err = np.abs(np.asarray(ours) - np.asarray(ref))
        assert err.max() <= FP32_MAX and err.mean() <= FP32_MEAN, (err.max(), err.mean())
    assert set(accepted) == set(range(width + 1))


def test_batched_prefill_and_extension_of_different_lengths(pair):
    hf, exact, cfg, weights, _ = pair
    lengths = [PROMPT, 257, 131]
    seqs = [list(_tokens(n, cfg.vocab_size, 10 + i)) for i, n in enumerate(lengths)]
    padded = np.zeros((3, max(lengths)), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
        padded[i, len(s):] = (np.arange(max(lengths) - len(s)) * 7 + i) % cfg.vocab_size  # junk padding
    out = qwen3_5.forward_jit(weights, jnp.asarray(padded), qwen3_5.init_cache(cfg, 3, MAX_LEN), cfg,
                              num_valid=jnp.asarray(lengths, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), lengths)
    cases = [(out.logits[i, : len(s)], np.array(s), slice(None)) for i, s in enumerate(seqs)]
    cache = out.cache
    rng = np.random.default_rng(4)
    for keep in ([1, 4, 2], [3, 0, 4]):
        block = rng.integers(0, cfg.vocab_size, (3, 4)).astype(np.int32)
        out = qwen3_5.forward_jit(weights, jnp.asarray(block), cache, cfg)
        for i, s in enumerate(seqs):
            cases.append((out.logits[i], np.array(s + list(block[i])), slice(-4, None)))
            seqs[i] = s + list(block[i, : keep[i]])
        cache = qwen3_5.rollback_jit(out.cache, jnp.asarray([len(s) for s in seqs]))
    nxt = rng.integers(0, cfg.vocab_size, (3, 1)).astype(np.int32)
    out = qwen3_5.forward_jit(weights, jnp.asarray(nxt), cache, cfg)
    cases += [(out.logits[i], np.array(s + list(nxt[i])), slice(-1, None)) for i, s in enumerate(seqs)]
    _assert_near_exact(cases, hf, exact)


def test_deltanet_layer_is_exact_in_float64(pair):
    """In float64 the DeltaNet layer proves its math and its carried state exactly:
    - against transformers' layer in float64 (with a float64 delta rule) to 2e-6: transformers computes g and
      the output norm in float32 even in a float64 model, which is the whole difference (float32 runs
      differ by 1e-5);
    - one pass == kept blocks replayed by the next call == token by token, to 1e-10;
    - rolling a kept block back to any m rows gives the state and conv tail of a fresh (right-padded) pass
      over the prefix, to 1e-10."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as ref

    _, exact, cfg, weights, _ = pair
    i = cfg.linear_layers[-1]
    layer = exact.model.model.layers[i].linear_attn
    n, b = 150, 2
    x = np.random.default_rng(6).standard_normal((b, n, cfg.hidden_size))
    saved = ref.torch_chunk_gated_delta_rule
    ref.torch_chunk_gated_delta_rule = gated_delta_rule_float64
    try:
        with torch.no_grad(), fast_torch_cpu():
            expected = layer(torch.from_numpy(x)).numpy()
    finally:
        ref.torch_chunk_gated_delta_rule = saved
    with jax.enable_x64(True):
        w64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), weights.layers[i].mixer)
        layer_fn = jax.jit(qwen3_5.deltanet_mixer, static_argnames="cfg")
        fresh = lambda: qwen3_5.init_cache(cfg, b, 8, jnp.float64).linear[0]  # noqa: E731
        full = lambda t: jnp.full((b,), t, jnp.int32)  # noqa: E731

        def run(pieces, lin, steps=0, valid=None):
            outs = []
            for piece in pieces:
                num_valid = full(piece.shape[1]) if valid is None else full(valid)
                out, lin = layer_fn(jnp.asarray(piece), w64, lin, full(steps), num_valid, cfg=cfg)
                outs.append(np.asarray(out))
                steps = piece.shape[1] if piece.shape[1] <= lin.width else 0  # kept rows, committed next call
            return np.concatenate(outs, axis=1), lin, steps

        one_pass, _, _ = run([x], fresh())
        np.testing.assert_allclose(one_pass, expected, atol=2e-6, rtol=0)
        for split, upto in ((5, n), (1, 40)):  # kept blocks of 5 replayed by the next call; token by token
            outs, _, _ = run([x[:, s : s + split] for s in range(0, upto, split)], fresh())
            np.testing.assert_allclose(outs, one_pass[:, :upto], atol=1e-10, rtol=0)
        prefix, width = 37, 5
        _, lin, _ = run([x[:, :prefix], x[:, prefix : prefix + width]], fresh())  # the block is kept
        ksize = cfg.linear_conv_kernel
        for m in range(width + 1):
            state, tail = qwen3_5.gdn.committed_state(lin, full(m))
            # a fresh pass over the first prefix + m rows (padded; wider than W, so it commits)
            _, ref_lin, _ = run([x[:, : prefix + width]], fresh(), valid=prefix + m)
            np.testing.assert_allclose(np.asarray(state), np.asarray(ref_lin.state), atol=1e-10, rtol=0)
            np.testing.assert_allclose(np.asarray(tail), np.asarray(ref_lin.conv_window[:, : ksize - 1]),
                                       atol=1e-10, rtol=0)


def _release_layout(src, dst, *, fused: bool, prefix: str, extra: dict):
    """Rewrites a save_pretrained checkpoint (per-expert, `model.` prefix) into another layout."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = prefix + name[len("model."):]
        out[name] = t
    if fused:
        cfg = json.loads((src / "config.json").read_text())
        for i in range(cfg["num_hidden_layers"]):
            p = f"{prefix}layers.{i}.mlp.experts."
            e = range(cfg["num_experts"])
            gate = [out.pop(f"{p}{j}.gate_proj.weight") for j in e]
            up = [out.pop(f"{p}{j}.up_proj.weight") for j in e]
            down = [out.pop(f"{p}{j}.down_proj.weight") for j in e]
            out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])  # [E, 2I, H]
            out[p + "down_proj"] = torch.stack(down)  # [E, H, I]
    out.update(extra)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors")
    return dst


def _release_config(text_config: dict) -> dict:
    text = dict(text_config)
    text.pop("architectures", None)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True, mrope_section=[1, 1, 2])
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, attn_output_gate=True,
                mamba_ssm_dtype="float32", full_attention_interval=4)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text,
        "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 8},
        "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
        "vision_end_token_id": 248054, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    }


def test_release_layout_loads(pair, tmp_path):
    """`model.language_model.` prefix, fused experts without `.weight`, plus `mtp.*` and `model.visual.*`
    tensors and the multimodal config: the same model as the save_pretrained layout."""
    hf, _, cfg, weights, src = pair
    extra = {"mtp.fc.weight": torch.zeros(4, 4), "model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 8)}
    d = _release_layout(src, tmp_path / "release", fused=True, prefix="model.language_model.", extra=extra)
    (d / "config.json").write_text(json.dumps(_release_config(json.loads((src / "config.json").read_text()))))
    cfg_r, w_r = load_hf_target(d)
    assert cfg_r == cfg
    for a, b in zip(jax.tree.leaves(w_r), jax.tree.leaves(weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # per-expert tensors under the release prefix load too
    d2 = _release_layout(src, tmp_path / "per-expert", fused=False, prefix="model.language_model.", extra=extra)
    shutil.copy(d / "config.json", d2 / "config.json")
    _, w_p = load_hf_target(d2)
    for a, b in zip(jax.tree.leaves(w_p), jax.tree.leaves(weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = _tokens(6, cfg.vocab_size, 8)  # the block width of test_block_extensions_with_rollbacks
    ours = qwen3_5.forward_jit(w_r, jnp.asarray(tokens[None]), qwen3_5.init_cache(cfg, 1, MAX_LEN), cfg).logits
    np.testing.assert_allclose(np.asarray(ours[0]), _hf32(hf, tokens)[0][0], atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update({"model.language_model.layers.0.linear_attn.A_log":
                             t["model.layers.0.linear_attn.A_log"].clone()}), "duplicate"),
        (lambda t: t.update({"model.layers.2.linear_attn.A_log": torch.zeros(4)}), "config does not have"),
        (lambda t: t.pop("model.layers.1.linear_attn.dt_bias"), "missing tensors for layers.1.mixer.dt_bias"),
        (lambda t: t.update({"model.layers.0.linear_attn.conv1d.weight": torch.zeros(112, 1, 3)}), "has shape"),
        (lambda t: t.update({"visual.blocks.0.weight": torch.zeros(2)}), "not part of the model"),
    ],
    ids=["two-prefixes", "linear-tensor-on-full-layer", "missing", "conv-shape", "unknown"],
)
def test_bad_checkpoints_raise(pair, tmp_path, edit, message):
    _, _, _, _, src = pair
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_hf_target(d)


def _text_config():
    return {k: v for k, v in tiny_qwen3_5_moe_config().to_dict().items() if k != "architectures"}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
        (lambda c: c.update(layer_types=["linear_attention"] * 3), "one type per layer"),
        (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "sliding_attention"),
        (lambda c: c.update(attn_output_gate=False), "attn_output_gate"),
        (lambda c: c.update(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
        (lambda c: c.update(mlp_only_layers=[1]), "mlp_only_layers"),
        (lambda c: c.update(attention_bias=True), "attention_bias"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(some_new_knob=1), "some_new_knob"),
        (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}),
         "unexpected rope parameters"),
        (lambda c: c.update(head_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 4.0}),
         "partial_rotary_factor = 4.0 is above 1.0"),
    ],
)
def test_bad_text_configs_raise(edit, message):
    c = _text_config()
    edit(c)
    with pytest.raises(ConfigError, match=message):
        from_hf_config(c)


def test_wrapper_configs():
    text = _text_config()
    cfg = from_hf_config(text)
    assert cfg.rope.rotary_dim == 8 and cfg.linear_layers == (0, 1, 3) and cfg.full_layers == (2,)
    assert from_hf_config(_release_config(text)) == cfg
    # transformers' class defaults: partial_rotary_factor 0.25, layer_types from full_attention_interval
    bare = dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    del bare["layer_types"]
    bare["full_attention_interval"] = 2
    parsed = from_hf_config(bare)
    assert parsed.rope.rotary_dim == 8 and parsed.full_layers == (1, 3)
    for edit, message in [
        (lambda c: c.pop("text_config"), "needs a text_config"),
        (lambda c: c["text_config"].update(model_type="qwen3_next"), "expected 'qwen3_5_moe_text'"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda c: c.update(language_model_only=True), "language_model_only"),
    ]:
        c = _release_config(text)
        c["text_config"]["tie_word_embeddings"] = False
        edit(c)
        with pytest.raises(ConfigError, match=message):
            from_hf_config(c)


def test_the_hybrids_routed_experts_take_the_shared_moe_path():
    """Qwen3.5's routed experts run through `nn.moe.swiglu_experts` like every family's: on a CPU its choice of the
    compiled kernel, the routed-rows tiles or every token through every expert (`routed_path`), never for a GPU
    trace (a deviceless H200 compile on a CPU host keeps the grouped path); the layer equals the same sum through
    `ragged_dot`."""
    from dflash_jax import testing as T
    from dflash_jax.models import qwen3_5 as q35
    from dflash_jax.nn import moe
    from pallas_kernels import target

    cfg = T.tiny_qwen3_5_config()
    layer = T.random_pair(cfg, seed=0, expert_format="dense").target.layers[0]
    x = jax.random.normal(jax.random.PRNGKey(0), (40, cfg.hidden_size), jnp.float32)
    h = q35.mlp_input(layer, x, cfg)
    rt = q35.route(layer.mlp, h, cfg)
    with target.compiling_for("cpu"):
        assert moe.routed_path("auto", layer.mlp.gate_up, h.dtype, 40, rt.experts.shape[1]) in (
            "stream", "tiles", "dense")
    with target.compiling_for("gpu"):
        assert moe.routed_path("auto", layer.mlp.gate_up, h.dtype, 40, rt.experts.shape[1]) == "xla"
    ours = q35.mlp_sublayer(layer, x, h, cfg)
    grouped = q35.mlp_sublayer(layer, x, h, cfg, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(grouped), atol=2e-5)

