"""What a generation request may ask, checked at the Python boundary, and the shapes it compiles to.

Inputs are validated here, before anything is traced: prompts are sequences of Python or numpy integers
inside the vocabulary (floats, bools and strings are refused with a TypeError, never truncated), budgets
and seeds are integers (numpy integers welcome), stop ids are integers inside the vocabulary. The jitted
functions that run later trust what they are given.

Shapes follow buckets, not requests (`Buckets`): the batch, the prompt length, the output buffer, the
cache length and the stop-id list are rounded up to a few geometric sizes, so requests of one bucket
share one compiled program. What varies inside a bucket (each prompt's length, each sequence's budget,
sampling settings and stop ids) is traced data.

Capacity mode (`Buckets(capacity=N)`, the loops' default): the cache rows, the output buffer and the prompt
buffer are all fixed by N (capped at the target's positions), so every prompt length and budget that fits
(prompt + budget + verify width <= N) runs the same compiled programs; the prefill runs in chunks of
`Buckets.chunk` tokens inside one program, with the number of chunks traced (`spec.prefill.capacity_begin`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np

from dflash_jax.spec.sampling import SamplingParams

INT64 = 2**63


def bucket(n: int, base: int, fine: bool = False) -> int:
    """The smallest size >= n in {base * 2^k} (fine: also {1.5 * base * 2^k} when that is an integer)."""
    if n < 1:
        raise ValueError(f"a bucketed size must be >= 1, got {n}")
    size = base
    while True:
        if size >= n:
            return size
        mid = size * 3 // 2
        if fine and mid * 2 == size * 3 and mid >= n:
            return mid
        size *= 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buckets:
    """The compiled shapes. Every size rounds up to `base * 2^k`; with `fine`, the batch, prompt and cache
    sizes also take the steps `1.5 * base * 2^k` (padding waste <= 1/3 instead of 1/2).

    prompt: smallest prompt-length bucket (the prefill runs on the right-padded bucket).
    output: smallest output-buffer bucket (holds every sequence's budget; budgets are traced).
    cache:  smallest cache-length bucket; cache rows = bucket(prompt bucket + output bucket + block size),
            capped at the target's max_position_embeddings.
    stops:  smallest stop-id list bucket (padded with -1).
    pad_batch: round the batch up (padded sequences are done from the start).
    capacity: None (bucketed shapes, above) or the capacity mode's rows N: cache rows = output-buffer columns
            = min(N, the target's max_position_embeddings) whatever the request, so one compiled program
            serves every prompt length and budget with prompt + budget + verify width <= those rows
            (`prompt`, `output` and `cache` are then unused; the batch and stop-id buckets stay).
    chunk:  capacity mode: prefill tokens per chunk, at most a quarter of the cache rows (the prefill runs
            ceil(prompt / chunk) chunks inside one program).
    grow:   capacity mode: a request past the capacity runs at the next power of two of rows that holds it (one
            more program, up to the target's positions) instead of being refused (the loops' default; an explicit
            capacity, `dflash-generate --capacity N`, refuses).
    floor:  capacity mode: None (every request at the capacity's rows) or F: a request that needs fewer rows runs
            at the smallest power of two >= F that holds it (programs at F, 2F, .. up to the capacity, at most a
            few, each serving every request of its tier). Attention reads a cache's rows (the dense path all of
            them, the chunked path a copy of each live chunk), so a short request in a long cache pays for rows it
            never uses: at 32 rows of the shipped pair, a DFlash round over 256 rows measured 1.2x one over 2048.
    """

    prompt: int = 16
    output: int = 64
    cache: int = 64
    stops: int = 4
    fine: bool = True
    pad_batch: bool = True
    capacity: int | None = None
    chunk: int = 128
    grow: bool = False
    floor: int | None = None

    def __post_init__(self):
        for name in ("prompt", "output", "cache", "stops", "chunk") + tuple(
                n for n in ("capacity", "floor") if getattr(self, n) is not None):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Buckets.{name} must be a positive integer, got {value!r}")

    @property
    def fixed(self) -> bool:
        """Capacity mode: every shape but the batch (and the stop-id list) is fixed by `capacity`."""
        return self.capacity is not None

    def capacity_rows(self, max_positions: int, need: int = 0) -> int:
        """Capacity mode: the cache rows (= output-buffer columns), the capacity capped at the target's positions;
        with `grow`, the next power of two holding `need` rows when the capacity does not."""
        if self.capacity is None:
            raise ValueError("capacity_rows needs a capacity (Buckets(capacity=N))")
        rows = min(int(self.capacity), int(max_positions))
        if self.floor is not None and need <= rows:  # the smallest tier that holds the request
            rows = min(rows, bucket(max(need, 1), int(self.floor)))
        if self.grow and rows < need <= max_positions:
            rows = need_capacity(need, max_positions)
        return rows

    def prompt_buffer(self, rows: int) -> int:
        """Capacity mode: the prompt buffer's columns for `rows` cache rows, whole chunks (the prefill reads the
        buffer chunk by chunk; rows past the cache are never written)."""
        chunk = self.chunk_len(rows)
        return -(-rows // chunk) * chunk

    def chunk_len(self, rows: int) -> int:
        """Capacity mode: prefill tokens per chunk for `rows` cache rows: `chunk`, at most a quarter of the rows. A
        chunk computes all its columns, so a small tier's prompts (short, or they would not fit it) take narrower
        chunks: a 64-token prompt in the 256-row tier prefills one chunk of 64, not one of 128 half padding."""
        return max(1, min(int(self.chunk), rows // 4))

    def batch_size(self, n: int) -> int:
        return bucket(n, 1, self.fine) if self.pad_batch else n

    def prompt_len(self, n: int) -> int:
        return bucket(n, self.prompt, self.fine)

    def output_len(self, n: int) -> int:
        return bucket(n, self.output)

    def cache_len(self, n: int) -> int:
        return bucket(n, self.cache, self.fine)

    def stops_len(self, n: int) -> int:
        return bucket(max(n, 1), self.stops)


DEFAULT_BUCKETS = Buckets()
DEFAULT_CAPACITY = 2048  # the loops' capacity (capped at the target's positions): `Buckets(capacity=...)`


def capacity_error(need: int, capacity: int, max_positions: int, what: str) -> ValueError:
    """The one message for a request that does not fit a capacity: what it needs and how to raise it."""
    if need > max_positions:  # the target's positions are the limit, not the capacity
        return ValueError(f"{what} needs {need} cache rows, more than the target's {max_positions} positions: "
                          f"shorten the prompt or lower max_new_tokens")
    return ValueError(f"{what} needs {need} cache rows, more than the capacity {capacity}: raise it with "
                      f"buckets=Buckets(capacity={need_capacity(need, max_positions)}) (dflash-generate "
                      f"--capacity {need_capacity(need, max_positions)}; at most the target's {max_positions} "
                      f"positions), or shorten the request")


def need_capacity(need: int, max_positions: int) -> int:
    """A capacity that holds `need` rows: the next power of two, capped at the target's positions."""
    return min(bucket(need, 1), max_positions)


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------

def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_int(value, name: str, *, low: int | None = None, high: int | None = None, what: str = "an integer") -> int:
    """An integer (Python or numpy; not bool, not float) in [low, high); TypeError / ValueError naming `name`."""
    if not is_int(value):
        hint = " (convert it with int() if that is what you mean)" if isinstance(value, (float, np.floating)) else ""
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}{hint}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value >= high):
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def is_sequence(x) -> bool:
    """A sequence or numpy array (one value per row), not a string."""
    return isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, (str, bytes))


