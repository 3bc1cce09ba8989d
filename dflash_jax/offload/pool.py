"""The device expert pool: per MoE layer S slots holding copies of experts, a slot table, eviction.

Each MoE layer l has device arrays `[S, ...]` (one per per-expert leaf of its tables, see `store`) and a
slot table `slot_of[l]` [E] int32: `slot_of[l][e] = s` when expert e sits in slot s, the sentinel `S`
otherwise. `nn.moe.swiglu_experts` runs on the pool through the table. A row routed to the sentinel
contributes nothing (its group is out of range); the offloaded forward never lets that happen (it checks
residency on the host before every expert GEMM), and `poison=True` makes a violation loud: the pool gets
one extra *trap* slot S, and the trap and every free slot hold huge finite values (`_poison_like`), so a
computation that reads a non-resident expert or a stale slot blows up (`_poison_leaves`).

Eviction (host side, per layer): *pinned* experts (placement) never leave; experts the current step
protects (the layer's exact routed set while it runs, the round's prediction while it is prefetched)
are never evicted; among the rest the victim is the expert with the lowest CRF score (LRFU): every use at
round t adds `2^(-lambda * (now - t))` to its score, so `lambda = 1` is LRU-like and `lambda -> 0` LFU.
Ties go to the least recently used, then the lowest slot. Free slots are used first.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.store import HostExpertStore, as_int32, memory_sharding, power_of_two_chunks, pull_rows
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor


class PoolTooSmall(RuntimeError):
    """A layer needs more distinct experts at once than its pool has unpinned slots."""


def slots_for_budget(store: HostExpertStore, budget_bytes: int) -> int:
    """Slots per MoE layer that `budget_bytes` buys: `floor(budget / sum_l expert_bytes_l)`, at most E."""
    per_slot = sum(store.expert_bytes(layer) for layer in store.layer_ids)
    return int(min(store.num_experts, budget_bytes // per_slot))


def _poison_leaves(le, rows: int) -> list[jax.Array]:
    """Leaves `[rows, ...]` (aligned with the store's per-expert leaves) of huge FINITE expert weights: a GEMM
    row that reads them blows up (inf / NaN downstream, or a visibly different output), while a product with
    zero stays zero. Finite matters: XLA's CPU `ragged_dot` is a dense dot over all slots with the unrouted
    ones multiplied by zero, so NaN poison would leak into every row. Dense tables: 1e30 (fp16: 1e3);
    MXFP4: codes +6 and E8M0 scale 2^73; NVFP4: codes +6, block scale 448 (per-expert tensor scale 1e30)."""
    def full(a, value):
        return jnp.full((rows,) + tuple(a.shape[1:]), value, a.dtype)

    def poison(t):
        if isinstance(t, MXFP4Tensor):
            return MXFP4Tensor(blocks=full(t.blocks, 0x77), scales=full(t.scales, 0xC8))
        if isinstance(t, NVFP4Tensor):
            scale = t.tensor_scale
            if getattr(scale, "ndim", 0) >= 1 and scale.shape[0] == le.num_experts:
                scale = full(scale, 1e30)
            return NVFP4Tensor(packed=full(t.packed, 0x77), block_scales=full(t.block_scales, 448.0),
                               tensor_scale=scale)
        return full(t, 1e3 if t.dtype == jnp.float16 else 1e30)

    tables = le.tables(le.leaves)
    poisoned = jax.tree.map(poison, tables, is_leaf=lambda t: isinstance(t, (MXFP4Tensor, NVFP4Tensor)))
    return jax.tree.leaves(poisoned)


@dataclasses.dataclass
class _LayerPool:
    leaves: list  # device leaves [S(+1), ...] in the order of the store's leaves (shared leaves: the store's)
    slot_of: np.ndarray  # [E] int32, sentinel = S
    expert_in_slot: np.ndarray  # [S] int32, -1 = free
    pinned: np.ndarray  # [E] bool
    crf: np.ndarray  # [E] float64: CRF score as of round last_use
    last_use: np.ndarray  # [E] float64 (-inf: never used)
    device_slot_of: jax.Array | None = None  # cached device copy of slot_of


@dataclasses.dataclass
class FetchRecord:
    """What one `fetch` call moved: expert ids and bytes."""

    experts: np.ndarray
    bytes: int


class ExpertPool:
    """Device pool of `slots` experts per MoE layer of `store` (bytes: `slots * sum_l expert_bytes_l`).

    pinned: {layer: expert ids} loaded at construction and never evicted (`placement.plan_placement`).
    poison: add the trap slot and poison free slots (tests: any use of a non-resident expert blows up).
    crf_lambda: the LRFU decay (see module doc).
    """

    def __init__(self, store: HostExpertStore, slots: int, *, pinned: dict[int, Sequence[int]] | None = None,
                 poison: bool = False, crf_lambda: float = 0.5):
        if slots < 1:
            raise PoolTooSmall(
                f"the expert budget buys {slots} slots per MoE layer; one expert of every layer needs "
                f"{sum(store.expert_bytes(l) for l in store.layer_ids)} bytes")
        self.store, self.slots, self.poison, self.crf_lambda = store, int(slots), poison, crf_lambda
        self.now = 0.0
        self.layers: dict[int, _LayerPool] = {}
        dev = memory_sharding("device")
        rows = self.slots + (1 if poison else 0)
        e = store.num_experts
        for layer, le in store.layers.items():
            fill = _poison_leaves(le, rows) if poison else None
            leaves = []
            for j, (leaf, indexed) in enumerate(zip(le.leaves, le.per_expert)):
                if not indexed:
                    leaves.append(leaf)
                elif poison:
                    leaves.append(jax.device_put(fill[j], dev))
                else:
                    leaves.append(jax.device_put(jnp.zeros((rows,) + tuple(leaf.shape[1:]), leaf.dtype), dev))
            self.layers[layer] = _LayerPool(
                leaves=leaves, slot_of=np.full(e, self.slots, np.int32),
                expert_in_slot=np.full(self.slots, -1, np.int32),
                pinned=np.zeros(e, bool), crf=np.zeros(e), last_use=np.full(e, -np.inf))
        for layer, experts in (pinned or {}).items():
            experts = as_int32(experts)
            if len(experts) > self.slots:
                raise PoolTooSmall(f"layer {layer}: {len(experts)} pinned experts exceed the {self.slots} slots")
            self.fetch(layer, experts)
            self.layers[layer].pinned[experts] = True

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Device bytes of the pool's expert slots (trap slot excluded)."""
        return self.slots * sum(self.store.expert_bytes(layer) for layer in self.layers)

    def resident(self, layer: int) -> np.ndarray:
        """[E] bool: experts of `layer` currently in the pool."""
        return self.layers[layer].slot_of < self.slots

    def pinned(self, layer: int) -> np.ndarray:
        return self.layers[layer].pinned.copy()

    def missing(self, layer: int, experts: Iterable[int]) -> np.ndarray:
        """The distinct experts of `experts` that are not resident in `layer`'s pool (ascending)."""
        experts = np.unique(as_int32(list(experts) if not isinstance(experts, np.ndarray) else experts))
        return experts[~self.resident(layer)[experts]]

    def slot_table(self, layer: int) -> jax.Array:
        """`slot_of[layer]` [E] int32 on the device (sentinel = S for experts not in the pool)."""
        lp = self.layers[layer]
        if lp.device_slot_of is None:
            lp.device_slot_of = jax.device_put(lp.slot_of.copy(), memory_sharding("device"))  # no alias (CPU)
        return lp.device_slot_of

    def operands(self, layer: int) -> tuple:
        """The expert slot pools `[S(+1), ...]` of `layer` in the family's `expert_fields` order (`(gate_up, down)`;
        gpt-oss adds the biases), read through `slot_table(layer)` (`ModelFamily.with_expert_pool`)."""
        return self.store.layers[layer].tables(self.layers[layer].leaves)

    def pooled_weights(self, weights):
        """`weights` (e.g. `store.strip_experts` of the target) with every MoE layer reading its experts from
        this pool: the model's own forward then runs on the pool (every routed expert must be resident)."""
        fam = self.store.family
        layers = tuple(
            layer.replace(mlp=fam.with_expert_pool(layer.mlp, self.operands(i), self.slot_table(i)))
            if i in self.layers else layer for i, layer in enumerate(weights.layers))
        return weights.replace(layers=layers)

    # ---- updates -----------------------------------------------------------------------------------------
    def _score(self, lp: _LayerPool, experts: np.ndarray) -> np.ndarray:
        age = self.now - lp.last_use[experts]
        return np.where(np.isfinite(age), lp.crf[experts] * np.exp2(-self.crf_lambda * np.nan_to_num(age, posinf=0)),
                        0.0)

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """Records a use of `experts` at the current time (the CRF score of each gains 1)."""
        lp = self.layers[layer]
        experts = np.unique(as_int32(experts))
        lp.crf[experts] = self._score(lp, experts) + 1.0
        lp.last_use[experts] = self.now

    def advance(self, rounds: float = 1.0) -> None:
        """Moves the eviction clock (one unit per round)."""
        self.now += rounds

    def _victims(self, lp: _LayerPool, n: int, protect: np.ndarray, layer: int, needed: int) -> np.ndarray:
        free = np.flatnonzero(lp.expert_in_slot < 0)
        if len(free) >= n:
            return free[:n]
        occupied = np.flatnonzero(lp.expert_in_slot >= 0)
        held = lp.expert_in_slot[occupied]
        ok = ~lp.pinned[held] & ~protect[held]
        cand_slots, cand_experts = occupied[ok], held[ok]
        if len(free) + len(cand_slots) < n:
            raise PoolTooSmall(
                f"MoE layer {layer} needs {needed} experts resident at once, but its pool has {self.slots} slots of "
                f"which {int(lp.pinned.sum())} are pinned; raise the expert budget (at least one block's routed "
                f"union per layer: min(E, batch * block * top_k) slots) or pin fewer experts")
        order = np.lexsort((cand_slots, lp.last_use[cand_experts], self._score(lp, cand_experts)))
        return np.concatenate([free, cand_slots[order[: n - len(free)]]])

    def fetch(self, layer: int, experts: Iterable[int], *, protect: Iterable[int] = ()) -> FetchRecord:
        """Makes `experts` resident in `layer`'s pool: copies the missing ones from the host store into slots
        chosen by the eviction rule (never a pinned expert, never one of `experts` or `protect`). The copies
        are dispatched asynchronously (JAX runs them before any later computation that reads the pool).
        Returns what moved. Raises PoolTooSmall when the unpinned slots cannot hold them."""
        lp = self.layers[layer]
        wanted = np.unique(as_int32(experts))
        todo = wanted[lp.slot_of[wanted] >= self.slots]
        if len(todo) == 0:
            return FetchRecord(experts=todo, bytes=0)
        guard = np.zeros(len(lp.slot_of), bool)
        guard[wanted] = True
        guard[as_int32(list(protect))] = True
        slots = self._victims(lp, len(todo), guard, layer, len(wanted))
        evicted = lp.expert_in_slot[slots]
        lp.slot_of[evicted[evicted >= 0]] = self.slots
        lp.slot_of[todo] = slots
        lp.expert_in_slot[slots] = todo
        lp.device_slot_of = None
        le = self.store.layers[layer]
        idx = [j for j, indexed in enumerate(le.per_expert) if indexed]
        pool_leaves = tuple(lp.leaves[j] for j in idx)
        table_leaves = tuple(le.leaves[j] for j in idx)
        for start, size in power_of_two_chunks(len(todo)):
            pool_leaves = pull_rows(pool_leaves, table_leaves, jnp.asarray(todo[start:start + size]),
                                    jnp.asarray(slots[start:start + size].astype(np.int32)))
        for j, leaf in zip(idx, pool_leaves):
            lp.leaves[j] = leaf
        return FetchRecord(experts=todo, bytes=len(todo) * le.expert_bytes)

    def prefetch(self, layer: int, experts: Sequence[int], *, protect: Iterable[int] = ()) -> FetchRecord:
        """Best effort: fetches the longest prefix of the non-resident experts of `experts` (priority order,
        most likely first) that fits in free slots or slots whose expert is neither pinned, nor in `experts`,
        nor in `protect`. Never raises for lack of room; returns what moved."""
        lp = self.layers[layer]
        ids = as_int32(experts)
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # dedupe, keep the order
        todo = ids[lp.slot_of[ids] >= self.slots]
        guard = np.zeros(len(lp.slot_of), bool)
        guard[ids] = True
        guard[as_int32(list(protect))] = True
        held = lp.expert_in_slot[lp.expert_in_slot >= 0]
        room = int((lp.expert_in_slot < 0).sum() + (~lp.pinned[held] & ~guard[held]).sum())
        return self.fetch(layer, todo[:room], protect=np.flatnonzero(guard))

    def block_until_ready(self) -> None:
        jax.block_until_ready([lp.leaves for lp in self.layers.values()])
