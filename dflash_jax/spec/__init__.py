"""Speculative decoding: the state and the chain's draft/verify (`session`), token trees (`tree`), the round and its
proposers (`round`), the adaptive shape policy (`policy`), acceptance rules (`accept`), sampling, request checks
and shape buckets (`requests`), the drivers (`loop`)."""

from dflash_jax.spec.loop import GenerationResult, generate, generate_stepping, generate_tree, generate_tree_stepping
from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost
from dflash_jax.spec.requests import Buckets
from dflash_jax.spec.round import Chain, Proposal, commit, propose, round, spec_round, verify_forward
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import (
    Draft, RoundOutcome, RowParams, SpecConfig, SpecState, begin, draft_round, draft_round_jit, prepare, verify_round,
    verify_round_jit,
)
from dflash_jax.spec.tree import TreeShape

__all__ = ["AdaptivePolicy", "Buckets", "Chain", "Draft", "GenerationResult", "Proposal", "RoundOutcome", "RowParams",
           "SamplingParams", "SpecConfig", "SpecState", "TreeShape", "VerifyCost", "begin", "commit", "draft_round",
           "draft_round_jit", "generate", "generate_stepping", "generate_tree", "generate_tree_stepping", "prepare",
           "propose", "round", "spec_round", "verify_forward", "verify_round", "verify_round_jit"]
