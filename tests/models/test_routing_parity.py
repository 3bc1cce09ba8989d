"""Routing comes from the family only: the route-ahead predictors, the in-verify prediction and the serving
engine's byte pricing project a MoE layer's routing with `ModelFamily.route_rows`, the function the verify's
MoE layer itself routes with. Pinned here on every registered family: given the residual rows a MoE layer saw
in a verify, the predictors' routing of those rows is the verify's routing (same experts, same logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import decoder
from dflash_jax.models.family import families
from dflash_jax.offload.predictors import DraftRouter, RoundInputs, route_stacked


class _Recording(decoder.Steps):
    """The resident loop's steps, keeping each layer's residual stream entering its MLP sub-layer and routing."""

    def __init__(self, fam, cfg):
        super().__init__(fam, cfg)
        self.seen = {}

    def attend(self, i, layer, x, state, ctx, moe):
        x, h, routing, state = super().attend(i, layer, x, state, ctx, moe)
        if moe:
            self.seen[i] = (x.reshape(-1, x.shape[-1]), routing)
        return x, h, routing, state


@pytest.mark.parametrize("fam", families(), ids=lambda f: f.name)
def test_predictors_route_as_the_verify_does(fam):
    cfg = fam.tiny_config()
    weights = fam.random_weights(cfg, jax.random.key(5))
    cache = fam.init_cache(cfg, 2, 16, verify_width=6)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    steps = _Recording(fam, cfg)
    decoder.run_layers(steps, weights, tokens, cache, logits="none")
    layers = fam.moe_layer_ids(weights)
    assert layers and sorted(steps.seen) == list(layers)
    routers = fam.routers_of(weights, layers)
    for j, layer in enumerate(layers):
        rows, verify = steps.seen[layer]
        experts, probs = route_stacked(fam, routers, rows, cfg, cfg.moe.top_k)  # every layer's router on the rows
        np.testing.assert_array_equal(np.asarray(experts[j]), np.asarray(verify.experts))
        np.testing.assert_allclose(np.asarray(probs[j]), np.asarray(verify.probs), rtol=1e-6, atol=1e-6)
        # the draft-router predictor on these rows predicts exactly the layer's routed set
        got = DraftRouter(weights, cfg).predict(RoundInputs(round=0, layers=layers, top_k=cfg.moe.top_k,
                                                            draft_hidden=rows[None]))
        assert set(got[layer].tolist()) == set(np.asarray(verify.experts).reshape(-1).tolist())
        # the learned model's start is the same router as a linear map (fp32 rows)
        linear = fam.linear_router(fam.router_of(weights.layers[layer]))
        r32 = rows.astype(jnp.float32)
        normed = r32 * jax.lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + cfg.rms_norm_eps) * linear.norm
        np.testing.assert_allclose(np.asarray(normed @ linear.router + linear.router_bias),
                                   np.asarray(verify.logits), rtol=1e-5, atol=1e-5)
