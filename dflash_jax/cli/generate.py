"""`dflash-generate`: lossless DFlash speculative generation from a converted checkpoint.

  dflash-generate --prompt "def fib(n):"                       # the small trained pair shipped with the package
  dflash-generate --pair tiny_pair_qwen3_5 --prompt "def fib(n):"   # the shipped hybrid (Qwen3.5-MoE) pair
  dflash-generate --checkpoint DIR --prompt-ids 1,2,3 --json --trace

`--json` prints one object: `tokens` (generated ids), `acceptance_lengths` (tokens committed per round),
`stats` (tokens/s, mean acceptance tau, rounds, time split), and with `--trace` a per-round `trace` of
`proposal` (the B-1 draft tokens), `accepted` and `bonus`.

`--proposer chain|head-chain|selector|tree|adaptive` picks what the draft proposes each round (default: the
selector chain for a DFlash 2 draft, else the measured choice: plain decoding (width 1, no draft forward) and the
chain of the block each timed on the prompt at warm-up (`decode.measured_policy`, `stats.measured_default`),
the chain kept only where it measures faster; `--no-measure`, `--proposer chain`, a named `--block-size` or named
compiled shapes run the chain as is;
`--tree-budget N`, `--tree-branch K` shape the tree), `--experts device|offload` where the target's experts live, `--loop jit|python`
the driver; every combination runs except offloaded experts in the jitted loop (`dflash_jax.api.CAPABILITIES`).
The older spellings `--head-chain`, `--adaptive`, `--offload` and `--tree-budget N` alone still work for this
release.

`--experts offload --expert-budget-mb X [--predictor NAME] [--pin-experts auto|none|N] [--placement device|hybrid]`
keeps the routed experts in pinned host memory and verifies through one device expert cache of X MB shared by
every MoE layer (`dflash_jax.offload`; any X from one expert up runs, a smaller one is refused at once with the
minimum); `stats` then also has `offload` (budget, cache slots, pinned experts) and `route_ahead` (coverage,
waste, hit rate, bytes moved, transfer vs hide window), and each `--trace` round its `bytes_moved`
(host->device expert bytes), `hits`, `misses`, `on_demand`, `host`, `prefetched`, `coverage` and `passes`.

`--mesh expert=4,tensor=2` restores the pair straight into its shardings on a (data, expert, tensor) device mesh
and generates on it (`dflash_jax.sharding`, docs/sharding.md); `stats.mesh` names the mesh. With offloaded experts the
non-expert weights are placed on the mesh and each device caches its share of the expert budget's slots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Sequence

from dflash_jax import SHIPPED_PAIR, SHIPPED_PAIRS  # noqa: F401  (re-exported for scripts)
from dflash_jax.api import EXPERTS, PROPOSERS
from dflash_jax.cli.errors import exit_on_signals, run_cli, run_interruptibly

PROG = "dflash-generate"
INT32_MAX = 2**31 - 1


class UsageError(Exception):
    pass


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty: give at least one token id")
    huge = [i for i in ids if abs(i) >= 2**31]
    if huge:
        raise UsageError(f"token id {huge[0]} is far outside any vocabulary; ids are 0 .. vocab size - 1")
    negative = [i for i in ids if i < 0]
    if negative:
        raise UsageError(f"token id {negative[0]} is negative; ids are 0 .. vocab size - 1")
    return ids


def _check_int_flag(flag: str, value: int | None, low: int, high: int = INT32_MAX, what: str = "") -> None:
    """An integer flag in [low, high] (every count the run traces is an int32), or one line naming it."""
    if value is None:
        return
    if value < low:
        raise UsageError(f"{flag} must be >= {low}{what}, got {value}")
    if value > high:
        bound = "2^31 - 1" if high == INT32_MAX else str(high)
        raise UsageError(f"{flag} must be at most {bound}{what}, got {value}")


def check_numbers(args) -> None:
    """Every numeric flag in range, before anything loads or traces (the sampling values are checked by
    `SamplingParams`, in `sampling_params`; ids in `_parse_ids`; the block size against the draft at load)."""
    _check_int_flag("--max-new-tokens", args.max_new_tokens, 1,
                    what=" (and the prompt plus it must fit the target's positions)")
    if not -2**63 <= args.seed < 2**63:
        raise UsageError(f"--seed must fit in 64 bits (-2^63 .. 2^63 - 1), got {args.seed}")
    _check_int_flag("--tree-budget", args.tree_budget, 1, what=" (nodes per verify)")
    _check_int_flag("--capacity", getattr(args, "capacity", None), 2, what=" (cache rows)")
    _check_int_flag("--tree-branch", args.tree_branch, 1)
    _check_int_flag("--predictor-width", args.predictor_width, 1, what=" (experts per token)")
    budget = args.expert_budget_mb
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise UsageError(f"--expert-budget-mb must be a finite number of MB > 0, got {budget:g}")
    if args.pflash_keep is not None and not 0 < args.pflash_keep <= 1:
        raise UsageError(f"--pflash-keep must be a fraction in (0, 1] (1 keeps every token), got {args.pflash_keep:g}")


def sampling_params(args):
    """`SamplingParams` from the flags; its range errors name the flag (`dflash_jax.spec.sampling`)."""
    from dflash_jax.spec.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, mode=args.acceptance)
    except (TypeError, ValueError) as e:
        message = str(e)
        for name, flag in (("temperature", "--temperature"), ("top_p", "--top-p"), ("top_k", "--top-k")):
            if message.startswith(name):
                message = flag + message[len(name):]
        raise UsageError(message) from None


def add_dequantize_flag(group) -> None:
    """`--dequantize-experts`, shared by dflash-generate and dflash-serve (read by `load_pair`)."""
    group.add_argument("--dequantize-experts", choices=["auto", "yes", "no"], default="auto",
                       help="dequantize FP4 experts once at load (auto: where no FP4 kernel runs, i.e. the CPU, and "
                            "they take at most 25%% of memory; never with --experts offload, which moves FP4 bytes)")


def load_pair(directory: str, args, *, offload: bool, mesh=None, branch_head: bool):
    """The pair as both CLIs load it: offloaded experts as stored in pinned host memory (FP4 bytes are what moves);
    else on the device (or `mesh`), the FP4 expert tables dequantized once per `--dequantize-experts` ("auto": where
    no FP4 kernel runs and memory allows, and not across a mesh's shards)."""
    import dflash_jax

    dequantize = {"auto": "auto", "yes": True, "no": False}[args.dequantize_experts]
    if offload and dequantize is True:
        raise UsageError("--dequantize-experts yes does not combine with --experts offload (it moves the FP4 bytes)")
    return dflash_jax.load(directory, expert_memory="pinned_host" if offload else "device",
                           dequantize_experts=False if offload or (mesh is not None and dequantize == "auto")
                           else dequantize, mesh=None if offload else mesh, branch_head=branch_head)


def load_tokenizer(pair):
    path = pair.tokenizer_path
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-generate", description=__doc__.splitlines()[0])
    ckpt = p.add_argument_group("checkpoint")
    ckpt.add_argument("--checkpoint", help="a convert-weights checkpoint directory (default: the shipped tiny pair)")
    ckpt.add_argument("--pair", metavar="NAME", default=None,
                      help=f"a pair shipped with the package, by name: {', '.join(SHIPPED_PAIRS)} (default: "
                           f"tiny_pair, the Qwen3-MoE pair; tiny_pair_qwen3_5 is the hybrid Qwen3.5-MoE one; "
                           "tiny_pair_dflash2 a DFlash 2 draft of tiny_pair's target, tiny_pair_qwen3_5_dflash2 one of "
                           "the hybrid's)")
    add_dequantize_flag(ckpt)
    req = p.add_argument_group("request")
    src = req.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json and `tokenizers`)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    req.add_argument("--max-new-tokens", type=int, default=64)
    req.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    req.add_argument("--top-p", type=float, default=1.0)
    req.add_argument("--top-k", type=int, default=0)
    req.add_argument("--acceptance", choices=["exact_match", "rejection"], default="exact_match",
                     help="sampling acceptance rule (temperature > 0)")
    req.add_argument("--seed", type=int, default=0)
    req.add_argument("--stop-ids", default=None, help="comma-separated stop token ids (default: the target's eos)")
    req.add_argument("--ignore-eos", action="store_true", help="no stop tokens: always generate --max-new-tokens")
    prop = p.add_argument_group("proposer (what the draft proposes each round; every choice is lossless)")
    prop.add_argument("--proposer", choices=list(PROPOSERS), default=None,
                      help="chain: the draft's per-position argmax (DFlash, the default for a DFlash 1 draft); "
                           "head-chain: the chain from the pair's branch head, each position given the previous "
                           "proposal; selector: a DFlash 2 draft's candidate-selector chain (its default); tree: a "
                           "token tree of "
                           "--tree-budget nodes (from the branch head when the pair ships one); adaptive: each round's "
                           "shape (chain B = 4/8/16 or tree N = 8/16/32) chosen from the acceptance so far and each "
                           "shape's cost")
    prop.add_argument("--block-size", type=int, default=None, help="verify width B (default: the draft's trained size)")
    prop.add_argument("--no-measure", action="store_true",
                      help="with no --proposer named: run the draft's chain as is, without first measuring it against "
                           "plain decoding on the prompt (by default, with no --block-size, --capacity or --bucketed named, "
                           "the run decodes plain where the chain measures no faster)")
    prop.add_argument("--tree-budget", type=int, default=None,
                      help="nodes per tree verify, the anchor included (--proposer tree; default 16; alone it implies "
                           "--proposer tree)")
    prop.add_argument("--tree-branch", type=int, default=4, help="candidates per tree node")
    prop.add_argument("--no-branch-head", action="store_true",
                      help="build trees from the draft's per-position marginals even when the pair ships a branch head")
    prop.add_argument("--head-chain", action="store_true", help=argparse.SUPPRESS)  # old name of --proposer head-chain
    prop.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)  # old name of --proposer adaptive
    off = p.add_argument_group("experts (where the target's routed experts live)")
    off.add_argument("--experts", choices=list(EXPERTS), default=None,
                     help="device: resident (default); offload: in pinned host memory, verified through one device "
                          "expert cache of --expert-budget-mb shared by every MoE layer (lossless: the same tokens)")
    off.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)  # old name of --experts offload
    off.add_argument("--expert-budget-mb", type=float, default=None,
                     help="device memory for the expert cache in MB (1e6 bytes), shared by every MoE layer; any value "
                          "from one expert up runs (a layer whose routed experts do not fit runs in passes); "
                          "required with --experts offload")
    off.add_argument("--pin-experts", default="auto",
                     help="auto: pin the prompt's hottest experts in what one layer's routed union leaves; none; or N: "
                          "at most N pinned (layer, expert) pairs")
    off.add_argument("--placement", default="device", choices=["device", "hybrid"],
                     help="hybrid: cold experts computed on the host CPU when the cost model says that beats copying")
    off.add_argument("--predictor", default="draft_router",
                     help="route-ahead prefetch: none | previous | draft_router | residual (next layer's router on "
                          "the verify's residual, one layer ahead) | a '+'-joined union, e.g. previous+residual")
    off.add_argument("--predictor-width", type=int, default=None,
                     help="experts per token the predictor prefetches (default: the target's top-k)")
    run_g = p.add_argument_group("driver and compiled shapes")
    run_g.add_argument("--loop", choices=["jit", "python"], default=None,
                       help="jit: one compiled while_loop; python: stepping loop with the draft/verify/host time split "
                            "(default: python with --trace or --experts offload, else jit)")
    shapes = run_g.add_mutually_exclusive_group()
    shapes.add_argument("--capacity", type=int, default=None, metavar="N",
                        help="cache rows of the compiled programs: any prompt + --max-new-tokens + block size up to N "
                             "runs on the same programs (default: the smallest of 256 / 512 / 1024 / 2048 rows that "
                             "holds the request, at most the target's positions)")
    shapes.add_argument("--bucketed", action="store_true",
                        help="size the programs by the request's prompt / budget buckets instead (a new bucket "
                             "compiles again)")
    run_g.add_argument("--mesh", default=None,
                       help="run on a device mesh, e.g. expert=4,tensor=2 (axes data, expert, tensor; their sizes "
                            "multiply to at most the device count): experts sharded along E, heads / MLPs / vocab along "
                            "tensor (docs/sharding.md); with --experts offload each device caches its share of the "
                            "experts")
    run_g.add_argument("--no-compile-cache", action="store_true",
                       help="skip the persistent compilation cache (also DFLASH_JAX_CACHE_DIR=off; default location: "
                            "$DFLASH_JAX_CACHE_DIR, else $XDG_CACHE_HOME/dflash_jax/jax, else ~/.cache/dflash_jax/jax)")
    pf = p.add_argument_group("prefill compression (lossy)")
    pf.add_argument("--pflash-keep", type=float, default=None, metavar="R",
                    help="PFlash prefill compression: prefill only the fraction R (0 < R <= 1) of the prompt a scorer "
                         "finds most attended (sink tokens, the last window and whole chunks), at their original "
                         "positions, then decode as usual (docs/pflash.md)")
    pf.add_argument("--pflash-scorer", default=None, metavar="DIR",
                    help="the scorer for --pflash-keep: a convert-weights checkpoint whose target scores the prompt "
                         "(default: the generating pair's own target)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--trace", action="store_true", help="include per-round proposal / accepted / bonus")
    return p


