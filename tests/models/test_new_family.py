"""A new model family, added entirely from this file: its config dataclass and HF parser, its weights and
declarations, its forward pieces (from the `nn/` building blocks), its HF conversion table and its HF writer,
registered once with a `ModelFamily`. No library file names it; convert-weights converts its HF checkpoint,
`dflash_jax.load` loads the result and `dflash_jax.generate` runs speculative decoding on it, losslessly.

The toy: a pre-norm MoE decoder with plain GQA attention (no q/k norm), RoPE, a softmax-top-k router and
SwiGLU experts in every layer, in an invented HF layout (`model.blocks.{i}.*`, fused expert tensors)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import dflash_jax
from convert import convert
from dflash_jax.config import ConfigError, Fields, MoEConfig, RopeConfig, check_heads, parse_rope, require_positive
from dflash_jax.decode import greedy_generate
from dflash_jax.models.declare import HFTable, Placement, Target, attention_targets, layer_getter, rule
from dflash_jax.models.decoder import BlockContext, Routing, block_positions
from dflash_jax.models.family import ModelFamily, draft_family, register, unregister
from dflash_jax.models.hf_export import save_hf_directory, to_numpy
from dflash_jax.nn.attention import cached_causal_attention
from dflash_jax.nn.moe import softmax_topk_router, swiglu_experts
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, rope_cos_sin


# ---- config and HF parser ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
    model_type: str = "toy_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    moe: MoEConfig
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        require_positive(self, "vocab_size", "hidden_size", "num_layers", "head_dim", "rms_norm_eps")
        check_heads(self.num_heads, self.num_kv_heads)

    @property
    def layer_windows(self) -> tuple[None, ...]:  # every layer attends to the whole prefix
        return (None,) * self.num_layers


def parse_toy(f: Fields) -> ToyConfig:
    f.require("model_type")
    head_dim = int(f.require("head_dim"))
    cfg = ToyConfig(
        vocab_size=int(f.require("vocab_size")), hidden_size=int(f.require("hidden_size")),
        num_layers=int(f.require("num_hidden_layers")), num_heads=int(f.require("num_attention_heads")),
        num_kv_heads=int(f.require("num_key_value_heads")), head_dim=head_dim,
        rms_norm_eps=float(f.require("rms_norm_eps")), rope=parse_rope(f, head_dim),
        moe=MoEConfig(num_experts=int(f.require("num_experts")), top_k=int(f.require("num_experts_per_tok")),
                      intermediate_size=int(f.require("moe_intermediate_size")), norm_topk_prob=True),
        max_position_embeddings=int(f.require("max_position_embeddings")),
    )
    f.check_all_used()
    return cfg


def tiny_toy_config(**overrides) -> ToyConfig:
    kw = dict(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
              rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0, rotary_dim=16),
              moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True))
    kw.update(overrides)
    return ToyConfig(**kw)


# ---- weights and their declarations --------------------------------------------------------------------------

@struct.dataclass
class ToyAttention:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    o: jax.Array


@struct.dataclass
class ToyMoE:
    router: jax.Array  # [H, E]
    gate_up: jax.Array  # [E, H, 2I], gate half first
    down: jax.Array  # [E, I, H]
    slot_of: jax.Array | None = None


@struct.dataclass
class ToyLayer:
    input_norm: jax.Array
    attn: ToyAttention
    post_norm: jax.Array
    mlp: ToyMoE


@struct.dataclass
class ToyWeights:
    embed: jax.Array
    layers: tuple[ToyLayer, ...]
    final_norm: jax.Array
    lm_head: jax.Array | None


def declare_toy(cfg: ToyConfig) -> dict[str, Target]:
    h, e, i = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
    out = {"embed": Target((cfg.vocab_size, h)), "final_norm": Target((h,)), "lm_head": Target((h, cfg.vocab_size))}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        out.update(attention_targets(p, hidden=h, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, bias=False, qk_norm=False))
        out.update({p + "input_norm": Target((h,)), p + "post_norm": Target((h,)),
                    p + "mlp.router": Target((h, e)), p + "mlp.gate_up": Target((e, h, 2 * i), coverage=(e,)),
                    p + "mlp.down": Target((e, i, h), coverage=(e,))})
    return out


def toy_from_flat(flat: dict, cfg: ToyConfig) -> ToyWeights:
    layers = []
    for n in range(cfg.num_layers):
        g = layer_getter(flat, n, required=True)
        layers.append(ToyLayer(input_norm=g("input_norm"), post_norm=g("post_norm"),
                               attn=ToyAttention(**{k: g(f"attn.{k}") for k in "qkvo"}),
                               mlp=ToyMoE(router=g("mlp.router"), gate_up=g("mlp.gate_up"), down=g("mlp.down"))))
    return ToyWeights(embed=flat["embed"], layers=tuple(layers), final_norm=flat["final_norm"], lm_head=flat["lm_head"])


def random_toy(cfg: ToyConfig, key, dtype=jnp.float32) -> ToyWeights:
    flat = {}
    for n, (name, target) in enumerate(sorted(declare_toy(cfg).items())):
        k = jax.random.fold_in(key, n)
        if name.endswith("norm"):
            flat[name] = (1.0 + 0.2 * jax.random.normal(k, target.shape)).astype(dtype)
        else:
            flat[name] = (jax.random.normal(k, target.shape) / np.sqrt(target.shape[-2])).astype(dtype)
    return toy_from_flat(flat, cfg)


# ---- forward pieces (the decoder loop runs them) ---------------------------------------------------------------

def toy_block_context(weights: ToyWeights, tokens, cache, cfg: ToyConfig, num_valid):
    positions = block_positions(cache.lengths, tokens.shape[1])
    x = jnp.take(weights.embed, tokens, axis=0)
    cos, sin = rope_cos_sin(cfg.rope, positions, x.dtype)
    return x, BlockContext(positions=positions, starts=cache.lengths, cos=cos, sin=sin,
                           num_valid=jnp.asarray(num_valid, jnp.int32))


def toy_attention(layer: ToyLayer, x, k_buf, v_buf, ctx: BlockContext, window, cfg: ToyConfig):
    b, t, _ = x.shape
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    q = apply_rope((h @ layer.attn.q).reshape(b, t, cfg.num_heads, cfg.head_dim), ctx.cos, ctx.sin)
    k = apply_rope((h @ layer.attn.k).reshape(b, t, cfg.num_kv_heads, cfg.head_dim), ctx.cos, ctx.sin)
    v = (h @ layer.attn.v).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    out, k_buf, v_buf = cached_causal_attention(q, k, v, k_buf, v_buf, ctx.positions, window=window,
                                                scale=cfg.head_dim**-0.5, tree_mask=ctx.tree_mask)
    return x + out.reshape(b, t, -1) @ layer.attn.o, k_buf, v_buf


def toy_mlp_input(layer: ToyLayer, x, cfg: ToyConfig):
    return rms_norm(x, layer.post_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1])


def toy_route_rows(router, x, cfg: ToyConfig, top_k: int) -> Routing:
    probs, experts, logits = softmax_topk_router(rms_norm(x, router.norm, cfg.rms_norm_eps), router.router, top_k,
                                                 normalize=False)
    return Routing(weights=probs / probs.sum(axis=-1, keepdims=True), experts=experts, logits=logits, probs=probs)


def toy_mlp(layer: ToyLayer, x, h, cfg: ToyConfig, implementation="auto", *, routing=None):
    out = swiglu_experts(h, routing.experts, routing.weights, layer.mlp.gate_up, layer.mlp.down,
                         slot_of=layer.mlp.slot_of, implementation=implementation)
    return x + out.reshape(x.shape)


# ---- the HF layout: conversion table and writer --------------------------------------------------------------

_B = r"model\.blocks\.(\d+)\."


def toy_rules(cfg: ToyConfig):
    return [
        rule(r"model\.embed\.weight", lambda m: Placement("embed")),
        rule(r"model\.final_norm\.weight", lambda m: Placement("final_norm")),
        rule(r"head\.weight", lambda m: Placement("lm_head", transpose=(1, 0))),
        rule(_B + r"(input|post)_norm\.weight", lambda m: Placement(f"layers.{m[1]}.{m[2]}_norm")),
        rule(_B + r"attn\.([qkvo])\.weight", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}", transpose=(1, 0))),
        rule(_B + r"moe\.router\.weight", lambda m: Placement(f"layers.{m[1]}.mlp.router", transpose=(1, 0))),
        rule(_B + r"moe\.(gate_up|down)",
             lambda m: Placement(f"layers.{m[1]}.mlp.{m[2]}", cover=slice(None), transpose=(0, 2, 1))),
    ]


def export_toy(weights: ToyWeights, cfg: ToyConfig, directory, *, eos_token_id=None) -> None:
    tensors = {"model.embed.weight": to_numpy(weights.embed), "model.final_norm.weight": to_numpy(weights.final_norm),
               "head.weight": to_numpy(weights.lm_head).T}
    for n, layer in enumerate(weights.layers):
        p = f"model.blocks.{n}."
        tensors.update({p + "input_norm.weight": to_numpy(layer.input_norm),
                        p + "post_norm.weight": to_numpy(layer.post_norm),
                        p + "moe.router.weight": to_numpy(layer.mlp.router).T,
                        p + "moe.gate_up": to_numpy(layer.mlp.gate_up).transpose(0, 2, 1),
                        p + "moe.down": to_numpy(layer.mlp.down).transpose(0, 2, 1)})
        tensors.update({p + f"attn.{k}.weight": to_numpy(getattr(layer.attn, k)).T for k in "qkvo"})
    config = {"architectures": ["ToyMoeForCausalLM"], "model_type": "toy_moe", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta, "num_experts": cfg.moe.num_experts,
              "num_experts_per_tok": cfg.moe.top_k, "moe_intermediate_size": cfg.moe.intermediate_size,
              "max_position_embeddings": cfg.max_position_embeddings}
    save_hf_directory(str(directory), config, tensors)


# ---- the family, registered once --------------------------------------------------------------------------------

class ToyFamily(ModelFamily):
    name = "toy_moe"
    config_type, weights_type, moe_type = ToyConfig, ToyWeights, ToyMoE
    model_types = ("toy_moe",)
    parse_hf = staticmethod(parse_toy)
    hf_table = HFTable(rules=toy_rules)
    export_hf = staticmethod(export_toy)
    tiny_config_fn = staticmethod(tiny_toy_config)
    declare_fn = staticmethod(declare_toy)
    from_flat_fn = staticmethod(toy_from_flat)
    block_context_fn = staticmethod(toy_block_context)
    attention_fn = staticmethod(toy_attention)
    mlp_input_fn = staticmethod(toy_mlp_input)
    route_rows_fn = staticmethod(toy_route_rows)
    mlp_fn = staticmethod(toy_mlp)
    final_norm_fn = staticmethod(lambda weights, x, cfg: rms_norm(x, weights.final_norm, cfg.rms_norm_eps))

    def random_weights(self, cfg, key, dtype=jnp.float32, *, expert_format="dense"):
        return random_toy(cfg, key, dtype)


@pytest.fixture
def toy():
    fam = register(ToyFamily())
    try:
        yield fam
    finally:
        unregister(fam.name)


def test_a_family_from_a_test_file_converts_loads_and_generates(toy, tmp_path):
    cfg = toy.tiny_config()
    drafts = draft_family()
    dcfg = drafts.tiny_config(cfg)
    # the HF checkpoints a release would ship: the toy target in its own layout, a DFlash draft for it
    toy.export_hf(toy.random_weights(cfg, jax.random.key(1)), cfg, tmp_path / "hf_target")
    drafts.export_hf(drafts.random_weights(dcfg, jax.random.key(2)), dcfg, str(tmp_path / "hf_draft"))
    with pytest.raises(ConfigError, match="not understood"):  # the family's parser is strict like the others
        toy.parse_hf(Fields(dict(json.loads((tmp_path / "hf_target" / "config.json").read_text()), extra=1), "toy"))

    convert(tmp_path / "hf_target", tmp_path / "hf_draft", tmp_path / "out", expert_format="mxfp4", progress=False,
            log=lambda message: None)
    pair = dflash_jax.load(str(tmp_path / "out"))
    assert isinstance(pair.target_cfg, ToyConfig) and pair.target_cfg == cfg and isinstance(pair.target, ToyWeights)

    prompts = [[3, 17, 42, 5, 9]]
    got = dflash_jax.generate(pair, prompts, max_new_tokens=8)
    want = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=8)
    assert [list(t) for t in got.tokens] == [list(t) for t in want]  # lossless on the new family
