"""The one model-family interface and its registry.

A target family (Qwen3 / Qwen3-MoE, gpt-oss, Qwen3.5-MoE, ...) is one package `models/<family>/` and one
`ModelFamily` subclass, registered once from it with `register(...)`; the draft (DFlash 1 and 2) is one
`DraftFamily`, registered with `register_draft(...)`. Everything outside the family packages asks the registry
(`family_of(cfg)`, `family_of_weights(weights)`, `family_named(name)`, `draft_family()`) instead of dispatching
on types: the config parser, the speculative rounds, plain decoding, expert offload, the converter, the
exporter, the training recipe, the test helpers.

What a family declares:
  name, config_type, weights_type, moe_type, model_types   identity (HF `model_type`s it parses)
  parse_hf, hf_table, export_hf    its HF side: the config.json parser (registered with `config.from_hf_config`),
                       the checkpoint layout (`models.declare.HFTable`: name rules onto its declarations, what
                       `convert` runs) and the writer of trained weights in that layout
  tiny_config(**overrides), small_config(...)               a tiny config for tests, the trained pairs' shape
  expert_fields        the per-expert fields of a MoE layer's weights, in expert-pool order
                       (Qwen3 / Qwen3.5: gate_up, down; gpt-oss: gate_up, down, gate_up_bias, down_bias)
  init_cache(cfg, batch, max_len, dtype, verify_width=)   an empty cache that can roll a width-
                       `verify_width` forward back to any prefix
  rollback(cache, lengths)                                 keep each sequence's first `lengths` tokens
  random_weights(cfg, key, dtype, expert_format=)          random tiny weights (tests, examples)
  declare_weights(cfg), weights_from_flat(flat, cfg)       every array's stored name, shape and dtype, and
                       the pytree built from them (checkpoint loading checks, the converter's targets);
                       `sharded_declarations(cfg)` adds what a mesh needs (`dflash_jax.sharding`)
  the layer pieces the decoder loop (`models.decoder`) runs, all traceable:
    block_context(weights, tokens, cache, num_valid, cfg) -> (x, ctx)
    kind(cfg, i)             a hashable static description of layer i (its window / mixer type): layers of
                             one kind share compiled programs in the layer-wise (offloaded) forward
    layer_cache(cache, i, cfg), mixer(layer, x, state, ctx, kind, cfg) -> (x, state),
    new_cache(cache, ctx, states, cfg)                       each layer's part of the cache in and out
    mlp_input(layer, x, cfg),
    experts(layer, x, h, routing, cfg, implementation)     the MoE sub-layer on `layer.mlp`'s tables,
                             which may be a device slot pool addressed through `layer.mlp.slot_of`
    dense(layer, x, h, cfg, implementation)                 a dense MLP sub-layer
    finish(weights, x, num_valid, cfg, logits) -> (final-normed x, logits)
  routing, the family's one routing function, used by the verify and by everything that projects a layer's
  routing onto other hidden states (route-ahead predictors, the serving engine's byte pricing):
    router_of(layer) -> RouterWeights                       what the layer's router reads (stackable)
    route_rows(router, x, cfg, top_k=None) -> Routing       the routing of residual rows x [rows, H] (post-
                             attention norm included); vmappable over a stack of MoE layers' `router_of`
    linear_router(router) -> RouterWeights                  the router as a plain `rms(x) * norm @ router + bias`
                             (fp32): the start of the learned route-ahead model (`offload.route_model`)

An expert pool is just different MoE weights: `with_expert_pool(layer_mlp, tables, slot_of)` swaps the
per-expert tables for a `[S, ...]` slot pool and sets the layer's `slot_of` [E] table (see `nn.moe`), so
the forward has no offload-only parameters.

Families are module-level singletons, hashable by identity, so they pass to `jax.jit` as static arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax import config
from dflash_jax.cache import KVCache, init_kv_cache
from dflash_jax.cache import rollback as _counter_rollback
from dflash_jax.models import decoder


class ModelFamily:
    """Base family: a decoder whose every layer is a KV-cached attention mixer (slot = position cache).
    Families with other mixers (Qwen3.5's DeltaNet) override the cache pieces."""

    name: str = ""
    config_type: type = type(None)
    weights_type: type = type(None)
    moe_type: type = type(None)
    model_types: tuple[str, ...] = ()
    expert_fields: tuple[str, ...] = ("gate_up", "down")
    needs_rollback_width: bool = False  # the cache must be sized by the verify width (linear attention)
    # ---- the family's HuggingFace side (its package's `config.py` and `hf.py`) -----------------------------
    parse_hf = None  # (config.Fields) -> the family's config: its HF config.json parser, for `model_types`
    hf_table = None  # models.declare.HFTable: its HF checkpoint layout (the converter's table)
    export_hf = None  # (weights, cfg, directory, *, eos_token_id=None) -> None: writes weights in that layout
    draft_model_types: tuple[str, ...] = ()  # draft config model_types that name drafts built for this family
    small_config_fn = None  # (vocab_size, eos_id, num_experts, top_k, expert_intermediate) -> the trained pairs'
    # target config (`train.tiny_pair.Recipe`)

    # ---- caches ------------------------------------------------------------------------------------------
    def init_cache(self, cfg, batch: int, max_len: int, dtype=jnp.float32, *, verify_width: int = 0) -> Any:
        return init_kv_cache(num_layers=cfg.num_layers, batch=batch, max_len=max_len,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype)

    def rollback(self, cache, lengths):
        """Keeps each sequence's first `lengths` positions (slot = position: a counter move)."""
        return _counter_rollback(cache, lengths)

    def layer_cache(self, cache, i: int, cfg):
        return cache.keys[i], cache.values[i]

    def new_cache(self, cache, ctx, states, cfg):
        return KVCache(keys=tuple(k for k, _ in states), values=tuple(v for _, v in states),
                       lengths=ctx.starts + ctx.num_valid.astype(jnp.int32))

    # ---- weights -----------------------------------------------------------------------------------------
    declare_fn = None  # (cfg) -> {stored name: models.declare.Target}
    from_flat_fn = None  # ({stored name: array}, cfg) -> the weights pytree

    def declare_weights(self, cfg) -> dict:
        """Every array of the family's weights: stored name -> `models.declare.Target` (shape, dtype)."""
        return self.declare_fn(cfg)

    def sharded_declarations(self, cfg) -> dict:
        """`declare_weights` with the sharding unit of every attention array that declares none set so that a
        tensor-parallel split keeps whole GQA groups: k / v (and biases) by KV heads; q, o, q's bias by the
        query heads of one KV head; sinks by that many heads. Either the KV heads divide over the shards and
        all of them shard, or none does (replicated attention, no collectives inside it)."""
        per_group = max(1, cfg.num_heads // max(1, cfg.num_kv_heads))
        units = {"k": cfg.head_dim, "v": cfg.head_dim, "q": cfg.head_dim * per_group, "o": cfg.head_dim * per_group,
                 "sinks": per_group}
        out = {}
        for name, target in self.declare_weights(cfg).items():
            m = re.search(r"attn\.(q|k|v|o|sinks)(_bias)?$", name)
            if target.axes is None and target.unit == 1 and m and not (m[1] == "o" and m[2]):
                target = dataclasses.replace(target, unit=units[m[1]])
            out[name] = target
        return out

    def weights_from_flat(self, flat: dict, cfg):
        """The weights pytree from `{stored name: array}` (what a converted checkpoint holds)."""
        return self.from_flat_fn(flat, cfg)

    tiny_config_fn = None  # (**overrides) -> a tiny config of the family (tests, examples)

    def tiny_config(self, **overrides):
        """A tiny config of the family for tests and examples (`overrides` replace its fields)."""
        if self.tiny_config_fn is None:
            raise NotImplementedError(f"{self.name}: no tiny config")
        return self.tiny_config_fn(**overrides)

    def small_config(self, *, vocab_size: int, eos_id: int, num_experts: int, top_k: int, expert_intermediate: int):
        """The small target config the trained pairs use (`train.tiny_pair.Recipe(family=...)`)."""
        if self.small_config_fn is None:
            raise NotImplementedError(f"{self.name}: no small training config")
        return self.small_config_fn(vocab_size, eos_id, num_experts, top_k, expert_intermediate)

    def random_weights(self, cfg, key: jax.Array, dtype=jnp.float32, *, expert_format: str = "dense"):
        """Random tiny weights with the expert tables in `expert_format` ("dense", "mxfp4", ...)."""
        raise NotImplementedError(f"{self.name}: no random weights")

    def is_moe(self, layer) -> bool:
        return isinstance(layer.mlp, self.moe_type)

    def moe_layer_ids(self, weights) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(weights.layers) if self.is_moe(layer))

    def expert_tables(self, mlp) -> tuple:
        """The per-expert tables of a MoE layer's weights, in `expert_fields` order."""
        return tuple(getattr(mlp, f) for f in self.expert_fields)

    def strip(self, mlp):
        """The MoE weights without their per-expert tables (router, shared expert, ... stay)."""
        return mlp.replace(**{f: None for f in self.expert_fields}, slot_of=None)

    def with_expert_pool(self, mlp, tables, slot_of):
        """The MoE weights with their per-expert tables replaced by a slot pool `tables` (in `expert_fields`
        order, `[S, ...]`) addressed through `slot_of` [E] int32 (None: the tables are the whole table)."""
        if len(tables) != len(self.expert_fields):
            raise ValueError(f"{self.name} expert pools have {len(self.expert_fields)} tables "
                             f"({', '.join(self.expert_fields)}), got {len(tables)}")
        return mlp.replace(**dict(zip(self.expert_fields, tables)), slot_of=slot_of)

    def routed_only(self, mlp):
        """The MoE weights with every non-routed part contributing exactly zero (a shared expert's weights
        zeroed), so that `experts` adds only the routed experts' output: the offloaded forward's second and
        later expert passes over one layer (the first pass adds the shared part)."""
        return mlp

    # ---- routing (traced): the one routing function ----------------------------------------------------
    route_rows_fn = None  # (router: RouterWeights, x [rows, H], cfg, top_k) -> Routing

    def router_of(self, layer) -> decoder.RouterWeights:
        """What MoE layer `layer`'s router reads; the same structure for every MoE layer of the family (so that
        a stack of them vmaps), without the expert tables (works on stripped weights)."""
        return decoder.RouterWeights(norm=layer.post_norm, router=layer.mlp.router)

    def routers_of(self, weights, layers) -> decoder.RouterWeights:
        """`router_of` of the MoE layers `layers` of `weights`, stacked along a leading layer axis (what
        `route_rows` is vmapped over)."""
        return jax.tree.map(lambda *xs: jnp.stack(xs), *[self.router_of(weights.layers[i]) for i in layers])

    def route_rows(self, router, x, cfg, *, top_k: int | None = None) -> decoder.Routing:
        """The exact routing of residual rows `x` [rows, H] (the stream entering the MoE sub-layer, before its
        post-attention norm) by the router `router` (`router_of(layer)`): what the verify computes for the
        layer. `top_k` (default `cfg.moe.top_k`): each row's top-`top_k` experts instead, with their
        probabilities in `probs` (route-ahead widths). Traced; vmap it over a stack of `router_of`s."""
        return self.route_rows_fn(router, x, cfg, cfg.moe.top_k if top_k is None else top_k)

    def linear_router(self, router) -> decoder.RouterWeights:
        """`router` as a plain linear map on RMS-normalized rows, all fp32: logits = `(x / rms(x)) * norm @ router
        + router_bias` equal `route_rows(router, x).logits` on fp32 rows (`router_bias` zeros when the family has
        none). What the learned route-ahead model starts from (`offload.route_model.init_from_target`)."""
        bias = router.router_bias
        return decoder.RouterWeights(
            norm=router.norm.astype(jnp.float32), router=router.router.astype(jnp.float32),
            router_bias=(jnp.zeros(router.router.shape[-1], jnp.float32) if bias is None
                         else bias.astype(jnp.float32)))

    # ---- layer pieces (traced) ----------------------------------------------------------------------------
    # A family's model module defines module-level pieces; the family names them here (staticmethods) and the
    # methods below adapt them to the decoder loop. Families with other mixers override the methods.
    block_context_fn = None  # (weights, tokens, cache, cfg, num_valid) -> (x, BlockContext)
    attention_fn = None  # (layer, x, k_buf, v_buf, ctx, window, cfg) -> (x, k_buf, v_buf)
    mlp_input_fn = None  # (layer, x, cfg) -> h [b*T, H]
    mlp_fn = None  # (layer, x, h, cfg, implementation, *, routing=None) -> x
    final_norm_fn = None  # (weights, x, cfg) -> final-normed x
    attention_queries_fn = None  # (layer, x, ctx, kind, cfg) -> post-RoPE queries [b, T, Hq, d] or None

    def attention_queries(self, layer, x, ctx, kind, cfg):
        """The post-RoPE queries [b, T, Hq, d] layer's attention reads the cache's keys with, from the layer's
        input `x` (None: not an attention layer): the PFlash scorer's input (`dflash_jax.pflash`)."""
        return None if self.attention_queries_fn is None else self.attention_queries_fn(layer, x, ctx, kind, cfg)

    def block_context(self, weights, tokens, cache, num_valid, cfg):
        return self.block_context_fn(weights, tokens, cache, cfg, num_valid)

    def kind(self, cfg, i: int):
        return cfg.layer_windows[i]

    def mixer(self, layer, x, state, ctx, kind, cfg):
        x, k_buf, v_buf = self.attention_fn(layer, x, state[0], state[1], ctx, kind, cfg)
        return x, (k_buf, v_buf)

    def mlp_input(self, layer, x, cfg):
        return self.mlp_input_fn(layer, x, cfg)

    def experts(self, layer, x, h, routing, cfg, implementation):
        return self.mlp_fn(layer, x, h, cfg, implementation, routing=routing)

    def dense(self, layer, x, h, cfg, implementation):
        return self.mlp_fn(layer, x, h, cfg, implementation)

    def finish(self, weights, x, num_valid, cfg, logits):
        """(final-normed x, logits in mode `logits`)."""
        normed = self.final_norm_fn(weights, x, cfg)
        return normed, decoder.select_logits(normed, num_valid, logits,
                                             functools.partial(decoder.lm_head_logits, weights))

    # ---- whole forwards ----------------------------------------------------------------------------------
    def forward(self, weights, tokens, cache, cfg, **kwargs):
        """The family's forward through the one decoder loop (`models.decoder.forward`)."""
        return decoder.forward(self, weights, tokens, cache, cfg, **kwargs)

    def forward_jit(self, weights, tokens, cache, cfg, **kwargs):
        """`forward`, jitted with the family, config and modes static (`models.decoder.forward_jit`)."""
        return decoder.forward_jit(self, weights, tokens, cache, cfg, **kwargs)

    def __repr__(self):
        return f"<model family {self.name}>"


class DraftFamily:
    """The draft model's registration (DFlash 1 and 2: one family, `models.draft`): its config type, weights
    type, HF config parser (found by `architectures`: a draft's model_type names the target family it was built
    for), declarations, pytree builder, HF layout, writer and tiny config, as the converter, the exporter and
    the test helpers look them up (`draft_family()`)."""

    name: str = ""
    config_type: type = type(None)
    weights_type: type = type(None)
    architectures: tuple[str, ...] = ()
    parse_hf = None
    hf_table = None
    export_hf = None  # (weights, cfg, directory) -> None
    declare_fn = None
    from_flat_fn = None
    tiny_config_fn = None  # (target_cfg, **overrides) -> a tiny draft config for that target
    random_weights_fn = None  # (cfg, key, dtype) -> random draft weights

    def declare_weights(self, cfg) -> dict:
        return self.declare_fn(cfg)

    def weights_from_flat(self, flat: dict, cfg):
        return self.from_flat_fn(flat, cfg)

    def tiny_config(self, target_cfg, **overrides):
        return self.tiny_config_fn(target_cfg, **overrides)

    def random_weights(self, cfg, key: jax.Array, dtype=jnp.float32):
        return self.random_weights_fn(cfg, key, dtype)

    def __repr__(self):
        return f"<draft family {self.name}>"


REGISTRY: dict[str, ModelFamily] = {}
DRAFT_REGISTRY: dict[str, DraftFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Registers a target family (once per name), with its HF config parser for its `model_types`; returns it."""
    if not family.name:
        raise ValueError("a model family needs a name")
    if family.name in REGISTRY and REGISTRY[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered twice")
    if family.parse_hf is not None:
        config.register_hf_parser(family.parse_hf, model_types=family.model_types)
    REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes a registered target family and its HF parsers (a family registered by a test)."""
    family = REGISTRY.pop(name, None)
    if family is not None and family.parse_hf is not None:
        for model_type in family.model_types:
            if config.HF_PARSERS.get(model_type) is family.parse_hf:
                del config.HF_PARSERS[model_type]


def register_draft(family: DraftFamily) -> DraftFamily:
    """Registers a draft family (once per name), with its HF config parser for its `architectures`."""
    if family.name in DRAFT_REGISTRY and DRAFT_REGISTRY[family.name] is not family:
        raise ValueError(f"draft family {family.name!r} is registered twice")
    config.register_hf_parser(family.parse_hf, architectures=family.architectures)
    DRAFT_REGISTRY[family.name] = family
    return family


def _ensure_loaded() -> None:
    # The built-in families register when their modules are imported, which importing `dflash_jax.models`
    # does; a caller holding only this module (imported first by a family module) gets them here.
    import dflash_jax.models  # noqa: F401  (justified: the package imports this module, not the reverse)


def families() -> tuple[ModelFamily, ...]:
    _ensure_loaded()
    return tuple(REGISTRY.values())


def family_named(name: str) -> ModelFamily:
    _ensure_loaded()
    if name not in REGISTRY:
        raise KeyError(f"no model family {name!r} (registered: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def draft_family(name: str = "dflash") -> DraftFamily:
    """The registered draft family (one today: the DFlash draft, versions 1 and 2)."""
    _ensure_loaded()
    return DRAFT_REGISTRY[name]


def draft_family_of(cfg) -> DraftFamily | None:
    """The draft family of a config (None: not a draft config)."""
    _ensure_loaded()
    return next((d for d in DRAFT_REGISTRY.values() if isinstance(cfg, d.config_type)), None)


def family_of_draft_model_type(model_type: str) -> ModelFamily | None:
    """The target family a draft config's `model_type` names as the family it was built for (z-lab ships
    gpt-oss drafts with the target's `gpt_oss` config class), or None (a generic `qwen3` DFlash container)."""
    return next((fam for fam in families() if model_type in fam.draft_model_types), None)


def _family_by_type(obj, attr: str, what: str) -> ModelFamily:
    # An exact type match wins over a subclass match, so a family registered for a subclass of another
    # family's config (or weights) type gets its own objects.
    registered = families()
    for fam in registered:
        if type(obj) is getattr(fam, attr):
            return fam
    for fam in registered:
        if isinstance(obj, getattr(fam, attr)):
            return fam
    raise TypeError(f"no registered target family for {what} of type {type(obj).__name__} (registered: "
                    f"{', '.join(getattr(f, attr).__name__ for f in registered)})")


def family_of(cfg) -> ModelFamily:
    """The family of a target config; a clear error for configs of no registered family."""
    return _family_by_type(cfg, "config_type", "a config")


def family_of_weights(weights) -> ModelFamily:
    """The family of a target weight pytree."""
    return _family_by_type(weights, "weights_type", "weights")


def is_moe_layer(layer) -> bool:
    """Whether a decoder layer of any registered family has routed experts."""
    return any(fam.is_moe(layer) for fam in families())
