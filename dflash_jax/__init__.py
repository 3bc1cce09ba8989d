"""dflash_jax: lossless DFlash speculative decoding for Mixture-of-Experts LLMs in JAX."""

# light on purpose: a console script imports this package before its own code can install signal handlers, so
# nothing heavy (the config module, jax) is imported here; `from_hf_config` is loaded on first use
from dflash_jax.errors import CheckpointError, ConfigError

__version__ = "0.1.0"

import os as _os  # noqa: E402

# The small trained pair that ships with the package (a Qwen3-MoE target trained on the Python standard
# library and its DFlash draft, MXFP4 experts): `dflash_jax.load()` and `dflash-generate` without a checkpoint.
SHIPPED_PAIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "assets", "tiny_pair")
# Every pair that ships, by name (`dflash-generate --pair NAME`): the default Qwen3-MoE pair above, the hybrid
# Qwen3.5-MoE pair (Gated DeltaNet + gated attention + shared expert) trained on the same corpus and tokenizer, and
# a DFlash 2 draft of the default pair's target (a draft variant: it reads its target from tiny_pair), and a DFlash 2
# draft of the hybrid pair's target (a draft variant of tiny_pair_qwen3_5).
SHIPPED_PAIRS = {
    "tiny_pair": SHIPPED_PAIR,
    "tiny_pair_qwen3_5": _os.path.join(_os.path.dirname(SHIPPED_PAIR), "tiny_pair_qwen3_5"),
    "tiny_pair_dflash2": _os.path.join(_os.path.dirname(SHIPPED_PAIR), "tiny_pair_dflash2"),
    "tiny_pair_qwen3_5_dflash2": _os.path.join(_os.path.dirname(SHIPPED_PAIR), "tiny_pair_qwen3_5_dflash2"),
}


def load(directory=None, *, expert_memory: str = "device", verify: bool = True, mesh=None,
         dequantize_experts=False, branch_head: bool = True):
    """A converted target + draft pair (`dflash_jax.pair.Pair`) from a `convert-weights` checkpoint (None: the
    shipped pair, `SHIPPED_PAIR`); `verify` checks every file's sha256 first (see `dflash_jax.pair.load`).
    HuggingFace directories load with `convert.load_hf_target` / `convert.load_hf_pair`. `dequantize_experts`
    ("auto", True, False; default False): FP4 expert tables dequantized once at load ("auto": where no FP4
    kernel runs and memory allows, `dflash_jax.pair.dense_experts_wanted`; `dflash-generate` uses "auto"). `mesh`: restore
    every array into its sharding on that mesh (`dflash_jax.sharding`, docs/sharding.md). `branch_head`: attach the
    pair's shipped branch head (token trees build from it; `dflash_jax.models.draft.BranchHeadWeights`)."""
    from dflash_jax.pair import load as _load  # keeps `import dflash_jax` light (no model code until a load)

    return _load(SHIPPED_PAIR if directory is None else directory, expert_memory=expert_memory, verify=verify,
                 mesh=mesh, dequantize_experts=dequantize_experts, branch_head=branch_head)


def generate(pair, prompts, *, max_new_tokens, proposer="chain", experts: str = "device", **options):
    """Lossless speculative generation: any proposer ("chain", "head-chain", "tree", "adaptive") on any expert
    placement ("device", "offload"), by the jitted or the stepping driver (`dflash_jax.api.generate`)."""
    from dflash_jax.api import generate as _generate

    return _generate(pair, prompts, max_new_tokens=max_new_tokens, proposer=proposer, experts=experts, **options)


def __getattr__(name):
    if name == "from_hf_config":
        from dflash_jax.config import from_hf_config

        return from_hf_config
    if name == "load_hf_target":  # moved: the runtime never imports the converter
        raise AttributeError("dflash_jax.load_hf_target moved to convert.load_hf_target")
    raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")


__all__ = ["CheckpointError", "ConfigError", "SHIPPED_PAIR", "SHIPPED_PAIRS", "from_hf_config", "generate", "load", "__version__"]
