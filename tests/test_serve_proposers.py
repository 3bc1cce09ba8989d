"""`dflash-serve --proposer tree --tree-budget 16` on the shipped pair, a real process and the real `openai` client:
every concurrent request's completion equals the same prompt generated alone with the same proposer
(`dflash_jax.generate(..., proposer="tree", tree_budget=16)`, what `dflash-generate --proposer tree` runs), and the
server's tokens per verify (`/metrics`: dflash_acceptance_length) beat the chain's. The same with
`--experts offload` at the smallest expert cache that runs."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import dflash_jax
from tests.serve.server_process import free_port, stop, wait_ready

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 17], [7] * 12, list(range(40, 56))]
N = 40


def _metric_mean(text: str, name: str) -> float:
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return values["_sum"] / values["_count"]


def _serve(tmp_path, args, prompts, timeout=600):
    """Starts `dflash-serve` with `args` (a real process), completes `prompts` concurrently with the real `openai`
    client (greedy, N tokens) and stops it; returns (the completions' texts, the /metrics text)."""
    openai = pytest.importorskip("openai")
    port = free_port()
    env = dict(os.environ, DFLASH_JAX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--max-new-tokens",
                             str(N), "--log-level", "warning", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        wait_ready(client, proc, timeout=timeout)

        def complete(ids):
            out = client.completions.create(model="tiny_pair", prompt=ids, max_tokens=N, temperature=0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    finally:
        code = stop(proc)
    assert code == 128 + 15, proc.stderr.read()
    return served, metrics


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["device", "offload"])
def test_served_trees_equal_each_prompt_alone(tmp_path, experts):
    pytest.importorskip("openai")
    from dflash_jax.checkpoint import read_manifest
    from dflash_jax.offload.cache import min_budget_from_manifest

    pair = dflash_jax.load()
    tokenizer = __import__("tokenizers").Tokenizer.from_file(pair.tokenizer_path)
    extra = []
    if experts == "offload":
        minimum, _ = min_budget_from_manifest(read_manifest(dflash_jax.SHIPPED_PAIR))
        extra = ["--experts", "offload", "--expert-budget-mb", f"{minimum / 1e6 * 1.0001:.6f}"]
    served, metrics = _serve(tmp_path, ["--slots", "4", "--max-prompt-len", "16", "--proposer", "tree",
                                        "--tree-budget", "16", *extra], PROMPTS)
    alone = dflash_jax.generate(pair, PROMPTS, max_new_tokens=N, proposer="tree", tree_budget=16, stop_ids=[])
    assert served == [tokenizer.decode(t) for t in alone.tokens]
    chain = dflash_jax.generate(pair, PROMPTS, max_new_tokens=N, stop_ids=[])
    chain_tau = float(np.mean([a for seq in chain.acceptance_lengths for a in seq]))
    assert _metric_mean(metrics, "dflash_acceptance_length") > chain_tau > 1.3


@pytest.mark.slow
def test_served_pflash_equals_pflash_generate(tmp_path):
    """`dflash-serve --pflash-keep 0.5 --pflash-min-tokens 64`: a 200-token prompt is compressed as it arrives (the
    server's own target scores it) and its completion equals `pflash.generate` over the same kept tokens; a short
    prompt beside it is untouched (equals `dflash_jax.generate`); /metrics counts the tokens left out."""
    pytest.importorskip("openai")
    from dflash_jax import pflash

    pair = dflash_jax.load()
    tokenizer = __import__("tokenizers").Tokenizer.from_file(pair.tokenizer_path)
    long = np.random.default_rng(7).integers(0, 1000, 200).tolist()
    served, metrics = _serve(tmp_path, ["--slots", "2", "--max-prompt-len", "256", "--pflash-keep", "0.5",
                                        "--pflash-min-tokens", "64"], [long, PROMPTS[0]], timeout=900)
    kept = pflash.compress(pflash.Scorer.from_pair(pair), long, keep_ratio=0.5)
    assert len(kept) < len(long)
    compressed = pflash.generate(pair, [long], [kept], max_new_tokens=N, stop_ids=[]).tokens[0]
    plain = dflash_jax.generate(pair, [PROMPTS[0]], max_new_tokens=N, stop_ids=[]).tokens[0]
    assert served == [tokenizer.decode(compressed), tokenizer.decode(plain)]
    left_out = [line for line in metrics.splitlines() if line.startswith("dflash_prefill_compressed_tokens_total ")]
    assert left_out and float(left_out[0].split()[-1]) == len(long) - len(kept)
