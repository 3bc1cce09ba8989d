"""Which sequences verify this round: a 2-D deficit round robin over {verify tokens, expert bytes}.

A pure function (`schedule`) over plain data, tested on its own. On an MoE target a verify's cost is not its
token count alone: it is the bytes of the union of the experts its rows route to (each routed expert's
weights are read once per round, however many rows route to it). So a round has two budgets, verify tokens
and expert bytes, and a sequence's demand is (its verify width, the experts its drafted block is projected
to route to); the round's byte cost is the bytes of the union over the admitted sequences, and a sequence
admitted after others pays only the bytes it adds to that union (its marginal bytes).

The rule, one round (live sequences in a fixed cyclic order; `pointer` = where the last round's first
admission was):
  1. every live sequence earns a quantum of each resource: (token budget, byte budget) / number live,
     its deficit capped at `cap` (no bursts hoarded while idle) and floored at -`cap`;
  2. deficit pass: visiting the sequences cyclically from the pointer, a sequence is admitted when its
     deficit covers its cost in both dimensions (tokens; marginal bytes) and its cost fits what is left
     of both round budgets; the FIRST sequence whose deficits cover its cost is admitted even when its
     cost alone exceeds a budget (a sequence larger than the budget still runs, alone in its turn);
  3. work-conserving pass: by normalized credit (token deficit / token quantum + byte deficit / byte quantum,
     largest first; ties in the cyclic order), any sequence not yet admitted whose cost fits what is left of
     both budgets is admitted (no capacity stays idle while someone could use it);
  4. if nothing was admitted, the sequence with the largest normalized credit is (every round with a live
     sequence verifies at least one);
  5. admitted sequences pay their cost (tokens, marginal bytes) from their deficits; the pointer moves
     just past the first sequence admitted by the deficit pass (step 2), else it stays.

Guarantees (tested with adversarial mixes): a live sequence's deficits reach any cost <= `cap` within
ceil(cap / quantum) rounds of waiting and only grow while it waits; once they cover its cost, each round
either admits it or admits in step 2 a sequence strictly between the pointer and it, and the pointer then
moves past that one: so it verifies within (number live + ceil(cap_t / q_t) + ceil(cap_b / q_b)) rounds.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Demand:
    """One live sequence's request for this round: its key (stable while it lives), the verify tokens and the
    experts its block is projected to route to (bool [L, E] over the MoE layers)."""

    key: int
    tokens: int
    experts: np.ndarray


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Per-round budgets: verify tokens and expert bytes (None: unlimited)."""

    tokens: int | None = None
    expert_bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """What the scheduler carries between rounds: deficits per sequence key and the cyclic pointer (the
    key the next deficit pass starts at or after)."""

    token_deficit: dict = dataclasses.field(default_factory=dict)
    byte_deficit: dict = dataclasses.field(default_factory=dict)
    pointer: int = -1


@dataclasses.dataclass(frozen=True)
class Decision:
    """The round's admissions (keys, in admission order), what they cost, how each was admitted
    ("deficit" / "work" / "forced") and the next scheduler state."""

    admitted: tuple[int, ...]
    tokens: int
    expert_bytes: float
    how: dict
    state: SchedulerState
    waiting: tuple[int, ...]


def wait_bound(live: int, budgets: Budgets, max_tokens: int, expert_bytes: np.ndarray) -> int:
    """The guarantee above: rounds a sequence may wait at most while `live` sequences (or fewer) share these
    budgets, the widest verify being `max_tokens` (the sum over `live` when the token budget is unlimited)."""
    all_bytes = float(np.asarray(expert_bytes).sum())
    tok = budgets.tokens if budgets.tokens is not None else max_tokens * live
    byte = budgets.expert_bytes if budgets.expert_bytes is not None else all_bytes
    q_t, q_b = max(tok / live, 1.0), max(byte / live, 1.0)
    return live + int(np.ceil(max(max_tokens, q_t) / q_t)) + int(np.ceil(max(all_bytes, q_b) / q_b))


