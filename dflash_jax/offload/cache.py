"""One device expert cache shared by every MoE layer: slabs of slots, per-layer slot tables, eviction across
layers, passes when a layer's routed union does not fit.

Layout. The layers' per-expert leaves (the store's, `store.LayerExperts`) are grouped by *expert shape* (the
treedef and every per-expert leaf's trailing shape and dtype): each group gets one *slab*, device arrays
`[N, ...]` per per-expert leaf, N slots bought by the budget (the budget is split between slabs in proportion
to their layers' total expert bytes; a model whose MoE layers are alike has one slab). Layer l reads its
experts through its own slot table `slot_of[l]` [E] int32 into its slab (sentinel N = not resident); the
family's grouped MoE runs on the slab unchanged (`ModelFamily.with_expert_pool`). With `poison=True` the slab
has one extra *trap* row N and every free slot and the trap hold huge finite weights, so a read of a
non-resident expert blows the output up (`_poison_leaves`).

Budget. The smallest budget that runs is one slot per slab (`min_budget_bytes`): a layer whose routed union
does not fit in the slots it can use runs its experts in *passes* (`plan_passes`): each pass makes a group of
the routed experts resident, computes their rows' contribution, and the next pass may evict them. The sum of
the passes is the layer's MoE output (rows are split between passes, never duplicated; the passes chain the
residual and only the first adds a shared expert: `ModelFamily.routed_only`).

Eviction (host side). Entries are (layer, expert). Never evicted: *pinned* experts (placement), experts the
current step needs (`fetch`'s own set and `protect`), and experts *held* (`hold`: the layer that is running;
the loop holds it until its experts are dispatched, so an in-verify prefetch for the next layer cannot evict
them). Experts prefetched this round for a layer that has not run yet are evicted only after every other
candidate (`soft` protection, cleared by `advance`). Among the rest the victim is the entry with the lowest
CRF score (LRFU: every use at round t adds 2^(-lambda (now - t)), so lambda = 1 is LRU-like and lambda -> 0
LFU), then the least recently used, then the lowest slot; free slots are used first.

Copies. Chosen host rows move with `store.pull_rows` (a jitted dynamic slice of the pinned host table placed in
device memory, written into the donated slab) in power-of-two chunks, or, with `transfer="device_put"`, as
`jax.device_put` of host row buffers sliced on the host, issued ahead and written into the slab when the slab
is next read (the copy can then run on a transfer stream while the device computes: the GPU measurement hook of
`benchmarks/offload.py --overlap`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.offload.store import HostExpertStore, as_int32, memory_sharding, power_of_two_chunks, pull_rows
from dflash_jax.quant import MXFP4Tensor, NVFP4Tensor


class PoolTooSmall(RuntimeError):
    """The expert budget is below one expert of each expert shape, or a fetch needs more distinct experts of a
    layer resident at once than the cache can hold now (pinned and held entries stay)."""


@dataclasses.dataclass
class FetchRecord:
    """What one `fetch` / `prefetch` call moved: expert ids and bytes."""

    experts: np.ndarray
    bytes: int


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


def _shape_key(le) -> tuple:
    """What two layers must share to use one slab: the tables' structure and every per-expert leaf's trailing
    shape and dtype."""
    return (le.treedef,) + tuple((tuple(leaf.shape[1:]), str(leaf.dtype))
                                 for leaf, indexed in zip(le.leaves, le.per_expert) if indexed)


def slab_groups(store: HostExpertStore) -> list[tuple[int, ...]]:
    """The MoE layers of `store` grouped by expert shape, in layer order (one slab each)."""
    groups: dict[tuple, list[int]] = {}
    for layer, le in store.layers.items():
        groups.setdefault(_shape_key(le), []).append(layer)
    return [tuple(v) for v in groups.values()]


def min_budget_bytes(store: HostExpertStore) -> int:
    """The smallest budget an `ExpertCache` of `store` runs with: one slot per slab (one expert of the largest
    kind), every layer's routed union then computed in passes of one expert."""
    return int(sum(store.expert_bytes(g[0]) for g in slab_groups(store)))


