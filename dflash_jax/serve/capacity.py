"""How many slots and how long a prompt the memory of the serving device holds for a pair (`dflash-serve`'s defaults).

A slot costs what its rows of the batched state cost: the target's cache rows (KV buffers of every attention layer,
for the hybrid family its Gated DeltaNet state, conv tail and the verify's replay rows) and the draft's context rows,
both at the engine's cache length, plus the output buffer; and, while serving, the same again for the rows a fork of
`n` samples builds beside the state, and one verify's fp32 logits (width x vocabulary, with its log-softmax). Beyond
the slots the engine holds a prefill group (4 rows), a prompt in chunked prefill and its snapshot copy (2 rows), and
the prefix cache's pool. The weights are already loaded when this is computed: what the device (or the process's
CPU budget) has left excludes them.

The budget: on an accelerator, `HEADROOM` of the device's free memory (`memory_stats`: bytes_limit - bytes_in_use); on
the CPU, `CPU_FRACTION` of the machine's available RAM (MemAvailable), with the slots also capped at
`CPU_SLOTS_PER_CORE` per core (a CPU round computes its rows on the host's cores: past that, more slots only lengthen
rounds). Slots are capped at `MAX_SLOTS` everywhere (vLLM's default `max_num_seqs`).

Defaults: the prompt length is the target's context (less the verify after it); when fewer than `MIN_SLOTS` slots
fit at that length it halves until they do. The slots are then as many as fit. An explicit slot count or prompt length
is kept, and the other one is fitted to it; both explicit and not fitting is a `CapacityError` naming the numbers.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from dflash_jax.spec import requests as rq

HEADROOM = 0.9  # of an accelerator's free memory (the rest: XLA's scratch, fragmentation)
CPU_FRACTION = 0.5  # of the machine's available RAM for the CPU backend (other processes share it)
CPU_SLOTS_PER_CORE = 8
MAX_SLOTS = 256
MIN_SLOTS = 4  # the default prompt length shrinks (halving) until at least this many slots fit
EXTRA_ROWS = 6  # a prefill group of 4 rows, a prompt in chunked prefill and its prefix-cache snapshot copy
LOGIT_COPIES = 3  # a verify's fp32 logits, their log-softmax and the committed log-probs' top-k work


class CapacityError(ValueError):
    """The requested slots and prompt length do not fit the memory budget (the message names both and the fix)."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """The bytes the engine may use beyond the loaded weights, and where the number comes from."""

    bytes: int
    source: str  # e.g. "90% of 140.1 GB free on cuda:0" / "50% of 22.3 GB available RAM"
    cpu: bool
    cores: int = 1


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The plan: `slots` rows of prompts up to `max_prompt_len` tokens, and what it was derived from."""

    slots: int
    max_prompt_len: int
    max_len: int  # cache rows per slot
    row_bytes: int  # one slot's state rows (target cache + draft context + output)
    target_row_bytes: int
    draft_row_bytes: int
    verify_bytes: int  # per slot: one verify's logits work
    pool_bytes: int  # the prefix cache's budget
    expert_cache_bytes: int  # an offloaded engine's device expert cache (0: resident)
    weights_bytes: int
    budget: Budget
    cap: int  # the slot cap that applied (MAX_SLOTS, or the CPU's per-core cap)
    slots_given: bool = False
    prompt_given: bool = False
    halved: bool = False  # the default prompt length was shortened below the context to fit MIN_SLOTS

    @property
    def slot_bytes(self) -> int:
        """What one more slot costs: its rows twice (the state, a fork's rows) and its verify's logits."""
        return 2 * self.row_bytes + self.verify_bytes

    @property
    def used_bytes(self) -> int:
        return (self.slots * self.slot_bytes + EXTRA_ROWS * self.row_bytes + self.pool_bytes
                + self.expert_cache_bytes)

    def describe(self) -> str:
        """One line: the numbers and how they were derived."""
        mb = lambda b: f"{b / 1e6:.1f} MB" if b >= 1e7 else f"{b / 1e6:.3g} MB"  # noqa: E731
        how = []
        how.append("--slots" if self.slots_given else f"as many as fit, at most {self.cap}")
        how.append("--max-prompt-len" if self.prompt_given else "the target's context" +
                   (", halved until enough slots fit" if self.halved else ""))
        expert = f" + expert cache {mb(self.expert_cache_bytes)}" if self.expert_cache_bytes else ""
        return (f"capacity: {self.slots} slots x prompts up to {self.max_prompt_len} tokens ({self.max_len} cache rows"
                f" per slot; slots: {how[0]}; prompt length: {how[1]}): a slot costs {mb(self.slot_bytes)} "
                f"(target cache {mb(self.target_row_bytes)} + draft context {mb(self.draft_row_bytes)} per row, twice "
                f"for a fork of n samples, + verify logits {mb(self.verify_bytes)}); {EXTRA_ROWS} rows of prefill, "
                f"prefix-cache pool {mb(self.pool_bytes)}{expert}; uses {mb(self.used_bytes)} of "
                f"{mb(self.budget.bytes)} ({self.budget.source}); weights {mb(self.weights_bytes)} already loaded")