MEASURE_TOKENS = 16  # tokens per calibration run of the default's choice (plain decoding or the chain)


def shape_name(shape) -> str:
    """"plain" for a width-1 shape, else "chain B=N"."""
    return "plain" if shape.budget == 1 else f"chain B={shape.budget}"


def measure_default(args, proposer_name: str, offload: bool, driver: str) -> bool:
    """Whether the run's proposer is the measured default (`decode.measured_policy`): greedy decoding, no
    proposer named, the pair's default is the argmax chain, resident experts, the jitted loop,
    no PFlash prefill, no verify width named (`--block-size B` asks for the chain at B) and no compiled shapes
    named (`--capacity`, `--bucketed`: the chain's loop), and `--no-measure` not given. A named `--proposer chain`
    runs the fixed chain."""
    return (named_no_proposer(args) and proposer_name == "chain" and not offload and driver == "jit"
            and args.pflash_keep is None and not args.no_measure and args.block_size is None
            and getattr(args, "capacity", None) is None and not getattr(args, "bucketed", False)
            and args.temperature == 0)


def named_no_proposer(args) -> bool:
    """Whether the flags leave the proposer to the pair (`api.default_proposer`)."""
    return args.proposer is None and not args.head_chain and not args.adaptive and args.tree_budget is None


