"""The hybrid-target sweep: expert budget x speculation on/off x PFlash prefill compression on/off.

  python benchmarks/hybrid_sweep.py [--pair NAME | --checkpoint DIR] [--prompt-len N] [--scorers LIST] [--quick] [--write-docs]

On a shipped pair (default: the Qwen3.5-MoE hybrid pair `tiny_pair_qwen3_5` when it is installed, else the
Qwen3-MoE `tiny_pair`), with held-out prompts (standard-library files the pair never trained on) as long as the
target's context allows (by default its positions less the new tokens, a block and 64 tokens of slack):

1. Resident (every expert on the device), for PFlash off (the full prefill) and keep ratios 0.5 / 0.25 / 0.1
   with each scorer (`--scorers`: by default a cheap one, the first layer of a shipped pair with the same
   tokenizer, and the target itself), plain greedy decoding (block 1) and DFlash (the draft's block): the TTFT
   split into the scorer's pass over the whole prompt and the target's compressed prefill (with the first token),
   decode tokens/s (the tokens after the first over the time after it), DFlash acceptance (tokens per round), and
   quality against the full prefill's plain greedy output: agreement of the first `--max-new` (64) greedy tokens
   (the fraction of equal positions, and the common prefix).
2. A needle-retrieval set (`dflash_jax.pflash.needle`): a passage of held-out text planted early in a long
   held-out prompt that ends by repeating the passage's start, so the right continuation is the planted text;
   exact match of the next tokens, the same with the passage swapped for another (the chance level), and the
   fraction of the passage each selection kept. Measured at keep 1 first: the set scores compression only when
   the full prefill retrieves clearly above the chance level, and the report says which.
3. Offloaded (`offload.OffloadedGenerator`, experts in host memory, a device expert cache of each budget), with the
   first scorer, on one held-out prompt of `--offload-prompt-len` (1024) tokens: the same PFlash x speculation
   grid: TTFT, decode tokens/s and MB moved host -> device, for the prefill (the generator streams every expert
   table through the device, so its traffic does not depend on the prompt; the experts the kept tokens route to,
   the least an on-demand prefill would move, are listed beside it) and for the decode. Every offloaded DFlash
   output is checked equal to the offloaded plain output.

Every timing is a warm run (each compiled shape is run once before it is timed; the best of `--repeats`), on this
machine's shared CPU; ratios compare runs of one process. PFlash "off" runs the full prefill at explicit positions
(every token kept), which tests/pflash show equal to the plain prefill token for token. Writes
hybrid_sweep.{json,md,png} (docs/benchmarks with --write-docs).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

import harness as h

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


def _same_file(a, b) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def load_scorers(spec: str, pair, name: str):
    """The scorers of a comma-separated list: `target` (the pair's target), `target:N` (its first N layers),
    `PAIR[:N]` (a shipped pair's target, or its first N layers) or `DIR[:N]` (a converted checkpoint's); `auto`:
    the first layer of another shipped pair with this pair's tokenizer (a cheap scorer) when there is one, then
    the target."""
    import dflash_jax
    from dflash_jax import pflash

    shipped = getattr(dflash_jax, "SHIPPED_PAIRS", {})
    if spec == "auto":
        items = []
        for other, path in shipped.items():
            tok = os.path.join(path, "tokenizer.json")
            if other != name and pair.tokenizer_path and os.path.exists(tok) and _same_file(tok, pair.tokenizer_path):
                items.append(f"{other}:1")
                break
        items.append("target")
    else:
        items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise SystemExit("--scorers is empty: give e.g. 'target' or 'tiny_pair:1,target'")
    scorers = []
    for item in items:
        base, _, layers = item.partition(":")
        try:
            n_layers = int(layers) if layers else None
        except ValueError:
            raise SystemExit(f"--scorers item {item!r}: the part after ':' must be a layer count") from None
        if base == "target":
            other = pair
        else:
            path = shipped.get(base, base)
            if not os.path.exists(os.path.join(path, "manifest.json")):
                raise SystemExit(f"--scorers item {item!r}: {base!r} is neither 'target', a shipped pair "
                                 f"({', '.join(shipped)}) nor a converted checkpoint directory")
            other = dflash_jax.load(path, dequantize_experts="auto")
            if not (other.tokenizer_path and pair.tokenizer_path and _same_file(other.tokenizer_path,
                                                                                pair.tokenizer_path)):
                raise SystemExit(f"--scorers item {item!r}: its tokenizer is not the pair's: a scorer must read the "
                                 "same token ids (use a scorer trained with the pair's tokenizer)")
            base = os.path.basename(str(path).rstrip("/"))
        try:
            scorer = pflash.Scorer.from_pair(other, name=f"{base}:target" if base != "target" else "target",
                                             layers=n_layers)
        except ValueError as e:
            raise SystemExit(f"--scorers item {item!r}: {e}") from None
        scorers.append(scorer)
    return scorers


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--pair": (None, f"a shipped pair (default: {HYBRID} when installed, else tiny_pair)"),
        "--checkpoint": (None, "a convert-weights checkpoint instead of a shipped pair"),
        "--prompt-len": (None, "held-out prompt tokens (default and cap: the target's positions - max-new - block - "
                               "64)"),
        "--needles": (4, "needle-retrieval prompts"),
        "--needle-answer": (8, "needle answer tokens scored by exact match"),
        "--scorers": ("auto", "comma-separated scorers: target, target:N (its first N layers), PAIR[:N] or DIR[:N] "
                              "(another model with the same tokenizer); auto: a shipped pair's first layer when one "
                              "shares the tokenizer, then the target"),
        "--block-size": (None, "DFlash block (default: the draft's)"),
        "--budgets": ("0.25,1.0", "offload budgets as fractions of all expert bytes (comma-separated; '' skips "
                                  "offload)"),
        "--offload-prompt-len": (1024, "the offloaded grid's held-out prompt tokens (its layer-by-layer prefill is the "
                                       "slowest part of the sweep; capped like --prompt-len)")},
        prompts=2, max_new=64, repeats=2)
    args = h.parse(p, argv, quick=dict(prompt_len="128", prompts=1, needles=1, needle_answer=2, max_new=4, repeats=1,
                                       scorers="target", budgets="1.0", offload_prompt_len=128))
    args.prompt_len = None if args.prompt_len is None else int(args.prompt_len)
    args.block_size = None if args.block_size is None else int(args.block_size)
    if args.needle_answer < 1 or args.needles < 0 or (args.prompt_len is not None and args.prompt_len < 128):
        p.error("--needle-answer must be >= 1, --needles >= 0, --prompt-len >= 128")

    import dflash_jax
    from dflash_jax import pflash
    from dflash_jax.cli.generate import UsageError, load_tokenizer, resolve_pair
    from dflash_jax.offload import OffloadedGenerator
    from dflash_jax.pflash import needle as nd
    from dflash_jax.spec.loop import LOOP_BUCKETS
    from dflash_jax.train.data import file_windows
    from study.needle import needle_set

    name = args.pair if args.checkpoint else (args.pair or _default_pair())
    try:
        directory = resolve_pair(args.checkpoint, None if args.checkpoint else name)
    except UsageError as e:
        raise SystemExit(str(e))
    pair = dflash_jax.load(directory, dequantize_experts="auto")
    tok = load_tokenizer(pair)
    tcfg = pair.target_cfg
    block = args.block_size or pair.draft_cfg.block_size
    if block < 2:
        p.error("--block-size must be >= 2 (block 1 is the plain run, always measured)")
    n_new = args.max_new
    cap = tcfg.max_position_embeddings - n_new - block - 64
    length = cap if args.prompt_len is None else min(args.prompt_len, cap)
    scorers = load_scorers(args.scorers, pair, name)
    prompts = file_windows(pair, "held_out", args.prompts, length)
    needles = needle_set(pair, args.needles, length, answer=args.needle_answer) if args.needles else []
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    _log(f"pair {name or directory}: {tcfg.model_type}, {tcfg.num_layers} layers, {tcfg.max_position_embeddings} "
         f"positions, block {block}; scorers {[s.name for s in scorers]}; {len(prompts)} prompts of {length} tokens, "
         f"{len(needles)} needles, {n_new} new tokens; offload budgets {budgets}")

    score_cache = {}

    def score(prompt_id, prompt, scorer, timed=True):
        """The scorer's per-token importance (its bucket compiled first) and its best (wall, CPU) seconds."""
        key = (prompt_id, scorer.name)
        if key not in score_cache:
            scores = pflash.score_tokens(scorer, prompt)  # compiles this bucket (or hits the cache)
            best = (float("nan"),) * 2
            if timed:
                t = h.paired_runs({"score": functools.partial(pflash.score_tokens, scorer, prompt)}, args.repeats)
                best = (t.stat("score"), t.stat("score", "cpu"))
            score_cache[key] = (scores, best)
        return score_cache[key]

    def compress(prompt_id, prompt, keep, scorer, timed=True):
        """(kept indices, scorer + selection (wall, CPU) seconds); keep 1 keeps everything without a scorer."""
        if keep == 1:
            return np.arange(len(prompt), dtype=np.int32), (0.0, 0.0)
        scores, (score_s, score_cpu) = score(prompt_id, prompt, scorer, timed)
        kept, wall, cpu = h.timed(lambda: pflash.select_tokens(scores, keep_ratio=keep))
        return kept, (score_s + wall, score_cpu + cpu)

    warm_shapes = set()

    def run(prompt, kept, bs):
        """The fastest of `repeats` warm runs (prefill and decode each at its best); a shape's first run compiles."""
        shape = (LOOP_BUCKETS.prompt_len(len(kept)), bs)
        runs = [pflash.generate(pair, [prompt], [kept], max_new_tokens=n_new, block_size=bs, stop_ids=[],
                                warmup=i == 0 and shape not in warm_shapes) for i in range(args.repeats)]
        warm_shapes.add(shape)
        best = runs[0]
        for k in ("prefill_s", "prefill_cpu_s"):
            best.stats[k] = min(r.stats[k] for r in runs)
        best.stats["decode_s"] = min(r.stats["seconds"] - r.stats["prefill_s"] for r in runs)
        best.stats["decode_cpu_s"] = min(r.stats["cpu_s"] - r.stats["prefill_cpu_s"] for r in runs)
        return best

    # ---- 1. resident: quality and speed ----
    resident = []
    for pi, prompt in enumerate(prompts):
        ref = None
        for keep in KEEPS:
            for scorer in ([None] if keep == 1 else scorers):
                kept, (score_s, score_cpu) = compress(pi, prompt, keep, scorer)
                for bs in (1, block):
                    r = run(prompt, kept, bs)
                    s = r.stats
                    if ref is None:
                        ref = r.tokens[0]  # the full prefill's plain greedy output (keep 1, block 1: first)
                    agree, prefix = agreement(r.tokens[0], ref)
                    row = {"prompt": pi, "prompt_tokens": len(prompt), "keep": keep, "kept_tokens": len(kept),
                           "scorer": "-" if scorer is None else scorer.name, "speculation": bs > 1, "block_size": bs,
                           "score_s": score_s, "prefill_s": s["prefill_s"], "ttft_s": score_s + s["prefill_s"],
                           "score_cpu_s": score_cpu, "prefill_cpu_s": s["prefill_cpu_s"],
                           "ttft_cpu_s": score_cpu + s["prefill_cpu_s"],
                           "decode_tokens_per_s": (len(r.tokens[0]) - 1) / s["decode_s"],
                           "decode_tokens_per_cpu_s": (len(r.tokens[0]) - 1) / s["decode_cpu_s"],
                           "acceptance": s["mean_acceptance"], "agreement": agree, "common_prefix": prefix,
                           "tokens": r.tokens[0]}
                    resident.append(row)
                    _log(f"resident prompt {pi} keep {keep:4.2f} ({len(kept):4d} kept, scorer {row['scorer']}) "
                         f"B={bs:2d}: "
                         f"scorer {score_s * 1e3:7.1f} ms + prefill {s['prefill_s'] * 1e3:7.1f} ms (CPU "
                         f"{score_cpu * 1e3:.0f} + {s['prefill_cpu_s'] * 1e3:.0f} ms), "
                         f"{row['decode_tokens_per_s']:6.1f} tok/s, tau {row['acceptance']:.2f}, agreement {agree:.2f} "
                         f"(prefix {prefix})")

    # ---- 2. needles: keep 1 (and the chance level) first, then every scorer x keep ----
    needle_rows = []

    def answer_of(prompt, kept):
        r = pflash.generate(pair, [prompt], [kept], max_new_tokens=args.needle_answer, block_size=1, stop_ids=[])
        return r.tokens[0]

    for ni, case in enumerate(needles):
        full = np.arange(len(case.prompt), dtype=np.int32)
        em, match = nd.score_answer(answer_of(case.prompt, full), case.answer)
        cem, cmatch = nd.score_answer(answer_of(case.control, full), case.answer)
        aem, amatch = nd.score_answer(answer_of(case.adjacent, full), case.answer)
        needle_rows.append({"needle": ni, "depth": case.depth, "keep": 1.0, "scorer": "-", "exact_match": em,
                            "token_match": match, "needle_kept": 1.0, "control_exact_match": cem,
                            "control_token_match": cmatch, "adjacent_exact_match": aem, "adjacent_token_match": amatch})
        _log(f"needle {ni} (depth {case.depth:.1f}) keep 1: EM {int(em)}, answer tokens matched {match:.2f}; "
             f"passage swapped (chance): EM {int(cem)}, matched {cmatch:.2f}; passage right before the query: "
             f"EM {int(aem)}, matched {amatch:.2f}")
    if needles:
        k1 = [x for x in needle_rows if x["keep"] == 1.0]
        _log(f"needle set at keep 1: exact match {np.mean([x['exact_match'] for x in k1]):.2f} (chance "
             f"{np.mean([x['control_exact_match'] for x in k1]):.2f}), answer tokens "
             f"{np.mean([x['token_match'] for x in k1]):.2f} (chance "
             f"{np.mean([x['control_token_match'] for x in k1]):.2f})")
    for ni, case in enumerate(needles):
        for scorer in scorers:
            for keep in KEEPS[1:]:
                kept, _ = compress(("needle", ni), case.prompt, keep, scorer, timed=False)
                em, match = nd.score_answer(answer_of(case.prompt, kept), case.answer)
                needle_rows.append({"needle": ni, "depth": case.depth, "keep": keep, "scorer": scorer.name,
                                    "exact_match": em, "token_match": match,
                                    "needle_kept": nd.kept_fraction(kept, case.span)})
        _log(f"needle {ni}: " + ", ".join(f"{x['scorer']} keep {x['keep']}: EM {int(x['exact_match'])} kept "
                                          f"{x['needle_kept']:.2f}" for x in needle_rows if x["needle"] == ni))

    # ---- 3. offloaded: traffic and speed under each budget (the first scorer) ----
    offloaded = []
    if budgets:
        from dflash_jax.offload.store import HostExpertStore

        host_pair = dflash_jax.load(directory, expert_memory="pinned_host")
        store = HostExpertStore(host_pair.target)
        off_len = min(args.offload_prompt_len, cap)
        prompt, scorer = file_windows(pair, "held_out", 1, off_len)[0], scorers[0]
        plain_tokens = {}
        for frac in budgets:
            for bs in (1, block):
                gen = OffloadedGenerator(host_pair, budget_bytes=int(max(frac * store.total_bytes, 1)),
                                         prefetcher="draft_router" if bs > 1 else "none", block_size=bs, store=store)
                for keep in KEEPS:
                    kept, (score_s, score_cpu) = compress("offload", prompt, keep, scorer)
                    warm = gen.prefill([prompt], max_new_tokens=n_new, stop_ids=[], kept=[kept])
                    if not warm.done:
                        gen.round(warm)  # compiles this prefill's shapes and a round
                    del warm
                    c0 = time.process_time()
                    session = gen.prefill([prompt], max_new_tokens=n_new, stop_ids=[], kept=[kept])
                    c1 = time.process_time()
                    while not session.done:
                        gen.round(session)
                    r = gen.result(session)
                    c2 = time.process_time()
                    s, off = r.stats, r.stats["offload"]
                    decode_s = s["seconds"] - s["time_split"]["prefill_s"]
                    moved = s["route_ahead"]["summary"]["bytes_moved"]
                    row = {"budget_fraction": frac, "budget_mb": off["budget_bytes"] / 1e6, "keep": keep,
                           "scorer": "-" if keep == 1 else scorer.name,
                           "kept_tokens": len(kept), "speculation": bs > 1, "block_size": bs, "score_s": score_s,
                           "prefill_s": s["time_split"]["prefill_s"], "ttft_s": score_s + s["time_split"]["prefill_s"],
                           "score_cpu_s": score_cpu, "prefill_cpu_s": c1 - c0, "ttft_cpu_s": score_cpu + c1 - c0,
                           "decode_tokens_per_cpu_s": (len(r.tokens[0]) - 1) / (c2 - c1),
                           "decode_tokens_per_s": (len(r.tokens[0]) - 1) / decode_s, "acceptance": s["mean_acceptance"],
                           "prefill_streamed_mb": off["prefill_bytes"] / 1e6,
                           "prefill_routed_mb": off["prefill_routed_bytes"] / 1e6,
                           "decode_mb_moved": moved / 1e6, "decode_mb_per_token": moved / 1e6 / len(r.tokens[0]),
                           "prompt_tokens": len(prompt),
                           "lossless_vs_plain": r.tokens[0] == plain_tokens.setdefault((frac, keep), r.tokens[0])}
                    offloaded.append(row)
                    _log(f"offload {frac:.2f} of experts ({row['budget_mb']:.3f} MB) B={bs:2d} keep {keep:4.2f}: TTFT "
                         f"{row['ttft_s'] * 1e3:7.1f} ms, {row['decode_tokens_per_s']:6.1f} tok/s, prefill routed "
                         f"{row['prefill_routed_mb']:.3f} MB, decode {row['decode_mb_moved']:.3f} MB, = plain "
                         f"{row['lossless_vs_plain']}")

    report = h.Report(args, "hybrid_sweep")
    # the measurements, kept until the report is written
    raw_path = report.json({"resident": resident, "needles": needle_rows, "offloaded": offloaded}, suffix="_raw")
    result = summarize(name or directory, [s.name for s in scorers], pair, block, length, n_new, resident,
                       needle_rows, offloaded, args.needle_answer)
    report.write(result, markdown(result), draw=functools.partial(draw, result), ncols=3, figsize=(16, 4.4),
                 image="quality and TTFT by keep ratio; decode by budget")
    os.remove(raw_path)
    print(result["recommendation"])
    return 0


def _mean(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def summarize(name, scorer_names, pair, block, length, n_new, resident, needle_rows, offloaded, answer_len) -> dict:
    """Per (keep, scorer, speculation) means over the prompts, the needle scores, and the recommendation."""
    grid = []
    for keep in KEEPS:
        for scorer in (["-"] if keep == 1 else scorer_names):
            needles = [x for x in needle_rows if x["keep"] == keep and x["scorer"] == scorer]
            for spec in (False, True):
                rows = [r for r in resident if r["keep"] == keep and r["scorer"] == scorer and r["speculation"] == spec]
                grid.append({
                    "keep": keep, "scorer": scorer, "speculation": spec, "kept_tokens": _mean(rows, "kept_tokens"),
                    "ttft_ms": 1e3 * _mean(rows, "ttft_s"), "score_ms": 1e3 * _mean(rows, "score_s"),
                    "prefill_ms": 1e3 * _mean(rows, "prefill_s"), "ttft_cpu_ms": 1e3 * _mean(rows, "ttft_cpu_s"),
                    "score_cpu_ms": 1e3 * _mean(rows, "score_cpu_s"),
                    "prefill_cpu_ms": 1e3 * _mean(rows, "prefill_cpu_s"),
                    "decode_tokens_per_cpu_s": _mean(rows, "decode_tokens_per_cpu_s"),
                    "decode_tokens_per_s": _mean(rows, "decode_tokens_per_s"), "acceptance": _mean(rows, "acceptance"),
                    "agreement": _mean(rows, "agreement"), "common_prefix": _mean(rows, "common_prefix"),
                    "needle_exact_match": _mean(needles, "exact_match"),
                    "needle_token_match": _mean(needles, "token_match"),
                    "needle_kept": _mean(needles, "needle_kept"),
                    "lossless_vs_plain_same_keep": all(
                        a["tokens"] == b["tokens"] for a in rows for b in resident
                        if b["prompt"] == a["prompt"] and b["keep"] == keep and b["scorer"] == scorer
                        and not b["speculation"]),
                })
    full = {g["speculation"]: g for g in grid if g["keep"] == 1.0}
    for g in grid:
        base = full[False]
        g["ttft_vs_full"] = g["ttft_ms"] / base["ttft_ms"]
        g["prefill_vs_full"] = g["prefill_ms"] / base["prefill_ms"]
        g["ttft_cpu_vs_full"] = g["ttft_cpu_ms"] / base["ttft_cpu_ms"]
        g["prefill_cpu_vs_full"] = g["prefill_cpu_ms"] / base["prefill_cpu_ms"]
        same = next(x for x in grid if x["keep"] == g["keep"] and x["scorer"] == g["scorer"] and not x["speculation"])
        g["decode_vs_plain"] = g["decode_tokens_per_s"] / same["decode_tokens_per_s"]
        g["decode_cpu_vs_plain"] = g["decode_tokens_per_cpu_s"] / same["decode_tokens_per_cpu_s"]
    k1 = [x for x in needle_rows if x["keep"] == 1.0]
    needle = None
    if k1:
        needle = {"cases": len(k1), "answer_tokens": answer_len,
                  "keep1_exact_match": _mean(k1, "exact_match"), "chance_exact_match": _mean(k1, "control_exact_match"),
                  "keep1_token_match": _mean(k1, "token_match"), "chance_token_match": _mean(k1, "control_token_match"),
                  "adjacent_exact_match": _mean(k1, "adjacent_exact_match"),
                  "adjacent_token_match": _mean(k1, "adjacent_token_match")}
        needle["measurable"] = needle["keep1_exact_match"] - needle["chance_exact_match"] >= 0.25
    spec_gain = full[True]["decode_tokens_per_s"] / full[False]["decode_tokens_per_s"]
    spec_gain_cpu = full[True]["decode_tokens_per_cpu_s"] / full[False]["decode_tokens_per_cpu_s"]
    lines = [f"Speculation: DFlash (block {block}) decodes {spec_gain:.2f}x plain greedy after the full prefill "
             f"({spec_gain_cpu:.2f}x in CPU time; tau {full[True]['acceptance']:.2f}): "
             f"{'on' if min(spec_gain, spec_gain_cpu) > 1 else 'off'} recommended at this prompt length (output "
             "identical either way)."]
    base_cpu = full[False]["prefill_cpu_ms"]

    def ttft(g):
        return (f"TTFT {g['ttft_cpu_vs_full']:.2f}x the full prefill's in CPU time ({g['ttft_vs_full']:.2f}x wall): "
                f"scorer {g['score_cpu_ms']:.0f} + target prefill {g['prefill_cpu_ms']:.0f} CPU ms against "
                f"{base_cpu:.0f}")

    plain = [g for g in grid if not g["speculation"] and g["keep"] < 1]
    needle_ok = (lambda g: True) if not (needle and needle["measurable"]) else (
        lambda g: g["needle_exact_match"] >= 0.9 * needle["keep1_exact_match"])
    good = [g for g in plain if g["agreement"] >= 0.9 and g["ttft_cpu_vs_full"] < 1 and needle_ok(g)]
    if good:
        best = min(good, key=lambda g: g["ttft_cpu_vs_full"])
        lines.append(f"PFlash: keep {best['keep']} with the scorer {best['scorer']} keeps {best['agreement']:.0%} "
                     f"agreement with the full prefill; {ttft(best)}.")
    else:
        top = max(plain, key=lambda g: g["agreement"])
        lines.append(f"PFlash: no keep ratio below 1 keeps 90% agreement with the full prefill on this pair (best: "
                     f"keep {top['keep']} with {top['scorer']}, {top['agreement']:.0%}, common prefix "
                     f"{top['common_prefix']:.1f} tokens): keep PFlash off (keep 1) where the output should match the "
                     "full prompt's.")
        faster = [g for g in plain if g["ttft_cpu_vs_full"] < 0.8]
        if faster:
            pick = max(faster, key=lambda g: (round(g["agreement"], 2), -g["ttft_cpu_vs_full"]))
            lines.append(f"Where time to first token matters more than fidelity: keep {pick['keep']} with the scorer "
                         f"{pick['scorer']} ({ttft(pick)}; agreement {pick['agreement']:.0%}, common prefix "
                         f"{pick['common_prefix']:.1f}).")
        for name_ in scorer_names:
            rows = [g for g in plain if g["scorer"] == name_]
            if rows and min(g["ttft_cpu_vs_full"] for g in rows) >= 0.8:
                lines.append(f"The scorer {name_} costs {np.mean([g['score_cpu_ms'] for g in rows]):.0f} CPU ms, "
                             f"against the full prefill's {base_cpu:.0f}: with it PFlash does not shorten TTFT.")
    if needle is not None and not needle["measurable"]:
        lines.append(f"Needles: the full prefill retrieves {needle['keep1_exact_match']:.0%} of the planted answers "
                     f"(chance {needle['chance_exact_match']:.0%}; {needle['adjacent_exact_match']:.0%} with the "
                     "passage right before the query): this target does not copy from its context, so the needle set "
                     "cannot rank keep ratios here (the passage kept by each selection is listed).")
    if offloaded:
        fracs = sorted({o["budget_fraction"] for o in offloaded})
        best = max((o for o in offloaded if o["keep"] == 1.0), key=lambda o: o["decode_tokens_per_s"])
        lines.append(f"Offload: best full-prefill decode at {best['budget_fraction']:.2f} of the expert bytes with "
                     f"speculation {'on' if best['speculation'] else 'off'} ({best['decode_tokens_per_s']:.1f} tok/s, "
                     f"{best['decode_mb_per_token']:.3f} MB/token); budgets swept {fracs}.")
    rec = " ".join(lines)
    cfg = pair.target_cfg
    return {"pair": name, "scorers": scorer_names, "target": {"model_type": cfg.model_type, "layers": cfg.num_layers,
                                                              "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                                                              "max_positions": cfg.max_position_embeddings},
            "block_size": block, "prompt_tokens": length, "new_tokens": n_new,
            "grid": grid, "needle_calibration": needle, "needles": needle_rows, "offloaded": offloaded,
            "resident": [{k: v for k, v in r.items() if k != "tokens"} for r in resident],
            "speculation_speedup_full_prefill": spec_gain, "recommendation": rec}


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def markdown(r: dict) -> list[str]:
    t = r["target"]
    n = r["needle_calibration"]
    lines = [
        "# Hybrid sweep: expert budget x speculation x PFlash",
        "",
        f"`python benchmarks/hybrid_sweep.py --write-docs` on the shipped pair `{r['pair']}` ({t['model_type']}, "
        f"{t['layers']} layers, {t['experts']} experts top-{t['top_k']}, {t['max_positions']} positions, DFlash "
        f"block {r['block_size']}): held-out prompts of {r['prompt_tokens']} tokens (as long as the context allows "
        f"with {r['new_tokens']} new tokens), {r['new_tokens']} greedy tokens, scorers "
        f"{', '.join('`' + s + '`' for s in r['scorers'])}. CPU, a shared machine: absolute times are this machine's "
        "(best of the repeats, every shape compiled before it is timed); compare rows of one run.",
        "",
        f"**Recommended configuration.** {r['recommendation']}",
        "",
    ]
    if n is not None:
        lines += [
            "## Needle set: calibrated at keep 1",
            "",
            f"{n['cases']} prompts of {r['prompt_tokens']} held-out tokens, each with a 48-token passage of another "
            "held-out file planted at 10-70% depth and ending with the passage's first 16 tokens again; the answer is "
            f"the passage's next {n['answer_tokens']} tokens (exact match of the greedy continuation). Chance: the "
            "same prompt with another passage planted (positions and query unchanged).",
            "",
            *h.table(["", "exact match", "answer tokens matched"],
                     [[what, f"{n[k + '_exact_match']:.2f}", f"{n[k + '_token_match']:.2f}"] for what, k in (
                         ("full prefill (keep 1)", "keep1"), ("passage swapped (chance)", "chance"),
                         ("passage right before the query (easiest)", "adjacent"))]),
            "",
            ("The full prefill retrieves clearly above chance: the needle columns below rank the keep ratios."
             if n["measurable"] else
             "The full prefill does not retrieve above chance on this target, so the needle's exact match cannot rank "
             "the keep ratios here; 'passage kept' (the fraction of the planted passage the selection kept) still "
             "measures the scorer."),
            "",
        ]
    lines += [
        "## Resident experts: TTFT by keep ratio and scorer",
        "",
        "TTFT = the scorer's pass over the whole prompt + the target's compressed prefill (with the first token; "
        "the DFlash rows also feed the draft its context). CPU ms: the process's CPU time (every thread), the work "
        "itself, which the machine's other load does not inflate; wall ms: the best elapsed time of the repeats.",
        "",
    ]
    lines += h.table(["keep", "scorer", "kept tokens", "speculation", "scorer CPU ms",
                      "target prefill CPU ms (vs full)", "TTFT CPU ms (vs full)", "scorer wall ms", "target prefill wall ms", "TTFT wall ms (vs full)"],
                     [[g["keep"], g["scorer"], f"{g['kept_tokens']:.0f}", "DFlash" if g["speculation"] else "plain",
                       f"{g['score_cpu_ms']:.0f}", f"{g['prefill_cpu_ms']:.0f} ({g['prefill_cpu_vs_full']:.2f})",
                       f"{g['ttft_cpu_ms']:.0f} ({g['ttft_cpu_vs_full']:.2f})", f"{g['score_ms']:.0f}",
                       f"{g['prefill_ms']:.0f}", f"{g['ttft_ms']:.0f} ({g['ttft_vs_full']:.2f})"] for g in r["grid"]])
    lines += [
        "",
        "## Resident experts: decode and quality by keep ratio and scorer",
        "",
        "Decode: the tokens after the first over the time after it (per wall second and per CPU second; vs plain: "
        "the same keep and scorer without speculation). Agreement: fraction of the first greedy tokens equal to the "
        "full prefill's plain greedy output (and the common prefix). Needle columns (plain greedy, per keep and "
        "scorer): exact match, answer tokens matched, and the fraction of the planted passage the selection kept.",
        "",
    ]
    lines += h.table(["keep", "scorer", "speculation", "decode tok/s", "per CPU s", "vs plain (wall / CPU)", "tau",
                      "agreement", "common prefix", "needle EM", "needle answer tokens", "passage kept",
                      "DFlash = plain"],
                     [[g["keep"], g["scorer"], "DFlash" if g["speculation"] else "plain",
                       f"{g['decode_tokens_per_s']:.1f}",
                       f"{g['decode_tokens_per_cpu_s']:.1f}",
                       f"{g['decode_vs_plain']:.2f} / {g['decode_cpu_vs_plain']:.2f}", f"{g['acceptance']:.2f}",
                       f"{g['agreement']:.2f}", f"{g['common_prefix']:.1f}", _f(g["needle_exact_match"]),
                       _f(g["needle_token_match"]), _f(g["needle_kept"]),
                       "yes" if g["lossless_vs_plain_same_keep"] else "NO"] for g in r["grid"]])
    if r["offloaded"]:
        lines += [
            "",
            "## Offloaded experts: traffic and speed by budget",
            "",
            "Prefill streamed: the offloaded prefill streams every expert table through the device once, whatever "
            "the prompt; prefill routed: the experts the (kept) prompt tokens route to, the least an on-demand prefill "
            "would move. Decode MB: host -> device expert bytes of all rounds. "
            f"One held-out prompt of {r['offloaded'][0]['prompt_tokens']} tokens (the layer-by-layer offloaded prefill "
            "of a full-context prompt takes tens of seconds here), the first scorer. = plain: the output equals the "
            "offloaded plain output of the same budget and keep (offloaded = resident is tested in tests/pflash).",
            "",
        ]
        lines += h.table(
            ["budget (of all experts)", "MB", "speculation", "keep", "scorer", "kept", "TTFT CPU ms (scorer + prefill)",
             "TTFT wall ms", "decode tok/s", "per CPU s", "tau", "prefill streamed MB", "prefill routed MB",
             "decode MB", "MB/token", "= plain"],
            [[f"{o['budget_fraction']:.2f}", f"{o['budget_mb']:.3f}", "DFlash" if o["speculation"] else "plain",
              o["keep"], o["scorer"], o["kept_tokens"],
              f"{o['ttft_cpu_s'] * 1e3:.0f} ({o['score_cpu_s'] * 1e3:.0f} + {o['prefill_cpu_s'] * 1e3:.0f})",
              f"{o['ttft_s'] * 1e3:.0f}", f"{o['decode_tokens_per_s']:.1f}", f"{o['decode_tokens_per_cpu_s']:.1f}",
              f"{o['acceptance']:.2f}", f"{o['prefill_streamed_mb']:.3f}", f"{o['prefill_routed_mb']:.3f}",
              f"{o['decode_mb_moved']:.3f}", f"{o['decode_mb_per_token']:.4f}",
              "yes" if o["lossless_vs_plain"] else "NO"]
             for o in r["offloaded"]])
    return lines


def draw(r: dict, axes) -> None:
    a, b, c = axes
    full = next(g for g in r["grid"] if g["keep"] == 1.0 and not g["speculation"])
    for si, scorer in enumerate(r["scorers"]):
        rows = [full] + [g for g in r["grid"] if g["scorer"] == scorer and not g["speculation"]]
        keeps = [g["keep"] for g in rows]
        a.plot(keeps, [g["agreement"] for g in rows], "o-", color=f"C{si}", label=f"agreement ({scorer})")
        if rows[-1]["needle_kept"] is not None:
            a.plot(keeps, [g["needle_kept"] for g in rows], "^:", color=f"C{si}", label=f"passage kept ({scorer})")
            a.plot(keeps, [g["needle_exact_match"] for g in rows], "v--", color=f"C{si}", alpha=0.6,
                   label=f"needle exact match ({scorer})")
        b.plot(keeps, [g["ttft_cpu_ms"] for g in rows], "o-", color=f"C{si}", label=f"TTFT, scorer {scorer}")
    rows = [full] + [g for g in r["grid"] if g["scorer"] == r["scorers"][0] and not g["speculation"]]
    b.plot([g["keep"] for g in rows], [g["prefill_cpu_ms"] for g in rows], "s--", color="gray",
           label="target prefill alone")
    a.set_xlabel("PFlash keep ratio")
    a.set_ylabel("vs the full prefill")
    a.set_ylim(-0.05, 1.05)
    a.legend(fontsize="x-small")
    b.set_xlabel("PFlash keep ratio")
    b.set_ylabel("time to first token (CPU ms, plain)")
    b.set_ylim(bottom=0)
    b.legend(fontsize="x-small")
    for spec, keep, style in ((False, 1.0, "o--"), (True, 1.0, "s-"), (False, 0.25, "o:"), (True, 0.25, "s:")):
        rows = [o for o in r["offloaded"] if o["speculation"] == spec and o["keep"] == keep]
        if rows:
            c.plot([o["budget_fraction"] for o in rows], [o["decode_tokens_per_s"] for o in rows], style,
                   label=f"{'DFlash' if spec else 'plain'}, keep {keep}")
    c.set_xlabel("expert cache budget (fraction of all expert bytes)")
    c.set_ylabel("decode tokens/s (offloaded)")
    c.set_ylim(bottom=0)
    c.legend(fontsize="x-small")


if __name__ == "__main__":
    sys.exit(main())
