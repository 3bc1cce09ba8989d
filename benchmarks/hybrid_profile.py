"""Where a verify forward of the shipped hybrid Qwen3.5-MoE target spends its time, piece by piece, by width.

  python benchmarks/hybrid_profile.py [--widths 1,4,8,16] [--reps 40] [--dequantize-experts] [--quick]
                                     [--out DIR | --write-docs]

After a 128-token prefill of a held-out prompt (cache rollback width 16, as a B=16 DFlash run keeps), each piece
of the target's forward is jitted alone and timed at widths T = 1 / 4 / 8 / 16 (one sequence): the whole
forward (all logits, the draft's taps) with the routed experts as the model runs them and with them through
`ragged_dot` (what the model ran before), one MoE layer both ways, its shared expert, a DeltaNet mixer and
its parts (committing kept rows, the qkv projection + causal conv, the gated delta rule), the gated
attention mixer, the final norm + lm_head, the rollback after a verify, and the draft's round after one round
(a later round's draft reads only the rows the last one accepted, as in a run, not the whole prompt).

Timing: each piece runs as a compiled loop of `--calls` calls (`looped`: a piece's own time, no dispatch), the
wall time of a loop over its calls, the median over `--reps` loops made in turn (pieces interleaved,
`timing.paired_runs`), with XLA's CPU runtime on one thread (set before jax is imported), so that the pieces add
up; per-core costs, not the wall time of a multi-threaded run. (Process CPU time undercounts here: a loop of a
small piece measured 1.4 ms wall and 0.1 ms CPU, the runtime's waits between its steps being no one's CPU time,
and a minimum of such CPU times had read a width-8 forward below a width-4 one.) Writes hybrid_profile.{json,md}
to --out (default bench_out/) or, with --write-docs, to docs/benchmarks/.
"""

from __future__ import annotations

import functools
import os
import platform
import sys

import harness as h

os.environ.setdefault("XLA_FLAGS", h.ONE_THREAD)


MOVE_MAX = 8192  # the largest input a loop's call moves (elements): tokens, activations, states; not KV or weights


def looped(piece, calls: int, weights=(0,)):
    """One compiled program running `piece` `calls` times in a `fori_loop`, so that a call's time is the piece's
    own (no dispatch: jitted alone, a tiny piece's call is mostly Python and pytree flattening, which inflated the
    narrow widths most). Every input of at most `MOVE_MAX` elements outside the `weights` operands moves by 0 x the
    last call's result (a 0 behind an optimization barrier), and one element of every output, at an index the
    compiler cannot know, feeds the next:
    no work is hoisted out of the loop or left out of a call, and no large buffer is copied for it."""
    import jax
    import jax.numpy as jnp

    def run(*operands):
        parts = [jax.tree.flatten(x) for x in operands]

        def moves(i, x):
            return (i not in weights and jnp.size(x) <= MOVE_MAX
                    and jnp.issubdtype(jnp.result_type(x), jnp.number))

        def body(_, acc):
            # a 0 the compiler cannot fold (x * 0 -> 0 would leave every input loop-invariant, and hoisted)
            _, zero = jax.lax.optimization_barrier((acc, acc * 0))
            ins = [jax.tree.unflatten(tree, [x + zero.astype(jnp.result_type(x)) if moves(i, x) else x
                                             for x in leaves])
                   for i, (leaves, tree) in enumerate(parts)]
            at = zero.astype(jnp.int32)
            return acc + sum(jnp.ravel(x)[at].astype(jnp.float32) for x in jax.tree.leaves(piece(*ins)))

        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))

    return jax.jit(run)


