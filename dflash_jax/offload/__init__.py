"""Host-offloaded experts with route-ahead prefetch (lossless).

  store.py        HostExpertStore: per-layer stacked expert tables (dense / FP4 parts, biases) in pinned_host memory
  cache.py        ExpertCache: one device expert cache shared by every MoE layer (a slab per expert shape, per-layer
                  slot tables), LRFU eviction across layers, pinning, passes when a layer's routed experts do not fit;
                  PoolTooSmall
  hybrid.py       HostCompute: the per-expert, per-round cost-model choice to compute a cold expert on the host
  placement.py    pin the hottest experts of a routing profile under the budget, warm the cache slots
  forward.py      forward_layerwise: the verify layer by layer, exact routing read before each expert GEMM
  families.py     per-family adapters (Qwen3-MoE, gpt-oss, Qwen3.5-MoE): expert fields, layer steps, caches
  predictors.py   route-ahead predictors (previous round, target routers on draft hidden states, learned, the next
                  layer's router on the verify's residual, union)
  route_model.py  the learned predictor's model: weights, init from the target routers, logits / probabilities
                  (fitted by `train.route_predictor`)
  stats.py        RouteAheadStats: coverage / waste / hit rate / bytes / transfer time vs hide window; round observers
                  (RoundObserver, TraceObserver)
  loop.py         OffloadedGenerator (prefill / round / generate, a pluggable RoutePrefetcher, observers) and the
                  one-call generate_offloaded: B1 / B2 / B3 through one stepping loop
  bandwidth.py    the measured host->device bandwidth the stats compare transfer times with

The package exports what a user needs (the generator, the store and cache, the predictors by name, the stats);
the pieces (forward_layerwise, the predictor classes, placement) import from their modules.

Study code (the B0-B3 cost model, offline scoring, round recording) lives in `dflash_jax.study`.
"""

from dflash_jax.offload.cache import ExpertCache, PoolTooSmall, min_budget_bytes
from dflash_jax.offload.hybrid import HostCompute
from dflash_jax.offload.loop import OffloadedGenerator, OffloadResult, OffloadSession, generate_offloaded
from dflash_jax.offload.predictors import PREDICTORS, make_predictor
from dflash_jax.offload.stats import RoundStats, RouteAheadStats, TraceObserver
from dflash_jax.offload.store import HostExpertStore

__all__ = [
    "ExpertCache", "HostCompute", "HostExpertStore", "OffloadResult", "OffloadSession", "OffloadedGenerator",
    "PREDICTORS", "PoolTooSmall", "RoundStats", "RouteAheadStats", "TraceObserver", "generate_offloaded",
    "make_predictor", "min_budget_bytes",
]
