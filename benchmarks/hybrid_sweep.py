"""The hybrid-target sweep: expert budget x speculation on/off x PFlash prefill compression on/off.

  python benchmarks/hybrid_sweep.py [--pair NAME | --checkpoint DIR] [--prompt-len 1024] [--write-docs]

On a shipped pair (default: the Qwen3.5-MoE hybrid pair `tiny_pair_qwen3_5` when it is installed, else the
Qwen3-MoE `tiny_pair`), with long held-out prompts (standard-library files the pair never trained on):

1. Resident (every expert on the device), for PFlash off (the full prefill) and keep ratios 0.5 / 0.25 / 0.1,
   plain greedy decoding (block 1) and DFlash (the draft's block): TTFT (the scorer's pass over the whole prompt +
   the compressed prefill + the first token), decode tokens/s (the tokens after the first over the time after
   it), DFlash acceptance (tokens per round), and quality against the full prefill's plain greedy output:
   agreement of the first `--max-new` (64) greedy tokens (the fraction of equal positions, and the common
   prefix), and exact match on a needle set (a line `secret_token = "<6 random letters>"` planted at 30% depth of
   a held-out window, the prompt ending in the line's start, scored on the value) together with whether the
   selection kept the needle line.
2. Offloaded (`offload.OffloadedGenerator`, experts in host memory, a device expert cache of each budget):
   the same PFlash x speculation grid: TTFT, decode tokens/s and MB moved host -> device, for the prefill (the
   generator streams every expert table through the device, so its traffic does not depend on the prompt; the
   experts the kept tokens route to, the least an on-demand prefill would move, are listed beside it) and for
   the decode. Every offloaded output is checked equal to the resident output of the same configuration.

Every timing is a warm run (compiled shapes), on this machine's shared CPU; ratios compare runs of one process.
PFlash "off" runs the full prefill at explicit positions (every token kept), which tests/pflash show equal to
the plain prefill token for token. Writes hybrid_sweep.{json,md,png} (docs/benchmarks with --write-docs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _output import add_output_args, output_dir  # noqa: E402

KEEPS = (1.0, 0.5, 0.25, 0.1)
HYBRID = "tiny_pair_qwen3_5"
T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _default_pair() -> str:
    import dflash_jax

    pairs = getattr(dflash_jax, "SHIPPED_PAIRS", {})
    path = pairs.get(HYBRID)
    return HYBRID if path and os.path.exists(os.path.join(path, "manifest.json")) else "tiny_pair"


def agreement(tokens, ref) -> tuple[float, int]:
    """(fraction of the reference's positions with the same token, common prefix length)."""
    n = len(ref)
    same = sum(1 for a, b in zip(tokens, ref) if a == b)
    prefix = 0
    for a, b in zip(tokens, ref):
        if a != b:
            break
        prefix += 1
    return same / n, prefix


def needle_set(pair, tok, n: int, length: int, seed: int = 1):
    """[(prompt ids, answer ids, needle span)]: a secret planted at 30% depth of a held-out window."""
    from dflash_jax.train.data import file_windows

    rng = random.Random(seed)
    out = []
    for hay in file_windows(pair, "held_out", n, length, seed=seed):
        value = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        needle = tok.encode(f'\n    secret_token = "{value}"\n', add_special_tokens=False).ids
        query = tok.encode('\n    secret_token = "', add_special_tokens=False).ids
        answer = tok.encode(f'{value}"', add_special_tokens=False).ids
        at = int(len(hay) * 0.3)
        out.append((hay[:at] + needle + hay[at:] + query, answer, (at, at + len(needle))))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=None, metavar="NAME",
                   help=f"a shipped pair (default: {HYBRID} when installed, else tiny_pair)")
    p.add_argument("--checkpoint", default=None, help="a convert-weights checkpoint instead of a shipped pair")
    p.add_argument("--prompt-len", type=int, default=1024, help="held-out prompt tokens (capped by the context)")
    p.add_argument("--prompts", type=int, default=2, help="long-form prompts for timing and agreement")
    p.add_argument("--needles", type=int, default=4, help="needle-retrieval prompts")
    p.add_argument("--max-new", type=int, default=64, help="greedy tokens compared with the full prefill's")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (the fastest is kept)")
    p.add_argument("--scorer-layers", type=int, default=None,
                   help="score with the target's first N layers only (default: the whole target)")
    p.add_argument("--budgets", default="0.25,1.0",
                   help="offload budgets as fractions of all expert bytes (comma-separated; '' skips offload)")
    add_output_args(p)
    args = p.parse_args(argv)
    if min(args.prompt_len, args.prompts, args.max_new) < 1 or args.needles < 0:
        p.error("--prompt-len, --prompts and --max-new must be >= 1, --needles >= 0")

    import jax

    import dflash_jax
    from dflash_jax import pflash
    from dflash_jax.cli.generate import UsageError, load_tokenizer, resolve_pair
    from dflash_jax.offload import OffloadedGenerator
    from dflash_jax.spec import Buckets
    from dflash_jax.train.data import file_windows

    name = args.pair if args.checkpoint else (args.pair or _default_pair())
    try:
        directory = resolve_pair(args.checkpoint, None if args.checkpoint else name)
    except UsageError as e:
        raise SystemExit(str(e))
    pair = dflash_jax.load(directory, dequantize_experts="auto")
    tok = load_tokenizer(pair)
    tcfg = pair.target_cfg
    block = pair.draft_cfg.block_size
    n_new = args.max_new
    length = min(args.prompt_len, tcfg.max_position_embeddings - n_new - block - 64)
    prompts = file_windows(pair, "held_out", args.prompts, length)
    needles = needle_set(pair, tok, args.needles, length) if tok is not None and args.needles else []
    buckets = Buckets(cache=2 ** int(np.ceil(np.log2(length + 64 + n_new + block))))
    scorer = pflash.Scorer.from_pair(pair, layers=args.scorer_layers)
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    _log(f"pair {name or directory}: {tcfg.model_type}, {tcfg.num_layers} layers, block {block}; scorer {scorer.name}; "
         f"{len(prompts)} prompts of {length} tokens, {len(needles)} needles, {n_new} new tokens; "
         f"offload budgets {budgets}")

    def compress(prompt, keep, timed=True):
        kept = pflash.compress(scorer, prompt, keep_ratio=keep)  # compiles the scorer's bucket once
        best = float("inf")
        for _ in range(args.repeats if timed else 0):
            t = time.perf_counter()
            kept = pflash.compress(scorer, prompt, keep_ratio=keep)
            best = min(best, time.perf_counter() - t)
        return kept, (best if keep < 1 and timed else 0.0)

    def run(prompt, kept, bs):
        """The fastest of `repeats` warm runs (prefill and decode each at its best)."""
        runs = [pflash.generate(pair, [prompt], [kept], max_new_tokens=n_new, block_size=bs, stop_ids=[],
                                warmup=i == 0, buckets=buckets) for i in range(args.repeats)]
        best = runs[0]
        best.stats["prefill_s"] = min(r.stats["prefill_s"] for r in runs)
        best.stats["decode_s"] = min(r.stats["seconds"] - r.stats["prefill_s"] for r in runs)
        return best

    # ---- 1. resident: quality and speed ----
    resident, refs = [], {}
    for pi, prompt in enumerate(prompts):
        refs[pi] = run(prompt, None, 1).tokens[0]
        for keep in KEEPS:
            kept, score_s = compress(prompt, keep)
            for bs in (1, block):
                r = run(prompt, kept, bs)
                s = r.stats
                decode_s = s["decode_s"]
                agree, prefix = agreement(r.tokens[0], refs[pi])
                row = {"prompt": pi, "prompt_tokens": len(prompt), "keep": keep, "kept_tokens": len(kept),
                       "speculation": bs > 1, "block_size": bs, "score_s": score_s, "prefill_s": s["prefill_s"],
                       "ttft_s": score_s + s["prefill_s"], "decode_tokens_per_s": (len(r.tokens[0]) - 1) / decode_s,
                       "acceptance": s["mean_acceptance"], "agreement": agree, "common_prefix": prefix,
                       "tokens": r.tokens[0]}
                resident.append(row)
                _log(f"resident prompt {pi} keep {keep:4.2f} ({len(kept):4d} kept) B={bs:2d}: TTFT "
                     f"{row['ttft_s'] * 1e3:7.1f} ms, {row['decode_tokens_per_s']:6.1f} tok/s, tau "
                     f"{row['acceptance']:.2f}, agreement {agree:.2f} (prefix {prefix})")
    needle_rows = []
    for ni, (prompt, answer, (lo, hi)) in enumerate(needles):
        for keep in KEEPS:
            kept, _ = compress(prompt, keep, timed=False)
            r = pflash.generate(pair, [prompt], [kept], max_new_tokens=len(answer), block_size=block, stop_ids=[],
                                buckets=buckets)
            needle_rows.append({"needle": ni, "keep": keep, "exact_match": r.tokens[0][:len(answer)] == answer,
                                "needle_kept": bool(set(range(lo, hi)) <= set(kept.tolist()))})
        _log(f"needle {ni}: " + ", ".join(f"keep {x['keep']}: EM {int(x['exact_match'])} kept {int(x['needle_kept'])}"
                                          for x in needle_rows[-len(KEEPS):]))

    # ---- 2. offloaded: traffic and speed under each budget ----
    offloaded = []
    if budgets:
        from dflash_jax.offload.store import HostExpertStore

        host_pair = dflash_jax.load(directory, expert_memory="pinned_host")
        store = HostExpertStore(host_pair.target)
        prompt = prompts[0]
        for frac in budgets:
            for bs in (1, block):
                gen = None
                for keep in KEEPS:
                    kept, score_s = compress(prompt, keep)
                    if gen is None:
                        gen = OffloadedGenerator(host_pair, budget_bytes=int(max(frac * store.total_bytes, 1)),
                                                 prefetcher="draft_router" if bs > 1 else "none", block_size=bs,
                                                 buckets=buckets, store=store)
                    warm = gen.prefill([prompt], max_new_tokens=n_new, stop_ids=[], kept=[kept])
                    if not warm.done:
                        gen.round(warm)  # compiles this prefill's shapes and a round
                    del warm
                    session = gen.prefill([prompt], max_new_tokens=n_new, stop_ids=[], kept=[kept])
                    while not session.done:
                        gen.round(session)
                    r = gen.result(session)
                    s, off = r.stats, r.stats["offload"]
                    same = next(x for x in resident if x["prompt"] == 0 and x["keep"] == keep and x["block_size"] == bs)
                    decode_s = s["seconds"] - s["time_split"]["prefill_s"]
                    moved = s["route_ahead"]["summary"]["bytes_moved"]
                    row = {"budget_fraction": frac, "budget_mb": off["budget_bytes"] / 1e6, "keep": keep,
                           "kept_tokens": len(kept), "speculation": bs > 1, "block_size": bs,
                           "ttft_s": score_s + s["time_split"]["prefill_s"],
                           "decode_tokens_per_s": (len(r.tokens[0]) - 1) / decode_s, "acceptance": s["mean_acceptance"],
                           "prefill_streamed_mb": off["prefill_bytes"] / 1e6,
                           "prefill_routed_mb": off["prefill_routed_bytes"] / 1e6,
                           "decode_mb_moved": moved / 1e6, "decode_mb_per_token": moved / 1e6 / len(r.tokens[0]),
                           "lossless_vs_resident": r.tokens[0] == same["tokens"]}
                    offloaded.append(row)
                    _log(f"offload {frac:.2f} of experts ({row['budget_mb']:.3f} MB) B={bs:2d} keep {keep:4.2f}: TTFT "
                         f"{row['ttft_s'] * 1e3:7.1f} ms, {row['decode_tokens_per_s']:6.1f} tok/s, prefill routed "
                         f"{row['prefill_routed_mb']:.3f} MB, decode {row['decode_mb_moved']:.3f} MB, lossless "
                         f"{row['lossless_vs_resident']}")

    result = summarize(name or directory, scorer.name, pair, length, n_new, resident, needle_rows, offloaded)
    out = output_dir(args)
    with open(os.path.join(out, "hybrid_sweep.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out, "hybrid_sweep.md"), "w") as fh:
        fh.write(markdown(result))
    plotted = plot(result, os.path.join(out, "hybrid_sweep.png"))
    _log(f"wrote {out}/hybrid_sweep.json, .md{', .png' if plotted else ''}")
    print(result["recommendation"])
    return 0


def summarize(name, scorer_name, pair, length, n_new, resident, needle_rows, offloaded) -> dict:
    """Per (keep, speculation) means over the prompts, the needle scores, and the recommendation."""
    grid = []
    for keep in KEEPS:
        for spec in (False, True):
            rows = [r for r in resident if r["keep"] == keep and r["speculation"] == spec]
            needles = [x for x in needle_rows if x["keep"] == keep]
            grid.append({
                "keep": keep, "speculation": spec, "kept_tokens": float(np.mean([r["kept_tokens"] for r in rows])),
                "ttft_ms": 1e3 * float(np.mean([r["ttft_s"] for r in rows])),
                "score_ms": 1e3 * float(np.mean([r["score_s"] for r in rows])),
                "prefill_ms": 1e3 * float(np.mean([r["prefill_s"] for r in rows])),
                "decode_tokens_per_s": float(np.mean([r["decode_tokens_per_s"] for r in rows])),
                "acceptance": float(np.mean([r["acceptance"] for r in rows])),
                "agreement": float(np.mean([r["agreement"] for r in rows])),
                "common_prefix": float(np.mean([r["common_prefix"] for r in rows])),
                "needle_exact_match": float(np.mean([x["exact_match"] for x in needles])) if needles else None,
                "needle_kept": float(np.mean([x["needle_kept"] for x in needles])) if needles else None,
                "lossless_vs_plain_same_keep": all(
                    a["tokens"] == b["tokens"] for a in rows for b in resident
                    if b["prompt"] == a["prompt"] and b["keep"] == keep and not b["speculation"]),
            })
    full = {g["speculation"]: g for g in grid if g["keep"] == 1.0}
    for g in grid:
        base = full[False]
        g["ttft_vs_full"] = g["ttft_ms"] / base["ttft_ms"]
        g["prefill_vs_full"] = g["prefill_ms"] / base["prefill_ms"]
        g["decode_vs_plain"] = g["decode_tokens_per_s"] / next(
            x for x in grid if x["keep"] == g["keep"] and not x["speculation"])["decode_tokens_per_s"]
    spec_gain = full[True]["decode_tokens_per_s"] / full[False]["decode_tokens_per_s"]
    good = [g for g in grid if g["speculation"] and g["keep"] < 1 and g["agreement"] >= 0.9]
    lines = [f"Speculation: DFlash decodes {spec_gain:.2f}x plain greedy with the full prefill "
             f"({'on' if spec_gain > 1 else 'off'} recommended; output identical)."]
    if good:
        best = min(good, key=lambda g: g["keep"])
        lines.append(f"PFlash: keep ratio {best['keep']} keeps {best['agreement']:.0%} agreement with the target's "
                     f"prefill at {best['prefill_vs_full']:.2f}x and TTFT (scorer included) at "
                     f"{best['ttft_vs_full']:.2f}x the full prefill's.")
    else:
        mild = next(g for g in grid if g["speculation"] and g["keep"] == 0.5)
        lines.append(f"PFlash: no keep ratio below 1 keeps 90% agreement with the full prefill on this pair "
                     f"(keep 0.5: {mild['agreement']:.0%} agreement, common prefix {mild['common_prefix']:.1f} tokens; "
                     f"target prefill {mild['prefill_vs_full']:.2f}x, TTFT with the scorer {mild['ttft_vs_full']:.2f}x "
                     f"the full prefill's): keep PFlash off (keep 1) where output quality matters; it pays only with a "
                     f"scorer much cheaper than the target and where divergence from the full prefill is acceptable.")
    if offloaded:
        fracs = sorted({o["budget_fraction"] for o in offloaded})
        best = max((o for o in offloaded if o["keep"] == 1.0), key=lambda o: o["decode_tokens_per_s"])
        lines.append(f"Offload: best full-prefill decode at {best['budget_fraction']:.2f} of the expert bytes with "
                     f"speculation {'on' if best['speculation'] else 'off'} ({best['decode_tokens_per_s']:.1f} tok/s, "
                     f"{best['decode_mb_per_token']:.3f} MB/token); budgets swept {fracs}.")
    rec = " ".join(lines)
    cfg = pair.target_cfg
    return {"pair": name, "scorer": scorer_name, "target": {"model_type": cfg.model_type, "layers": cfg.num_layers,
                                     "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                                     "max_positions": cfg.max_position_embeddings},
            "block_size": pair.draft_cfg.block_size, "prompt_tokens": length, "new_tokens": n_new,
            "grid": grid, "needles": needle_rows, "offloaded": offloaded,
            "resident": [{k: v for k, v in r.items() if k != "tokens"} for r in resident],
            "speculation_speedup_full_prefill": spec_gain, "recommendation": rec}


def markdown(r: dict) -> str:
    t = r["target"]
    lines = [
        "# Hybrid sweep: expert budget x speculation x PFlash",
        "",
        f"`python benchmarks/hybrid_sweep.py --write-docs` on the shipped pair `{r['pair']}` ({t['model_type']}, "
        f"{t['layers']} layers, {t['experts']} experts top-{t['top_k']}, draft block {r['block_size']}): held-out "
        f"prompts of {r['prompt_tokens']} tokens, {r['new_tokens']} greedy tokens, scorer `{r['scorer']}`. CPU, a "
        "shared machine: absolute times are this machine's (best of the repeats); compare rows of one run.",
        "",
        f"**Recommended configuration.** {r['recommendation']}",
        "",
        "## Resident experts: quality and speed by keep ratio",
        "",
        "Agreement: fraction of the first greedy tokens equal to the full prefill's plain greedy output (and the "
        "common prefix). Needle: exact match of a planted secret (and how often the selection kept its line). "
        "TTFT includes the scorer's pass over the whole prompt.",
        "",
        "| keep | kept tokens | speculation | scorer ms | target prefill ms (vs full) | TTFT ms (vs full) | "
        "decode tok/s | vs plain | tau | agreement | common prefix | needle EM | needle kept | DFlash = plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in r["grid"]:
        em = "-" if g["needle_exact_match"] is None else f"{g['needle_exact_match']:.2f}"
        nk = "-" if g["needle_kept"] is None else f"{g['needle_kept']:.2f}"
        lines.append(
            f"| {g['keep']} | {g['kept_tokens']:.0f} | {'DFlash' if g['speculation'] else 'plain'} | "
            f"{g['score_ms']:.1f} | {g['prefill_ms']:.1f} ({g['prefill_vs_full']:.2f}) | {g['ttft_ms']:.1f} "
            f"({g['ttft_vs_full']:.2f}) | {g['decode_tokens_per_s']:.1f} | "
            f"{g['decode_vs_plain']:.2f} | {g['acceptance']:.2f} | {g['agreement']:.2f} | {g['common_prefix']:.1f} | "
            f"{em} | {nk} | {'yes' if g['lossless_vs_plain_same_keep'] else 'NO'} |")
    if r["offloaded"]:
        lines += [
            "",
            "## Offloaded experts: traffic and speed by budget",
            "",
            "Prefill streamed: the offloaded prefill streams every expert table through the device once, whatever "
            "the prompt; prefill routed: the experts the (kept) prompt tokens route to, the least an on-demand prefill "
            "would move. Decode MB: host -> device expert bytes of all rounds.",
            "",
            "| budget (of all experts) | MB | speculation | keep | kept | TTFT ms | decode tok/s | tau | prefill "
            "streamed MB | prefill routed MB | decode MB | MB/token | = resident |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for o in r["offloaded"]:
            lines.append(
                f"| {o['budget_fraction']:.2f} | {o['budget_mb']:.3f} | {'DFlash' if o['speculation'] else 'plain'} | "
                f"{o['keep']} | {o['kept_tokens']} | {o['ttft_s'] * 1e3:.1f} | {o['decode_tokens_per_s']:.1f} | "
                f"{o['acceptance']:.2f} | {o['prefill_streamed_mb']:.3f} | {o['prefill_routed_mb']:.3f} | "
                f"{o['decode_mb_moved']:.3f} | {o['decode_mb_per_token']:.4f} | "
                f"{'yes' if o['lossless_vs_resident'] else 'NO'} |")
    lines += ["", "![quality and TTFT by keep ratio; decode by budget](hybrid_sweep.png)", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for spec, style in ((False, "o--"), (True, "s-")):
        rows = [g for g in r["grid"] if g["speculation"] == spec]
        label = "DFlash" if spec else "plain"
        a.plot([g["keep"] for g in rows], [g["agreement"] for g in rows], style, label=f"agreement ({label})")
        b.plot([g["keep"] for g in rows], [g["ttft_ms"] for g in rows], style, label=f"TTFT ({label})")
    rows = [g for g in r["grid"] if g["speculation"]]
    if rows[0]["needle_kept"] is not None:
        a.plot([g["keep"] for g in rows], [g["needle_kept"] for g in rows], "^:", label="needle line kept")
        a.plot([g["keep"] for g in rows], [g["needle_exact_match"] for g in rows], "v:", label="needle exact match")
    a.set_xlabel("PFlash keep ratio")
    a.set_ylabel("vs the full prefill")
    a.set_ylim(-0.05, 1.05)
    a.legend(fontsize="small")
    b.set_xlabel("PFlash keep ratio")
    b.set_ylabel("time to first token (ms, scorer included)")
    b.set_ylim(bottom=0)
    b.legend(fontsize="small")
    for spec, keep, style in ((False, 1.0, "o--"), (True, 1.0, "s-"), (True, 0.25, "s:")):
        rows = [o for o in r["offloaded"] if o["speculation"] == spec and o["keep"] == keep]
        if rows:
            c.plot([o["budget_fraction"] for o in rows], [o["decode_tokens_per_s"] for o in rows], style,
                   label=f"{'DFlash' if spec else 'plain'}, keep {keep}")
    c.set_xlabel("expert cache budget (fraction of all expert bytes)")
    c.set_ylabel("decode tokens/s (offloaded)")
    c.set_ylim(bottom=0)
    c.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
