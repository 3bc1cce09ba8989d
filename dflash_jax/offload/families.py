"""What the offload path needs to know about each target family, in one small adapter per family.

The maths lives in the model modules (`models/qwen3.py`, `models/gpt_oss.py`, `models/qwen3_5.py`), each
composed of layer-wise pieces: `block_context`, the attention / mixer sub-layer, `mlp_input`, `route`,
`mlp_sublayer(..., routing=, <expert fields>=, slot_of=)`, and `forward(..., expert_pools=, slot_of=)`. An
adapter maps those pieces onto the one interface the generic layer-wise driver (`offload.forward`), the
store (`offload.store`) and the predictors (`offload.predictors`) use:

  expert_fields       the per-expert fields of a MoE layer's weights, in expert-pool order
                      (Qwen3 / Qwen3.5: gate_up, down; gpt-oss: gate_up, down, gate_up_bias, down_bias)
  is_moe(layer)       whether a decoder layer has routed experts
  kind(cfg, i)        a hashable static description of layer i (its window, or its mixer type): layers of
                      one kind share compiled programs
  layer_cache(cache, i, cfg) / mixer(...) / new_cache(...)   each layer's part of the cache in and out
  experts(...)        the MoE sub-layer on expert pools; dense(...): a dense MLP sub-layer
  finish(...)         final norm and logits
  router_norm / router_bias / router_topk_first   how a layer's router is applied outside the layer (`DraftRouter`
                      on draft hidden states, the in-verify route-ahead on the previous MoE layer's residual)
  router_parts(layer) (post-attention norm weights, router, router bias or None) of a MoE layer
  norm_scale(w)       the effective fp32 scale of the post-attention norm (Qwen3.5: 1 + w)

Adapters are module-level singletons, hashable by identity, so the driver passes them to `jax.jit` as static
arguments.
"""

from __future__ import annotations

from types import ModuleType

import jax.numpy as jnp

from dflash_jax.cache import KVCache
from dflash_jax.models import gpt_oss, qwen3, qwen3_5


class Family:
    """Base adapter; `module` is the model module, `moe_type` its MoE weight class."""

    name: str
    module: ModuleType
    weights_type: type
    config_type: type
    moe_type: type
    router_norm: dict = {}  # keyword arguments of `nn.norms.rms_norm` for the post-attention norm
    router_topk_first: bool = False  # gpt-oss: top-k of the (biased) logits, then softmax over those k

    @property
    def expert_fields(self) -> tuple[str, ...]:
        return self.module.EXPERT_FIELDS

    def is_moe(self, layer) -> bool:
        return isinstance(layer.mlp, self.moe_type)

    def expert_tables(self, mlp) -> tuple:
        """The per-expert tables of a MoE layer's weights, in `expert_fields` order."""
        return tuple(getattr(mlp, f) for f in self.expert_fields)

    def strip(self, mlp):
        """The MoE weights without their per-expert tables (router, shared expert, ... stay)."""
        return mlp.replace(**{f: None for f in self.expert_fields})

    def router_bias(self, mlp):
        return None

    def router_parts(self, layer) -> tuple:
        """(post-attention norm weights, router [H, E], router bias [E] or None) of a MoE layer: with
        `router_norm` and `router_topk_first`, everything needed to apply its router to another hidden state."""
        return layer.post_norm, layer.mlp.router, self.router_bias(layer.mlp)

    def norm_scale(self, weight) -> jnp.ndarray:
        """The post-attention norm's effective fp32 scale s, so that on fp32 inputs the family's norm is
        `s * x / rms(x)` (plain and fp32-scaled norms: w; Qwen3.5's zero-centred norm: 1 + w)."""
        return weight.astype(jnp.float32)

    # ---- layer-wise steps (all traced inside jit; `kind` is static) ----
    def begin(self, weights, tokens, cache, num_valid, cfg):
        return self.module.block_context(weights, tokens, cache, cfg, num_valid)

    def kind(self, cfg, i: int):
        return cfg.layer_windows[i]

    def layer_cache(self, cache, i: int, cfg):
        return cache.keys[i], cache.values[i]

    def mixer(self, layer, x, state, ctx, kind, cfg):
        x, k_buf, v_buf = self.module.attention_sublayer(layer, x, state[0], state[1], ctx, kind, cfg)
        return x, (k_buf, v_buf)

    def mlp_input(self, layer, x, cfg):
        return self.module.mlp_input(layer, x, cfg)

    def route(self, layer, h, cfg):
        return self.module.route(layer.mlp, h, cfg)

    def experts(self, layer, x, h, routing, tables, slot_of, cfg, implementation):
        return self.module.mlp_sublayer(layer, x, h, cfg, implementation, routing=routing, slot_of=slot_of,
                                        **dict(zip(self.expert_fields, tables)))

    def dense(self, layer, x, h, cfg, implementation):
        return self.module.mlp_sublayer(layer, x, h, cfg, implementation)

    def finish(self, weights, x, num_valid, cfg, logits):
        """(final-normed x, logits in mode `logits`)."""
        raise NotImplementedError

    def new_cache(self, cache, ctx, states, cfg):
        return KVCache(keys=tuple(k for k, _ in states), values=tuple(v for _, v in states),
                       lengths=ctx.starts + ctx.num_valid.astype(jnp.int32))

    def __repr__(self):
        return f"<offload family {self.name}>"


