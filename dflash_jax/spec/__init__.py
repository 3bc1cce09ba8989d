"""Speculative decoding: pure rounds (`session`), acceptance rules (`accept`), sampling, request checks and
shape buckets (`requests`), loops."""

from dflash_jax.spec.loop import GenerationResult, generate, generate_stepping
from dflash_jax.spec.requests import Buckets
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import (
    Draft, RowParams, SpecConfig, SpecState, begin, draft_round, draft_round_jit, prepare, spec_round, verify_round,
    verify_round_jit,
)

__all__ = ["Buckets", "Draft", "GenerationResult", "RowParams", "SamplingParams", "SpecConfig", "SpecState", "begin",
           "draft_round", "draft_round_jit", "generate", "generate_stepping", "prepare", "spec_round", "verify_round",
           "verify_round_jit"]
