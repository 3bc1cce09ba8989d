"""`dflash_jax.generate`: one entry for research code, any proposer on any expert placement.

  res = dflash_jax.generate(pair, prompts, max_new_tokens=64)                              # argmax chain, jit loop
  res = dflash_jax.generate(pair, prompts, max_new_tokens=64, proposer="tree", tree_budget=16)
  res = dflash_jax.generate(pair, prompts, max_new_tokens=64, proposer="head-chain", experts="offload",
                            expert_budget_mb=8)

The same three seams as everywhere else: the proposer (`spec.round`), the placement of the target's experts
(resident on the device, or offloaded to host memory behind a device cache, `dflash_jax.offload`) and the driver
(`jit`: one compiled while-loop; `stepping`: a Python loop, one jitted propose and one verify+commit per round).
`CAPABILITIES` is the one table of what combines; the CLIs and the docs read it.
"""

from __future__ import annotations

PROPOSERS = ("chain", "head-chain", "selector", "tree", "adaptive")
EXPERTS = ("device", "offload")
DRIVERS = ("jit", "stepping")

# (proposer, experts, driver) -> None when it runs, else why not (one line naming the flag). Every proposer runs on
# every placement; offloaded experts are fetched between layers from Python, so that placement steps.
CAPABILITIES = {
    (p, e, d): (None if e == "device" or d == "stepping" else
                "offloaded experts are fetched layer by layer from the host between jitted pieces: use the stepping "
                "driver (--loop python) with --experts offload")
    for p in PROPOSERS for e in EXPERTS for d in DRIVERS
}


def check_combination(proposer: str, experts: str, driver: str) -> None:
    """ValueError naming the cause when this combination cannot run (`CAPABILITIES`)."""
    for name, value, allowed in (("proposer", proposer, PROPOSERS), ("experts", experts, EXPERTS),
                                 ("driver", driver, DRIVERS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    why = CAPABILITIES[(proposer, experts, driver)]
    if why is not None:
        raise ValueError(why)


def default_proposer(pair) -> str:
    """The proposer a pair runs when none is named: "selector" for a DFlash 2 draft (its candidate selector's
    chain, as z-lab's `dflash_generate` proposes), else "chain" (the draft's argmax chain, DFlash)."""
    return "selector" if getattr(getattr(pair, "draft_cfg", None), "dflash2", False) else "chain"


def make_proposer(pair, proposer=None, *, tree_budget: int = 16, tree_branch: int | None = None,
                  branch_head: bool = True, calibration="pair"):
    """The round's proposer object from a name ("chain", "head-chain", "selector", "tree", "adaptive"; None: the
    pair's `default_proposer`) or an object (`spec.round.Chain`, `spec.tree.TreeShape`,
    `spec.policy.AdaptivePolicy`), returned as is.

    "selector" is a DFlash 2 draft's selector chain: the chain from the draft's conditional head, which for a
    DFlash 2 draft is its candidate selector (`models.draft.SelectorWeights`), i.e. `Chain(head=True)`
    ("head-chain" on a DFlash 2 draft is the same proposer). Trees of a DFlash 2 draft rank each node's children
    by the selector's transition scores."""
    from dflash_jax.models.draft import is_selector
    from dflash_jax.spec.loop import tree_plan
    from dflash_jax.spec.policy import AdaptivePolicy
    from dflash_jax.spec.round import Chain
    from dflash_jax.spec.tree import DEFAULT_BRANCH, TreeShape

    if isinstance(proposer, (Chain, TreeShape, AdaptivePolicy)):
        return proposer
    if proposer is None:
        proposer = default_proposer(pair)
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)} (or a Chain / TreeShape / AdaptivePolicy), "
                         f"got {proposer!r}")
    if proposer == "chain":
        return Chain()
    if proposer == "selector":
        if not is_selector(getattr(pair.draft, "branch_head", None)):
            raise ValueError("the selector proposer needs a DFlash 2 draft (DFlash2DraftModel, with a candidate "
                             "selector), and this pair's draft is a DFlash 1 draft: use the chain (or head-chain with "
                             "a branch head), or convert a DFlash 2 pair")
        return Chain(head=True)
    if proposer == "head-chain":
        return Chain(head=True)
    return tree_plan(pair, tree_budget=tree_budget, branch=DEFAULT_BRANCH if tree_branch is None else tree_branch,
                     calibration=calibration, adaptive=proposer == "adaptive", branch_head=branch_head)


