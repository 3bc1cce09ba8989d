"""The model-family registry: one interface, one decoder loop, nothing else dispatching on a family's types."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from dflash_jax import config as config_mod
from dflash_jax import testing
from dflash_jax.models.qwen3.config import Qwen3Config
from dflash_jax.models import decoder, qwen3
from dflash_jax.models.family import families, family_named, family_of, family_of_weights, register, unregister
from dflash_jax.offload.forward import ExpertOperands, forward_layerwise
from dflash_jax.offload.store import HostExpertStore, strip_experts

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = {"qwen3": testing.tiny_qwen3_moe_config, "gpt_oss": testing.tiny_gpt_oss_config,
           "qwen3_5": testing.tiny_qwen3_5_config}


def test_registry_covers_every_parsed_model_type_once():
    fams = families()
    assert sorted(f.name for f in fams) == sorted(CONFIGS)
    types = [t for f in fams for t in f.model_types]
    assert len(types) == len(set(types)), "a HF model_type claimed by two families"
    assert set(types) == set(config_mod.registered_model_types()), "config parsers and registered families disagree"
    for name, make in CONFIGS.items():
        cfg = make()
        assert family_of(cfg) is family_named(name)
    with pytest.raises(TypeError, match="no registered target family"):
        family_of(object())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_runs_the_one_loop_resident_and_layerwise(name):
    """The resident forward (one program) and the layer-wise forward (separately jitted steps, experts placed by
    a hook) are the same loop over the same pieces: identical numbers, for every family, including the cache."""
    cfg = CONFIGS[name]()
    fam = family_named(name)
    weights = fam.random_weights(cfg, jax.random.key(3))
    assert family_of_weights(weights) is fam
    cache = fam.init_cache(cfg, 2, 48, verify_width=8)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    taps = (0, cfg.num_layers - 1)
    want = fam.forward_jit(weights, tokens, cache, cfg, tap_layers=taps, num_valid=jnp.asarray([8, 5], jnp.int32))
    store = HostExpertStore(weights)
    every = np.ones(cfg.moe.num_experts, bool)
    got = forward_layerwise(strip_experts(weights), tokens, cache, cfg, num_valid=jnp.asarray([8, 5], jnp.int32),
                            tap_layers=taps,
                            provider=lambda layer, experts: ExpertOperands(store.device_tables(layer), None, every))
    for a, b in zip(jax.tree.leaves((want.logits, want.taps, want.cache)),
                    jax.tree.leaves((got.out.logits, got.out.taps, got.out.cache))):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # a GPU compiles one program and the separate steps into different fusions: float32 rounding apart
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert sorted(got.routed) == list(fam.moe_layer_ids(weights))


# ---- a family added from outside the library: one subclass + one registration, nothing else ---------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _ToyConfig(Qwen3Config):
    """A Qwen3-MoE whose residual stream is scaled after every MoE sub-layer (a different model)."""

    residual_scale: float = 0.5


@struct.dataclass
class _ToyWeights(qwen3.Qwen3Weights):
    pass


def _toy_mlp(layer, x, h, cfg, implementation="auto", *, routing=None):
    return qwen3.mlp_sublayer(layer, x, h, cfg, implementation, routing=routing) * cfg.residual_scale


class _ToyFamily(qwen3.Qwen3Family):
    name = "toy_scaled_qwen3"
    config_type, weights_type = _ToyConfig, _ToyWeights
    model_types = ()
    mlp_fn = staticmethod(_toy_mlp)

    def random_weights(self, cfg, key, dtype=jnp.float32, *, expert_format="dense"):
        w = super().random_weights(cfg, key, dtype, expert_format=expert_format)
        return _ToyWeights(**{f.name: getattr(w, f.name) for f in dataclasses.fields(w)})


def test_a_registered_family_runs_through_the_rounds_without_other_changes():
    toy = register(_ToyFamily())
    try:
        base = testing.tiny_qwen3_moe_config()
        cfg = _ToyConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, residual_scale=0.5)
        assert family_of(cfg) is toy and family_of(base) is family_named("qwen3")
        pair = testing.random_pair(cfg, seed=2)
        assert isinstance(pair.target, _ToyWeights)
        # its forward is the decoder loop over its own pieces: a different model than Qwen3 on the same weights
        cache = toy.init_cache(cfg, 1, 32)
        tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]
        mine = toy.forward_jit(pair.target, tokens, cache, cfg).logits
        plain = decoder.forward_jit(family_named("qwen3"), qwen3.Qwen3Weights(
            **{f.name: getattr(pair.target, f.name) for f in dataclasses.fields(pair.target)}), tokens, cache,
            base).logits
        assert float(jnp.abs(mine - plain).max()) > 1e-3
        # the speculative loop and plain greedy decoding find it through the registry: lossless, with acceptance
        from dflash_jax.decode import greedy_generate
        from dflash_jax.spec import generate

        prompt = [3, 17, 42, 5, 9, 11, 7, 2]
        spec = generate(pair, [prompt], max_new_tokens=24, block_size=4)
        ref = greedy_generate(pair.target, cfg, [prompt], max_new_tokens=24)
        assert len(spec.tokens[0]) == 24 and spec.tokens[0] == list(ref[0])
        assert spec.stats["mean_acceptance"] >= 1.3, spec.acceptance_lengths  # measured 1.44: proposals accepted
    finally:
        unregister(toy.name)


# ---- nothing outside the model modules dispatches on a family's types ---------------------------------------

_FAMILY_TYPES = {"Qwen3Config", "GptOssConfig", "Qwen3_5Config", "Qwen3Weights", "GptOssWeights", "Qwen3_5Weights",
                 "MoEWeights", "SparseMoEWeights", "GptOssMoEWeights"}


def _isinstance_on_family_types(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                     for n in ast.walk(node.args[1])}
            if names & _FAMILY_TYPES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_family_packages_dispatch_on_family_types():
    allowed = {ROOT / "dflash_jax" / "models", ROOT / "dflash_jax" / "train"}
    offenders = []
    for package in ("dflash_jax", "convert"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if any(a in path.parents for a in allowed):
                continue
            offenders += _isinstance_on_family_types(path)
    assert not offenders, f"dispatch on a family's types outside its module (ask the registry): {offenders}"
