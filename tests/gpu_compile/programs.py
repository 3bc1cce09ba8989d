"""The programs compiled for the H200: the FP4 kernel at real MoE shapes, one verify round and one draft round
of each family at real size, and the offloaded layer-wise pieces. Weights are abstract (`jax.eval_shape` of
the families' random initializers): nothing is allocated.

Targets are the release configs (HF config.json fields): Qwen3-Coder-30B-A3B-Instruct, gpt-oss-120b and
Qwen3.5-35B-A3B. The drafts' sizes are assumptions, the same as `study.cost_model`'s (the z-lab DFlash drafts:
Qwen3-style layers of the target's hidden size; 5 layers of MLP 6144 for the Qwen targets, 8 layers of MLP 7680
for gpt-oss), with the block size set to the verify width 16.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import from_hf_config
from dflash_jax.models import draft as draft_model
from dflash_jax.models.family import family_of
from dflash_jax.quant import MXFP4Tensor, quantize_mxfp4
from dflash_jax.spec import session
from pallas_kernels import fp4_grouped_matmul as fgm

EXPERT_TABLE = re.compile(r"layers\.\d+\.mlp\.(gate_up|down)")
WIDTH = 16  # the verify width (tokens per verify round)
PREFILL = 4096  # prefill tokens of the kernel's prefill shape
MAX_LEN = 8192  # cache rows of the round programs
PROMPT = 1024  # prompt tokens before the round

QWEN3_CODER_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 5472, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 10000000, "max_position_embeddings": 262144,
    "vocab_size": 151936, "tie_word_embeddings": False, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_local_experts": 128, "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "sliding_window": 128, "attention_bias": True, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "swiglu_limit": 7.0, "max_position_embeddings": 131072, "vocab_size": 201088, "tie_word_embeddings": False,
    "eos_token_id": 200002,
}
QWEN3_5_35B = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-06, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "vocab_size": 248320,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 248044,
}


def _draft(target: dict, *, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int, taps, mask: int):
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target["hidden_size"],
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": mlp, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
        "vocab_size": target["vocab_size"], "block_size": WIDTH, "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)}, "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    }


MODELS = {
    "Qwen3-Coder-30B-A3B": (QWEN3_CODER_30B, _draft(QWEN3_CODER_30B, layers=5, heads=32, kv_heads=4, head_dim=128,
                                                    mlp=6144, taps=(1, 12, 23, 34, 45), mask=151669)),
    "gpt-oss-120b": (GPT_OSS_120B, _draft(GPT_OSS_120B, layers=8, heads=64, kv_heads=8, head_dim=64, mlp=7680,
                                          taps=(1, 9, 17, 25, 33), mask=200000)),
    "Qwen3.5-35B-A3B": (QWEN3_5_35B, _draft(QWEN3_5_35B, layers=5, heads=32, kv_heads=4, head_dim=128, mlp=6144,
                                            taps=(1, 10, 19, 28, 37), mask=248070)),
}


@functools.cache
def configs(model: str):
    target, draft = MODELS[model]
    return from_hf_config(target), from_hf_config(draft)


# --------------------------------------------------------------------------------------------------------------
# The kernel at real shapes.
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelShape:
    model: str
    matrix: str  # "gate_up" | "down"
    phase: str  # "verify" | "prefill"
    groups: int  # experts G
    n: int  # output columns
    k: int  # contraction
    m: int  # rows = tokens x top-k
    top_k: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.matrix} {self.phase} (M={self.m}, N={self.n}, K={self.k}, G={self.groups})"


def kernel_shapes(phases=("verify", "prefill")) -> list[KernelShape]:
    """Each model's two expert matrices (gate_up: [2I, H]; down: [H, I]) at the verify width (16 tokens) and
    at a 4096-token prefill."""
    out = []
    for model in MODELS:
        cfg, _ = configs(model)
        e, k, inter, h = cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.hidden_size
        for phase in phases:
            tokens = WIDTH if phase == "verify" else PREFILL
            out.append(KernelShape(model, "gate_up", phase, e, 2 * inter, h, tokens * k, k))
            out.append(KernelShape(model, "down", phase, e, h, inter, tokens * k, k))
    return out


def kernel_args(shape: KernelShape):
    """Abstract (x [M, K] bf16, MXFP4 weight [G, N, K], group_sizes [G] int32)."""
    w = jax.eval_shape(lambda: quantize_mxfp4(jnp.zeros((shape.groups, shape.n, shape.k), jnp.float32)))
    return (jax.ShapeDtypeStruct((shape.m, shape.k), jnp.bfloat16), w,
            jax.ShapeDtypeStruct((shape.groups,), jnp.int32))


def kernel_program(x, w, group_sizes):
    return fgm.fp4_grouped_matmul(x, w, group_sizes, interpret=False)


def routed_bytes_upper_bound(shape: KernelShape) -> int:
    """FP4 bytes the kernel reads at most: min(G, M) routed experts' codes + scales."""
    per_group = shape.n * (shape.k // 2 + shape.k // 32)
    return min(shape.groups, shape.m) * per_group


# --------------------------------------------------------------------------------------------------------------
# Rounds at real size.
# --------------------------------------------------------------------------------------------------------------


def _abstract_mxfp4(k_in_shape: tuple[int, ...]):
    """An abstract MXFP4Tensor of a dense `[E, K, N]` table (logical `[E, N, K]`, blocks along K)."""
    e, k, n = k_in_shape
    return MXFP4Tensor(blocks=jax.ShapeDtypeStruct((e, n, k // 32, 16), jnp.uint8),
                       scales=jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8))


@functools.cache
def abstract_weights(model: str):
    """(target weights, draft weights) as ShapeDtypeStructs from the families' weight declarations: bf16
    (fp32 where declared), routed expert tables MXFP4 (as the release of gpt-oss ships them and
    `convert-weights --expert-format mxfp4` stores the Qwen ones)."""
    cfg, dcfg = configs(model)
    fam = family_of(cfg)
    flat, packed = {}, {}
    for name, t in fam.declare_weights(cfg).items():
        base, _, part = name.partition("#")
        if part:  # a table kept packed: NAME#blocks / NAME#scales
            packed.setdefault(base, {})[part] = jax.ShapeDtypeStruct(t.shape, t.dtype)
        elif EXPERT_TABLE.fullmatch(name):
            flat[name] = _abstract_mxfp4(t.shape)
        else:
            flat[name] = jax.ShapeDtypeStruct(t.shape, t.dtype or jnp.bfloat16)
    for base, parts in packed.items():
        flat[base] = MXFP4Tensor(blocks=parts["blocks"], scales=parts["scales"])
    dflat = {name: jax.ShapeDtypeStruct(t.shape, t.dtype or jnp.bfloat16)
             for name, t in draft_model.declare_weights(dcfg).items()}
    return (jax.eval_shape(lambda f: fam.weights_from_flat(f, cfg), flat),
            jax.eval_shape(lambda f: draft_model.weights_from_flat(f, dcfg), dflat))


@dataclasses.dataclass(frozen=True)
class _AbstractPair:
    """What `session.prepare` reads of a pair (configs)."""

    target_cfg: object
    draft_cfg: object


@functools.cache
def round_inputs(model: str, batch: int = 1, prompt: int = PROMPT):
    """(spec, abstract SpecState after a prefill, abstract Draft) for one width-16 round of `batch` sequences
    of `prompt` tokens in a cache of MAX_LEN rows."""
    cfg, dcfg = configs(model)
    target, draft = abstract_weights(model)
    prompts = [[1] * prompt for _ in range(batch)]
    prep = session.prepare(_AbstractPair(cfg, dcfg), prompts, block_size=WIDTH, max_new_tokens=MAX_LEN - prompt - 64)
    spec = dataclasses.replace(prep.spec, max_len=MAX_LEN)
    state = jax.eval_shape(functools.partial(session.begin_arrays, spec=spec), target, draft, prep.tokens, prep.lengths,
                           prep.params, prep.key_data, prep.key_fold)
    drafted = jax.eval_shape(functools.partial(session.draft_round, spec=spec), target, draft, state)
    return spec, state, drafted


def verify_program(target, state, drafted, *, spec):
    return session.verify_round(target, state, drafted, spec)


def draft_program(target, draft, state, *, spec):
    return session.draft_round(target, draft, state, spec)


# --------------------------------------------------------------------------------------------------------------
# The offloaded layer-wise pieces.
# --------------------------------------------------------------------------------------------------------------


def pool_slots(model: str) -> int:
    """Slots of one layer's device pool in the layer-wise verify: every expert a width-16 block can route
    to (16 tokens x top-k), capped at the layer's experts."""
    cfg, _ = configs(model)
    return min(cfg.moe.num_experts, WIDTH * cfg.moe.top_k)


def offload_pieces(model: str):
    """{piece name: (function, args, static kwargs)} of the offloaded forward's steps for one width-16 verify
    block: `begin` (embedding + block context), `attend` (mixer + router) of each layer kind, `experts` of a
    MoE layer on a pool of `pool_slots` slots, `finish` (final norm + all logits)."""
    from dflash_jax.offload import forward as lw

    cfg, _ = configs(model)
    fam = family_of(cfg)
    target, _ = abstract_weights(model)
    spec, state, drafted = round_inputs(model)
    tokens = jax.ShapeDtypeStruct((1, WIDTH), jnp.int32)
    cache = state.target_cache
    num_valid = jax.ShapeDtypeStruct((1,), jnp.int32)
    x, ctx = jax.eval_shape(lambda w, t, c, n: lw.begin_forward.__wrapped__(fam, w, t, c, n, cfg), target, tokens, cache,
                            num_valid)
    pieces = {"begin": (lambda w, t, c, n: lw.begin_forward.__wrapped__(fam, w, t, c, n, cfg), (target, tokens, cache,
                                                                                        num_valid), {})}
    moe_layers = fam.moe_layer_ids(target)
    seen = set()
    for i in range(cfg.num_layers):
        kind = fam.kind(cfg, i)
        if kind in seen:
            continue
        seen.add(kind)
        layer, layer_state = target.layers[i], fam.layer_cache(cache, i, cfg)
        moe = i in moe_layers

        def attend(layer, x, layer_state, ctx, kind=kind, moe=moe):
            return lw.attend_layer.__wrapped__(fam, layer, x, layer_state, ctx, cfg, kind, moe)

        pieces[f"attend[{kind}]"] = (attend, (layer, x, layer_state, ctx), {})
    i = moe_layers[0]
    layer = target.layers[i]
    h_routing = jax.eval_shape(lambda layer, x, s, c: lw.attend_layer.__wrapped__(fam, layer, x, s, c, cfg,
                                                                             fam.kind(cfg, i), True)[1:3],
                               layer, x, fam.layer_cache(cache, i, cfg), ctx)
    slots = pool_slots(model)
    tables = tuple(jax.tree.map(lambda a: jax.ShapeDtypeStruct((slots,) + a.shape[1:], a.dtype), t)
                   for t in fam.expert_tables(layer.mlp))
    pooled = layer.replace(mlp=fam.with_expert_pool(layer.mlp, tables, jax.ShapeDtypeStruct(
        (cfg.moe.num_experts,), jnp.int32)))

    def experts(layer, x, h, routing):
        return lw.mlp_layer.__wrapped__(fam, layer, x, h, routing, cfg, "auto")

    pieces[f"experts[{slots} slots]"] = (experts, (pooled, x, *h_routing), {})

    def finish(weights, x, n):
        return lw.finish_forward.__wrapped__(fam, weights, x, n, cfg, "all")

    pieces["finish"] = (finish, (target, x, num_valid), {})
    return pieces


def expert_bytes(model: str) -> int:
    """Bytes of all routed experts' FP4 tables of the target (as stored)."""
    target, _ = abstract_weights(model)
    fam = family_of(configs(model)[0])
    total = 0
    for layer in target.layers:
        if fam.is_moe(layer):
            for t in fam.expert_tables(layer.mlp):
                total += sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(t))
    return total