def resolve_vocabulary(args) -> tuple[str, str, str]:
    """(proposer, experts, driver) from the flags, the old spellings included (--head-chain, --adaptive, --offload,
    --tree-budget alone); one UsageError for a contradiction or a combination that cannot run (`api.CAPABILITIES`)."""
    from dflash_jax.api import CAPABILITIES

    implied = [name for flag, name in ((args.head_chain, "head-chain"), (args.adaptive, "adaptive")) if flag]
    if len(implied) > 1 or (implied and args.proposer not in (None, implied[0])):
        raise UsageError(f"--proposer {args.proposer or implied[0]} and --{implied[-1]} contradict: "
                         "pass one --proposer")
    proposer = args.proposer or (implied[0] if implied else "tree" if args.tree_budget is not None else "chain")
    if args.tree_budget is not None and proposer not in ("tree", "adaptive"):
        raise UsageError(f"--tree-budget applies to --proposer tree, not {proposer}")
    if args.no_branch_head and proposer not in ("tree", "adaptive"):
        raise UsageError("--no-branch-head only applies to trees: add --proposer tree (or adaptive)")
    if args.offload and args.experts == "device":
        raise UsageError("--offload and --experts device contradict: pass one --experts")
    experts = args.experts or ("offload" if args.offload else "device")
    if args.loop == "jit" and experts == "offload":
        raise UsageError(CAPABILITIES[(proposer, experts, "jit")] + ": drop --loop jit")
    driver = {"jit": "jit", "python": "stepping"}.get(args.loop) or (
        "stepping" if args.trace or experts == "offload" else "jit")
    if args.trace and driver == "jit":
        raise UsageError("--trace needs --loop python (the jitted loop keeps rounds on the device)")
    why = CAPABILITIES[(proposer, experts, driver)]
    if why is not None:
        raise UsageError(why)
    return proposer, experts, driver


