"""Prefix caching for the serving engine: prefill snapshots at chunk boundaries, reused by later prompts.

A prompt longer than the engine's prefill chunk C is prefilled by chunks (`spec.prefill`). After each chunk that
ends at a boundary k*C inside the prompt, the engine keeps a copy of the one-row partial prefill (the target's KV
rows, for the hybrid family its Gated DeltaNet recurrent state and conv tail, the draft's context rows, the last
logits: everything a cold prefill has at that point) under the hash of the tokens [0, k*C). A later prompt that
starts with the same k*C tokens starts from a copy of it and prefills only the rest, by the same chunks at the same
boundaries: its caches are bit for bit those of a cold prefill, so its output equals the cold one token for token.
A snapshot keeps only the live rows of the KV buffers (`RoundRunner.prefill_snapshot`: cut to the power of two of rows
at or above k*C, a few compiled shapes), so the pool holds prefixes by their length, not the cache's capacity.

The snapshots live in a pool of `budget_bytes` with least-recently-used eviction (a lookup or a store makes an entry
the most recent). Keys chain SHA-256 over the chunks (key_k = H(key_{k-1} || chunk k's ids [|| positions])), so a
prompt's keys cost one pass over it. Host-only: the snapshots are the runner's opaque objects and their sizes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from typing import Any, Sequence

import numpy as np

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # `--prefix-cache-mb 1024`


def prefix_keys(ids: Sequence[int], chunk: int, positions: np.ndarray | None = None) -> list[tuple[int, bytes]]:
    """[(k*chunk, key of ids[:k*chunk])] for every chunk boundary strictly inside the prompt (a prefix that is the
    whole prompt leaves nothing to prefill for the first token's logits, so it is never a key). positions: the
    tokens' RoPE positions when they are not 0, 1, .. (a compressed prefill), hashed with them."""
    ids = np.asarray(ids, np.int32)
    out, h = [], b"dflash-prefix-v1"
    for end in range(chunk, len(ids), chunk):
        part = ids[end - chunk: end].tobytes()
        if positions is not None:
            part += np.asarray(positions[end - chunk: end], np.int32).tobytes()
        h = hashlib.sha256(h + part).digest()
        out.append((end, h))
    return out


@dataclasses.dataclass
class PrefixEntry:
    length: int  # prompt tokens the snapshot holds
    payload: Any  # the runner's snapshot (`RoundRunner.prefill_snapshot`: the live rows)
    nbytes: int


class PrefixCache:
    """Snapshots by prefix key, at most `budget_bytes` of them, least recently used evicted first (thread-safe:
    `/metrics` reads the counters from another thread)."""

    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ValueError(f"the prefix cache budget must be a positive number of bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, PrefixEntry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0
        self.stores = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, keys: list[tuple[int, bytes]]) -> PrefixEntry | None:
        """The entry of the longest cached prefix among `keys` (`prefix_keys`), made the most recent; None."""
        with self._lock:
            for _, key in reversed(keys):
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    return entry
        return None

    def store(self, key: bytes, length: int, payload: Any, nbytes: int) -> bool:
        """Keeps a snapshot (evicting the least recently used until it fits); False when it alone exceeds the
        budget or is already there."""
        with self._lock:
            if key in self._entries or nbytes > self.budget_bytes:
                return False
            while self.bytes + nbytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
                self.evictions += 1
            self._entries[key] = PrefixEntry(length=int(length), payload=payload, nbytes=int(nbytes))
            self.bytes += int(nbytes)
            self.stores += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