def _name(proposer) -> str:
    from dflash_jax.spec.policy import AdaptivePolicy
    from dflash_jax.spec.round import Chain

    if isinstance(proposer, str):
        return proposer
    if isinstance(proposer, AdaptivePolicy):
        return "adaptive"
    if isinstance(proposer, Chain):
        return "head-chain" if proposer.head else "chain"
    return "chain" if proposer.is_chain else "tree"


def generate(pair, prompts, *, max_new_tokens, proposer=None, experts: str = "device", driver: str | None = None,
             block_size: int | None = None, sampling=None, stop_ids=(), seed=0, tree_budget: int = 16,
             tree_branch: int | None = None, expert_budget_mb: float | None = None, buckets=None,
             warmup: bool = False, trace: bool = False, kept=None, compact="auto", lanes="auto", **offload_options):
    """Lossless speculative generation of `prompts` (token id lists) on `pair` (`dflash_jax.load`); returns a
    `spec.loop.GenerationResult` (tokens, acceptance lengths, stats).

    proposer: "chain" (the draft's argmax chain, DFlash), "head-chain" (the branch head's chain), "selector" (a DFlash
    2 draft's selector chain), "tree" (a token tree of `tree_budget` nodes, `tree_branch` candidates each),
    "adaptive" (the shape chosen per round), a proposer object, or None: the pair's `default_proposer` (the selector
    chain for a DFlash 2 draft, else the chain). experts: "device" (resident) or "offload" (routed experts in host memory behind a device cache of
    `expert_budget_mb` MB; `offload_options` go to `offload.OffloadedGenerator`: prefetcher, pin, hybrid, ...).
    driver: "jit" or "stepping" (default: jit on the device, stepping when offloaded). max_new_tokens, sampling
    (`spec.SamplingParams`), stop_ids, seed: one value for every prompt or one per prompt. kept: a compressed
    prefill (PFlash, lossy: one kept-index list per prompt, `pflash.compress`), with any proposer, driver and
    placement. compact: the jitted driver's compaction of finished rows (`spec.loop.generate`: "auto", True or
    False); the stepping drivers run every row to the end (only "auto" or False). lanes: the jitted driver's split of
    the rows over a CPU's cores (`spec.lanes`: "auto", or a positive integer); the other drivers run one batch (only
    "auto" or 1)."""
    from dflash_jax.spec.sampling import SamplingParams

    driver = driver or ("jit" if experts == "device" else "stepping")
    if compact is True and driver != "jit":
        raise ValueError("compact=True compacts the jitted driver's batch; the stepping drivers run every row to the "
                         "end: use driver='jit' (device experts) or leave compact at 'auto'")
    if lanes not in ("auto", 1) and driver != "jit":
        raise ValueError(f"lanes={lanes!r} splits the jitted driver's batch over a CPU's cores; the {driver} driver "
                         "runs one batch: use driver='jit' (device experts) or leave lanes at 'auto'")
    proposer = default_proposer(pair) if proposer is None else proposer
    check_combination(_name(proposer), experts, driver)
    prop = make_proposer(pair, proposer, tree_budget=tree_budget, tree_branch=tree_branch)
    request = dict(max_new_tokens=max_new_tokens, sampling=SamplingParams() if sampling is None else sampling,
                   stop_ids=stop_ids, seed=seed, kept=kept)
    if experts == "offload":
        from dflash_jax.offload.loop import OffloadedGenerator

        if expert_budget_mb is None:
            raise ValueError("experts='offload' needs expert_budget_mb (the device expert cache, in MB)")
        gen = OffloadedGenerator(pair, budget_bytes=int(expert_budget_mb * 1e6), block_size=block_size,
                                 proposer=prop, buckets=buckets, **offload_options)
        return gen.generate(prompts, **request)
    if offload_options:
        raise TypeError(f"{', '.join(sorted(offload_options))}: offload options need experts='offload'")
    from dflash_jax.spec.loop import generate as jit_generate, generate_stepping

    if driver == "jit":
        if trace:
            raise ValueError("a per-round trace needs the stepping driver (driver='stepping')")
        return jit_generate(pair, prompts, proposer=prop, block_size=block_size, warmup=warmup, buckets=buckets,
                            compact=compact, lanes=lanes, **request)
    return generate_stepping(pair, prompts, proposer=prop, block_size=block_size, warmup=warmup, buckets=buckets,
                             trace=trace, **request)


__all__ = ["CAPABILITIES", "DRIVERS", "EXPERTS", "PROPOSERS", "check_combination", "default_proposer", "generate",
           "make_proposer"]
