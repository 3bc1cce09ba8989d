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


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """The reference model's own greedy continuation: argmax of its forward, one token at a time on its
    own KV cache. (`generate` is not used: in transformers 5.24 its logits for these tiny MoE models
    differ from the model's forward by ~0.1, a property of `generate`'s code path, not of the model.)"""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ids, out = torch.tensor([list(prompt)]), []
    for _ in range(n):
        logits = hf(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


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
