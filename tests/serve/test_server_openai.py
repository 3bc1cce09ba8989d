"""The OpenAI surface evaluation tools use, through the real `openai` client against one server per module (on the
session's engine, `conftest.engine`), started with an API key: `n` samples, `logprobs` / `top_logprobs` equal to
log_softmax of a plain target forward, `echo` with the prompt's logprobs, stop strings cut exactly while streaming,
`stream_options.include_usage`, `max_completion_tokens`, and the key itself (401 without it, /health open)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.serve.logprob_checks import plain_log_softmax, tolerance
from tests.serve.server_process import serve_in_thread

openai = pytest.importorskip("openai")

PROMPT = "def fib(n):"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(engine, pair):
    from dflash_jax.cli.generate import load_tokenizer
    from dflash_jax.serve.server import create_app

    eos = tuple(pair.target_cfg.eos_token_ids)
    app = create_app(engine, load_tokenizer(pair), model_name="tiny", eos_ids=eos, grace_s=5.0, api_key=KEY)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(pair):
    from dflash_jax.cli.generate import load_tokenizer

    return load_tokenizer(pair)


def test_api_key(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}, headers=headers)
        assert r.status_code == 401, headers
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert httpx.get(server + "/health").status_code == 200  # probes need no key
    assert httpx.get(server + "/metrics").status_code == 401  # the metrics do
    assert httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_n_samples_reproducible_with_a_seed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    streamed = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    assert client.completions.create(**dict(kw, n=1)).choices[0].text == texts[0]  # sample 0 is the lone request
    greedy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=8, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 2 * len(greedy.choices[0].model_extra["token_ids"]) or \
        greedy.choices[0].finish_reason == "stop"


def test_logprobs_are_the_targets(client, pair, tokenizer):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    prompt_ids = list(tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    ids = c.model_extra["token_ids"]
    ref = plain_log_softmax(pair, prompt_ids + ids)
    n, tol = len(prompt_ids), tolerance(pair)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(n - 1, n - 1 + len(ids)), ids], atol=tol)
    for i, top in enumerate(lp.top_logprobs):
        assert len(top) <= 2
        np.testing.assert_allclose(max(top.values()), ref[n - 1 + i].max(), atol=tol)
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    # chat: content entries with bytes and top_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == len(chat.choices[0].model_extra["token_ids"])
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    # streamed logprobs are the same numbers
    streamed = []
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-6)


def test_echo_with_prompt_logprobs(client, pair, tokenizer):
    """What lm-evaluation-harness's loglikelihood requests send: echo, logprobs=1, max_tokens=1."""
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    c = out.choices[0]
    prompt_ids = list(tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    n = len(prompt_ids)
    assert len(lp.token_logprobs) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = plain_log_softmax(pair, prompt_ids + c.model_extra["token_ids"])
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(n), prompt_ids[1:] + c.model_extra["token_ids"]],
                               atol=tolerance(pair))
    assert lp.text_offset[n] == len(PROMPT)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_streaming_stop_strings_cut_exactly(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 12
    for stop in (full[5:9], full[9:12], full[-3:]):
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, stop=[stop], **kw)]
        assert "".join(pieces) == full[: full.index(stop)], stop
        one = client.completions.create(stop=[stop], **kw).choices[0]
        assert one.text == full[: full.index(stop)] and one.finish_reason == "stop"


def test_include_usage_and_max_completion_tokens(client, server):
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/chat/completions", headers=headers,
                   json={"model": "tiny", "messages": messages, "max_tokens": 3, "max_completion_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    for body, field in [({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                        ({"echo": True}, "echo"), ({"n": 9}, "n"), ({"stream_options": {"include_usage": True}},
                                                                      "stream_options")]:
        path = "/v1/completions" if field != "top_logprobs" or "logprobs" in body else "/v1/chat/completions"
        payload = {"model": "tiny", "messages": messages} if "chat" in path else {"model": "tiny", "prompt": PROMPT}
        if field == "echo":
            path, payload = "/v1/chat/completions", {"model": "tiny", "messages": messages}
        r = httpx.post(server + path, headers=headers, content=json.dumps({**payload, **body}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_held_back_text():
    from dflash_jax.serve.server import Server

    assert Server._held("abc</", ["</end>"]) == 2
    assert Server._held("abc<", ["</end>", "<x"]) == 1
    assert Server._held("abc", ["</end>"]) == 0
    assert Server._held("aaa", ["aab"]) == 2


def test_a_batch_of_prompts_answers_prompt_major(client, server, tokenizer):
    """A list of prompts (strings, or id lists) in one completions request: each prompt's choices are its `n`
    samples, indexed prompt by prompt, each equal to that prompt sent alone; echo and logprobs per prompt."""
    prompts = [PROMPT, "class A:", "import os"]
    kw = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [t for t in alone for _ in range(2)]
    ids = [list(tokenizer.encode(p, add_special_tokens=False).ids) for p in prompts]
    assert out.usage.prompt_tokens == sum(map(len, ids)) and out.usage.completion_tokens == 6 * 6
    scored = client.completions.create(prompt=ids[:2], max_tokens=1, temperature=0, logprobs=1, echo=True,
                                       model="tiny")
    for c, p, i in zip(scored.choices, prompts, ids):
        assert c.text.startswith(p) and len(c.logprobs.token_logprobs) == len(i) + 1
    streamed = ["", "", ""]
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == alone
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/completions", headers=headers,
                   json={"model": "tiny", "prompt": [PROMPT, [10**9]], "max_tokens": 2})
    assert r.status_code == 400 and "vocab" in r.json()["error"]["message"]  # one bad prompt refuses the batch
    r = httpx.post(server + "/v1/completions", headers=headers, json={"model": "tiny", "prompt": [PROMPT] * 100})
    assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
