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

from dflash_jax.models import gpt_oss as model  # the package: its declarations (it imports this module last)
from dflash_jax.models.declare import HFTable, Placement, Target, fp4_part, rule
from dflash_jax.models.gpt_oss.config import GptOssConfig

_L = r"model\.layers\.(\d+)\."
_T2 = (1, 0)
_FP32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_EXPERT_SOURCE = "model.layers.{i}.mlp.experts.{proj}_proj_blocks"


def deinterleave_index(inter: int) -> np.ndarray:
    """`dest[j]`: where interleaved gate/up index j (gate = even, up = odd) goes in the gate-first order."""
    j = np.arange(2 * inter)
    return j // 2 + (j % 2) * inter


def _packed_in(keys: Collection[str] | None):
    """Whether a layer's `proj` experts are MXFP4-packed in a checkpoint with tensor names `keys` (None: the
    release layout, packed)."""
    keys = None if keys is None else frozenset(keys)
    return lambda layer, proj: keys is None or _EXPERT_SOURCE.format(i=layer, proj=proj) in keys


def targets_for_checkpoint(cfg: GptOssConfig, keys: Collection[str] | None) -> dict[str, Target]:
    """The declarations of a checkpoint's layout: each expert table packed (MXFP4, as released) or dense, as the
    checkpoint's tensor names say."""
    return model.declare_weights(cfg, packed=_packed_in(keys))


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


HF_TABLE = HFTable(rules=rules, ignore=ignore, targets_for_checkpoint=targets_for_checkpoint)