def shape_buckets(args):
    """The compiled shapes the flags ask for: None (the loops' capacity mode, `spec.loop.LOOP_BUCKETS`), another
    capacity (--capacity N) or the bucketed shapes (--bucketed)."""
    from dflash_jax.spec.requests import Buckets

    if getattr(args, "capacity", None) is not None:
        return Buckets(capacity=args.capacity, pad_batch=True)
    if getattr(args, "bucketed", False):
        return Buckets(pad_batch=True)
    return None


def resolve_pair(checkpoint: str | None, pair: str | None) -> str:
    """The checkpoint directory from --checkpoint / --pair (neither: the default shipped pair)."""
    if checkpoint is not None and pair is not None:
        raise UsageError("--pair and --checkpoint both name a checkpoint: pass one of them (--pair NAME for a "
                         "shipped pair, --checkpoint DIR for a convert-weights output)")
    if pair is None:
        return checkpoint or SHIPPED_PAIR
    if pair not in SHIPPED_PAIRS:
        raise UsageError(f"--pair {pair!r} is not a shipped pair; the shipped pairs are: "
                         f"{', '.join(SHIPPED_PAIRS)} (or pass --checkpoint DIR)")
    return SHIPPED_PAIRS[pair]


def run(args) -> dict:
    import dflash_jax
    from dflash_jax import compile_cache
    from dflash_jax.spec import generate, generate_stepping

    directory = resolve_pair(args.checkpoint, getattr(args, "pair", None))
    if args.checkpoint is None and not os.path.exists(os.path.join(directory, "manifest.json")):
        raise UsageError("the shipped pair is missing from this installation; pass --checkpoint DIR "
                         "(a convert-weights output) or reinstall dflash_jax")
    check_numbers(args)
    proposer_name, experts, driver = resolve_vocabulary(args)
    offload = experts == "offload"
    sampling = sampling_params(args)
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--prompt is not valid UTF-8 text; check the terminal's (or the file's) encoding") from None
    if offload:
        from dflash_jax.offload import PREDICTORS

        if args.expert_budget_mb is None:
            raise UsageError("--experts offload needs --expert-budget-mb X (device MB for the expert pool, X > 0)")
        if args.predictor not in PREDICTORS:
            raise UsageError(f"--predictor must be one of {', '.join(PREDICTORS)}, got {args.predictor!r}")
        pin = pin_experts_arg(args.pin_experts)
        check_expert_budget(directory, args.expert_budget_mb)  # before anything heavy: from the manifest alone
    elif args.expert_budget_mb is not None:
        raise UsageError("--expert-budget-mb only applies with --experts offload")
    tree = proposer_name in ("tree", "adaptive")
    if args.pflash_keep is not None:
        if args.pflash_scorer is not None and not os.path.exists(os.path.join(args.pflash_scorer, "manifest.json")):
            raise UsageError(f"--pflash-scorer {args.pflash_scorer} is not a convert-weights checkpoint (no "
                             "manifest.json): pass a directory that convert-weights wrote")
    elif args.pflash_scorer is not None:
        raise UsageError("--pflash-scorer only applies with --pflash-keep R")
    mesh = None
    if args.mesh is not None:
        from dflash_jax.sharding import make_mesh, parse_mesh_spec

        parse_mesh_spec(args.mesh)  # a bad spec is refused before anything loads
        if offload and args.placement == "hybrid":
            raise UsageError("--placement hybrid does not combine with --mesh (host compute runs beside one "
                             "device): use --placement device, or drop --mesh")
        mesh = make_mesh(args.mesh)
    if args.no_compile_cache:
        compile_cache.disable()
    else:
        compile_cache.ensure_enabled()
    pair = load_pair(directory, args, offload=offload, mesh=mesh,  # offload: shards placed below
                     branch_head=(tree and not args.no_branch_head) or proposer_name == "head-chain")
    if named_no_proposer(args) and args.pflash_keep is None:  # the pair's default (DFlash 2: its selector chain)
        from dflash_jax.api import default_proposer

        proposer_name = default_proposer(pair)
    tokenizer = load_tokenizer(pair)
    if args.prompt is not None:
        if tokenizer is None:
            raise UsageError(f"{directory} has no tokenizer.json (or the `tokenizers` package is missing): "
                             "use --prompt-ids")
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        if not prompt:
            raise UsageError("--prompt encodes to no tokens: give a non-empty prompt")
    else:
        prompt = _parse_ids(args.prompt_ids)
    if args.ignore_eos:
        stops: list[int] = []
    elif args.stop_ids:
        stops = _parse_ids(args.stop_ids)
    else:
        stops = [t for t in pair.target_cfg.eos_token_ids if 0 <= t < pair.target_cfg.vocab_size]
    if offload and args.predictor_width is not None:
        experts = _routed_experts(pair.target_cfg)
        if experts and args.predictor_width > experts:
            raise UsageError(f"--predictor-width must be in 1 .. {experts} (the target's routed experts per layer), "
                             f"got {args.predictor_width}")
    if sampling.greedy and sampling.filters:
        print("dflash-generate: note: --top-p / --top-k do nothing at --temperature 0 (greedy decoding)",
              file=sys.stderr)
    from dflash_jax.api import make_proposer

    proposer = make_proposer(pair, proposer_name, tree_budget=args.tree_budget or 16, tree_branch=args.tree_branch,
                             branch_head=not args.no_branch_head)
    measured = None
    if measure_default(args, proposer_name, offload, driver):  # plain decoding unless the chain measures faster
        from dflash_jax.decode import measured_policy

        with compile_cache.compile_notice(compile_cache.print_notice("dflash-generate")):
            proposer = measured_policy(pair, [prompt], block_size=args.block_size,
                                       max_new_tokens=min(MEASURE_TOKENS, args.max_new_tokens),
                                       buckets=shape_buckets(args))
        measured = {shape_name(s): {"ms_per_round": round(t * 1e3, 3), "tokens_per_round": tau}
                    for s, t, tau in zip(proposer.shapes, proposer.seconds(), proposer.tokens_per_round())}
        measured["chosen"] = shape_name(proposer.shapes[proposer.reachable()[0]])
    kept = None
    if args.pflash_keep is not None:  # a prefill strategy: every proposer, driver and placement runs after it
        from dflash_jax import pflash

        scorer = (pflash.load_scorer(args.pflash_scorer) if args.pflash_scorer is not None
                  else pflash.Scorer.from_pair(pair))
        kept = [pflash.compress(scorer, prompt, keep_ratio=args.pflash_keep)]
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling,
                  block_size=None if measured is not None else args.block_size,  # measured: the chosen chain's
                  stop_ids=stops, seed=args.seed, warmup=True, buckets=shape_buckets(args), kept=kept)
    on_mesh = contextlib.nullcontext() if mesh is None else jax_set_mesh(mesh)
    with compile_cache.compile_notice(compile_cache.print_notice("dflash-generate")), on_mesh:
        if offload:
            from dflash_jax.offload import OffloadedGenerator, PoolTooSmall

            request = {k: v for k, v in kwargs.items() if k not in ("block_size", "warmup", "buckets")}
            try:
                hybrid = None
                if args.placement == "hybrid":
                    from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth
                    from dflash_jax.offload.hybrid import HostCompute

                    hybrid = HostCompute.for_pair(pair, probe_host_to_device_bandwidth())
                gen = OffloadedGenerator(pair, budget_bytes=int(args.expert_budget_mb * 1e6), prefetcher=args.predictor,
                                         width=args.predictor_width, block_size=args.block_size, pin=pin,
                                         hybrid=hybrid, mesh=mesh, buckets=kwargs["buckets"], proposer=proposer)
                warm = gen.prefill([prompt], **request)  # compiles the prefill and a round: the timed run is compiled
                if not warm.done:
                    gen.round(warm)
                del warm
                result = gen.generate([prompt], trace=args.trace, **request)
            except PoolTooSmall as e:
                raise UsageError(str(e).replace("expert budget", "--expert-budget-mb")) from None
        elif measured is not None:  # the measured choice, plain decoding by the fastest plain loop
            from dflash_jax.decode import generate_default

            result = generate_default(pair, [prompt], proposer, **kwargs)
        elif driver == "jit":
            result = generate(pair, [prompt], proposer=proposer, **kwargs)
        else:
            result = generate_stepping(pair, [prompt], trace=args.trace, proposer=proposer, **kwargs)
    out = {
        "tokens": result.tokens[0],
        "acceptance_lengths": result.acceptance_lengths[0],
        "stats": dict(result.stats, prompt_tokens=len(prompt), checkpoint=os.path.abspath(directory),
                      expert_format=pair.expert_format),
    }
    if measured is not None:
        out["stats"]["measured_default"] = measured
    if mesh is not None:
        from dflash_jax.sharding import describe

        out["stats"]["mesh"] = describe(mesh)
    if tokenizer is not None:
        out["text"] = tokenizer.decode(result.tokens[0])
    if args.trace:
        out["trace"] = [{k: row[0][k] for k in ("proposal", "accepted", "bonus") + OFFLOAD_TRACE if k in row[0]}
                        for row in result.trace if row[0] is not None]
    return out