def union_bytes(masks: Sequence[np.ndarray], expert_bytes: np.ndarray) -> float:
    """Bytes of the union of expert sets (bool [L, E] each) under per-(layer, expert) sizes [L, E]."""
    if not masks:
        return 0.0
    union = np.logical_or.reduce(np.stack(masks), axis=0)
    return float(expert_bytes[union].sum())


def schedule(demands: Sequence[Demand], state: SchedulerState, budgets: Budgets, expert_bytes: np.ndarray) -> Decision:
    """One round of the 2-D deficit round robin (see the module docstring). `expert_bytes` [L, E]: the bytes
    each (MoE layer, expert) costs to read. Pure: returns the next state, mutates nothing."""
    expert_bytes = np.asarray(expert_bytes, np.float64)
    keys = sorted(d.key for d in demands)
    if len(set(keys)) != len(keys):
        raise ValueError("schedule: duplicate sequence keys")
    by_key = {d.key: d for d in demands}
    n = len(keys)
    if n == 0:
        return Decision((), 0, 0.0, {}, SchedulerState({}, {}, state.pointer), ())
    all_bytes = float(expert_bytes.sum())
    max_tokens = max(d.tokens for d in demands)
    tok_budget = float(budgets.tokens) if budgets.tokens is not None else float(sum(d.tokens for d in demands))
    byte_budget = float(budgets.expert_bytes) if budgets.expert_bytes is not None else all_bytes
    q_t = max(tok_budget / n, 1.0)
    q_b = max(byte_budget / n, 1.0)
    cap_t = max(float(max_tokens), q_t)
    cap_b = max(all_bytes, q_b)
    dt = {k: min(state.token_deficit.get(k, 0.0) + q_t, cap_t) for k in keys}
    db = {k: min(state.byte_deficit.get(k, 0.0) + q_b, cap_b) for k in keys}

    start = next((i for i, k in enumerate(keys) if k >= state.pointer), 0)
    order = keys[start:] + keys[:start]
    union = np.zeros(expert_bytes.shape, bool)
    used_t, used_b = 0.0, 0.0
    admitted: list[int] = []
    how: dict = {}
    charged: dict = {}
    first_deficit = None

    def marginal(k):
        return float(expert_bytes[by_key[k].experts & ~union].sum())

    def admit(k, kind, extra):
        nonlocal union, used_t, used_b
        union = union | by_key[k].experts
        used_t += by_key[k].tokens
        used_b += extra
        admitted.append(k)
        how[k] = kind
        charged[k] = (by_key[k].tokens, extra)

    for k in order:  # step 2: the deficit pass
        cost_t, cost_b = by_key[k].tokens, marginal(k)
        if dt[k] < cost_t or db[k] < cost_b:
            continue
        fits = used_t + cost_t <= tok_budget and used_b + cost_b <= byte_budget
        if first_deficit is None or fits:
            admit(k, "deficit", cost_b)
            if first_deficit is None:
                first_deficit = k
    credit = {k: dt[k] / q_t + db[k] / q_b for k in keys}  # normalized credit: who has waited most
    by_credit = sorted(order, key=lambda k: -credit[k])  # stable: ties keep the cyclic order
    for k in by_credit:  # step 3: work conserving
        if k in how:
            continue
        cost_t, cost_b = by_key[k].tokens, marginal(k)
        if used_t + cost_t <= tok_budget and used_b + cost_b <= byte_budget:
            admit(k, "work", cost_b)
    if not admitted:  # step 4: progress
        k = by_credit[0]
        admit(k, "forced", marginal(k))
    for k, (cost_t, cost_b) in charged.items():
        dt[k] = max(dt[k] - cost_t, -cap_t)
        db[k] = max(db[k] - cost_b, -cap_b)
    pointer = state.pointer
    if first_deficit is not None:
        later = [k for k in keys if k > first_deficit]
        pointer = later[0] if later else keys[0]
    waiting = tuple(k for k in keys if k not in how)
    return Decision(tuple(admitted), int(used_t), float(expert_bytes[union].sum()), how,
                    SchedulerState(dt, db, pointer), waiting)
