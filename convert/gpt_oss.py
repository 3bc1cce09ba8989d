"""gpt-oss HuggingFace layouts -> `dflash_jax.models.gpt_oss.GptOssWeights`.

Release layout (openai/gpt-oss-20b, -120b; `[out, in]` Linear weights, transposed here to `[in, out]`):
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight
  model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}, model.layers.{i}.self_attn.sinks [Hq]
  model.layers.{i}.mlp.router.{weight [E, H], bias [E]}
  model.layers.{i}.mlp.experts.gate_up_proj_{blocks [E, 2I, H/32, 16] u8, scales [E, 2I, H/32] u8, bias [E, 2I]}
  model.layers.{i}.mlp.experts.down_proj_{blocks [E, H, I/32, 16] u8, scales [E, H, I/32] u8, bias [E, H]}
The MXFP4 blocks/scales are kept packed: they become `MXFP4Tensor`s of logical shape [E, 2I, H] / [E, H, I]
(the `[G, N, K]` orientation `pallas_kernels.ops` takes), never inflated.

Unquantized re-exports (what transformers' `save_pretrained` writes for a dequantized or freshly built
model; no `quantization_config`): dense fused `mlp.experts.gate_up_proj` [E, H, 2I] and
`mlp.experts.down_proj` [E, I, H] (`[in, out]` already), with the same `_bias` tensors. Which layout a
projection has is read from the tensor names, per layer and projection.

The release interleaves gate and up (gate = even rows of gate_up, up = odd); the rules below de-interleave
them while placing each tensor (packed rows, dense columns and biases alike), so the stored tables have the
gate half first, as every family's `nn.moe.swiglu_experts` expects. For packed rows this is a permutation of
whole 16-byte rows with their scales: exact.
"""

from __future__ import annotations

from typing import Any, Collection

import numpy as np

from convert.table import Placement, Target, fp4_part, rule
from dflash_jax.config import GptOssConfig
from dflash_jax.models import gpt_oss as model
from dflash_jax.quant import MXFP4_BLOCK_SIZE

_L = r"model\.layers\.(\d+)\."
_T2 = (1, 0)
_FP32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_EXPERT_SOURCE = "model.layers.{i}.mlp.experts.{proj}_proj_blocks"


def deinterleave_index(inter: int) -> np.ndarray:
    """`dest[j]`: where interleaved gate/up index j (gate = even, up = odd) goes in the gate-first order."""
    j = np.arange(2 * inter)
    return j // 2 + (j % 2) * inter


def _packed(cfg: GptOssConfig, keys: Collection[str] | None, layer: int, proj: str) -> bool:
    """Whether layer `layer`'s `proj` experts are MXFP4-packed in the checkpoint (the release default)."""
    return keys is None or _EXPERT_SOURCE.format(i=layer, proj=proj) in keys


def targets(cfg: GptOssConfig) -> dict[str, Target]:
    """Targets of the release layout (MXFP4 experts)."""
    return targets_for_checkpoint(cfg, None)