def check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
    """Each prompt as an int32 array; a clear TypeError / ValueError naming the prompt otherwise."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of token-id lists, got a string: tokenize it first")
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise TypeError(f"prompts as an array must be 2-D [batch, length], got shape {prompts.shape}")
        prompts = list(prompts)
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if is_int(prompts[0]):
        raise TypeError("prompts must be a list of prompts, each a list of token ids; got one flat list of "
                        "integers: pass [prompt]")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise TypeError(f"prompt {i} is a {type(prompt).__name__}: tokenize it first (a list of token ids)")
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1:
                raise TypeError(f"prompt {i} must be a 1-D sequence of token ids, got shape {prompt.shape}")
            if prompt.dtype.kind not in "iu":
                raise TypeError(f"prompt {i} must hold integer token ids, got dtype {prompt.dtype}")
            arr = prompt.astype(np.int64)
            ids = None
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
            for j, t in enumerate(ids):
                if not is_int(t):
                    hint = " (convert with int() if that is what you mean)" if isinstance(t, (float, np.floating)) \
                        else ""
                    raise TypeError(f"prompt {i}: token {j} must be an integer id, got {type(t).__name__} {t!r}"
                                    f"{hint}")
            arr = None
        else:
            raise TypeError(f"prompt {i} must be a sequence of token ids, got {type(prompt).__name__}")
        n = len(ids) if ids is not None else arr.shape[0]
        if n == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if ids is not None:
            bad = next((int(t) for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
            arr = np.asarray([int(t) for t in ids], np.int64)
        elif arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        out.append(arr.astype(np.int32))
    return out


def pad_prompts(prompts: list[np.ndarray], width: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads checked prompts into [rows, width] int32 (extra rows: the one-token prompt [0])."""
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
        lengths[i] = len(p)
    return tokens, lengths


def check_kept(prompts, kept) -> list[np.ndarray]:
    """Each prompt's kept indices of a compressed prefill (None, or a None entry: every token), checked: strictly
    increasing integers inside the prompt, the last token kept (decoding continues right after it). int32 arrays."""
    if kept is None:
        kept = [None] * len(prompts)
    if not is_sequence(kept) or len(kept) != len(prompts):
        raise ValueError(f"kept must give one index list per prompt ({len(prompts)}), got "
                         f"{len(kept) if is_sequence(kept) else type(kept).__name__}")
    out = []
    for i, (p, k) in enumerate(zip(prompts, kept)):
        n = len(p)
        k = np.arange(n, dtype=np.int64) if k is None else np.asarray(k).reshape(-1)
        if k.size == 0 or not np.issubdtype(k.dtype, np.integer):
            raise ValueError(f"kept[{i}] must be a non-empty list of integer token indices")
        if k[0] < 0 or k[-1] >= n or np.any(np.diff(k) <= 0):
            raise ValueError(f"kept[{i}] must be strictly increasing indices in [0, {n}) (pflash.compress gives them)")
        if k[-1] != n - 1:
            raise ValueError(f"kept[{i}] must keep the prompt's last token ({n - 1}): decoding continues after it")
        out.append(k.astype(np.int32))
    return out


