"""lm-evaluation-harness against `dflash-serve` (a real process, `--model local-completions`) and against the same
target through transformers (`--model hf`, the shipped pair exported by `dflash_jax.train.export`), on two local tasks
over small local JSON datasets (tests/serve/lm_eval_tasks: one `generate_until`, one `loglikelihood` multiple-choice;
no hub download). Greedy output is lossless and the log-probs are the target's, so the scores are equal, and so is
every sample: each generation, and each choice's log-likelihood (to float tolerance) and greediness. Slow: an export,
a server warm-up and two harness runs. Needs the `eval` extra (`pip install 'dflash_jax[eval]'`)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.serve.server_process import free_port, stop, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = "dflash_tiny_generate,dflash_tiny_choice"
SKIP = "lm-evaluation-harness is not installed (pip install 'dflash_jax[eval]')"


def _harness(model: str, model_args: str, out, env) -> tuple[dict, dict]:
    """One `lm_eval` run from the repository root (the tasks' data paths are relative to it): (results by task,
    {task: samples by doc id})."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--include_path",
           os.path.join("tests", "serve", "lm_eval_tasks"), "--tasks", TASKS, "--output_path", str(out),
           "--log_samples", "--batch_size", "1"]
    if model == "hf":
        cmd += ["--device", "cpu"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.load(open(glob.glob(os.path.join(str(out), "*", "results_*.json"))[0]))["results"]
    samples = {}
    for task in TASKS.split(","):
        path = glob.glob(os.path.join(str(out), "*", f"samples_{task}_*.jsonl"))[0]
        samples[task] = {s["doc_id"]: s for s in map(json.loads, open(path))}
    return results, samples


@pytest.mark.slow
def test_lm_eval_scores_of_the_served_pair_equal_transformers(tmp_path):
    pytest.importorskip("lm_eval", reason=SKIP)
    pytest.importorskip("tenacity", reason=SKIP)  # the harness's API models
    pytest.importorskip("accelerate", reason=SKIP)  # its hf model
    openai = pytest.importorskip("openai")
    import numpy as np

    import dflash_jax
    from dflash_jax.train.export import save_hf_target

    hf_dir = tmp_path / "hf"  # the shipped target in transformers' layout, with the pair's tokenizer
    pair = dflash_jax.load(dequantize_experts=True)
    save_hf_target(pair.target, pair.target_cfg, str(hf_dir), eos_token_id=int(pair.target_cfg.eos_token_ids[0]))
    shutil.copy(os.path.join(dflash_jax.SHIPPED_PAIR, "tokenizer.json"), hf_dir)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"), DFLASH_JAX_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("OPENAI_API_KEY", None)

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli.serve", "--port", str(port), "--slots", "2",
                             "--max-prompt-len", "128", "--max-new-tokens", "32", "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        wait_ready(client, proc, timeout=1200)
        served, served_samples = _harness(
            "local-completions", f"model=tiny_pair,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={hf_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
            tmp_path / "served", env)
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    finally:
        code = stop(proc)
    assert code == 128 + 15, proc.stderr.read()
    hf, hf_samples = _harness("hf", f"pretrained={hf_dir},dtype=float32", tmp_path / "hf_run", env)

    for task in TASKS.split(","):
        metrics_of = {k: v for k, v in served[task].items() if "," in k and "stderr" not in k}
        assert metrics_of and metrics_of == {k: hf[task][k] for k in metrics_of}, (task, served[task], hf[task])
        assert served_samples[task].keys() == hf_samples[task].keys()
        for doc, s in served_samples[task].items():
            h = hf_samples[task][doc]
            if task == "dflash_tiny_generate":  # the same greedy text, token for token
                assert s["filtered_resps"] == h["filtered_resps"], doc
            else:  # each choice's log-likelihood and whether it is the greedy continuation
                got = [(float(lp), greedy) for lp, greedy in s["filtered_resps"]]
                want = [(float(lp), greedy) for lp, greedy in h["filtered_resps"]]
                np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=2e-3)
                assert [g[1] for g in got] == [w[1] for w in want], doc
    assert 0 < served["dflash_tiny_choice"]["acc,none"] < 1  # a task that tells models apart
    # the served generations were speculative: some verify committed more than one token
    committed = {line.split('le="')[1].split('"')[0]: float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("dflash_acceptance_length_bucket")}
    assert committed["1.0"] < committed["+Inf"], committed
