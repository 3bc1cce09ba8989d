"""Tiny random HuggingFace reference models for parity tests (test-only: imports torch/transformers)."""

from __future__ import annotations

import numpy as np
import torch


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-initializes every parameter with a scale that makes bugs visible.

    Matrices: N(0, 1/fan_in) so activations stay O(1) through depth; the embedding N(0, 1); 1-D
    parameters (norm weights, biases) are randomized too, since the default ones/zeros hide bugs in
    (1 + w) norms and missing biases.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
    return model


def tiny_qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def build_and_save(config, directory, *, seed: int = 0, dtype=torch.float32, max_shard_size=None):
    """Builds the CausalLM for `config`, randomizes it, saves it to `directory`, returns the eval model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    model = model.to(dtype).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return model


@torch.no_grad()
def hf_forward(model, tokens: np.ndarray):
    """Logits, hidden states (HF convention: [0] embeddings, [i+1] layer i, last normed) and router logits."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]
    kwargs = {"output_router_logits": True} if hasattr(model.config, "num_experts_per_tok") else {}
    out = model(ids, output_hidden_states=True, **kwargs)
    as_np = lambda t: t.float().numpy()  # noqa: E731
    routers = tuple(as_np(r) for r in getattr(out, "router_logits", None) or ())
    return as_np(out.logits), tuple(as_np(h) for h in out.hidden_states), routers


def tiny_draft_config(*, target_layers: int, taps=(0, 2), mask_token_id: int = 159, block_size: int = 8,
                      **overrides):
    """A tiny z-lab DFlash draft config (a transformers Qwen3Config with `dflash_config`)."""
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_target_layers=target_layers, layer_types=["full_attention", "full_attention"], num_hidden_layers=2,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(taps), "block_size": block_size},
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def build_and_save_draft(config, directory, *, seed: int = 0):
    """z-lab's reference `DFlashDraftModel` for `config`, randomized and saved; returns the eval model."""
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    model = DFlashDraftModel(config).float()
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(directory)
    return model


DFLASH2_FIELDS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


def tiny_dflash2_config(*, target_layers: int, taps=(0, 2), mask_token_id: int = 159, block_size: int = 8,
                        dflash2=None, **overrides):
    """A tiny z-lab DFlash 2 draft config (`DFlash2DraftModel`): `tiny_draft_config` plus the convolution and
    selector fields (`DFLASH2_FIELDS`, updated by `dflash2`), a sliding-window first layer by default."""
    fields = dict(DFLASH2_FIELDS, **(dflash2 or {}))
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    kw.update(overrides)
    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": list(taps), "block_size": block_size}
    dflash.update(kw.pop("dflash_config", {}))
    config = tiny_draft_config(target_layers=target_layers, taps=taps, mask_token_id=mask_token_id,
                               block_size=block_size, dflash_config=dict(dflash, **fields), **kw)
    config.architectures = ["DFlash2DraftModel"]
    return config


def build_and_save_dflash2_draft(config, directory, *, seed: int = 0, release_layout: bool = True):
    """z-lab's reference `DFlash2DraftModel` for `config`, randomized (convolution kernels far from the
    identity, random codebooks) and saved; with `release_layout` the codebooks are stored as the published
    checkpoints store them (no `.weight`, which `DFlash2DraftModel.from_pretrained` maps back). Returns the
    eval model."""
    from dflash.model import DFlash2DraftModel

    torch.manual_seed(seed)
    model = DFlash2DraftModel(config).float()
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = 0.4 * torch.randn(conv.base_kernel.shape, generator=gen)
                base[:, 0] += 1.0  # near the identity, but far from it (every tap and the dynamic part count)
                conv.base_kernel.copy_(base)
                conv.kernel_projection.weight.mul_(0.5)
    model.eval()
    save_dflash2_draft(model, directory, release_layout=release_layout)
    return model