def main(argv=None) -> int:
    p = h.parser(__doc__, {"--widths": "1,4,8,16", "--reps": 7, "--calls": (100, "calls of a piece per compiled loop"),
                           "--dequantize-experts": (
        False, "expert tables dequantized at load (dflash-generate on a CPU); default: FP4 as stored")})
    args = h.parse(p, argv, quick=dict(widths="1,4", reps=1, calls=2))
    widths = h.int_list(p, args.widths, "--widths")
    if max(widths) > 16 or args.reps < 1 or args.calls < 1:
        p.error("--widths must be in 1..16 (the rollback width), --reps and --calls >= 1")

    import jax
    import jax.numpy as jnp

    import dflash_jax
    from dflash_jax.models import qwen3_5 as q
    from dflash_jax.nn import gated_deltanet as gdn
    from dflash_jax.nn.mlp import swiglu
    from dflash_jax.nn.moe import swiglu_experts
    from dflash_jax.spec import session

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIRS["tiny_pair_qwen3_5"], dequantize_experts=args.dequantize_experts)
    w, cfg = pair.target, pair.target_cfg
    prompt = h.prompts(pair, 1, 128)[0]
    width = q.DEFAULT_ROLLBACK_WIDTH
    c0 = q.forward_jit(w, jnp.asarray([prompt], jnp.int32), q.init_cache(cfg, 1, 512, rollback_width=width), cfg,
                       logits="last").cache
    taps = tuple(range(cfg.num_layers))
    lin_i = cfg.linear_layers[0]
    att_i = cfg.full_layers[0]
    lin_layer, att_layer = w.layers[lin_i], w.layers[att_i]

    def forward(impl):
        return jax.jit(lambda w, t, c: q.forward(w, t, c, cfg, tap_layers=taps, logits="all", implementation=impl))

    def moe_layer(as_run):
        def run(layer, x):
            h = q.mlp_input(layer, x, cfg)
            rt = q.route(layer.mlp, h, cfg)
            return swiglu_experts(h, rt.experts, rt.weights, layer.mlp.gate_up, layer.mlp.down,
                                  implementation="auto" if as_run else "xla")
        return jax.jit(run)

    def shared(layer, x):
        h = q.mlp_input(layer, x, cfg)
        m = layer.mlp
        return jax.nn.sigmoid(h @ m.shared_gate) * swiglu(h, m.shared.gate, m.shared.up, m.shared.down)

    def qkv_conv(lw, h, tail):
        window = jnp.concatenate([tail, h @ lw.qkv], axis=1)
        return jax.nn.silu(gdn.causal_depthwise_conv(window, lw.conv))

    rows = {}
    for t in widths:
        blk = jnp.asarray([prompt[:t]], jnp.int32)
        x, ctx = q.block_context(w, blk, c0, cfg)
        c16 = q.forward_jit(w, jnp.asarray([prompt[:width]], jnp.int32), c0, cfg).cache
        c3 = c16.replace(lengths=c0.lengths + 3)  # 3 of the 16 kept rows accepted: the next forward commits them
        fwd, fwd_ragged = forward("auto"), forward("xla")
        after = fwd(w, blk, c0).cache
        lin = c0.linear[0]
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        key = jax.random.split(jax.random.key(t), 3)
        kq = gdn.l2_normalize(jax.random.normal(key[0], (1, t, hk, dk)))
        vv = jax.random.normal(key[1], (1, t, hv, dv))
        g = -jnp.abs(jax.random.normal(key[2], (1, t, hv)))
        pieces = {
            "forward (as run)": (fwd, (w, blk, c0)),
            "forward, experts via ragged_dot (before)": (fwd_ragged, (w, blk, c0)),
            "forward committing 3 kept rows first": (fwd, (w, blk, c3)),
            "MoE routed experts, 1 layer (as run)": (moe_layer(True), (lin_layer, x)),
            "MoE routed experts, 1 layer, ragged_dot (before)": (moe_layer(False), (lin_layer, x)),
            "shared expert, 1 layer": (jax.jit(shared), (lin_layer, x)),
            "DeltaNet mixer, 1 layer": (
                jax.jit(lambda l, x, s, c: q.mixer_sublayer(l, x, s, c, "linear_attention", cfg)),
                (lin_layer, x, lin, ctx)),
            "  committing 3 kept rows": (
                jax.jit(gdn.committed_state), (c16.linear[0], jnp.full((1,), 3, jnp.int32)), ()),
            "  qkv projection + causal conv": (jax.jit(qkv_conv), (lin_layer.mixer, x, lin.conv_window[:, :3])),
            "  gated delta rule": (
                jax.jit(gdn.gated_delta_rule), (kq * dk**-0.5, kq, vv, g, jax.nn.sigmoid(g), lin.state), ()),
            "gated attention mixer": (jax.jit(lambda l, x, s, c: q.mixer_sublayer(l, x, s, c, "full_attention", cfg)),
                                      (att_layer, x, (c0.keys[0], c0.values[0]), ctx)),
            "final norm + lm_head": (jax.jit(lambda w, x: q.lm_head_logits(w, q.final_norm(w, x, cfg))), (w, x)),
            "rollback after the verify": (jax.jit(lambda c: q.rollback(c, c.linear_lengths + 1)), (after,), ()),
        }
        if t > 1:
            spec, state = session.begin(pair, [prompt], block_size=t, max_new_tokens=64)
            # one round first: a later round's draft reads only the rows the last one accepted, not the whole prompt
            state = session.verify_round_jit(w, state, session.draft_round_jit(w, pair.draft, state, spec), spec)
            pieces["draft round (block T)"] = (functools.partial(session.draft_round, spec=spec),
                                                (w, pair.draft, state), (0, 1))
        loops = {k: looped(f, args.calls, *rest) for k, (f, _, *rest) in pieces.items()}
        runs = {k: (lambda f=loops[k], a=a: jax.block_until_ready(f(*a))) for k, (_, a, *_) in pieces.items()}
        for run in runs.values():
            run()
        times = h.paired_runs(runs, args.reps, alternate=False)
        rows[t] = {k: round(times.stat(k, "wall", "median") / args.calls * 1e3, 4) for k in runs}
        print(t, rows[t], flush=True)

    names = list(dict.fromkeys(k for r in rows.values() for k in r))
    result = {"pair": "tiny_pair_qwen3_5", "dequantize_experts": args.dequantize_experts, "reps": args.reps,
              "backend": jax.default_backend(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "ms_by_width": rows}
    stem = "hybrid_profile" + ("_dense" if args.dequantize_experts else "")
    tables = "dequantized at load" if args.dequantize_experts else "FP4 as stored, dequantized in every forward"
    md = [f"# The hybrid target's forward, piece by piece (CPU, expert tables {tables})", "",
          f"`python benchmarks/hybrid_profile.py{' --dequantize-experts' if args.dequantize_experts else ''} "
          f"--write-docs` - ms per call on one core (wall time of a compiled loop of {args.calls} calls over "
          f"{args.calls}, the median of {args.reps} interleaved loops, XLA on one thread); batch 1 after a 128-token "
          f"prefill, rollback width 16; {result['machine']}.", ""]
    md += h.table(["piece"] + [f"T={t}" for t in rows],
                  [[k] + [f"{rows[t][k]:.3f}" if k in rows[t] else "-" for t in rows] for k in names])
    h.Report(args, stem).write(result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
