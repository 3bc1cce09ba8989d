"""Placement: which experts a budget pins on the device, from a routing profile.

With S slots per MoE layer and a verify of `batch * block` tokens routed to top-k experts each, a layer may
need up to `reserve = min(E, batch * block * top_k)` distinct experts in one round. Placement keeps
`reserve` slots per layer for the cache (so every round can run whatever it routes) and pins the
`S - reserve` hottest experts of the profile in the others; with `S >= E` every expert is pinned (the pool
is then the whole table: B0's residency through the offload path). The cache slots start warm: they are
filled with the next hottest experts (`warm_set`), evictable like any cached expert.
"""

from __future__ import annotations

import numpy as np


def routing_profile(routed: dict[int, np.ndarray], num_experts: int) -> dict[int, np.ndarray]:
    """{layer: expert ids of any shape} -> {layer: [E] int64 counts} (how often each expert was routed)."""
    return {layer: np.bincount(np.asarray(e).reshape(-1), minlength=num_experts) for layer, e in routed.items()}


def cache_reserve(num_experts: int, top_k: int, batch: int, block_size: int) -> int:
    """Distinct experts one verify of `batch * block_size` tokens can route to in one layer, at most."""
    return int(min(num_experts, batch * block_size * top_k))


def plan_placement(profile: dict[int, np.ndarray], slots: int, reserve: int) -> dict[int, np.ndarray]:
    """{layer: pinned expert ids}: the `slots - reserve` most-routed experts of each layer's profile (ties:
    lower id first), all experts when `slots >= E`, none when `slots <= reserve`."""
    pinned = {}
    for layer, counts in profile.items():
        counts = np.asarray(counts)
        e = len(counts)
        n = e if slots >= e else max(0, slots - reserve)
        order = np.lexsort((np.arange(e), -counts))
        pinned[layer] = np.sort(order[:n]).astype(np.int32)
    return pinned


def warm_set(profile: dict[int, np.ndarray], slots: int) -> dict[int, np.ndarray]:
    """{layer: the `min(slots, E)` most-routed experts} (ties: lower id first): the pool's initial content."""
    out = {}
    for layer, counts in profile.items():
        counts = np.asarray(counts)
        order = np.lexsort((np.arange(len(counts)), -counts))
        out[layer] = np.sort(order[: min(slots, len(counts))]).astype(np.int32)
    return out


def _ranked_pairs(profile: dict[int, np.ndarray], layers) -> list[tuple[int, int]]:
    """(layer, expert) pairs of `layers`, most routed first (ties: lower layer, then lower id)."""
    rows = [(-int(c), layer, e) for layer in layers for e, c in enumerate(np.asarray(profile[layer]))]
    return [(layer, e) for _, layer, e in sorted(rows)]


def plan_shared(profile: dict[int, np.ndarray], groups: list[tuple[tuple[int, ...], int]], reserve: int
                ) -> dict[int, np.ndarray]:
    """{layer: pinned expert ids} for a cache shared by the layers (`cache.ExpertCache`): per slab (`groups`:
    (its layers, its slots)) the `slots - reserve` (layer, expert) pairs the profile routed to most, across
    layers: the hot sets are non-uniform, a layer that routes to few experts pins fewer. That is the cost
    model's choice for equal expert sizes: a pinned expert saves its copy (bytes / link bandwidth) every round
    it is routed, so the pins go to the highest routing frequencies. `reserve` (one layer's routed union at
    most, `cache_reserve`) stays unpinned so that a layer runs in one pass; a slab holding every expert of its
    layers pins them all; a slab of at most `reserve` slots pins nothing (layers may run in passes)."""
    pinned = {layer: [] for layer in profile}
    for layers, slots in groups:
        e = len(np.asarray(profile[layers[0]]))
        n = len(layers) * e if slots >= len(layers) * e else max(0, slots - reserve)
        for layer, expert in _ranked_pairs(profile, layers)[:n]:
            pinned[layer].append(expert)
    return {layer: np.sort(np.asarray(v, np.int32)) for layer, v in pinned.items()}


def warm_shared(profile: dict[int, np.ndarray], groups: list[tuple[tuple[int, ...], int]],
                pinned: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """{layer: expert ids} that fill each slab's slots left after the pins with the next most routed pairs:
    the cache's initial content (evictable)."""
    out = {layer: [] for layer in profile}
    for layers, slots in groups:
        room = slots - sum(len(pinned.get(layer, ())) for layer in layers)
        for layer, expert in _ranked_pairs(profile, layers):
            if room <= 0:
                break
            if expert not in set(np.asarray(pinned.get(layer, ())).tolist()) and expert not in out[layer]:
                out[layer].append(expert)
                room -= 1
    return {layer: np.sort(np.asarray(v, np.int32)) for layer, v in out.items()}