def save_dflash2_draft(model, directory, *, release_layout: bool = True):
    """`save_pretrained`, then (with `release_layout`) the codebooks renamed as the published checkpoints store
    them (no `.weight`)."""
    import os

    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    if release_layout:
        path = os.path.join(directory, "model.safetensors")
        tensors = load_file(path)
        for name in ("predecessor_codebook", "successor_codebook"):
            tensors[f"candidate_selector.{name}"] = tensors.pop(f"candidate_selector.{name}.weight")
        save_file(tensors, path, metadata={"format": "pt"})


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """The reference model's own greedy continuation: argmax of its forward, one token at a time on its
    own KV cache. (`generate` is not used: in transformers 5.24 its logits for these tiny MoE models
    differ from the model's forward by ~0.1, a property of `generate`'s code path, not of the model.)"""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ids, out = torch.tensor([list(prompt)]), []
    for _ in range(n):
        logits = hf(input_ids=ids, use_cache=True, **{cache_keyword(hf): cache}).logits[0, -1]
        # a cache passed under a name the installed transformers does not know is silently dropped, and every
        # step after the first would then see one token without its context
        assert cache.get_seq_length() == len(prompt) + len(out), "the reference model ignored its KV cache"
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def cache_keyword(hf) -> str:
    """The keyword the installed transformers' `forward` takes its KV cache by: `cache` from 5.2x on, before that
    `past_key_values` (which the newer versions still accept, deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def reference_with_experts(hf_target, pair):
    """The HF target with its expert weights replaced by what a dflash_jax pair stores (dequantized)."""
    import jax.numpy as jnp

    from dflash_jax.models import qwen3
    from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor

    ref = type(hf_target)(hf_target.config).eval()
    ref.load_state_dict(hf_target.state_dict())
    for i, layer in enumerate(pair.target.layers):
        if not isinstance(layer.mlp, qwen3.MoEWeights):
            continue
        experts = ref.model.layers[i].mlp.experts
        for name, table in (("gate_up_proj", layer.mlp.gate_up), ("down_proj", layer.mlp.down)):
            if isinstance(table, (MXFP4Tensor, NVFP4Tensor)):
                dense = np.asarray(table.dequantize(jnp.float32))  # [E, out, in], HF orientation
            else:
                dense = np.swapaxes(np.asarray(table, np.float32), 1, 2)
            with torch.no_grad():
                getattr(experts, name).copy_(torch.from_numpy(np.array(dense)))
    return ref


def make_agreeable_(target, draft, *, strength: float = 2.0, tokens=(7, 9)):
    """Gives a random target + draft pair something to agree on, so speculative rounds accept a mix of
    0..B-1 proposals: both final norms amplify hidden dim 0 and the (shared) lm_head maps its sign to
    one of two tokens."""
    with torch.no_grad():
        target.model.norm.weight[0] = 30.0
        draft.norm.weight[0] = 30.0
        target.lm_head.weight[:, 0] = 0.0
        target.lm_head.weight[tokens[0], 0] = strength
        target.lm_head.weight[tokens[1], 0] = -strength


# --------------------------------------------------------------------------------------------------
# gpt-oss
# --------------------------------------------------------------------------------------------------

GPT_OSS_MXFP4_QUANTIZATION = {  # the release's quantization_config
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}


def tiny_gpt_oss_config(**overrides):
    """A tiny transformers `GptOssConfig`: alternating sliding (window 16) / full layers, the release's YaRN."""
    from transformers import GptOssConfig

    kw = dict(
        vocab_size=160, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=131072,
    )
    kw.update(overrides)
    return GptOssConfig(**kw)


def build_gpt_oss(config, *, seed: int = 0, expert_scale: float = 4.0, mxfp4_experts: bool = True):
    """A randomized fp32 eager `GptOssForCausalLM`.

    On top of `randomize_`: sinks N(0, 1) (large enough to matter), expert biases, and gate_up expert
    weights `expert_scale / sqrt(H)` so that the +-7 SwiGLU clamp is active. With `mxfp4_experts` the
    expert weights are replaced by their MXFP4 round trip, so the model equals its release-layout export.
    """
    from transformers import AutoModelForCausalLM

    from dflash_jax.quant import dequantize_mxfp4_np, quantize_mxfp4_np

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    h, inter = config.hidden_size, config.intermediate_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(expert_scale * torch.randn(ex.gate_up_proj.shape, generator=gen) / np.sqrt(h))
            ex.gate_up_proj_bias.copy_(0.5 * torch.randn(ex.gate_up_proj_bias.shape, generator=gen))
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=gen) / np.sqrt(inter))
            ex.down_proj_bias.copy_(0.1 * torch.randn(ex.down_proj_bias.shape, generator=gen))
            if mxfp4_experts:
                for name in ("gate_up_proj", "down_proj"):
                    p = getattr(ex, name)
                    blocks, scales = quantize_mxfp4_np(p.detach().transpose(1, 2).numpy())  # [E, out, in]
                    dense = np.swapaxes(dequantize_mxfp4_np(blocks, scales, np.float32), 1, 2)
                    p.copy_(torch.from_numpy(np.ascontiguousarray(dense)))
    return model.eval()