class _Qwen3(Family):
    name, module, weights_type, config_type, moe_type = (
        "qwen3", qwen3, qwen3.Qwen3Weights, qwen3.Qwen3Config, qwen3.MoEWeights)

    def finish(self, weights, x, num_valid, cfg, logits):
        normed = qwen3.rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
        return normed, qwen3.select_logits(weights, normed, num_valid, logits)


class _GptOss(Family):
    name, module, weights_type, config_type, moe_type = (
        "gpt_oss", gpt_oss, gpt_oss.GptOssWeights, gpt_oss.GptOssConfig, gpt_oss.GptOssMoEWeights)
    router_norm = {"scale_in_fp32": True}
    router_topk_first = True

    def router_bias(self, mlp):
        return mlp.router_bias

    def finish(self, weights, x, num_valid, cfg, logits):
        normed = gpt_oss.final_norm(weights, x, cfg)
        return normed, qwen3.select_logits(weights, normed, num_valid, logits)


class _Qwen3_5(Family):
    name, module, weights_type, config_type, moe_type = (
        "qwen3_5", qwen3_5, qwen3_5.Qwen3_5Weights, qwen3_5.Qwen3_5Config, qwen3_5.SparseMoEWeights)
    router_norm = {"zero_centered": True}

    def norm_scale(self, weight):
        return 1.0 + weight.astype(jnp.float32)

    def kind(self, cfg, i):
        return cfg.layer_types[i]

    def layer_cache(self, cache, i, cfg):
        return qwen3_5.layer_cache(cache, i, cfg)

    def mixer(self, layer, x, state, ctx, kind, cfg):
        return qwen3_5.mixer_sublayer(layer, x, state, ctx, kind, cfg)

    def finish(self, weights, x, num_valid, cfg, logits):
        normed = qwen3_5.final_norm(weights, x, cfg)
        return normed, qwen3_5.select_logits(weights, normed, num_valid, logits)

    def new_cache(self, cache, ctx, states, cfg):
        return qwen3_5.assemble_cache(cache, ctx, states, cfg)


FAMILIES: tuple[Family, ...] = (_Qwen3(), _GptOss(), _Qwen3_5())


def family_of_config(cfg) -> Family:
    """The adapter of a target config; a clear error for configs without one."""
    for fam in FAMILIES:
        if isinstance(cfg, fam.config_type):
            return fam
    raise NotImplementedError(
        f"expert offload covers {', '.join(f.config_type.__name__ for f in FAMILIES)} targets, not "
        f"{type(cfg).__name__}")


def family_of_weights(weights) -> Family:
    """The adapter of a target weight pytree (`Qwen3Weights`, `GptOssWeights`, `Qwen3_5Weights`)."""
    for fam in FAMILIES:
        if isinstance(weights, fam.weights_type):
            return fam
    raise TypeError(
        f"expert offload needs target weights of a known family ({', '.join(f.weights_type.__name__ for f in FAMILIES)}"
        f"), got {type(weights).__name__}")


def is_moe_layer(layer) -> bool:
    """Whether a decoder layer of any family has routed experts."""
    return any(fam.is_moe(layer) for fam in FAMILIES)
