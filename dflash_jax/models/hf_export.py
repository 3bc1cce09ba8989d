"""Writing weights in a HuggingFace release layout: what the families' exporters share (each family's own
writer lives in its package, `dflash_jax/models/<family>/hf.py`, registered as `ModelFamily.export_hf`)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file


def to_numpy(a) -> np.ndarray:
    """A contiguous fp32 numpy copy (what the exporters write)."""
    return np.ascontiguousarray(np.asarray(a, np.float32))


def rope_json(rope) -> dict:
    if rope.kind != "default":
        raise ValueError("export supports default RoPE only")
    return {"rope_type": "default", "rope_theta": rope.theta}


def qwen_attention_tensors(prefix: str, attn) -> dict[str, np.ndarray]:
    """A Qwen3-style attention block (`models.qwen3.AttentionWeights`) as `self_attn.*` release tensors."""
    out = {}
    for name in "qkvo":
        out[f"{prefix}self_attn.{name}_proj.weight"] = to_numpy(getattr(attn, name)).T
        bias = getattr(attn, f"{name}_bias")
        if bias is not None:
            out[f"{prefix}self_attn.{name}_proj.bias"] = to_numpy(bias)
    out[f"{prefix}self_attn.q_norm.weight"] = to_numpy(attn.q_norm)
    out[f"{prefix}self_attn.k_norm.weight"] = to_numpy(attn.k_norm)
    return out


def save_hf_directory(directory: str, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """`config.json` and `model.safetensors` in `directory` (created if missing)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