def targets_for_checkpoint(cfg: GptOssConfig, keys: Collection[str] | None) -> dict[str, Target]:
    h, d = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    e, inter = cfg.moe.num_experts, cfg.moe.intermediate_size
    keys = None if keys is None else frozenset(keys)
    out = {"embed": Target((cfg.vocab_size, h)), "final_norm": Target((h,), dtype=_FP32)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = Target((h, cfg.vocab_size))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_norm": Target((h,), dtype=_FP32),
            p + "post_norm": Target((h,), dtype=_FP32),
            p + "attn.q": Target((h, qd)),
            p + "attn.k": Target((h, kvd)),
            p + "attn.v": Target((h, kvd)),
            p + "attn.o": Target((qd, h)),
            p + "attn.sinks": Target((cfg.num_heads,)),
            p + "mlp.router": Target((h, e)),
            p + "mlp.router_bias": Target((e,)),
            p + "mlp.gate_up_bias": Target((e, 2 * inter)),
            p + "mlp.down_bias": Target((e, h)),
        })
        if cfg.attention_bias:
            out.update({
                p + "attn.q_bias": Target((qd,)),
                p + "attn.k_bias": Target((kvd,)),
                p + "attn.v_bias": Target((kvd,)),
                p + "attn.o_bias": Target((h,)),
            })
        # logical [out, in] of the packed tables, [in, out] of the dense ones
        for proj, rows, cols in (("gate_up", 2 * inter, h), ("down", h, inter)):
            if _packed(cfg, keys, i, proj):
                groups = cols // MXFP4_BLOCK_SIZE
                out[fp4_part(p + f"mlp.{proj}", "blocks")] = Target((e, rows, groups, MXFP4_BLOCK_SIZE // 2), dtype=_U8)
                out[fp4_part(p + f"mlp.{proj}", "scales")] = Target((e, rows, groups), dtype=_U8)
            else:
                out[p + f"mlp.{proj}"] = Target((e, cols, rows))
    return out


def rules(cfg: GptOssConfig):
    dest = deinterleave_index(cfg.moe.intermediate_size)
    every = slice(None)

    def packed(m):
        layer, proj, part = m[1], m[2], m[3]
        region = (every, dest) if proj == "gate_up" else Ellipsis
        return Placement(fp4_part(f"layers.{layer}.mlp.{proj}", part), region=region)

    def dense(m):
        layer, proj = m[1], m[2]
        region = (every, every, dest) if proj == "gate_up" else Ellipsis
        return Placement(f"layers.{layer}.mlp.{proj}", region=region)

    def bias(m):
        layer, proj = m[1], m[2]
        region = (every, dest) if proj == "gate_up" else Ellipsis
        return Placement(f"layers.{layer}.mlp.{proj}_bias", region=region)

    return [
        rule(r"model\.embed_tokens\.weight", lambda m: Placement("embed")),
        rule(r"model\.norm\.weight", lambda m: Placement("final_norm")),
        rule(r"lm_head\.weight", lambda m: Placement("lm_head", transpose=_T2)),
        rule(_L + r"input_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.input_norm")),
        rule(_L + r"post_attention_layernorm\.weight", lambda m: Placement(f"layers.{m[1]}.post_norm")),
        rule(_L + r"self_attn\.([qkvo])_proj\.weight",
             lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}", transpose=_T2)),
        rule(_L + r"self_attn\.([qkvo])_proj\.bias", lambda m: Placement(f"layers.{m[1]}.attn.{m[2]}_bias")),
        rule(_L + r"self_attn\.sinks", lambda m: Placement(f"layers.{m[1]}.attn.sinks")),
        rule(_L + r"mlp\.router\.weight", lambda m: Placement(f"layers.{m[1]}.mlp.router", transpose=_T2)),
        rule(_L + r"mlp\.router\.bias", lambda m: Placement(f"layers.{m[1]}.mlp.router_bias")),
        rule(_L + r"mlp\.experts\.(gate_up|down)_proj_(blocks|scales)", packed),
        rule(_L + r"mlp\.experts\.(gate_up|down)_proj_bias", bias),
        rule(_L + r"mlp\.experts\.(gate_up|down)_proj", dense),
    ]


def ignore(cfg: GptOssConfig):
    return lambda name: cfg.tie_word_embeddings and name == "lm_head.weight"


def build_weights(flat: dict[str, Any], cfg: GptOssConfig) -> model.GptOssWeights:
    layers = []
    for i in range(cfg.num_layers):
        g = lambda k: flat.get(f"layers.{i}.{k}")  # noqa: E731,B023
        attn = model.GptOssAttentionWeights(
            q=g("attn.q"), k=g("attn.k"), v=g("attn.v"), o=g("attn.o"), sinks=g("attn.sinks"),
            q_bias=g("attn.q_bias"), k_bias=g("attn.k_bias"), v_bias=g("attn.v_bias"), o_bias=g("attn.o_bias"),
        )
        mlp = model.GptOssMoEWeights(
            router=g("mlp.router"), router_bias=g("mlp.router_bias"), gate_up=g("mlp.gate_up"),
            gate_up_bias=g("mlp.gate_up_bias"), down=g("mlp.down"), down_bias=g("mlp.down_bias"),
        )
        layers.append(model.GptOssLayerWeights(input_norm=g("input_norm"), attn=attn, post_norm=g("post_norm"),
                                               mlp=mlp))
    return model.GptOssWeights(
        embed=flat["embed"], layers=tuple(layers), final_norm=flat["final_norm"], lm_head=flat.get("lm_head")
    )
