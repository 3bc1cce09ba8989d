"""Cost model of offloaded MoE speculative decoding: predicted tokens/s of B0-B3 from bytes and bandwidths.

Batch 1, one round = one draft forward + one width-B verify. Routing model: tokens route independently;
expert i of a layer is one of a token's top-k with probability q_i = min(1, k p_i), with popularity
p_i ~ (i + 1)^-skew (skew 0: uniform). Placement pins the S most popular experts per layer (temporal reuse
across rounds, which the LRFU cache adds on top, is not modeled: hit rates are lower bounds).

  U(B)   = sum_i 1 - (1 - q_i)^B          distinct experts one layer's width-B verify routes to
                                          (uniform: E (1 - (1 - k/E)^B); Qwen3-30B: 29 at B=4, 52 at B=8)
  M(B)   = sum_{i >= S} 1 - (1 - q_i)^B   of those, not in the pool (S = min(E, budget / (L eb)) slots,
                                          eb = bytes of one expert, L = MoE layers)
  t_dev(B) = L * (max(bytes_layer / HBM, flops_layer / FLOPS) + launch) + lm_head / HBM
             bytes_layer = attention + router weights + U(B) eb     (the verify is memory bound)
  t_draft  = (draft weights + lm_head) / HBM + draft layers * launch
  tau(B)   = (1 - a^B) / (1 - a)          tokens committed per round, a = per-position acceptance

  B0: t = t_draft + t_dev(B)                                       (all experts resident: needs the memory)
  B1: B = 1, no draft: t = t_dev(1) + L (sync + M(1) eb / PCIe)
  B2: t = t_draft + t_dev(B) + L (sync + M(B) eb / PCIe)           (every miss fetched on demand, exposed)
  B3: prefetch c M / (1 - w) experts per layer (coverage c, waste w), issued after the draft and overlapping
      the verify; the uncovered (1 - c) M fetched on demand:
      t = t_draft + max(t_dev(B) + L sync, T_prefetch) + T_demand
  tokens/s = tau(B) / t (B1: 1 / t). `best_block` picks the verify width B maximizing it.

`sync` is the per-MoE-layer host round trip of the layer-wise verify (read the routing, issue the copies,
launch the expert GEMM); it is 0 when the pool holds every expert (the verify then runs as one program).
The defaults for real models and machines are in MODELS / HARDWARE with their
sources; assumptions are marked. Study code (`benchmarks/offload_cost_model.py`): the runtime measures its own
link instead (`offload.bandwidth.probe_host_to_device_bandwidth`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

MB = 1e6
GB = 1e9


def mxfp4_bytes(params: float) -> float:
    """MXFP4 bytes of `params` weights: 4-bit codes plus one E8M0 byte per 32 (4.25 bits a weight)."""
    return params * (0.5 + 1 / 32)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """An MoE target + its DFlash draft. Bytes are as stored on the device (experts MXFP4, the rest bf16)."""

    name: str
    layers: int  # decoder layers (all MoE here)
    experts: int
    top_k: int
    expert_bytes: float  # one routed expert: gate, up, down (MXFP4 + scales)
    attention_bytes: float  # per layer: attention projections, norms, router, shared expert (bf16)
    head_bytes: float  # embedding + lm_head (bf16)
    draft_bytes: float  # the draft's own weights (bf16; it shares the target's embedding and head)
    draft_layers: int
    active_params: float  # target parameters one token touches (for the FLOP term)

    @property
    def all_expert_bytes(self) -> float:
        return self.layers * self.experts * self.expert_bytes

    @property
    def resident_bytes(self) -> float:
        """What stays on the device in every mode: non-expert weights and the draft."""
        return self.layers * self.attention_bytes + self.head_bytes + self.draft_bytes


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    memory_bytes: float
    flops: float  # dense bf16 tensor FLOP/s
    h2d_bytes_per_s: float  # measured-class host->device copy bandwidth
    launch_s: float = 20e-6  # per decoder layer: the kernels of one layer (assumed)
    sync_s: float = 50e-6  # per MoE layer of the layer-wise verify: routing read + copy issue (assumed)


def _qwen3_attention(h, q_heads, kv_heads, head_dim):
    return 2 * (h * (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim * h)


_QWEN3_30B_ATTN = _qwen3_attention(2048, 32, 4, 128) + 2 * 2048 * 128  # + router [H, E]
_GPT_OSS_ATTN = _qwen3_attention(2880, 64, 8, 64) + 2 * 2880 * 128
_DRAFT_LAYER_2048 = _qwen3_attention(2048, 32, 8, 128) + 2 * 3 * 2048 * 6144  # assumed Qwen3-style draft layer
_DRAFT_LAYER_2880 = _qwen3_attention(2880, 64, 8, 64) + 2 * 3 * 2880 * 7680  # assumed

# Shapes from the configs named in REFERENCE.md; draft sizes (layers, MLP width) are assumptions.
MODELS = {
    "qwen3-30b-a3b": ModelSpec(
        name="Qwen3-30B-A3B (Qwen3-Coder-30B-A3B)", layers=48, experts=128, top_k=8,
        expert_bytes=mxfp4_bytes(3 * 2048 * 768), attention_bytes=_QWEN3_30B_ATTN,
        head_bytes=2 * 2 * 151936 * 2048, draft_bytes=5 * _DRAFT_LAYER_2048 + 2 * 5 * 2048 * 2048, draft_layers=5,
        active_params=3.3e9),
    "gpt-oss-20b": ModelSpec(
        name="gpt-oss-20b", layers=24, experts=32, top_k=4, expert_bytes=mxfp4_bytes(3 * 2880 * 2880),
        attention_bytes=_GPT_OSS_ATTN - 2 * 2880 * 96, head_bytes=2 * 2 * 201088 * 2880,
        draft_bytes=8 * _DRAFT_LAYER_2880 + 2 * 5 * 2880 * 2880, draft_layers=8, active_params=3.6e9),
    "gpt-oss-120b": ModelSpec(
        name="gpt-oss-120b", layers=36, experts=128, top_k=4, expert_bytes=mxfp4_bytes(3 * 2880 * 2880),
        attention_bytes=_GPT_OSS_ATTN, head_bytes=2 * 2 * 201088 * 2880,
        draft_bytes=8 * _DRAFT_LAYER_2880 + 2 * 5 * 2880 * 2880, draft_layers=8, active_params=5.1e9),
    "qwen3.5-35b-a3b": ModelSpec(  # 30 Gated DeltaNet + 10 full-attention layers; attention bytes approximate
        name="Qwen3.5-35B-A3B", layers=40, experts=256, top_k=8, expert_bytes=mxfp4_bytes(3 * 2048 * 512),
        attention_bytes=2 * 2048 * 8192 + 2 * 3 * 2048 * 512 + 2 * 2048 * 256,  # ~ mixer + shared expert + router
        head_bytes=2 * 2 * 248320 * 2048, draft_bytes=5 * _DRAFT_LAYER_2048 + 2 * 5 * 2048 * 2048, draft_layers=5,
        active_params=3.0e9),
}

# Bandwidths: HBM and FLOPs from vendor specs; host->device from REFERENCE.md measurements (PCIe 4 ~25 GB/s,
# PCIe 5 ~58 GB/s host->device copies).
HARDWARE = {
    "h200-pcie5": Hardware("H200, PCIe 5", hbm_bytes_per_s=4.8e12, memory_bytes=141 * GB, flops=989e12,
                           h2d_bytes_per_s=58 * GB),
    "h200-pcie4": Hardware("H200, PCIe 4 link", hbm_bytes_per_s=4.8e12, memory_bytes=141 * GB, flops=989e12,
                           h2d_bytes_per_s=25 * GB),
    "rtx4090-pcie4": Hardware("RTX 4090, PCIe 4", hbm_bytes_per_s=1.0e12, memory_bytes=24 * GB, flops=165e12,
                              h2d_bytes_per_s=25 * GB),
    "rtx5090-pcie5": Hardware("RTX 5090, PCIe 5", hbm_bytes_per_s=1.79e12, memory_bytes=32 * GB, flops=209e12,
                              h2d_bytes_per_s=55 * GB),
}


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Route-ahead quality: coverage c and waste w (see `offload.stats`)."""

    coverage: float = 0.8
    waste: float = 0.3


