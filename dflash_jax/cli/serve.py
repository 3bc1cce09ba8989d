"""`dflash-serve`: an OpenAI-compatible server (continuous batching, DFlash rounds) on a converted checkpoint.

  dflash-serve                                   # the small trained pair shipped with the package, 127.0.0.1:8000
  dflash-serve --checkpoint DIR --slots 8 --port 8080

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true), GET /v1/models,
/health, /metrics (Prometheus). Ctrl-C / SIGTERM: no new requests, in-flight ones finish (up to
--grace-seconds), then the rest is cancelled. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Sequence

from dflash_jax import SHIPPED_PAIR
from dflash_jax.cli.errors import run_cli
from dflash_jax.cli.generate import add_dequantize_flag
from dflash_jax.errors import UsageError

# the most rounds of one device call: `serve.runner.MAX_BURST`, written out so that the parser imports no JAX (a test
# holds the two equal)
MAX_ROUNDS_PER_CALL = 64

# the verify block B when --block-size is not given, with the default widths (1,B) or --widths fixed (docs/serving.md,
# "Which default": with the experts dense at load the shipped pair on a CPU serves 4 - 32 clients no faster than plain
# at a fixed block of 4; width 1 or 4 chosen per round follows the load)
DEFAULT_FIXED_BLOCK = 4
GREEDY_PROGRAMS = {"auto": None, "on": True, "off": False}  # --greedy-programs -> Engine(greedy_programs=)
DEFAULT_WIDTHS = "1,B"  # the default --widths of a chain proposer: no speculation or the block, chosen per round


def parse_widths(text: str, block_size: int | None = None):
    """--widths as the engine takes it: None ('fixed'), 'auto', or a list of ints, where B stands for the block size
    (`block_size`; None: checked only). One UsageError naming the forms otherwise."""
    if text in ("fixed", "auto"):
        return None if text == "fixed" else "auto"
    items = [w.strip() for w in text.split(",")]
    try:
        widths = [(block_size or 1) if w in ("B", "b") else int(w) for w in items]
    except ValueError:
        raise UsageError(f"--widths must be 'auto', 'fixed' or a comma list of integers (B: the block size), got "
                         f"{text!r}") from None
    if not widths or min(widths) < 1:
        raise UsageError(f"--widths must be positive integers, got {text!r}")
    return widths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-serve", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a convert-weights checkpoint directory (default: the shipped tiny pair)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every endpoint but /health (/metrics included); "
                        "default: the DFLASH_API_KEY environment variable, else no key")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint's name)")
    p.add_argument("--slots", type=int, default=None,
                   help="batch slots: requests decoded together (a compiled shape; every row bucket up to it compiles at "
                        "warm-up). Default: as many as the device's free memory holds (on the CPU: half the available "
                        "RAM, at most 8 per core) at --max-prompt-len, at most 256; the numbers are printed at start")
    p.add_argument("--block-size", type=int, default=None,
                   help="the verify block B, the widest with --widths auto (default: 4 with the default widths, "
                        "--widths fixed or a list naming B; the draft's trained size with --widths auto or a list of "
                        "numbers; the default is at most the draft's size; 1 = no speculation)")
    p.add_argument("--widths", default=None,
                   help="the verify widths the engine chooses each round's from, by its cost model (learned while "
                        "serving): a comma list, B standing for the block size (e.g. 1,4,8 or 1,B); 'auto' (1, 2, "
                        "4, .. B); or 'fixed' (every round verifies B). Default: 1,B (no speculation or the block; "
                        "the narrower width is warmed after start), fixed with a tree proposer")
    p.add_argument("--no-learn-costs", action="store_true",
                   help="keep the width chooser's warm-up cost table as measured (default: learn it from the rounds "
                        "served, per row bucket, exploring a stale neighbouring width now and then)")
    p.add_argument("--explore-every", type=int, default=8,
                   help="at most one round in N of a row bucket runs a neighbouring width whose cost entry is stale, "
                        "to re-measure it (default 8; 0: never explore)")
    p.add_argument("--acceptance-budget", type=float, default=0.03,
                   help="the share of the served time the width chooser may lose running a drafting width it would "
                        "not pick, to measure what the draft accepts (default 0.03; 0: only the first try)")
    p.add_argument("--no-acceptance-exploration", action="store_true",
                   help="never run a drafting width the acceptance estimate rules out (default: try one now and "
                        "then, within --acceptance-budget, so that a prior that undersells the draft is corrected)")
    p.add_argument("--greedy-programs", choices=("auto", "on", "off"), default="auto",
                   help="rounds whose every live request is greedy run a program without the sampling work, the other "
                        "rounds the general one (both compiled at warm-up): 'auto' (the default) where the platform "
                        "runs a conditional from the host (a GPU: two waits a round saved), 'on', or 'off' (one "
                        "program: half the round programs to compile)")
    p.add_argument("--rounds-per-call", default="auto",
                   help="rounds one device call may run while every live request verifies every round and the host "
                        "has nothing to do between them: 'auto' (the default: as many as fit in --call-ms by the "
                        "rounds' measured time, at most %d) or a number 1..%d (1: the host looks after every round). "
                        "Streams then get a call's tokens at once; outputs never change"
                        % (MAX_ROUNDS_PER_CALL, MAX_ROUNDS_PER_CALL))
    p.add_argument("--call-ms", type=float, default=50.0,
                   help="the device time one call of several rounds aims at (--rounds-per-call auto; default 50): "
                        "how often a stream gets tokens at least, and how long a new request may wait for a call "
                        "to end")
    p.add_argument("--lanes", default="auto",
                   help="the slots split over this many runners whose rounds run side by side on their own threads: "
                        "'auto' (the default: one per core on a CPU with the experts on the device, at most what "
                        "divides --slots; 1 elsewhere; DFLASH_LANES overrides it) or a number (1: one runner)")
    prop = p.add_argument_group("proposer (what the draft proposes each round; every choice is lossless)")
    prop.add_argument("--proposer", choices=["chain", "head-chain", "selector", "tree", "adaptive"], default=None,
                      help="chain: the draft's argmax chain at --block-size (--widths chooses among widths; the "
                           "default, except for a DFlash 2 pair); head-chain: the chain from the pair's branch head; "
                           "selector: a DFlash 2 draft's candidate-selector chain (its default); tree: a token tree of --tree-budget "
                           "nodes every round; adaptive: each round's shape (chains of 1, 2, 4, .. B and the tree) "
                           "chosen by the cost model, learned while serving (the same as tree with --widths auto)")
    prop.add_argument("--tree-budget", type=int, default=None,
                      help="nodes per tree verify, the anchor included (--proposer tree / adaptive; default 16)")
    prop.add_argument("--tree-branch", type=int, default=4, help="candidates per tree node")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt served, in tokens. Default: the target's context, halved until at least 4 "
                        "slots fit in memory (with --slots: the longest prompt that many slots fit)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="largest max_tokens a request may ask")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="a prompt longer than this many tokens is prefilled one chunk per round while the running "
                        "requests keep decoding (prompts up to --max-prompt-len, which may reach the target's "
                        "context); 0: every prompt prefilled whole in one go (default: 256)")
    p.add_argument("--prefix-cache-mb", type=float, default=1024.0, metavar="MB",
                   help="prefix caching: a prompt that shares its first chunks with one prefilled before starts from "
                        "the cached caches at that chunk boundary (outputs equal a cold prefill's); snapshots kept "
                        "in MB of device memory, least recently used evicted first (default: 1024)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--max-request-mb", type=float, default=8.0,
                   help="largest request body in MB (1e6 bytes); a larger one gets 413 before it is read (default 8)")
    p.add_argument("--acceptance", choices=["exact_match", "rejection"], default="exact_match",
                   help="acceptance rule of sampled requests (temperature > 0)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="scheduler: verify tokens per round (default: unlimited, every live slot verifies)")
    p.add_argument("--round-expert-mb", type=float, default=None,
                   help="scheduler: expert MB (1e6 bytes) a round's verify may read, the union over its sequences "
                        "(default: unlimited)")
    p.add_argument("--grace-seconds", type=float, default=10.0,
                   help="on shutdown, how long in-flight requests may run before they are cancelled")
    p.add_argument("--mesh", default=None,
                   help="serve on a device mesh, e.g. expert=4,tensor=2 (axes data, expert, tensor; their sizes multiply "
                        "to at most the device count): the pair is restored into its shardings (docs/sharding.md)")
    p.add_argument("--no-warmup", action="store_true", help="compile on the first requests instead of at start")
    p.add_argument("--no-compile-cache", action="store_true", help="skip the persistent compilation cache")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    pf = p.add_argument_group("prefill compression (lossy; as dflash-generate)")
    pf.add_argument("--pflash-keep", type=float, default=None, metavar="R",
                    help="PFlash: a prompt of at least --pflash-min-tokens tokens is scored as it arrives and only the "
                         "fraction R (0 < R < 1) a scorer finds most attended is prefilled (sink tokens, the last "
                         "window, whole chunks), at the original positions; decoding is unchanged (docs/pflash.md)")
    pf.add_argument("--pflash-scorer", default=None, metavar="DIR",
                    help="the scorer for --pflash-keep: a convert-weights checkpoint whose target scores the prompt "
                         "(default: the served pair's own target)")
    pf.add_argument("--pflash-min-tokens", type=int, default=1024, metavar="N",
                    help="compress only prompts of at least N tokens (default 1024; shorter ones prefill whole)")
    off = p.add_argument_group("experts (where the target's routed experts live; as dflash-generate)")
    off.add_argument("--experts", choices=["device", "offload"], default=None,
                     help="device: resident (default); offload: in pinned host memory, the admitted rows' projected "
                          "experts prefetched into one device cache before each verify; lossless (same tokens)")
    off.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)  # old name of --experts offload
    add_dequantize_flag(off)
    off.add_argument("--expert-budget-mb", type=float, default=None,
                     help="device memory for the expert cache in MB (1e6 bytes), shared by every MoE layer and "
                          "request; any value from one expert up runs; required with --offload. The scheduler's byte "
                          "budget (--round-expert-mb: bytes a round may move, its projected experts not in the cache) "
                          "defaults to it")
    off.add_argument("--pin-experts", default="auto",
                     help="auto: pin the first prompts' hottest experts in what one round's routed union leaves; none; "
                          "or N: at most N pinned (layer, expert) pairs")
    off.add_argument("--placement", default="device", choices=["device", "hybrid"],
                     help="hybrid: cold experts computed on the host CPU when the cost model says that beats copying")
    off.add_argument("--predictor", default="draft_router", choices=["draft_router", "none"],
                     help="prefetch: draft_router (the scheduler's demand, the admitted rows' projected experts) or "
                          "none (fetch on demand only)")
    return p


def check_args(args) -> None:
    """Flag errors a user can make, before anything heavy is imported."""
    if getattr(args, "mesh", None) is not None:
        from dflash_jax.sharding import parse_mesh_spec

        parse_mesh_spec(args.mesh)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if getattr(args, "api_key", None) is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty (leave it out for a server without a key)")
    for name in ("slots", "max_prompt_len", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if getattr(args, "prefill_chunk", 0) < 0:
        raise UsageError(f"--prefill-chunk must be >= 0 (0: whole prompts), got {args.prefill_chunk}")
    if args.token_budget is not None and args.token_budget < 1:
        raise UsageError(f"--token-budget must be >= 1, got {args.token_budget}")
    if args.round_expert_mb is not None and not args.round_expert_mb > 0:
        raise UsageError(f"--round-expert-mb must be > 0, got {args.round_expert_mb}")
    if args.widths is not None:
        parse_widths(args.widths)
    rpc = getattr(args, "rounds_per_call", "auto")
    if rpc != "auto":
        try:
            args.rounds_per_call = int(rpc)
        except ValueError:
            raise UsageError(f"--rounds-per-call must be 'auto' or a number of rounds 1..{MAX_ROUNDS_PER_CALL}, "
                             f"got {rpc!r}") from None
        if not 1 <= args.rounds_per_call <= MAX_ROUNDS_PER_CALL:
            raise UsageError(f"--rounds-per-call must be 'auto' or a number of rounds 1..{MAX_ROUNDS_PER_CALL}, "
                             f"got {rpc!r}")
    lanes = getattr(args, "lanes", "auto")
    if lanes != "auto":
        if not str(lanes).isdigit() or int(lanes) < 1:
            raise UsageError(f"--lanes must be 'auto' or a positive number of lanes, got {lanes!r}")
        args.lanes = int(lanes)
    if not 0.1 <= getattr(args, "call_ms", 50.0) <= 10000:
        raise UsageError(f"--call-ms must be in 0.1..10000 milliseconds, got {args.call_ms:g}")
    if getattr(args, "explore_every", 0) < 0:
        raise UsageError(f"--explore-every must be >= 0 (0: never explore), got {args.explore_every}")
    if not 0.0 <= getattr(args, "acceptance_budget", 0.03) <= 1.0:
        raise UsageError(f"--acceptance-budget must be a share of the served time in 0..1, got "
                         f"{args.acceptance_budget:g}")
    if not 0 <= args.grace_seconds <= 86400:
        raise UsageError(f"--grace-seconds must be in 0..86400, got {args.grace_seconds}")
    if not 1e-3 <= getattr(args, "max_request_mb", 8.0) <= 1e5:
        raise UsageError(f"--max-request-mb must be in 0.001..100000, got {args.max_request_mb}")
    directory = args.checkpoint or SHIPPED_PAIR
    if getattr(args, "offload", False) and getattr(args, "experts", None) == "device":
        raise UsageError("--offload and --experts device contradict: pass one --experts")
    args.offload = getattr(args, "offload", False) or getattr(args, "experts", None) == "offload"
    proposer = getattr(args, "proposer", "chain")
    if getattr(args, "tree_budget", None) is not None:
        if proposer not in ("tree", "adaptive"):
            raise UsageError(f"--tree-budget applies to --proposer tree (or adaptive), not {proposer}")
        if args.tree_budget < 2:
            raise UsageError(f"--tree-budget must be >= 2 (the anchor and at least one proposal), got {args.tree_budget}")
    if getattr(args, "tree_branch", 4) < 2 and proposer in ("tree", "adaptive"):
        raise UsageError(f"--tree-branch must be >= 2 for a tree (1 is the chain: --proposer chain), got "
                         f"{args.tree_branch}")
    if proposer in ("tree", "adaptive") and args.widths not in (None, "fixed", "auto"):
        raise UsageError(f"--widths {args.widths} chooses chain widths: drop it with --proposer {proposer}")
    if getattr(args, "prefix_cache_mb", 1.0) < 0:
        raise UsageError(f"--prefix-cache-mb must be >= 0 (0: off, as --no-prefix-cache), got {args.prefix_cache_mb:g}")
    keep = getattr(args, "pflash_keep", None)
    if keep is not None:
        if not 0 < keep < 1:
            raise UsageError(f"--pflash-keep must be a fraction in (0, 1) (leave it out to prefill whole), got {keep:g}")
        if args.pflash_min_tokens < 1:
            raise UsageError(f"--pflash-min-tokens must be >= 1, got {args.pflash_min_tokens}")
        if args.pflash_scorer is not None and not os.path.exists(os.path.join(args.pflash_scorer, "manifest.json")):
            raise UsageError(f"--pflash-scorer {args.pflash_scorer} is not a convert-weights checkpoint (no "
                             "manifest.json): pass a directory that convert-weights wrote")
    elif getattr(args, "pflash_scorer", None) is not None:
        raise UsageError("--pflash-scorer only applies with --pflash-keep R")
    if getattr(args, "offload", False):
        from dflash_jax.cli import generate as generate_cli  # the same checks as dflash-generate --offload

        if args.expert_budget_mb is None or args.expert_budget_mb <= 0:
            raise UsageError("--experts offload needs --expert-budget-mb X (device MB for the expert cache, X > 0)")
        if args.mesh is not None:
            raise UsageError("--experts offload serves on one device: drop --mesh (or serve resident on the mesh)")
        if getattr(args, "dequantize_experts", "auto") == "yes":
            raise UsageError("--dequantize-experts yes does not combine with --experts offload (it moves the FP4 "
                             "bytes): drop it")
        try:
            generate_cli.pin_experts_arg(args.pin_experts)
            if os.path.exists(os.path.join(directory, "manifest.json")):
                generate_cli.check_expert_budget(directory, args.expert_budget_mb)  # from the manifest alone
        except generate_cli.UsageError as e:
            raise UsageError(str(e)) from None
    elif getattr(args, "expert_budget_mb", None) is not None:
        raise UsageError("--expert-budget-mb only applies with --experts offload")
    if not os.path.exists(os.path.join(directory, "manifest.json")):
        if args.checkpoint is None:
            raise UsageError("the shipped pair is missing from this installation; pass --checkpoint DIR")
        raise UsageError(f"{directory} is not a convert-weights checkpoint (no manifest.json): pass the directory "
                         "convert-weights wrote")
    try:
        import fastapi  # noqa: F401  (optional dependency: the serve extra)
        import uvicorn  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as e:
        raise UsageError(f"dflash-serve needs the serve extra ({e.name} is missing): pip install 'dflash_jax[serve]'") \
            from None


def chat_template(directory: str, side_file=None):
    """The checkpoint's chat template as a checked, sandboxed `serve.templates.ChatTemplate`, or None when it has none.

    HF's places, in HF's order: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or
    a list of named templates, of which "default" is used). `side_file(name) -> path | None` finds a file and
    verifies it against the checkpoint's checksums (`Pair.side_file`: an edited or added template file is refused
    in one line); without it the directory's files are read as they are. A template that is not valid Jinja,
    fails on a plain conversation or reaches for Python internals is refused here, at start, in one line: it is
    never run."""
    from dflash_jax.errors import CheckpointError, open_regular
    from dflash_jax.serve.templates import ChatTemplate, TemplateRefused

    def find(name: str) -> str | None:
        if side_file is not None:
            return side_file(name)
        path = os.path.join(directory, name)
        return path if os.path.lexists(path) else None

    try:
        jinja, config = find("chat_template.jinja"), find("tokenizer_config.json")
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    try:
        if jinja is not None:
            with open_regular(jinja, UsageError, what="chat template file") as f:
                text, source = f.read().decode("utf-8"), jinja
        elif config is not None:
            with open_regular(config, UsageError, what="tokenizer config file") as f:
                data = json.loads(f.read().decode("utf-8"))
            if not isinstance(data, dict):
                raise UsageError(f"{config} is not a JSON object: restore the checkpoint's tokenizer_config.json")
            text, source = data.get("chat_template"), f"the chat template in {config}"
            if isinstance(text, list):  # [{"name": ..., "template": ...}]: the default one
                named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
                text = named.get("default")
            if text is None:
                return None
        else:
            return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{jinja or config} cannot be read as a chat template "
                         f"({type(e).__name__}: {e}); restore it from the checkpoint's source") from None
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    try:
        return ChatTemplate(text, source=source)
    except TemplateRefused as e:
        raise UsageError(f"{e} (checkpoint {directory})") from None


API_KEY_ENV = "DFLASH_API_KEY"


def api_key_of(args) -> str | None:
    """--api-key, else the DFLASH_API_KEY environment variable, else None (no key)."""
    key = getattr(args, "api_key", None)
    if key is None:
        key = os.environ.get(API_KEY_ENV) or None
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only answers this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_access_warning(args) -> str | None:
    """The warning printed at start when the server listens beyond this machine with no API key (None: no warning)."""
    if api_key_of(args) is not None or is_loopback(args.host):
        return None
    return (f"listening on {args.host} with no API key: anyone who can reach this port can use it (set --api-key or "
            f"{API_KEY_ENV})")


def capacity_of(args, pair, block_size, widths, proposer, prefix_bytes: int, offload: bool) -> tuple[int, int]:
    """(slots, max_prompt_len) fitted to the device's memory for the pair (`serve.capacity.plan`, its one line
    printed): a flag given is kept (the other fitted to it); both given must fit, else one error naming the numbers."""
    from dflash_jax.serve import capacity
    from dflash_jax.spec.tree import TreeShape

    widest = block_size or pair.draft_cfg.block_size
    if widths not in (None, "auto"):
        widest = max(widest, *[int(w) for w in widths])
    if isinstance(proposer, TreeShape):
        widest = max(widest, proposer.budget)
    expert_cache = int(args.expert_budget_mb * 1e6) if offload and args.expert_budget_mb else 0
    try:
        cap = capacity.plan(pair, widest=widest, max_new_tokens=args.max_new_tokens, prefix_cache_bytes=prefix_bytes,
                            expert_cache_bytes=expert_cache, slots=args.slots, max_prompt_len=args.max_prompt_len)
    except capacity.CapacityError as e:
        raise UsageError(str(e)) from None
    print(f"dflash-serve: {cap.describe()}", file=sys.stderr, flush=True)
    return cap.slots, cap.max_prompt_len


def build_app(args):
    """(the FastAPI app, the engine) for parsed arguments: loads the pair and warms the engine up."""
    from dflash_jax import compile_cache
    from dflash_jax.cli.generate import load_pair, load_tokenizer
    from dflash_jax.serve.engine import Engine, attach_cost_metrics
    from dflash_jax.spec.policy import CostRule
    from dflash_jax.serve.server import create_app

    if args.no_compile_cache:
        compile_cache.disable()
    else:
        compile_cache.ensure_enabled()
    directory = args.checkpoint or SHIPPED_PAIR
    mesh = None
    if getattr(args, "mesh", None) is not None:
        from dflash_jax.sharding import make_mesh

        mesh = make_mesh(args.mesh)
    offload = getattr(args, "offload", False)
    proposer_name = getattr(args, "proposer", None)
    head = proposer_name in ("head-chain", "tree", "adaptive")  # the branch head is read only when used
    # the experts as dflash-generate loads them: dense once at load where no FP4 kernel runs (the CPU), else every
    # round would dequantize every table (2.7x a round's time at 32 rows on the shipped pair)
    pair = load_pair(directory, args, offload=offload, mesh=mesh, branch_head=head)
    template = chat_template(directory, pair.side_file)  # verified, checked (or refused) before the long warm-up
    try:
        text = DEFAULT_WIDTHS if args.widths is None else args.widths
        block_size = args.block_size
        if block_size is None and text not in ("fixed", "auto") and "B" in text.upper().split(","):
            block_size = min(DEFAULT_FIXED_BLOCK, pair.draft_cfg.block_size)  # B: the block of --widths fixed
        widths = parse_widths(text, block_size)
        proposer = None
        if proposer_name is None:  # the pair's default: a DFlash 2 draft's selector chain, else the chain
            from dflash_jax.api import default_proposer

            proposer_name = default_proposer(pair)
        if proposer_name == "selector":
            from dflash_jax.api import make_proposer

            make_proposer(pair, "selector")  # a DFlash 1 draft has no selector: one error naming the fix
        if proposer_name in ("head-chain", "selector"):  # a DFlash 2 draft's head is its selector
            proposer = "head-chain"
        elif proposer_name in ("tree", "adaptive"):  # adaptive: the tree among the chain widths, chosen per round
            from dflash_jax.api import make_proposer

            proposer = make_proposer(pair, "tree", tree_budget=getattr(args, "tree_budget", None) or 16,
                                     tree_branch=getattr(args, "tree_branch", 4))
            widths = "auto" if proposer_name == "adaptive" or args.widths == "auto" else None
            block_size = pair.draft_cfg.block_size if block_size is None else block_size
        if block_size is None and widths is None:
            block_size = min(DEFAULT_FIXED_BLOCK, pair.draft_cfg.block_size)
        byte_budget = None if args.round_expert_mb is None else args.round_expert_mb * 1e6
        prefix_bytes = 0 if getattr(args, "no_prefix_cache", False) else int(getattr(args, "prefix_cache_mb", 1024.0) * 1e6)
        slots, max_prompt_len = capacity_of(args, pair, block_size, widths, proposer, prefix_bytes, offload)
        common = dict(slots=slots, block_size=block_size, widths=widths, max_prompt_len=max_prompt_len,
                      max_new_tokens=args.max_new_tokens, method=args.acceptance, token_budget=args.token_budget,
                      max_queue=args.max_queue, learn_costs=not getattr(args, "no_learn_costs", False),
                      cost_rule=CostRule(explore_every=getattr(args, "explore_every", 8),
                                         accept_budget=getattr(args, "acceptance_budget", 0.03)),
                      acceptance_exploration=not getattr(args, "no_acceptance_exploration", False),
                      greedy_programs=GREEDY_PROGRAMS[getattr(args, "greedy_programs", "auto")],
                      prefill_chunk=getattr(args, "prefill_chunk", 0) or None, proposer=proposer,
                      prefix_cache_bytes=prefix_bytes, rounds_per_call=getattr(args, "rounds_per_call", "auto"),
                      call_seconds=getattr(args, "call_ms", 50.0) / 1e3, lanes=getattr(args, "lanes", "auto"))
        if getattr(args, "pflash_keep", None) is not None:
            from dflash_jax import pflash

            scorer = (pflash.load_scorer(args.pflash_scorer) if args.pflash_scorer is not None
                      else pflash.Scorer.from_pair(pair))
            common["compress"] = pflash.Compressor(scorer, keep_ratio=args.pflash_keep,
                                                   min_tokens=args.pflash_min_tokens)
        if offload:
            from dflash_jax.cli.generate import pin_experts_arg
            from dflash_jax.offload import PoolTooSmall

            hybrid = None
            if args.placement == "hybrid":
                from dflash_jax.offload.bandwidth import probe_host_to_device_bandwidth
                from dflash_jax.offload.hybrid import HostCompute

                hybrid = HostCompute.for_pair(pair, probe_host_to_device_bandwidth())
            try:
                engine = Engine(pair, experts="offload", budget_bytes=int(args.expert_budget_mb * 1e6),
                                predictor=args.predictor, pin=pin_experts_arg(args.pin_experts), hybrid=hybrid,
                                expert_byte_budget="cache" if byte_budget is None else byte_budget, **common)
            except PoolTooSmall as e:
                raise UsageError(str(e).replace("expert budget", "--expert-budget-mb")) from None
        else:
            engine = Engine(pair, mesh=mesh, expert_byte_budget=byte_budget, **common)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).replace("block_size", "--block-size").replace("widths", "--widths")
                         .replace("max_prompt_len", "--max-prompt-len")) from None
    if not args.no_warmup:
        print(f"dflash-serve: compiling {engine.slots} slots, prompts up to {engine.max_prompt_len} tokens ...",
              file=sys.stderr, flush=True)
        seconds = engine.warmup(later_widths=True)  # the narrower widths warm while the server waits for work
        later = engine.widths_warming
        later = f" (then widths {', '.join(map(str, later))}, warmed while idle)" if later else ""
        print(f"dflash-serve: ready in {seconds:.1f}s{later}", file=sys.stderr, flush=True)
    name = args.model_name or os.path.basename(os.path.normpath(directory))
    eos = tuple(t for t in pair.target_cfg.eos_token_ids if 0 <= t < pair.target_cfg.vocab_size)
    app = create_app(engine, load_tokenizer(pair), model_name=name, chat_template=template,
                     eos_ids=eos, grace_s=args.grace_seconds,
                     max_body_bytes=int(getattr(args, "max_request_mb", 8.0) * 1e6), api_key=api_key_of(args))
    attach_cost_metrics(engine)  # /metrics: the cost table as learned, the exploration's rounds and seconds
    if offload:  # /metrics: bytes moved per round, hits / misses, predicted vs used experts
        from dflash_jax.serve.offload_runner import attach_server_metrics

        attach_server_metrics(engine)
    return app, engine


class _Server:
    """uvicorn's server with dflash-serve's shutdown: the first SIGINT / SIGTERM stops taking requests and gives
    the ones in flight `--grace-seconds` to finish (the engine cancels the rest, whose streams then end with
    [DONE]); a second signal cancels everything at once (the shutdown then runs as usual: the app's lifespan ends,
    nothing is torn down mid-task); a third stops waiting for open connections. The signal is remembered for the
    exit code, not re-raised."""

    def __init__(self, config, engine, grace_s: float):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            def handle_exit(self, sig, frame):
                outer.signals.append(sig)
                if len(outer.signals) >= 3:  # a third: stop waiting for connections (their clients are gone)
                    self.force_exit = True
                elif self.should_exit:  # the second: no more grace; the streams end now, with [DONE]
                    threading.Thread(target=outer.engine.stop, kwargs=dict(cancel=True, timeout=None),
                                     name="dflash-cancel", daemon=True).start()
                else:
                    self.should_exit = True
                    threading.Thread(target=outer.engine.stop, kwargs=dict(timeout=outer.grace_s),
                                     name="dflash-drain", daemon=True).start()

        self.engine, self.grace_s, self.signals = engine, grace_s, []
        self.server = Server(config)

    def run(self) -> int | None:
        """Serves until a signal; returns it (None when the server stopped by itself)."""
        try:
            self.server.run()
        finally:  # whatever ended the server, the engine's thread is done before the interpreter exits
            self.engine.stop(cancel=True, timeout=None)
        return self.signals[0] if self.signals else None


def _serve(args) -> int:
    check_args(args)
    warning = open_access_warning(args)
    if warning:
        print(f"dflash-serve: warning: {warning}", file=sys.stderr, flush=True)
    import uvicorn

    from dflash_jax.cli import errors

    # loading, compiling and warming up run on a worker thread: a signal ends the process at once (exit 130 / 143)
    run = getattr(errors, "run_interruptibly", lambda prog, fn: fn())
    app, engine = run("dflash-serve", lambda: build_app(args))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on")
    signum = _Server(config, engine, args.grace_seconds).run()
    if signum is None:
        return 0
    print(f"dflash-serve: stopped ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
    return 128 + signum


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli("dflash-serve", lambda: _serve(args), known=(UsageError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
