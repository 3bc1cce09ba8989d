"""Benchmark: chain vs token-tree verification vs the adaptive policy, resident and offloaded.

  python benchmarks/tree.py [--checkpoint DIR] [--sets held_out:0,train:1] [--prompts 6] [--prompt-len 64]
                            [--max-new 64] [--chains 4,8,16] [--trees 8,16,32] [--branch 8] [--repeats 3]
                            [--no-offload] [--out DIR | --write-docs]

Resident (the shipped pair), per prompt set (windows of the pair's held-out or training standard-library
files, one batch):
  - tokens per round (tau: tokens committed per round and sequence, the bonus included);
  - expert union per round: distinct experts the verify's rows route to, per MoE layer (first set only);
  - tokens/s of the warmed jitted loop: the fastest of `--repeats` runs, the runs of all shapes interleaved
    (repeat 1 of every shape, then repeat 2, ...) so that a shared machine's load drifts across all alike;
  - trees built from the acceptance model (`spec.tree.TreeCalibration`) fitted on training-split prompts
    (the pair's shipped `spec.calibration_file.CALIBRATION_FILE`, written by `--fit-calibration` from `--fit-seeds`; without
    one, fitted on `--calib-seeds`), `--branch` candidates a node, and the plain build at the largest budget;
  - the adaptive policy (`spec.policy.AdaptivePolicy`): its seconds and tokens per round measured by
    `calibrate_policy` (each shape's fixed loop, interleaved repeats) on two training-split calibration
    batches, not the measured sets, with a prior toward the cheapest shape (`--margin`); it compiles and
    provisions only the shapes it can choose. It is timed
    against the fastest fixed shape of the set in alternating order, with a control (that fixed shape
    against itself) that shows the machine's noise on identical work.
Offloaded (`offload.OffloadedGenerator`, experts in host memory, a device cache below all experts,
`draft_router` prefetch): the shipped pair and a random pair of the route-study shape (64 experts top-4,
MXFP4): tokens per round, expert bytes moved per round, seconds (fastest of 2, shapes interleaved); the
adaptive policy's figures are the fixed shapes' offloaded seconds and tokens per round on calibration
prompts (transfers included), timed as above with a control (a second generator of the fastest shape).
Every output is checked equal to the target's plain greedy output. Writes tree.{json,md} (+ tree.png with
matplotlib) to --out (default bench_out/) or, with --write-docs, docs/benchmarks/.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import numpy as np

import harness as h

log = h.logger("tree", sys.stderr)


def interleaved(runs: dict, repeats: int, what: str = "", alternate: bool = False, cpu: dict | None = None) -> dict:
    """{name: fastest seconds} (each run's own `stats["seconds"]`) over `repeats` rounds of one run of each
    (compiled) function (`harness.paired_runs`; `alternate`: the order reversed every other round). `cpu`: filled
    with {name: least process CPU seconds} (the work done, less sensitive to other processes' load)."""
    def progress(r, t):
        log(f"{what}timing repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {t.stat(k) * 1e3:.0f} ms" for k in t.modes))

    t = h.paired_runs(runs, repeats, alternate=alternate, on_repeat=progress, seconds_of=lambda r: r.stats["seconds"])
    if cpu is not None:
        cpu.update({k: min(cpu.get(k, np.inf), t.stat(k, "cpu")) for k in t.modes})
    return {k: t.stat(k) for k in t.modes}


RANGE = (0.5, 2.0)  # the adaptive policy's calibration range (AdaptivePolicy.calibration_range)


HAS_HEAD = False  # the pair carries a branch head (set in main): trees of `use_head` shapes build from it


def label(shape) -> str:
    if shape.is_chain:
        return shape.label()
    if HAS_HEAD and shape.use_head:
        return f"{shape.label()} K={shape.branch} head"
    return f"{shape.label()} K={shape.branch}" + (" cal" if shape.calibration is not None else "")


def cpu_summary(cpu: dict) -> dict:
    """The adaptive run against the fixed shape of least process CPU time (every run emits the same tokens)."""
    fixed = {k: v for k, v in cpu.items() if k not in ("adaptive", "control")}
    least = min(fixed, key=fixed.get)
    return dict(least_cpu_fixed=least, adaptive_over_least_cpu_fixed=round(fixed[least] / cpu["adaptive"], 3),
                cpu_seconds={k: round(v, 3) for k, v in cpu.items()})


def taus(result) -> float:
    return float(np.mean([a for seq in result.acceptance_lengths for a in seq]))


def draw(rows: list[dict]):
    def on(axes):
        first = [r for r in rows if r["set"] == rows[0]["set"]]
        labels = [r["shape"] for r in first]
        colors = ["tab:blue" if r["kind"] == "chain" else "tab:green" if r["kind"] == "tree" else "tab:red"
                  for r in first]
        for ax, key, title in zip(axes, ("tokens_per_round", "expert_union_per_round", "tokens_per_second"),
                                  ("tokens per round", "experts per layer per verify", "tokens/s (CPU)")):
            ax.bar(labels, [r.get(key) or 0 for r in first], color=colors)
            ax.set_title(f"{title} ({first[0]['set']})")
            ax.tick_params(axis="x", rotation=45)

    return on


def resident(args, pair, shapes, calib_prompts, sets, policy_shapes):
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec import generate
    from dflash_jax.spec.calibrate import calibrate_policy
    from dflash_jax.spec.loop import generate_tree, generate_tree_stepping
    from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost

    n = args.max_new
    t0 = time.perf_counter()
    parts = [calibrate_policy(pair, batch, policy_shapes, max_new_tokens=n, repeats=args.repeats,
                              calibration_range=RANGE, clock=args.clock, log=log) for batch in calib_prompts]
    # over the calibration batches: the mean seconds and tokens per round; the prior toward the cheapest shape
    policy = AdaptivePolicy(tuple(policy_shapes), VerifyCost(tuple(np.mean([p.cost.seconds for p in parts], axis=0))),
                            taus=tuple(float(t) for t in np.mean([p.taus for p in parts], axis=0)),
                            calibration_range=RANGE, margin=args.margin)
    cost = policy.cost
    log("calibration: " + ", ".join(f"{label(s)} {c * 1e3:.1f} ms/round tau {t:.2f}" for s, c, t in
                                    zip(policy_shapes, cost.seconds, policy.taus))
        + f"; reachable {[label(policy.shapes[i]) for i in policy.reachable()]} ({time.perf_counter() - t0:.0f} s)")
    rows, summary = [], {}
    for si, (name, prompts) in enumerate(sets):
        plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)

        def runner(kind, shape, prompts=prompts):
            if kind == "chain":
                return lambda: generate(pair, prompts, max_new_tokens=n, block_size=shape.budget)
            return lambda: generate_tree(pair, prompts, max_new_tokens=n, tree_budget=shape.budget,
                                         branch=shape.branch, temperature=shape.temperature,
                                         calibration=shape.calibration, branch_head=shape.use_head)

        runs, set_rows = {}, []
        for kind, shape in shapes:
            t0 = time.perf_counter()
            name_s = label(shape)
            runs[name_s] = runner(kind, shape)
            res = runs[name_s]()
            assert res.tokens == plain, f"{name_s}: output differs from plain greedy"
            union = off = None
            if si == 0:
                stepped, rounds = generate_tree_stepping(pair, prompts, max_new_tokens=n, shape=shape)
                assert stepped.tokens == plain
                live = np.concatenate([r["live"] for r in rounds])
                union = round(float(np.concatenate([r["expert_union"] for r in rounds])[live].mean()), 2)
                off = round(float(np.concatenate([r["off_chain"] for r in rounds])[live].mean()), 3)
            set_rows.append(dict(set=name, kind=kind, shape=name_s, budget=shape.budget, branch=shape.branch,
                                 calibrated=shape.calibration is not None, head=HAS_HEAD and shape.use_head,
                                 tokens_per_round=round(taus(res), 3), expert_union_per_round=union,
                                 off_chain_rounds=off, tokens=sum(len(t) for t in res.tokens),
                                 rounds=int(res.stats["rounds"])))
            log(f"[{name}] {name_s:>14}: tau {set_rows[-1]['tokens_per_round']:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
        cpu = {}
        best = interleaved(runs, args.repeats, f"[{name}] ", cpu=cpu)
        for r in set_rows:
            r["seconds"] = round(best[r["shape"]], 4)
            r["tokens_per_second"] = round(r["tokens"] / best[r["shape"]], 1)
        fastest = max(set_rows, key=lambda r: r["tokens_per_second"])
        adaptive = lambda prompts=prompts: generate_tree(pair, prompts, max_new_tokens=n, adaptive=policy)  # noqa: E731
        res = adaptive()
        assert res.tokens == plain, "adaptive: output differs from plain greedy"
        paired = interleaved({"adaptive": adaptive, fastest["shape"]: runs[fastest["shape"]],
                              "control": runs[fastest["shape"]]}, args.paired_repeats, f"[{name}] paired ",
                             alternate=True, cpu=cpu)
        chosen = res.stats["adaptive_rounds"]
        tokens = sum(len(t) for t in res.tokens)
        set_rows.append(dict(set=name, kind="adaptive", shape="adaptive", budget=None, branch=None,
                             tokens_per_round=round(taus(res), 3), expert_union_per_round=None, off_chain_rounds=None,
                             tokens=tokens, tokens_per_second=round(tokens / paired["adaptive"], 1),
                             seconds=round(paired["adaptive"], 4), rounds=int(res.stats["rounds"]), chosen=chosen))
        best_chain = max((r for r in set_rows if r["kind"] == "chain"), key=lambda r: r["tokens_per_round"])
        trees = [r for r in set_rows if r["kind"] == "tree"]
        best_tree = max(trees, key=lambda r: r["tokens_per_round"])
        at32 = max((r for r in trees if r["budget"] <= 32), key=lambda r: r["tokens_per_round"])
        extra = {}
        marg = [r for r in trees if not r.get("head")]
        if marg and HAS_HEAD:
            bm = max(marg, key=lambda r: r["tokens_per_round"])
            extra.update(best_marginal_tree=bm["shape"], marginal_tree_over_best_chain=round(
                bm["tokens_per_round"] / best_chain["tokens_per_round"], 3))
        summary[name] = dict(
            best_chain=best_chain["shape"], best_tree=best_tree["shape"], **extra,
            tree_over_best_chain_tokens_per_round=round(
                best_tree["tokens_per_round"] / best_chain["tokens_per_round"], 3),
            tree_budget_le_32_over_best_chain=round(at32["tokens_per_round"] / best_chain["tokens_per_round"], 3),
            fastest_fixed=fastest["shape"],
            adaptive_over_fastest_fixed_tokens_per_second=round(paired[fastest["shape"]] / paired["adaptive"], 3),
            control_over_fastest_fixed=round(paired[fastest["shape"]] / paired["control"], 3),
            **cpu_summary(cpu), adaptive_rounds=chosen)
        log(f"[{name}] adaptive: tau {set_rows[-1]['tokens_per_round']:.2f}, {summary[name]}")
        rows += set_rows
    return rows, summary, policy


def offloaded(args, label, pair, prompts, calib, shapes, fraction):
    """Offloaded rows of one pair: each shape, then the adaptive policy with the shapes' measured costs."""
    from dflash_jax.decode import greedy_generate
    from dflash_jax.offload import HostExpertStore, OffloadedGenerator
    from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost

    n = args.offload_new
    store = HostExpertStore(pair.target)
    budget = int(store.total_bytes * fraction)
    plain = greedy_generate(pair.target, pair.target_cfg, prompts, max_new_tokens=n)

    def gen(shape):
        if shape is None or (not isinstance(shape, AdaptivePolicy) and shape.is_chain):
            return OffloadedGenerator(pair, budget_bytes=budget, store=store, prefetcher="draft_router",
                                      block_size=None if shape is None else shape.budget)
        return OffloadedGenerator(pair, budget_bytes=budget, store=store, prefetcher="draft_router", tree=shape)

    gens = {s.label(): gen(s) for s in shapes}
    # calibration batches (training-split prompts, never the measured ones): each shape's offloaded generate,
    # transfers included; per batch the median over interleaved repeats of its seconds, then seconds per round
    # = the batches' seconds over their rounds, tokens per round the batches' mean
    rounds = [[1] * len(calib) for _ in shapes]
    tau_b = [[0.0] * len(calib) for _ in shapes]
    for i, s in enumerate(shapes):  # compile, tokens per round
        for j, batch in enumerate(calib):
            res = gens[s.label()].generate(batch, max_new_tokens=n)
            tau_b[i][j], rounds[i][j] = taus(res), max(1, int(res.stats["rounds"]))
    spent = [h.paired_runs({i: (lambda g=gens[s.label()], b=batch: g.generate(b, max_new_tokens=n))
                            for i, s in enumerate(shapes)}, args.offload_calib_repeats,
                           seconds_of=lambda res: sum(res.stats["time_split"][k] for k in ("draft_s", "verify_s", "host_s")))
             for batch in calib]
    per_round = [sum(t.stat(i, args.clock, "median") for t in spent) / sum(rounds[i]) for i in range(len(shapes))]
    cal_taus = [float(np.mean(t)) for t in tau_b]
    policy = AdaptivePolicy(tuple(shapes), VerifyCost(tuple(per_round)), taus=tuple(cal_taus),
                            calibration_range=RANGE, margin=args.margin)
    log(f"[{label}] calibration: " + ", ".join(f"{s.label()} {c * 1e3:.1f} ms/round tau {t:.2f}"
                                               for s, c, t in zip(shapes, per_round, cal_taus))
        + f"; reachable {[shapes[i].label() for i in policy.reachable()]}")
    gens["adaptive"] = gen(policy)
    runs, rows = {}, []
    for name, g in gens.items():
        res = g.generate(prompts, max_new_tokens=n)
        assert res.tokens == plain, f"offloaded {name}: output differs from plain greedy"
        summ = res.stats["route_ahead"]["summary"]
        rounds = max(1, int(res.stats["rounds"]))
        rows.append(dict(set=label, kind="offloaded", shape=name, tokens_per_round=round(taus(res), 3),
                         bytes_moved_per_round=round(summ["bytes_moved"] / rounds),
                         tokens=sum(len(t) for t in res.tokens), rounds=rounds,
                         chosen=res.stats.get("adaptive_rounds")))
        runs[name] = lambda g=g: g.generate(prompts, max_new_tokens=n)
        log(f"[{label}] {name}: tau {rows[-1]['tokens_per_round']:.2f}, "
            f"{rows[-1]['bytes_moved_per_round'] / 1e6:.2f} MB moved per round")
    fixed_runs = {k: v for k, v in runs.items() if k != "adaptive"}
    cpu = {}
    best = interleaved(fixed_runs, 2, f"[{label}] ", cpu=cpu)
    fastest = min(best, key=lambda k: best[k] / next(r["tokens"] for r in rows if r["shape"] == k))
    control = gen(next(s for s in shapes if s.label() == fastest))  # the fastest fixed shape again
    control.generate(prompts, max_new_tokens=n)
    paired = interleaved({"adaptive": runs["adaptive"], fastest: runs[fastest],
                          "control": lambda: control.generate(prompts, max_new_tokens=n)}, args.offload_repeats,
                         f"[{label}] paired ", alternate=True, cpu=cpu)
    best["adaptive"] = paired["adaptive"]
    best[fastest] = min(best[fastest], paired[fastest])
    for r in rows:
        r["seconds"] = round(best[r["shape"]], 4)
        r["tokens_per_second"] = round(r["tokens"] / best[r["shape"]], 1)
    summary = dict(fastest_fixed=fastest, cost_per_round_s=[round(c, 4) for c in per_round],
                   calibration_taus=[round(t, 3) for t in cal_taus],
                   reachable=[shapes[i].label() for i in policy.reachable()],
                   adaptive_over_fastest_fixed_tokens_per_second=round(paired[fastest] / paired["adaptive"], 3),
                   control_over_fastest_fixed=round(paired[fastest] / paired["control"], 3), **cpu_summary(cpu),
                   budget_bytes=budget, expert_bytes_all=store.total_bytes)
    log(f"[{label}] {summary}")
    return rows, summary


def fit_head(args) -> int:
    """The shipped branch head: training-split prompts only (seeds `--head-seeds`), deterministic; reports the
    cross-entropy of the head and of the draft's marginals on held-out prompts."""
    import dflash_jax
    from dflash_jax import SHIPPED_PAIR
    from dflash_jax.pair import save_branch_head
    from dflash_jax.train.branch_head import branch_head_data, fit_branch_head, marginal_ce
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(args.checkpoint or SHIPPED_PAIR, branch_head=False)
    t0 = time.perf_counter()
    seeds = [int(x) for x in args.head_seeds.split(",")]
    parts = []
    for seed in seeds:
        parts.append(branch_head_data(pair, file_windows(pair, "train", args.head_windows, args.prompt_len, seed),
                                      seed=seed))
        log(f"head data: seed {seed} done ({time.perf_counter() - t0:.0f} s)")
    data = {k: np.concatenate([d[k] for d in parts]) for k in parts[0]}
    held = branch_head_data(pair, file_windows(pair, "held_out", args.head_windows, args.prompt_len, 0), seed=0,
                            anchors_per_seq=0)
    head, losses = fit_branch_head(pair, data, steps=args.head_steps)
    ce = dict(marginals=round(marginal_ce(pair, held), 4), head=round(marginal_ce(pair, held, head), 4))
    log(f"held-out cross-entropy at block positions 1..B-1 (teacher-forced parents): {ce} "
        f"({time.perf_counter() - t0:.0f} s)")
    path = save_branch_head(head, pair.directory, pair=pair, fitted_on=dict(
        split="train", seeds=seeds, windows=args.head_windows, prompt_len=args.prompt_len, continuation=96,
        anchors_per_seq=32, examples=int(len(data["label"])), steps=args.head_steps,
        final_loss=round(losses[-1], 4), held_out_ce=ce))
    log(f"wrote {os.path.relpath(path)}")
    return 0


def main(argv=None) -> int:
    p = h.parser(__doc__, {
        "--sets": ("held_out:0,train:1", "prompt sets split:seed (held_out / train)"),
        "--chains": "4,8,16", "--trees": "8,16,32", "--branch": (8, "candidates per node of the calibrated trees"),
        "--calib-seeds": ("7,11,13,17", "training-split prompt sets (seeds) the tree build's acceptance model is "
                                        "fitted on"),
        "--no-calibration": (False, "build trees from the draft's marginals"),
        "--no-branch-head": (False, "build the measured trees from the draft's marginals even when the pair carries "
                                    "a branch head"),
        "--no-offload": False, "--offload-prompts": 2, "--offload-new": 32,
        "--offload-repeats": (6, "paired repeats, adaptive vs the fastest fixed"),
        "--paired-repeats": (6, "resident paired repeats"),
        "--offload-calib-repeats": (4, "offloaded calibration repeats"),
        "--margin": (0.15, "the adaptive policy's prior toward the cheapest shape (AdaptivePolicy.margin): another "
                           "shape must promise this much more tokens/s; the spread of identical work by CPU time here"),
        "--fit-calibration": (False, "fit the tree build's acceptance model on --fit-seeds and write it beside the "
                                     "pair (spec.calibration_file.CALIBRATION_FILE, loaded by default), then exit"),
        "--fit-seeds": ("7,11,13,17,19,23,29,31,37,41,43,47,53,59,61,67,71,73,79,83,89,97",
                        "training-split prompt sets (seeds) for --fit-calibration"),
        "--fit-branch-head": (False, "fit the pair's branch head (models.draft.BranchHeadWeights) on training-split "
                                     "prompts and write it beside the checkpoint (dflash_jax.pair.BRANCH_HEAD_FILE), "
                                     "then exit"),
        "--head-seeds": ("101,102,103,104,105,106,107,108", "training-split prompt sets (seeds) for --fit-branch-head"),
        "--head-windows": (256, "prompts per --head-seeds set"), "--head-steps": 3000,
        "--clock": ("cpu", "the adaptive policy's calibration clock: process CPU seconds (the work) or wall seconds",
                    ("cpu", "wall")),
        "--keep-resident": (False, "reuse the resident rows of the tree.json already in the output directory "
                                   "(offloaded only)")},
        checkpoint=None, prompts=6, prompt_len=64, max_new=64, repeats=3)
    args = h.parse(p, argv, quick=dict(sets="held_out:0", prompts=1, prompt_len=32, max_new=8, chains="4",
                                       trees="8", branch=2, repeats=1, paired_repeats=1, no_offload=True,
                                       calib_seeds="7"))
    out_dir = args.out_dir

    import jax

    import dflash_jax
    from dflash_jax import SHIPPED_PAIR, testing
    from dflash_jax.spec.calibration_file import CALIBRATION_FILE, pair_calibration, save_calibration
    from dflash_jax.spec.tree import DEFAULT_TEMPERATURE, TreeShape
    from dflash_jax.train.data import file_windows
    from dflash_jax.train.tiny_pair import target_config
    from study.tree_calibration import calibration_samples, fit_calibration

    branch = args.branch
    if args.fit_branch_head:
        return fit_head(args)
    pair = dflash_jax.load(args.checkpoint or SHIPPED_PAIR)
    sets = h.prompt_sets(pair, args.sets, args.prompts, args.prompt_len)
    calib = [p for _, p in h.prompt_sets(pair, "train:7,train:11", args.prompts, args.prompt_len)]
    def fit(seeds):
        t0 = time.perf_counter()
        samples = np.concatenate([calibration_samples(pair, file_windows(pair, "train", args.prompts, args.prompt_len,
                                                                         int(seed)), max_new_tokens=args.max_new)
                                  for seed in seeds.split(",")])
        fitted = fit_calibration(samples)
        log(f"tree calibration fitted on {len(samples)} candidates of train seeds {seeds}: {fitted.weights} "
            f"({time.perf_counter() - t0:.0f} s)")
        return fitted, len(samples)

    if args.fit_calibration:  # the shipped acceptance model: training-split prompts only, deterministic
        fitted, n_rows = fit(args.fit_seeds)
        path = save_calibration(fitted, pair.directory, pair=pair, fitted_on=dict(
            split="train", seeds=[int(x) for x in args.fit_seeds.split(",")], prompts=args.prompts,
            prompt_len=args.prompt_len, max_new_tokens=args.max_new, tree="N=32 K=8 plain build", rows=n_rows))
        log(f"wrote {os.path.relpath(path)}")
        return 0
    cal, cal_rows, cal_from = None, 0, ""
    if not args.no_calibration:  # the build's acceptance model, fitted on training-split prompts only
        cal = pair_calibration(pair)
        if cal is not None:
            with open(os.path.join(pair.directory, CALIBRATION_FILE)) as fh:
                fitted_on = json.load(fh)["fitted_on"]
            cal_rows, cal_from = fitted_on["rows"], f"the pair's shipped {CALIBRATION_FILE}, "
            seeds = ",".join(str(x) for x in fitted_on["seeds"])
        else:
            cal, cal_rows = fit(args.calib_seeds)
            seeds = args.calib_seeds
        cal_from += f"{cal_rows} candidates of training-split prompts (seeds {seeds}, never the measured sets)"
    global HAS_HEAD
    HAS_HEAD = pair.draft.branch_head is not None and not args.no_branch_head
    head_from = ""
    if HAS_HEAD:
        from safetensors import safe_open

        from dflash_jax.pair import BRANCH_HEAD_FILE

        with safe_open(os.path.join(pair.directory, BRANCH_HEAD_FILE), framework="numpy") as fh:
            fitted = json.loads(fh.metadata()["fitted_on"])
        head_from = (f"{BRANCH_HEAD_FILE}, {fitted['examples']} examples of seeds {fitted['seeds']}, held-out "
                     f"cross-entropy {fitted['held_out_ce']['head']} vs the marginals' "
                     f"{fitted['held_out_ce']['marginals']}")
    widest = max(int(t) for t in args.trees.split(","))
    shapes = ([("chain", TreeShape(int(b), 1)) for b in args.chains.split(",")]
              + [("tree", TreeShape(int(t), branch, calibration=cal, use_head=HAS_HEAD))
                 for t in args.trees.split(",")])
    policy_shapes = [s for _, s in shapes]
    if HAS_HEAD:  # reference: the calibrated marginal build (the earlier default)
        shapes.append(("tree", TreeShape(widest, branch, calibration=cal, use_head=False)))
    shapes.append(("tree", TreeShape(widest, 4, use_head=False)))  # the plain build, reference
    log(f"sets {[s for s, _ in sets]} of {args.prompts} prompts x {args.prompt_len} tokens, {args.max_new} new; "
        f"shapes {[label(s) for _, s in shapes]} (draft temperature {DEFAULT_TEMPERATURE})")
    if args.keep_resident:
        with open(os.path.join(out_dir, "tree.json")) as fh:
            old = json.load(fh)
        rows, summary = old["rows"], old["summary"]
        from dflash_jax.spec.policy import VerifyCost

        cost = VerifyCost(tuple(old["warmup_cost_s"]))
        reach, res_taus = old.get("reachable", []), old.get("calibration_taus", [])
    else:
        rows, summary, policy = resident(args, pair, shapes, calib, sets, policy_shapes)
        cost, res_taus = policy.cost, list(policy.taus)
        reach = [label(policy.shapes[i]) for i in policy.reachable()]

    off_rows, off_summary = [], {}
    if not args.no_offload:
        oshapes = [TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 4)]
        ocal = [p for _, p in h.prompt_sets(pair, "train:7,train:11", args.offload_prompts, args.prompt_len)]
        oprompts = sets[0][1][: args.offload_prompts]
        r, s = offloaded(args, "shipped pair, 4 of 8 experts", pair, oprompts, ocal, oshapes, 0.5)
        off_rows += r
        off_summary["shipped"] = s
        cfg = target_config(num_experts=64, top_k=4, expert_intermediate=32)
        rpair = testing.random_pair(cfg, seed=0, expert_format="mxfp4")
        rng = np.random.default_rng(0)
        rp = [rng.integers(0, cfg.vocab_size - 2, args.prompt_len).tolist() for _ in range(3 * args.offload_prompts)]
        r, s = offloaded(args, "route-study shape, 64 experts top-4, 16 of 64 cached", rpair,
                         rp[: args.offload_prompts], [rp[args.offload_prompts: 2 * args.offload_prompts],
                                                      rp[2 * args.offload_prompts:]], oshapes, 0.25)
        off_rows += r
        off_summary["route_study"] = s

    result = dict(checkpoint=os.path.basename((args.checkpoint or SHIPPED_PAIR).rstrip("/")), prompts=args.prompts,
                  repeats=args.repeats, prompt_len=args.prompt_len, max_new=args.max_new, branch=branch,
                  temperature=DEFAULT_TEMPERATURE, warmup_cost_s=[round(c, 5) for c in cost.seconds],
                  calibration_taus=[round(t, 3) for t in res_taus], reachable=reach, calibration_range=list(RANGE),
                  tree_calibration=list(cal.weights) if cal else None, tree_calibration_rows=cal_rows,
                  tree_calibration_from=cal_from, margin=args.margin, branch_head=head_from or None,
                  platform=f"{platform.machine()} {jax.devices()[0].platform}, jax {jax.__version__}",
                  rows=rows, summary=summary, offloaded=off_rows, offloaded_summary=off_summary, lossless=True)
    report = h.Report(args, "tree")
    report.json(result)
    has_plot = report.plot(draw(rows), ncols=3, figsize=(13, 3.6))
    md = ["# Chain vs tree verification vs the adaptive policy", "",
          f"`python benchmarks/tree.py --write-docs` - shipped pair; prompt sets of {args.prompts} stdlib windows of "
          f"{args.prompt_len} tokens as one batch, {args.max_new} new tokens each, greedy; "
          + (f"trees `K=k head`: k candidates a node, each node's children from the pair's branch head "
             f"(`{head_from}`: the draft's distribution at the next position given the node's token, fitted on "
             "training-split prompts only); " if HAS_HEAD else "")
          + "trees `K=k cal`: built from the draft's marginals scored by the acceptance model "
          f"(`spec.tree.TreeCalibration`): {cal_from}; "
          "a tree with neither is the plain build (the draft's marginals); chains are the draft's argmax chain; "
          f"{result['platform']}. Every run's output equals the target's plain greedy output. Expert union: "
          "distinct experts per MoE layer that one verify's rows route to (mean over layers and rounds; first "
          "set).", ""]
    md += h.table(["set", "shape", "tokens / round", "experts / layer / verify", "off-chain rounds", "tokens/s",
                   "rounds"],
                  [[r["set"], r["shape"], f"{r['tokens_per_round']:.2f}",
                    "" if r["expert_union_per_round"] is None else f"{r['expert_union_per_round']:.1f}",
                    "" if r["off_chain_rounds"] is None else f"{r['off_chain_rounds']:.2f}",
                    f"{r['tokens_per_second']:.0f}", r["rounds"]] for r in rows])
    md.append("")
    for name, s in summary.items():
        md.append(f"- **{name}**: best tree ({s['best_tree']}) / best chain ({s['best_chain']}) tokens per round "
                  f"**{s['tree_over_best_chain_tokens_per_round']:.2f}x** (budget <= 32: "
                  f"{s['tree_budget_le_32_over_best_chain']:.2f}x"
                  + (f"; the best marginal build, {s['best_marginal_tree']}: {s['marginal_tree_over_best_chain']:.2f}x"
                     if "best_marginal_tree" in s else "")
                  + f"); adaptive / fastest fixed ({s['fastest_fixed']}) "
                  f"tokens/s, paired: **{s['adaptive_over_fastest_fixed_tokens_per_second']:.2f}x** (control, the "
                  f"fastest fixed against itself: {s['control_over_fastest_fixed']:.2f}x); by process CPU time "
                  f"against the least of the fixed shapes ({s['least_cpu_fixed']}): "
                  f"**{s['adaptive_over_least_cpu_fixed']:.2f}x**; rounds per "
                  f"shape {s['adaptive_rounds']}")
    md += ["", "Adaptive policy figures (`spec.calibrate.calibrate_policy`: each shape's fixed loop on two batches of "
           f"training-split calibration prompts (seeds 7, 11), {args.clock} seconds per run over its rounds, the "
           f"least of the interleaved repeats, and tokens per round, each the mean of the batches; calibration "
           f"range {RANGE}; prior toward the cheapest shape: margin {args.margin}, i.e. another shape is chosen only "
           f"when its figures promise more than {args.margin:.0%} above the cheapest's tokens/s): "
           + ", ".join(f"{label(s)} {c * 1e3:.1f} ms, tau {t:.2f}" for s, c, t in
                       zip(policy_shapes, cost.seconds, res_taus))
           + f"; shapes it can choose (compiled, provisioned): {reach}. Tokens/s are CPU figures on a shared "
           "2-core machine (fastest of the interleaved repeats; the adaptive row's from its paired repeats with "
           "the fastest fixed shape). Process CPU time: the least over the same runs of this process's CPU "
           "seconds (all threads), the work each run did; on a machine shared with other jobs the wall time "
           "also carries their load (the control's spread shows how much).", ""]
    if off_rows:
        md += ["## Offloaded (experts in host memory, `draft_router` prefetch)", "",
               f"{args.offload_prompts} prompts, {args.offload_new} new tokens; seconds the fastest of 2 "
               f"interleaved runs of the fixed shapes, then {args.offload_repeats} paired runs of the adaptive "
               "policy and the fastest fixed shape (the ratio below); the adaptive policy's figures are the fixed "
               f"shapes' offloaded {args.clock} seconds per round (transfers included; per calibration batch the "
               f"median of {args.offload_calib_repeats} interleaved runs, two batches of training-split prompts "
               f"(seeds 7, 11; random prompts for the random pair), their seconds over their rounds) and tokens per "
               f"round (the batches' mean), calibration range {RANGE}, margin {args.margin} toward the cheapest "
               "shape; it provisions only the shapes it can choose.", ""]
        md += h.table(["pair, cache", "shape", "tokens / round", "expert MB moved / round", "tokens/s",
                       "rounds chosen"],
                      [[r["set"], r["shape"], f"{r['tokens_per_round']:.2f}", f"{r['bytes_moved_per_round'] / 1e6:.3f}",
                        f"{r['tokens_per_second']:.0f}", r["chosen"] or ""] for r in off_rows])
        md.append("")
        for name, s in off_summary.items():
            md.append(f"- **{name}**: adaptive / fastest fixed ({s['fastest_fixed']}) tokens/s "
                      f"**{s['adaptive_over_fastest_fixed_tokens_per_second']:.2f}x** (control, the fastest fixed "
                      f"against a second generator of it: {s['control_over_fastest_fixed']:.2f}x); by process CPU "
                      f"time against the least of the fixed shapes ({s['least_cpu_fixed']}): "
                      f"**{s['adaptive_over_least_cpu_fixed']:.2f}x**; calibration "
                      f"ms/round {[round(c * 1e3, 1) for c in s['cost_per_round_s']]}, tau {s['calibration_taus']}; "
                      f"reachable {s['reachable']}")
        md.append("")
    if has_plot:
        md += ["![tree benchmark](tree.png)", ""]
    report.markdown(md)
    log(f"wrote {out_dir}/tree.json, tree.md" + (", tree.png" if has_plot else ""))
    print(json.dumps(dict(resident=summary, offloaded=off_summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