def popularity(experts: int, skew: float) -> np.ndarray:
    """p_i ~ (i + 1)^-skew, normalized: expert popularity within a layer, most popular first."""
    p = (np.arange(experts) + 1.0) ** -skew
    return p / p.sum()


def distinct_experts(experts: int, top_k: int, tokens: int, *, skew: float = 0.0, skip: int = 0) -> float:
    """Expected distinct experts `tokens` tokens route to in one layer, counting only experts ranked >= `skip`
    by popularity (skip = S pinned slots gives the misses M; skip 0 gives U)."""
    q = np.minimum(1.0, top_k * popularity(experts, skew))
    return float(np.sum(1.0 - (1.0 - q[skip:]) ** tokens))


def slots_for(model: ModelSpec, budget_bytes: float) -> int:
    return int(min(model.experts, budget_bytes // (model.layers * model.expert_bytes)))


def tau(block: int, acceptance: float) -> float:
    """Mean tokens committed per round with per-position acceptance `acceptance` (geometric model)."""
    if acceptance >= 1.0:
        return float(block)
    return (1.0 - acceptance**block) / (1.0 - acceptance)


def verify_time(model: ModelSpec, hw: Hardware, block: int, skew: float = 0.0) -> float:
    """Device time of a width-`block` verify with every needed expert resident."""
    per_layer_bytes = (model.attention_bytes
                       + distinct_experts(model.experts, model.top_k, block, skew=skew) * model.expert_bytes)
    per_layer_flops = 2 * block * model.active_params / model.layers
    per_layer = max(per_layer_bytes / hw.hbm_bytes_per_s, per_layer_flops / hw.flops) + hw.launch_s
    return model.layers * per_layer + (model.head_bytes / 2) / hw.hbm_bytes_per_s


def draft_time(model: ModelSpec, hw: Hardware) -> float:
    return ((model.draft_bytes + model.head_bytes / 2) / hw.hbm_bytes_per_s) + model.draft_layers * hw.launch_s


@dataclasses.dataclass(frozen=True)
class RoundEstimate:
    mode: str
    block: int
    seconds: float
    tokens_per_round: float
    bytes_moved: float
    fits: bool  # the resident weights + pool (+ all experts for B0) fit the device memory

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_round / self.seconds


def estimate(model: ModelSpec, hw: Hardware, *, mode: str, block: int, budget_bytes: float, acceptance: float = 0.85,
             prediction: Prediction = Prediction(), skew: float = 0.0, overhead_bytes: float = 2 * GB) -> RoundEstimate:
    """One round of `mode` ("B0".."B3") at verify width `block` with a device expert budget `budget_bytes`
    (B0 ignores the budget: all experts resident). `overhead_bytes`: KV cache and workspace (assumed)."""
    if mode == "B1":
        block = 1
    t_dev = verify_time(model, hw, block, skew)
    t_draft = draft_time(model, hw) if block > 1 else 0.0
    taus = tau(block, acceptance)
    if mode == "B0":
        fits = model.resident_bytes + model.all_expert_bytes + overhead_bytes <= hw.memory_bytes
        return RoundEstimate(mode, block, t_draft + t_dev, taus, 0.0, fits)
    slots = slots_for(model, budget_bytes)
    fits = model.resident_bytes + slots * model.layers * model.expert_bytes + overhead_bytes <= hw.memory_bytes
    misses = model.layers * distinct_experts(model.experts, model.top_k, block, skew=skew, skip=slots)
    sync = 0.0 if slots >= model.experts else model.layers * hw.sync_s  # a full pool verifies in one program
    if mode in ("B1", "B2"):
        moved = misses * model.expert_bytes
        seconds = t_draft + t_dev + sync + moved / hw.h2d_bytes_per_s
        return RoundEstimate(mode, block, seconds, 1.0 if mode == "B1" else taus, moved, fits)
    if mode == "B3":
        c, w = prediction.coverage, prediction.waste
        prefetch = c * misses / max(1e-9, 1.0 - w) * model.expert_bytes
        demand = (1.0 - c) * misses * model.expert_bytes
        seconds = t_draft + max(t_dev + sync, prefetch / hw.h2d_bytes_per_s) + demand / hw.h2d_bytes_per_s
        return RoundEstimate(mode, block, seconds, taus, prefetch + demand, fits)
    raise ValueError(f"mode must be B0, B1, B2 or B3, got {mode!r}")


def best_block(model: ModelSpec, hw: Hardware, *, mode: str, budget_bytes: float, blocks=range(2, 17),
               **kw) -> RoundEstimate:
    """The verify width in `blocks` that maximizes accepted tokens/s for `mode` (B1: always 1)."""
    if mode == "B1":
        return estimate(model, hw, mode=mode, block=1, budget_bytes=budget_bytes, **kw)
    return max((estimate(model, hw, mode=mode, block=b, budget_bytes=budget_bytes, **kw) for b in blocks),
               key=lambda r: r.tokens_per_second)
