"""Speculative decoding: pure rounds (`session`), acceptance rules (`accept`), sampling, loops."""

from dflash_jax.spec.loop import GenerationResult, generate, generate_stepping
from dflash_jax.spec.sampling import SamplingParams
from dflash_jax.spec.session import Draft, SpecConfig, SpecState, begin, draft_round, spec_round, verify_round

__all__ = ["Draft", "GenerationResult", "SamplingParams", "SpecConfig", "SpecState", "begin", "draft_round",
           "generate", "generate_stepping", "spec_round", "verify_round"]