def jax_set_mesh(mesh):
    import jax  # loaded by then; kept out of the module so that --help answers before jax starts

    return jax.set_mesh(mesh)


# per-round offload fields of --trace (`offload.stats.TraceObserver`)
OFFLOAD_TRACE = ("bytes_moved", "hits", "misses", "on_demand", "host", "prefetched", "coverage", "passes")


def _routed_experts(cfg) -> int:
    """The routed experts per MoE layer of a target config (0 when it has none)."""
    return int(getattr(getattr(cfg, "moe", None), "num_experts", 0) or 0)


def pin_experts_arg(value: str):
    """`--pin-experts`: True for auto, False for none, or a count N."""
    if value in ("auto", "none"):
        return value == "auto"
    if value.isdigit():
        _check_int_flag("--pin-experts", int(value), 0)
        return int(value)
    raise UsageError(f"--pin-experts must be auto, none or a count N >= 0, got {value!r}")


def check_expert_budget(directory: str, budget_mb: float) -> None:
    """Refuses a budget below the smallest that runs, from the checkpoint's manifest (no weights loaded)."""
    from dflash_jax.checkpoint import read_manifest
    from dflash_jax.offload.cache import min_budget_from_manifest

    minimum, total = min_budget_from_manifest(read_manifest(directory))
    if total == 0:
        raise UsageError("--offload needs an MoE target (this checkpoint's target has no routed experts)")
    if budget_mb * 1e6 < minimum:
        raise UsageError(f"--expert-budget-mb {budget_mb:g} is below the minimum of {minimum / 1e6:.6g} MB (one expert "
                         f"of each expert shape; all experts: {total / 1e6:.6g} MB): raise --expert-budget-mb to at "
                         f"least {minimum / 1e6:.6g}")


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. The run (imports, loading, compiling, generating) goes through `run_interruptibly`: SIGINT /
    SIGTERM at any moment of it end the process within a fraction of a second with one line and 130 / 143,
    never a traceback or a crash at exit (its docstring says why the process must end by `os._exit`, and
    why that is safe here: nothing but the atomic compile-cache entries is written before the output, and
    the output is written whole by the main thread, signals held)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # bad block size, token ids, sampling values, bad checkpoints raise ValueError: one line, exit 2
    code = run_cli(PROG, lambda: run_interruptibly(PROG, lambda: run(args), finish=lambda out: _print(args, out)),
                   known=(UsageError, ValueError))
    if argv is None:  # this process is the CLI (the console script, `python -m`): its exit is not interrupted
        exit_on_signals(PROG)
    return code


def _run_and_print(args) -> int:
    return _print(args, run(args))


def _print(args, out: dict) -> int:
    if args.json:
        print(json.dumps(out), flush=True)
        return 0
    s = out["stats"]
    print(out.get("text", " ".join(map(str, out["tokens"]))), flush=True)
    split = s.get("time_split")
    split_text = (f", draft {split['draft_s']:.3f}s / verify {split['verify_s']:.3f}s / host {split['host_s']:.3f}s"
                  if split else "")
    print(f"-- {len(out['tokens'])} tokens, {s.get('tokens_per_second', 0):.1f} tok/s, "
          f"tau {s['mean_acceptance']:.2f} tokens/round, {s['rounds']} rounds, block {s['block_size']}{split_text}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
