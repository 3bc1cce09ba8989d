"""The OpenAI-compatible server, driven by the real `openai` client over HTTP on 127.0.0.1 (one server per module,
started in the test on a free port)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve.server_process import serve_in_thread

openai = pytest.importorskip("openai")

PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def server(engine, pair):
    from dflash_jax.cli.generate import load_tokenizer
    from dflash_jax.serve.server import create_app

    eos = tuple(pair.target_cfg.eos_token_ids)
    app = create_app(engine, load_tokenizer(pair), model_name="tiny", eos_ids=eos, grace_s=5.0)
    with serve_in_thread(app) as url:
        yield url
    assert not engine.running  # the lifespan stopped the engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4
    assert health["warming"] == 0  # warmed whole (`Engine.warmup()`): no width left for after start


def test_completion_equals_dflash_generate(client, capsys, pair):
    from dflash_jax.cli.generate import main

    assert main(["--prompt", PROMPT, "--max-new-tokens", "24", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    tokens = expected["tokens"]
    stopped = tokens[-1] in pair.target_cfg.eos_token_ids
    assert choice.model_extra["token_ids"] == (tokens[:-1] if stopped else tokens)
    assert choice.text == expected["text"]
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert out.usage.completion_tokens == len(tokens)


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    pieces, reasons, ids = [], [], []
    for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
        ids += chunk.choices[0].model_extra["token_ids"]
    assert len(pieces) > 1  # really streamed
    assert "".join(pieces) == full.choices[0].text
    assert ids == full.choices[0].model_extra["token_ids"]
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])

    messages = [{"role": "user", "content": "print hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream]
    assert chat.choices[0].message.role == "assistant"
    assert "".join(deltas) == chat.choices[0].message.content and chat.choices[0].message.content


def test_stop_strings(client):
    """A stop string ends the completion at its first occurrence (not shown), finish_reason "stop"; what comes
    before is exactly the unstopped output's text."""
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert "\n" in full.strip("\n")
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=["\n"],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index("\n")]


def test_concurrent_clients_equal_alone(client):
    """Six clients at once on four slots (some queue, rows join and leave mid-decode): each gets what it gets
    alone, greedy and sampled (the same seed)."""
    prompts = ["def fib(n):", "import os\n", "class Foo:", "for i in range(", "return x +", "# comment\n"]
    settings = [dict(max_tokens=20 + 7 * i, temperature=0 if i % 2 == 0 else 0.8, seed=i) for i in range(6)]
    alone = [client.completions.create(model="tiny", prompt=p, **s).choices[0].model_extra["token_ids"]
             for p, s in zip(prompts, settings)]
    results = [None] * 6

    def one(i):
        results[i] = client.completions.create(model="tiny", prompt=prompts[i], **settings[i]).choices[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.model_extra["token_ids"] for r in results] == alone
    assert any(len(a) > 10 for a in alone)


def _cancelled(server) -> float:
    text = httpx.get(server + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith('dflash_requests_finished_total{reason="cancelled"}')]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


def test_cancellation_frees_the_slot(client, server, engine):
    """A streaming client that goes away after its first chunk: its request is cancelled mid-generation (rounds
    slowed to >= 50 ms so 64 tokens cannot finish first) and its slot is free again."""
    assert len(engine.requests) == 0
    cancelled = _cancelled(server)
    slow = lambda info: time.sleep(0.05)  # noqa: E731
    engine.observers.append(slow)
    engine.rounds_per_call = 1  # a step per round: the request is still running when the client gives up
    try:
        stream = client.completions.create(model="tiny", prompt="def main():", max_tokens=64, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away mid-generation
        deadline = time.time() + 30
        while (httpx.get(server + "/health").json()["slots_in_use"] or _cancelled(server) == cancelled) \
                and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.observers.remove(slow)
        engine.rounds_per_call = "auto"
    assert httpx.get(server + "/health").json()["slots_in_use"] == 0
    assert _cancelled(server) == cancelled + 1


def test_a_non_streamed_client_that_goes_away_is_cancelled(server, engine):
    """A non-streamed request whose client gives up (a read timeout closes the connection) is cancelled while it
    waits for tokens (the stream's disconnect watcher), and its slot frees."""
    assert len(engine.requests) == 0
    cancelled = _cancelled(server)
    slow = lambda info: time.sleep(0.05)  # noqa: E731
    engine.observers.append(slow)
    engine.rounds_per_call = 1  # a step per round: the request is still running when the client gives up
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server + "/v1/completions", timeout=httpx.Timeout(5.0, read=0.5),
                       json={"prompt": "def main():", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
        deadline = time.time() + 30
        while (httpx.get(server + "/health").json()["slots_in_use"] or _cancelled(server) == cancelled) \
                and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.observers.remove(slow)
        engine.rounds_per_call = "auto"
    assert httpx.get(server + "/health").json()["slots_in_use"] == 0
    assert _cancelled(server) == cancelled + 1


def test_bad_requests(client, server, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10_000)
    assert e.value.status_code == 400 and "max_tokens" in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 99999])
    assert "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x " * 200)
    assert "--max-prompt-len" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    engine.max_queue, saved = 0, engine.max_queue
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 429
    finally:
        engine.max_queue = saved


