"""The warm-up calls its programs a second time only when the first pass left a state of other types than it
started from (`Engine.warmup`, `RoundRunner.carried`, `runner.array_types`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.serve.runner import array_types


def _admits(engine, monkeypatch) -> int:
    calls = []
    admit = engine._admit

    def counted(*args, **kwargs):
        calls.append(1)
        return admit(*args, **kwargs)

    monkeypatch.setattr(engine, "_admit", counted)
    engine.warmup([engine.max_prompt_len])
    monkeypatch.undo()
    return len(calls)


def test_one_pass_when_the_state_keeps_its_types_two_when_not(engine, monkeypatch):
    from dflash_jax import compile_cache

    per_pass = len(engine.prefill_groups)
    assert array_types(engine.runner.carried()) is not None  # a resident runner knows what it carries
    assert _admits(engine, monkeypatch) == per_pass  # reset's state has the rounds' types: one pass
    fresh = iter(range(10**6))
    monkeypatch.setattr(engine.runner, "carried", lambda: np.zeros(next(fresh)))  # a new shape every call
    assert _admits(engine, monkeypatch) == 2 * per_pass
    with compile_cache.CompileCounter() as counter:  # and serving after the one-pass warm-up compiles nothing
        req = engine.submit([5, 9, 2, 7], max_new_tokens=12, stop_ids=[])
        engine.run_until_idle()
    assert counter.compiles == 0 and len(req.tokens) == 12


def test_array_types_see_what_jit_keys_on():
    a = jnp.zeros((3,), jnp.float32)
    committed = jax.device_put(a, jax.devices()[0])
    assert array_types(a) == array_types(jnp.ones((3,), jnp.float32))
    assert array_types(a) != array_types(committed)  # committed or not
    assert array_types(a) != array_types(jnp.zeros((4,), jnp.float32))
    assert array_types(a) != array_types(jnp.zeros((3,), jnp.int32))
    assert array_types(jnp.asarray(1.0)) != array_types(jnp.asarray(1.0, jnp.float32))  # weak type
    assert array_types((a, a)) != array_types([a, a])  # the tree
    assert array_types(None) is None