def save_gpt_oss_mxfp4_release(model, directory):
    """Writes `model` in the release layout: experts as MXFP4 `*_blocks` [E, out, in/32, 16] / `*_scales`
    [E, out, in/32] uint8 ([out, in] order, gate/up rows interleaved as in the model), everything else as
    `save_pretrained` writes it, plus the release's `quantization_config`. The expert weights must be
    MXFP4-exact (`build_gpt_oss(mxfp4_experts=True)`), so the export is lossless; this is checked."""
    import json
    import os

    from safetensors.torch import save_file

    from dflash_jax.quant import dequantize_mxfp4_np, quantize_mxfp4_np

    model.save_pretrained(directory)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            oriented = p.detach().transpose(1, 2).contiguous().numpy()
            blocks, scales = quantize_mxfp4_np(oriented)
            assert np.array_equal(dequantize_mxfp4_np(blocks, scales, np.float32), oriented), name
            tensors[name + "_blocks"] = torch.from_numpy(blocks)
            tensors[name + "_scales"] = torch.from_numpy(scales)
        else:
            tensors[name] = p.detach().contiguous()
    for f in os.listdir(directory):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(directory, f))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(directory, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = GPT_OSS_MXFP4_QUANTIZATION
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)


def load_gpt_oss_mxfp4_reference(directory):
    """transformers' own reading of a release-layout (MXFP4) gpt-oss checkpoint on the CPU: with
    `Mxfp4Config(dequantize=True)` it dequantizes the blocks into the dense fp32 experts."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    )
    return model.eval()


def tiny_qwen3_5_moe_config(**overrides):
    """A tiny `Qwen3_5MoeTextConfig`: DeltaNet and gated-attention layers mixed (a linear layer after a full
    one), dk != dv, Hv = 2 Hk, partial RoPE (8 of 32 head dims), a shared expert narrower than the routed."""
    from transformers import Qwen3_5MoeTextConfig

    kw = dict(
        vocab_size=160, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=24, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def gated_delta_rule_float64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule one token at a time in float64, with the signature of transformers'
    `torch_recurrent_gated_delta_rule` (whose fallbacks always compute in float32):
    q, k L2-normalized (`x / sqrt(sum x^2 + 1e-6)`) when asked, q scaled by dk^-0.5; value head j reads key
    head j // (Hv / Hk); per step `S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q`."""
    q, k, v, g, beta = (t.double() for t in (query, key, value, g, beta))
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, t, h, dk = k.shape
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double())
    out = torch.empty_like(v)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        delta = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i]))
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = torch.einsum("bhkv,bhk->bhv", state, q[:, i])
    return out, (state if output_final_state else None)


class Float64Reference:
    """transformers' model of a checkpoint directory run entirely in float64: float64 weights, eager
    attention and experts, and `gated_delta_rule_float64` in place of the (float32-only) delta-rule
    fallbacks. The exact answer that both float32 implementations approximate."""

    def __init__(self, directory):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
        ).eval()

    @torch.no_grad()
    def __call__(self, tokens: np.ndarray, *, hidden_states: bool = False):
        """Logits [1, T, V]; with `hidden_states`, also the HF hidden states (as `hf_forward`)."""
        import importlib

        module = importlib.import_module(type(self.model).__module__)
        names = [n for n in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule") if hasattr(module, n)]
        saved = {n: getattr(module, n) for n in names}
        try:
            for n in names:
                setattr(module, n, gated_delta_rule_float64)
            ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
            with fast_torch_cpu():
                out = self.model(ids[None] if ids.ndim == 1 else ids, output_hidden_states=hidden_states)
            if hidden_states:
                return out.logits.numpy(), tuple(h.numpy() for h in out.hidden_states)
            return out.logits.numpy()
        finally:
            for n, fn in saved.items():
                setattr(module, n, fn)


class fast_torch_cpu:  # noqa: N801 - used as a context manager, like a function
    """`with fast_torch_cpu():` runs torch reference code single-threaded with denormals flushed, and
    restores both afterwards.

    Two intra-op threads on a busy 2-core machine next to XLA's threads make small kernels (a depthwise
    conv1d: 1000x) crawl, and the Gated DeltaNet reference's triangular solves are full of denormals
    (values below 1e-38 that only cost time)."""

    def __enter__(self):
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._flush = torch.set_flush_denormal(True)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self._threads)
        if self._flush:
            torch.set_flush_denormal(False)
        return False


def record_reference_proposals(monkeypatch, draft_ref) -> list[list[int]]:
    """Patches z-lab's draft so each of its `compute_logits` calls appends that round's greedy proposals
    (batch row 0) to the returned list."""
    proposals: list[list[int]] = []
    original = draft_ref.compute_logits

    def recording(hidden, head):
        logits = original(hidden, head)
        proposals.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(draft_ref, "compute_logits", recording)
    return proposals