def kept_positions(kept: list[np.ndarray], width: int, rows: int) -> np.ndarray:
    """[rows, width] int32 RoPE positions of right-padded kept tokens: each row's kept indices, its padding
    continuing after the last; rows past `kept` (padding rows) at 0, 1, .."""
    positions = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    for i, k in enumerate(kept):
        positions[i, :len(k)] = k
        positions[i, len(k):] = k[-1] + 1 + np.arange(width - len(k))
    return positions


def extend_positions(positions: np.ndarray, width: int) -> np.ndarray:
    """Positions [b, T] extended to [b, width] (width >= T), each row continuing after its last column."""
    b, t = positions.shape
    return np.concatenate([positions, positions[:, -1:] + 1 + np.arange(width - t, dtype=np.int32)], axis=1)


def per_row(value, n: int, name: str, is_single) -> list:
    """`value` for every one of n sequences: one value shared, or a sequence of n values."""
    if is_single(value):
        return [value] * n
    if not is_sequence(value):
        raise TypeError(f"{name} must be one value or a list of one per prompt, got {type(value).__name__}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one value or one per prompt")
    return value


def check_budgets(max_new_tokens, n: int) -> np.ndarray:
    """Tokens to generate per sequence (the first token included), int32 [n]."""
    values = per_row(max_new_tokens, n, "max_new_tokens", lambda v: not is_sequence(v))
    names = ["max_new_tokens"] * n if not is_sequence(max_new_tokens) else \
        [f"max_new_tokens[{i}]" for i in range(n)]
    return np.array([check_int(v, nm, low=1, high=2**31, what="a positive integer") for v, nm in zip(values, names)],
                    np.int32)


def check_seeds(seed, n: int) -> list[int] | int:
    """One seed (sequence i draws from fold_in(key(seed), i)) or one per sequence."""
    if not is_sequence(seed):
        return check_int(seed, "seed", low=-INT64, high=INT64, what="an integer in [-2**63, 2**63)")
    values = per_row(seed, n, "seed", lambda v: False)
    return [check_int(v, f"seed[{i}]", low=-INT64, high=INT64, what="an integer in [-2**63, 2**63)")
            for i, v in enumerate(values)]


def check_stop_ids(stop_ids, n: int, vocab_size: int) -> list[list[int]]:
    """Stop ids shared by every sequence (a list of ints) or one list per sequence."""
    if stop_ids is None:
        return [[] for _ in range(n)]
    if not is_sequence(stop_ids):
        raise TypeError(f"stop_ids must be a list of token ids (or one list per prompt), "
                        f"got {type(stop_ids).__name__} {stop_ids!r}")
    stop_ids = list(stop_ids)
    nested = bool(stop_ids) and all(is_sequence(s) for s in stop_ids)
    rows = per_row(stop_ids, n, "stop_ids", lambda v: not nested)
    out = []
    for i, row in enumerate(rows):
        ids = []
        for t in row:
            name = f"stop_ids[{i}]" if nested else "stop_ids"
            if is_sequence(t):
                raise TypeError(f"{name} must hold token ids, got a nested {type(t).__name__}")
            ids.append(check_int(t, f"{name} entry", low=0, high=vocab_size,
                                 what=f"a token id in [0, {vocab_size})"))
        out.append(ids)
    return out


def pad_stop_ids(rows: list[list[int]], width: int, total_rows: int) -> np.ndarray:
    out = np.full((total_rows, width), -1, np.int32)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


def check_sampling(sampling, n: int) -> tuple[list[SamplingParams], str]:
    """One `SamplingParams` per sequence and the acceptance method they share (the static part): the mode
    of the sampled sequences ("exact_match" when every sequence is greedy: greedy output is the same
    under both, and exact-match is the cheaper program)."""
    if not isinstance(sampling, SamplingParams) and not is_sequence(sampling):
        raise TypeError(f"sampling must be a SamplingParams (or one per prompt), got {type(sampling).__name__} "
                        f"{sampling!r}")
    rows = per_row(sampling, n, "sampling", lambda v: isinstance(v, SamplingParams))
    for i, s in enumerate(rows):
        if not isinstance(s, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (or one per prompt), got {type(s).__name__} "
                            f"at position {i}")
    modes = {s.mode for s in rows if not s.greedy}
    if len(modes) > 1:
        raise ValueError("sampled sequences of one batch must share one acceptance mode, got "
                         f"{sorted(modes)}: run them in separate batches")
    return rows, (modes.pop() if modes else "exact_match")

