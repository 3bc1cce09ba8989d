"""One engine on the shipped pair for the serving tests (compiled once per test process): 4 slots, prompts of
one bucket (<= 16 tokens), budgets <= 64."""

import pytest

PROMPT_BUCKET = 16


@pytest.fixture(scope="session")
def pair():
    import dflash_jax

    return dflash_jax.load()


@pytest.fixture(scope="session")
def engine(pair):
    from dflash_jax.serve.engine import Engine

    eng = Engine(pair, slots=4, max_prompt_len=PROMPT_BUCKET, max_new_tokens=64, max_queue=16)
    eng.warmup([PROMPT_BUCKET])
    return eng