def test_metrics_and_no_compiles(client, server):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(server + "/metrics").text
    assert _metric(text, "dflash_acceptance_length_count") > 0
    assert _metric(text, "dflash_generated_tokens_total") >= 8
    assert _metric(text, "dflash_rounds_total") > 0
    assert _metric(text, "dflash_round_expert_bytes_count") > 0 or _metric(text, "dflash_burst_calls_total") > 0
    assert _metric(text, "dflash_slots_in_use") == 0 and _metric(text, "dflash_queue_depth") == 0
    assert "dflash_tokens_per_second" in text
    admitted = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                   if x.startswith("dflash_scheduler_admissions_total{"))
    # every verify was a scheduler admission, or one of a call of several rounds (every live row verifies)
    assert admitted + _metric(text, "dflash_burst_verifies_total") == _metric(text, "dflash_acceptance_length_count")
    assert "dflash_scheduler_sat_out_total" in text
    # every request of this module sat in the warmed prompt bucket: the server compiled nothing
    assert _metric(text, "dflash_compile_events_total") == 0


# -- hostile and malformed requests (issue: no request may stall the server or others) ---------------------------


def _post(server, path: str, content: bytes, **headers) -> httpx.Response:
    return httpx.post(server + path, content=content, headers={"content-type": "application/json", **headers},
                      timeout=60)