def memory_budget(device=None) -> Budget:
    """The bytes an engine may allocate on `device` (default: the first device) beyond what is in use now."""
    device = jax.devices()[0] if device is None else device
    stats = None
    if device.platform != "cpu":
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without memory statistics: treated as the host's memory
            stats = None
    if stats and stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return Budget(bytes=int(HEADROOM * free), source=f"{HEADROOM:.0%} of {free / 1e9:.1f} GB free on {device}",
                      cpu=False)
    available = host_available_bytes()
    return Budget(bytes=int(CPU_FRACTION * available),
                  source=f"{CPU_FRACTION:.0%} of {available / 1e9:.1f} GB available RAM", cpu=True,
                  cores=os.cpu_count() or 1)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory (sysconf), else 4 GB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def _tree_bytes(tree) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def row_bytes(pair, max_len: int, verify_width: int, output_len: int) -> tuple[int, int]:
    """(target cache bytes, draft context bytes + output row) of one slot at `max_len` cache rows (shapes only:
    nothing is allocated)."""
    from dflash_jax.models import draft as draft_model
    from dflash_jax.spec.session import init_target_cache

    tcfg, dcfg = pair.target_cfg, pair.draft_cfg
    dtype = pair.target.embed.dtype
    target = _tree_bytes(jax.eval_shape(lambda: init_target_cache(tcfg, 1, max_len, dtype,
                                                                  verify_width=verify_width)))
    draft = _tree_bytes(jax.eval_shape(lambda: draft_model.init_draft_cache(dcfg, 1, max_len, dtype)))
    return target, draft + 4 * output_len


def plan(pair, *, widest: int, max_new_tokens: int, prefix_cache_bytes: int = 0, expert_cache_bytes: int = 0,
         slots: int | None = None, max_prompt_len: int | None = None, budget: Budget | None = None,
         buckets: rq.Buckets | None = None) -> Capacity:
    """The slots and prompt length for `pair` (module docstring). widest: the widest verify (the block, or a tree's
    budget); slots / max_prompt_len: given values (kept; the other fitted to them)."""
    buckets = rq.DEFAULT_BUCKETS if buckets is None else buckets
    budget = memory_budget() if budget is None else budget
    tcfg = pair.target_cfg
    max_pos = int(tcfg.max_position_embeddings)
    context_prompt = max_pos - 1 - int(widest)
    if context_prompt < 1:
        raise CapacityError(f"the target's context ({max_pos} positions) leaves no room for a prompt and a verify of "
                            f"{widest} rows: lower --block-size")
    output_len = buckets.output_len(int(max_new_tokens))
    vocab = int(tcfg.vocab_size)
    weights = _tree_bytes(pair.target) + _tree_bytes(pair.draft)
    cap = MAX_SLOTS if not budget.cpu else min(MAX_SLOTS, CPU_SLOTS_PER_CORE * max(1, budget.cores))
    verify = LOGIT_COPIES * 4 * int(widest) * vocab

    def shape(prompt: int) -> tuple[int, int, int]:
        length = min(buckets.cache_len(buckets.prompt_len(prompt) + output_len + int(widest)), max_pos)
        t, d = row_bytes(pair, length, int(widest), output_len)
        return length, t, d

    def fits(prompt: int) -> tuple[int, int, int, int]:
        length, t, d = shape(prompt)
        row = t + d
        left = budget.bytes - EXTRA_ROWS * row - int(prefix_cache_bytes) - int(expert_cache_bytes)
        return max(0, left // (2 * row + verify)), length, t, d

    def result(n: int, prompt: int, length: int, t: int, d: int) -> Capacity:
        fitted = int(prompt) if max_prompt_len is not None else int(min(prompt, length - int(widest) - 1))
        return Capacity(slots=int(n), max_prompt_len=fitted, max_len=length,
                        row_bytes=t + d, target_row_bytes=t, draft_row_bytes=d, verify_bytes=verify,
                        pool_bytes=int(prefix_cache_bytes), expert_cache_bytes=int(expert_cache_bytes),
                        weights_bytes=weights, budget=budget, cap=cap, slots_given=slots is not None,
                        prompt_given=max_prompt_len is not None, halved=prompt < context_prompt)

    if max_prompt_len is not None:
        n, length, t, d = fits(int(max_prompt_len))
        if slots is None:
            if n < 1:
                raise CapacityError(f"--max-prompt-len {max_prompt_len} does not fit one slot in {budget.source} "
                                    f"({(2 * (t + d) + verify) / 1e6:.1f} MB a slot after "
                                    f"{(EXTRA_ROWS * (t + d) + prefix_cache_bytes + expert_cache_bytes) / 1e6:.1f} MB "
                                    "of prefill rows and caches): lower --max-prompt-len or --prefix-cache-mb")
            return result(min(n, cap), int(max_prompt_len), length, t, d)
        if n < slots:
            raise CapacityError(f"--slots {slots} with --max-prompt-len {max_prompt_len} does not fit: "
                                f"{budget.source} holds {n} such slots ({(2 * (t + d) + verify) / 1e6:.1f} MB each); "
                                "lower --slots or --max-prompt-len (or leave one of them out to have it fitted)")
        return result(int(slots), int(max_prompt_len), length, t, d)
    want = MIN_SLOTS if slots is None else int(slots)
    prompt = context_prompt
    while True:
        n, length, t, d = fits(prompt)
        if n >= want or prompt <= 1:
            break
        prompt = max(1, prompt // 2)
    if n < want:
        if slots is not None:
            raise CapacityError(f"--slots {slots} does not fit even with 1-token prompts: {budget.source} holds {n} "
                                "slots; lower --slots (or --prefix-cache-mb)")
        if n < 1:
            raise CapacityError(f"not one slot fits in {budget.source}: lower --prefix-cache-mb or --max-new-tokens, "
                                "or free memory")
    return result(int(slots) if slots is not None else min(n, cap), prompt, length, t, d)


__all__ = ["Budget", "Capacity", "CapacityError", "memory_budget", "host_available_bytes", "plan", "row_bytes",
           "CPU_FRACTION", "CPU_SLOTS_PER_CORE", "HEADROOM", "MAX_SLOTS", "MIN_SLOTS"]