def slab_slots(store: HostExpertStore, budget_bytes: int) -> list[int]:
    """Slots per slab (`slab_groups` order) that `budget_bytes` buys: the budget split in proportion to each slab's
    layers' expert bytes, at most every expert of its layers, at least one slot (below `min_budget_bytes`:
    PoolTooSmall naming the minimum)."""
    groups = slab_groups(store)
    need = min_budget_bytes(store)
    if budget_bytes < need:
        raise PoolTooSmall(
            f"the expert budget of {budget_bytes / 1e6:.3f} MB is below the minimum of {need / 1e6:.3f} MB "
            f"({need} bytes: one expert of every expert shape); raise the expert budget to at least that")
    total = sum(store.expert_bytes(g[0]) * store.num_experts * len(g) for g in groups)
    slots = []
    for g in groups:
        eb = store.expert_bytes(g[0])
        share = budget_bytes * (eb * store.num_experts * len(g)) / total
        slots.append(int(max(1, min(store.num_experts * len(g), share // eb))))
    # whatever the proportional split left over goes to the slabs in order (one slab: floor(budget / eb))
    left = budget_bytes - sum(n * store.expert_bytes(g[0]) for n, g in zip(slots, groups))
    for i, g in enumerate(groups):
        eb = store.expert_bytes(g[0])
        extra = int(min(left // eb, store.num_experts * len(g) - slots[i]))
        slots[i] += max(0, extra)
        left -= max(0, extra) * eb
    return slots


@dataclasses.dataclass
class _Slab:
    layers: tuple[int, ...]
    slots: int
    expert_bytes: int
    leaves: list  # device [N(+1), ...] per per-expert leaf, in the store's per-expert leaf order
    owner_layer: np.ndarray  # [N] int32, -1 = free
    owner_expert: np.ndarray  # [N] int32, -1 = free
    # copies not yet written into the slab, in order: ("rows", slots, device row buffers) (device_put transfers
    # issued ahead) or ("pull", layer, experts, slots) (pull_rows copies deferred while the slab is lent)
    pending: list = dataclasses.field(default_factory=list)
    lent: bool = False  # operands handed out and not yet dispatched: a write now would donate them under the reader
    readers: list = dataclasses.field(default_factory=list)  # outputs of dispatched calls that read the slab


@dataclasses.dataclass
class _LayerState:
    slab: int
    slot_of: np.ndarray  # [E] int32, sentinel = the slab's N
    pinned: np.ndarray  # [E] bool
    held: np.ndarray  # [E] bool
    soft: np.ndarray  # [E] bool: prefetched this round, the layer has not run yet
    crf: np.ndarray  # [E] float64
    last_use: np.ndarray  # [E] float64
    device_slot_of: jax.Array | None = None


class ExpertCache:
    """The device expert cache of `store` in `budget_bytes` (see module doc), shared by every MoE layer.

    pinned: {layer: expert ids} made resident at construction and never evicted (`placement.plan_shared`).
    poison: trap row + poisoned free slots (tests). crf_lambda: the LRFU decay.
    transfer: "pull_rows" (a jitted copy per chunk) or "device_put" (host row buffers put on the device ahead,
      written into the slab when it is next read).
    The pool interface of the offloaded loop: `fetch`, `prefetch`, `touch`, `advance`, `resident`, `pinned`,
    `slot_table`, `operands`, `pooled_weights`, plus `capacity` / `plan_passes` / `hold` / `release`."""

    def __init__(self, store: HostExpertStore, budget_bytes: int, *, pinned: dict[int, Sequence[int]] | None = None,
                 poison: bool = False, crf_lambda: float = 0.5, transfer: str = "pull_rows"):
        if transfer not in ("pull_rows", "device_put"):
            raise ValueError(f"transfer must be 'pull_rows' or 'device_put', got {transfer!r}")
        self.store, self.poison, self.crf_lambda, self.transfer = store, poison, crf_lambda, transfer
        self.budget_bytes = int(budget_bytes)
        self.now = 0.0
        e = store.num_experts
        dev = memory_sharding("device")
        self.slabs: list[_Slab] = []
        self.layers: dict[int, _LayerState] = {}
        for k, (group, n) in enumerate(zip(slab_groups(store), slab_slots(store, budget_bytes))):
            le = store.layers[group[0]]
            rows = n + (1 if poison else 0)
            fill = _poison_leaves(le, rows) if poison else None
            leaves = [jax.device_put(fill[j] if poison else jnp.zeros((rows,) + tuple(leaf.shape[1:]), leaf.dtype), dev)
                      for j, (leaf, indexed) in enumerate(zip(le.leaves, le.per_expert)) if indexed]
            self.slabs.append(_Slab(layers=group, slots=n, expert_bytes=le.expert_bytes, leaves=leaves,
                                    owner_layer=np.full(n, -1, np.int32), owner_expert=np.full(n, -1, np.int32)))
            for layer in group:
                self.layers[layer] = _LayerState(
                    slab=k, slot_of=np.full(e, n, np.int32), pinned=np.zeros(e, bool), held=np.zeros(e, bool),
                    soft=np.zeros(e, bool), crf=np.zeros(e), last_use=np.full(e, -np.inf))
        for layer, experts in (pinned or {}).items():
            experts = as_int32(experts)
            slab = self._slab(layer)
            if int(sum(self.layers[l].pinned.sum() for l in slab.layers)) + len(experts) > slab.slots:
                raise PoolTooSmall(f"layer {layer}: {len(experts)} pinned experts do not fit in the cache's "
                                   f"{slab.slots} slots")
            self.fetch(layer, experts)
            self.layers[layer].pinned[experts] = True

    # ---- queries -----------------------------------------------------------------------------------------
    def layer_slots(self, layer: int) -> int:
        """The slots of the slab `layer`'s experts live in (shared with the layers of its expert shape)."""
        return self._slab(layer).slots

    def _slab(self, layer: int) -> _Slab:
        return self.slabs[self.layers[layer].slab]

    @property
    def slots(self) -> int:
        """Slots of all slabs together."""
        return int(sum(s.slots for s in self.slabs))

    @property
    def bytes(self) -> int:
        """Device bytes of the cache's slots (trap rows excluded): never above the budget."""
        return int(sum(s.slots * s.expert_bytes for s in self.slabs))

    def resident_bytes(self) -> int:
        """Bytes of the experts resident now (<= `bytes`)."""
        return int(sum(int((s.owner_layer >= 0).sum()) * s.expert_bytes for s in self.slabs))

    def resident(self, layer: int) -> np.ndarray:
        return self.layers[layer].slot_of < self._slab(layer).slots

    def pinned(self, layer: int) -> np.ndarray:
        return self.layers[layer].pinned.copy()

    def missing(self, layer: int, experts: Iterable[int]) -> np.ndarray:
        experts = np.unique(as_int32(list(experts) if not isinstance(experts, np.ndarray) else experts))
        return experts[~self.resident(layer)[experts]]

    def slot_table(self, layer: int) -> jax.Array:
        """`slot_of[layer]` [E] int32 on the device (sentinel = the slab's N: the trap row when poisoned)."""
        ls = self.layers[layer]
        if ls.device_slot_of is None:
            # a copy: on a CPU backend device_put may alias the numpy buffer, which later fetches edit in place
            ls.device_slot_of = jax.device_put(ls.slot_of.copy(), memory_sharding("device"))
        return ls.device_slot_of

    def _settle(self, slab: _Slab) -> None:
        """Waits until every dispatched call that read the slab has run, before a write donates the slab's
        buffers: a donated buffer is overwritten in place, and a backend may run the write before an earlier,
        still pending read of it (measured on the CPU backend: a pass read the next pass's expert). On the
        layer-wise verify this costs nothing for on-demand fetches (the routing read already waited for the
        previous layer); a pass waits for the previous pass, an in-verify prefetch's slab write for the running
        layer's experts (its host->device transfer, with transfer="device_put", was issued before)."""
        if slab.readers:
            jax.block_until_ready(slab.readers)
            slab.readers = []

    def _flush(self, slab: _Slab) -> None:
        """Writes the slab's pending copies into it (before any read of the slab)."""
        if slab.pending:
            self._settle(slab)
        for item in slab.pending:
            if item[0] == "rows":
                slab.leaves = list(_write_rows(tuple(slab.leaves), tuple(item[2]), jnp.asarray(item[1])))
            else:
                self._pull(slab, *item[1:])
        slab.pending = []

    def returned(self, *readers) -> None:
        """Every operand handed out has been dispatched; `readers`: outputs of those calls (a later write into
        the slab waits for them). Deferred copies are issued now (the offloaded loop calls this right after each
        expert dispatch, so an in-verify prefetch issued while layer i's operands were out lands right after
        layer i's experts)."""
        for slab in self.slabs:
            if slab.lent:
                slab.readers.extend(r for r in readers if r is not None)
            slab.lent = False
            self._flush(slab)

    def operands(self, layer: int) -> tuple:
        """The layer's expert tables on the slab (`expert_fields` order; shared leaves are the layer's own),
        read through `slot_table(layer)`."""
        slab = self._slab(layer)
        self._flush(slab)
        slab.lent = True
        le = self.store.layers[layer]
        it = iter(slab.leaves)
        return le.tables([next(it) if indexed else leaf for leaf, indexed in zip(le.leaves, le.per_expert)])

    def pooled_weights(self, weights):
        """`weights` with every MoE layer reading its experts from the cache (the model's own forward then
        runs on it; every routed expert must be resident)."""
        fam = self.store.family
        layers = tuple(
            layer.replace(mlp=fam.with_expert_pool(layer.mlp, self.operands(i), self.slot_table(i)))
            if i in self.layers else layer for i, layer in enumerate(weights.layers))
        return weights.replace(layers=layers)

    def capacity(self, layer: int) -> int:
        """How many experts of `layer` can be resident at once right now: the slab's free slots, this layer's
        own entries (pinned ones included) and other layers' entries that may be evicted (not pinned, not held)."""
        slab = self._slab(layer)
        entries = self._entries(slab)
        keep = entries["pinned"] | entries["held"]
        return int(slab.slots - (keep & (entries["layer"] != layer)).sum())

    def _entries(self, slab: _Slab) -> dict:
        """Per occupied slot of `slab` (ascending): its owner layer and expert and that entry's pinned / held /
        soft flags, CRF score and last use, gathered one layer at a time (vectorized)."""
        slots = np.flatnonzero(slab.owner_layer >= 0)
        layer, expert = slab.owner_layer[slots], slab.owner_expert[slots]
        out = {"slots": slots, "layer": layer, "expert": expert, "pinned": np.zeros(len(slots), bool),
               "held": np.zeros(len(slots), bool), "soft": np.zeros(len(slots), bool), "score": np.zeros(len(slots)),
               "last": np.zeros(len(slots))}
        for l in np.unique(layer):
            at = layer == l
            st, e = self.layers[int(l)], expert[at]
            out["pinned"][at], out["held"][at], out["soft"][at] = st.pinned[e], st.held[e], st.soft[e]
            out["score"][at], out["last"][at] = self._score(int(l), e), st.last_use[e]
        return out

    def plan_passes(self, layer: int, experts: Iterable[int]) -> list[np.ndarray]:
        """The routed experts of `layer` split into passes that each fit: one pass when the distinct set fits
        (`capacity`), else groups of at most the capacity (at least one expert), resident experts first (they
        move nothing) and pinned ones in the first pass."""
        wanted = np.unique(as_int32(experts))
        cap = self.capacity(layer)
        if len(wanted) <= cap:
            return [wanted]
        ls = self.layers[layer]
        # pinned and resident first: they need no copy; a later pass may evict the earlier ones (not pinned)
        order = np.lexsort((wanted, ~self.resident(layer)[wanted], ~ls.pinned[wanted]))
        wanted = wanted[order]
        pinned = int(ls.pinned[wanted].sum())
        free_cap = max(1, cap - int(ls.pinned.sum()))  # slots a pass can fill beyond the pinned ones
        first = wanted[: pinned + free_cap]
        rest = wanted[pinned + free_cap:]
        passes = [np.sort(first)] + [np.sort(rest[i:i + free_cap]) for i in range(0, len(rest), free_cap)]
        return passes

    # ---- updates -----------------------------------------------------------------------------------------
    def _score(self, layer: int, experts: np.ndarray) -> np.ndarray:
        ls = self.layers[layer]
        age = self.now - ls.last_use[experts]
        return np.where(np.isfinite(age), ls.crf[experts] * np.exp2(-self.crf_lambda * np.nan_to_num(age, posinf=0)),
                        0.0)

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        ls = self.layers[layer]
        experts = np.unique(as_int32(experts))
        ls.crf[experts] = self._score(layer, experts) + 1.0
        ls.last_use[experts] = self.now
        ls.soft[:] = False  # the layer ran: its prefetched experts compete like any other now

    def advance(self, rounds: float = 1.0) -> None:
        self.now += rounds
        for ls in self.layers.values():
            ls.soft[:] = False

    def hold(self, layer: int, experts: Iterable[int]) -> None:
        """Experts of `layer` no fetch or prefetch (of any layer) may evict until `release`."""
        self.layers[layer].held[as_int32(experts)] = True

    def release(self, layer: int | None = None) -> None:
        for l, ls in self.layers.items():
            if layer is None or l == layer:
                ls.held[:] = False

    def _candidates(self, slab: _Slab, layer: int, guard: np.ndarray, *, soft_out: bool = False):
        """Occupied slots that may be evicted for a fetch of `layer` (not pinned, not held, not in `layer`'s
        `guard`), in eviction order: other layers' prefetched entries last, then by CRF score, last use, slot.
        soft_out: also return which of them are another layer's prefetched entries."""
        en = self._entries(slab)
        mine = en["layer"] == layer
        ok = ~en["pinned"] & ~en["held"] & ~(mine & guard[en["expert"]])
        soft = en["soft"][ok] & ~mine[ok]
        slots = en["slots"][ok].astype(np.int64)
        order = np.lexsort((slots, en["last"][ok], en["score"][ok], soft))
        return (slots[order], soft[order]) if soft_out else slots[order]

    def _victims(self, slab: _Slab, layer: int, n: int, guard: np.ndarray, needed: int) -> np.ndarray:
        free = np.flatnonzero(slab.owner_layer < 0)
        if len(free) >= n:
            return free[:n]
        cand = self._candidates(slab, layer, guard)
        if len(free) + len(cand) < n:
            pinned = int(sum(self.layers[l].pinned.sum() for l in slab.layers))
            raise PoolTooSmall(
                f"MoE layer {layer} needs {needed} experts resident at once, but the expert cache has {slab.slots} "
                f"slots of which {pinned} are pinned and {len(free) + len(cand)} usable now; raise the expert budget, "
                "pin fewer experts, or let the layer run in passes (OffloadedGenerator does)")
        return np.concatenate([free, cand[: n - len(free)]]).astype(np.int64)

    def fetch(self, layer: int, experts: Iterable[int], *, protect: Iterable[int] = (), soft: bool = False
              ) -> FetchRecord:
        """Makes `experts` of `layer` resident: copies the missing ones into slots chosen by the eviction rule
        (never a pinned or held entry, nor one of this layer's `experts` / `protect`). Raises PoolTooSmall when
        they cannot all be resident at once (`plan_passes` splits such a set). soft: mark them prefetched
        (evicted last by other layers until this layer runs or the round ends)."""
        ls, slab = self.layers[layer], self._slab(layer)
        wanted = np.unique(as_int32(experts))
        todo = wanted[ls.slot_of[wanted] >= slab.slots]
        if len(todo) == 0:
            return FetchRecord(experts=todo, bytes=0)
        guard = np.zeros(len(ls.slot_of), bool)
        guard[wanted] = True
        guard[as_int32(list(protect))] = True
        slots = self._victims(slab, layer, len(todo), guard, len(wanted))
        for s in slots:
            ol = int(slab.owner_layer[s])
            if ol >= 0:
                st = self.layers[ol]
                st.slot_of[slab.owner_expert[s]] = slab.slots
                st.device_slot_of = None
        ls.slot_of[todo] = slots
        slab.owner_layer[slots] = layer
        slab.owner_expert[slots] = todo
        ls.device_slot_of = None
        if soft:
            ls.soft[todo] = True
        self._copy(slab, layer, todo, slots.astype(np.int32))
        return FetchRecord(experts=todo, bytes=len(todo) * slab.expert_bytes)

    def _copy(self, slab: _Slab, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        le = self.store.layers[layer]
        table = tuple(leaf for leaf, indexed in zip(le.leaves, le.per_expert) if indexed)
        if self.transfer == "device_put":
            dev = memory_sharding("device")
            host = self._host_arrays(layer, table)
            for start, size in power_of_two_chunks(len(experts)):
                ids = experts[start:start + size]
                rows = [jax.device_put(np.ascontiguousarray(h[ids]), dev) for h in host]
                slab.pending.append(("rows", slots[start:start + size], rows))
            if not slab.lent:
                self._flush(slab)
            return
        if slab.lent:
            slab.pending.append(("pull", layer, experts, slots))
            return
        self._flush(slab)
        self._settle(slab)
        self._pull(slab, layer, experts, slots)

    def _pull(self, slab: _Slab, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        le = self.store.layers[layer]
        table = tuple(leaf for leaf, indexed in zip(le.leaves, le.per_expert) if indexed)
        leaves = tuple(slab.leaves)
        for start, size in power_of_two_chunks(len(experts)):
            leaves = pull_rows(leaves, table, jnp.asarray(experts[start:start + size]),
                               jnp.asarray(slots[start:start + size]))
        slab.leaves = list(leaves)

    def _host_arrays(self, layer: int, table: tuple) -> list[np.ndarray]:
        """numpy views of the layer's per-expert host leaves (the buffers `transfer="device_put"` slices)."""
        if not hasattr(self, "_numpy"):
            self._numpy = {}
        if layer not in self._numpy:
            self._numpy[layer] = [np.asarray(t) for t in table]
        return self._numpy[layer]

    def prefetch(self, layer: int, experts: Sequence[int], *, protect: Iterable[int] = ()) -> FetchRecord:
        """Best effort: the longest prefix of `experts` (most likely first) that fits without evicting a pinned
        or held entry (the running layer's), this layer's `experts` / `protect`, or (while another candidate is
        left) what was prefetched for another layer that has not run yet. Never raises for lack of room."""
        ls, slab = self.layers[layer], self._slab(layer)
        ids = as_int32(experts)
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        todo = ids[ls.slot_of[ids] >= slab.slots]
        if len(todo) == 0:
            return FetchRecord(experts=todo, bytes=0)
        guard = np.zeros(len(ls.slot_of), bool)
        guard[ids] = True
        guard[as_int32(list(protect))] = True
        free = int((slab.owner_layer < 0).sum())
        cand, soft = self._candidates(slab, layer, guard, soft_out=True)
        # never evict what another layer had prefetched for this round (it is about to run)
        room = free + len(cand) - int(soft.sum())
        return self.fetch(layer, todo[:max(0, room)], protect=np.flatnonzero(guard), soft=True)

    def block_until_ready(self) -> None:
        self.returned()
        for slab in self.slabs:
            self._settle(slab)
        jax.block_until_ready([s.leaves for s in self.slabs])


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_rows(slab_leaves: tuple, rows: tuple, slots: jax.Array) -> tuple:
    return tuple(s.at[slots].set(r.astype(s.dtype)) for s, r in zip(slab_leaves, rows))


def min_budget_from_manifest(manifest: dict) -> tuple[int, int]:
    """(the smallest expert budget in bytes, every routed expert's bytes) of a checkpoint, from its manifest alone
    (`checkpoint.read_manifest`: each tensor's shape, format and bytes), without loading a weight: what
    `dflash-generate --offload` checks `--expert-budget-mb` against before anything heavy runs. The same rule as
    `min_budget_bytes` (one expert of each expert shape); (0, 0) for a target without routed experts."""
    from dflash_jax.models.family import families

    model_type = manifest.get("target_config", {}).get("model_type")
    fam = next((f for f in families() if model_type in f.model_types), None)
    if fam is None:
        return 0, 0
    tensors = manifest["tensors"]["target"]
    layers: dict[str, list] = {}
    for name, info in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2] == "mlp" and parts[3] in fam.expert_fields:
            layers.setdefault(parts[1], []).append((parts[3], info))
    kinds: dict[tuple, int] = {}
    total = 0
    for entries in layers.values():
        entries.sort(key=lambda t: t[0])
        experts = int(entries[0][1]["shape"][0])
        nbytes = sum(int(info["bytes"]) for _, info in entries)
        key = tuple((f, tuple(info["shape"]), info.get("format"), info.get("dtype")) for f, info in entries)
        kinds[key] = max(kinds.get(key, 0), nbytes // max(experts, 1))
        total += nbytes
    return int(sum(kinds.values())), int(total)