def test_malformed_requests_get_400_naming_the_field(client, server):
    """What used to be plain-text 500s with server tracebacks: each is one 400 in OpenAI's error shape."""
    surrogate = b'{"model": "tiny", "prompt": "abc \\ud800 def", "max_tokens": 2}'
    r = _post(server, "/v1/completions", surrogate)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "surrogate" in r.json()["error"]["message"]
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}'
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    nested = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"
    r = _post(server, "/v1/completions", nested)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for prompt in ([[[1, 2]]], [["a"]], [[1, [2]]]):  # one level of list around a prompt, no deeper
        r = _post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt}).encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", prompt
    for field, value in [("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"5": 10}),
                         ("n", 0), ("n", 99), ("n", True), ("logprobs", 99), ("logprobs", True), ("echo", "yes"),
                         ("top_logprobs", 2), ("min_p", 0.1), ("best_of", 2), ("stream_options", {"x": 1}),
                         ("top_k", 2**31), ("max_tokens", 2**31), ("seed", 2**64), ("stop_token_ids", [2**31]),
                         ("response_format", {"type": "json_object"})]:
        r = _post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPT, field: value}).encode())
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field or field in r.json()["error"]["message"], (field, r.text)
    # their no-op values are accepted (clients send them by default)
    out = _post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                       "presence_penalty": 0, "frequency_penalty": 0.0,
                                                       "logit_bias": {}, "n": 1, "temperature": 0}).encode())
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
    r = _post(server, "/v1/chat/completions",
              json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}).encode())
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/health", 405)]:
        r = httpx.request(method, server + path)
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_body_limit_and_health_during_a_maximal_body(server):
    """A body past the limit is refused with 413 (by its Content-Length, and when it streams in without one);
    `/health` keeps answering while a maximal body is received, parsed, tokenized and refused."""
    import dflash_jax.serve.server as srv

    limit = srv.DEFAULT_MAX_BODY_BYTES
    r = _post(server, "/v1/completions", b"x" * (limit + 1))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():
        for _ in range(limit // 2**16 + 2):
            yield b" " * 2**16

    r = httpx.post(server + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413

    text = "def f(x): return x * 2; "
    body = json.dumps({"model": "tiny", "prompt": text * ((limit - 200) // len(text))}).encode()
    assert limit - 400 < len(body) <= limit
    latencies, results, spans = [], [], []

    def send():
        t0 = time.perf_counter()
        results.append(_post(server, "/v1/completions", body))
        spans.append(time.perf_counter() - t0)

    sender = threading.Thread(target=send)
    with httpx.Client() as health:
        health.get(server + "/health")  # the connection is open before the big request starts
        sender.start()
        while sender.is_alive():
            t = time.perf_counter()
            assert health.get(server + "/health").status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.005)
    assert results[0].status_code == 400 and "--max-prompt-len" in results[0].json()["error"]["message"]
    # /health answered again and again while the big request was in flight (a loop blocked by the read, parse or
    # tokenization would answer it at most once); counted, not timed: the CI machines are shared.
    assert len(latencies) >= 3, (latencies, spans)


def test_a_bad_request_never_touches_the_ones_in_flight(client, server):
    """top_k = 2**31 (once accepted, then an int32 overflow inside the engine that cut every stream) is a 400,
    and a stream in flight beside it finishes untouched: the same tokens as alone, and [DONE]."""
    settings = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(**settings).choices[0].model_extra["token_ids"]
    ids, done = [], []

    def stream():
        with httpx.stream("POST", server + "/v1/completions", json={**settings.pop("extra_body", {}), **settings,
                                                                      "ignore_eos": True, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done.append(True)
                elif line.startswith("data: "):
                    ids.extend(json.loads(line[6:])["choices"][0]["token_ids"])

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(3):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0,
                                      extra_body={"top_k": 2**31})
        assert e.value.body["param"] == "top_k"
    t.join(60)
    assert done == [True] and ids == alone


def test_chat_templates_render_sandboxed(tmp_path, engine):
    """A checkpoint's chat template never runs code: one that reaches for Python internals is refused at load
    (even in a branch no request reaches) and leaves no file; a template that raises on some messages is a 400."""
    from dflash_jax.cli.serve import chat_template
    from dflash_jax.errors import UsageError
    from dflash_jax.serve.server import BadRequest, Server, Tokens

    pwned = tmp_path / "PWNED"
    hostile = [
        "{{ cycler.__init__.__globals__.os.popen('touch " + str(pwned) + "').read() }}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% if m.role == 'never' %}{{ joiner.__init__.__globals__ }}{% endif %}"
        "{{ m.content }}{% endfor %}",
        "{% for m in messages %}{{ m|attr('__class__') }}{% endfor %}",
    ]
    for i, template in enumerate(hostile):
        ckpt = tmp_path / f"ckpt{i}"
        ckpt.mkdir()
        (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        with pytest.raises(UsageError, match="Python internals"):
            chat_template(str(ckpt))
    # built at run time past the static check: the sandbox stops it when it runs
    sneaky = ("{% set n = '_' ~ '_init_' ~ '_' %}{{ (cycler|attr(n)) }}{% for m in messages %}{{ m.content }}"
              "{% endfor %}")
    (tmp_path / "ckpt0" / "tokenizer_config.json").write_text(json.dumps({"chat_template": sneaky}))
    rendered = chat_template(str(tmp_path / "ckpt0")).render([{"role": "user", "content": "hi"}])
    assert "function" not in rendered and "hi" in rendered
    assert not pwned.exists()

    strict = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
              "<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "ckpt1" / "chat_template.jinja").write_text(strict)  # HF's file wins over tokenizer_config.json
    from dflash_jax.cli.generate import load_tokenizer

    server = Server(engine, Tokens(load_tokenizer(engine.pair), chat_template(str(tmp_path / "ckpt1"))),
                    model_name="tiny")
    assert server.chat_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequest, match="no tools here") as e:
        server.chat_ids([{"role": "tool", "content": "{}"}])
    assert e.value.param == "messages" and e.value.status == 400
