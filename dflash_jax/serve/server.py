"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn): `dflash-serve`.

  POST /v1/completions        prompt (text, token ids, or a list of those: choices prompt-major), max_tokens, temperature, top_p, seed, stop, stream, n,
                              logprobs (0 .. 20 alternatives), echo (with the prompt's logprobs when logprobs is set)
  POST /v1/chat/completions   messages (the tokenizer's chat template when the checkpoint has one; a plain
                              "role: content" template otherwise), same settings (max_completion_tokens too),
                              logprobs: true + top_logprobs
  GET  /v1/models, /health, /metrics (Prometheus text format)

Streams take `stream_options.include_usage` (a last chunk with the usage and no choices) and hold back text that could
still be the start of a stop string, so nothing past one is ever sent. `n` samples share one prefill
(`Engine.submit(n=)`); log-probs are the target's, from the verify's logits (`RoundRunner.round_logprobs`).

Extensions (accepted in the request body, e.g. the `openai` client's `extra_body`): `top_k`, `stop_token_ids`
(token ids that end the generation; the target's eos is one unless `ignore_eos`), `ignore_eos`. Each
choice also carries `token_ids`: the generated ids (in a stream, the ids new in that chunk).

Bad requests get 400 with an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` (so do 404 and
405; a body over `max_body_bytes` gets 413 before it is read; a full queue 429; with an `api_key`, a request without
`Authorization: Bearer <key>` gets 401 before its body is read, on every path but /health). A client that
disconnects (streaming or not) cancels its request and frees its slot. Fields that would change the output and are
not implemented (`presence_penalty`, `frequency_penalty`, `logit_bias`, `best_of`, ...) are refused with a
400 naming them unless they hold their no-op value, never silently ignored. Every number is range-checked before
it reaches a traced int32 / float32. JSON parsing, chat templates (sandboxed: `serve.templates`), tokenizing and
detokenizing run on worker threads with the GIL released, so `/health` answers during any request. Shutdown
stops taking requests, lets in-flight ones finish for `grace_s`, then cancels what is left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import json
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_jax.serve.engine import Engine, QueueFull, Request, RequestError, RoundInfo
from dflash_jax.serve.metrics import Metrics
from dflash_jax.serve.runner import TOP_LOGPROBS
from dflash_jax.spec.sampling import SamplingParams


logger = logging.getLogger("dflash_jax.serve")
ENDPOINTS = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics")


class EngineFailed(RuntimeError):
    """The engine failed this request (its error message): 500, or an error event in a stream."""


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status)


PLAIN_TEMPLATE = "plain"
INT32_MAX = 2**31 - 1
# the roles a chat message may have (OpenAI's; "developer" is the newer name of "system")
ROLES = ("system", "developer", "user", "assistant", "tool")
# request fields that change what is generated, which this server does not implement: refused (400) unless they
# hold their no-op value, never silently ignored
UNSUPPORTED = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
               "logit_bias": ({},), "min_p": (0, 0.0), "min_tokens": (0,), "best_of": (1,), "suffix": ("",), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",), "response_format": ({"type": "text"},), "guided_json": (),
               "guided_regex": (), "guided_choice": (), "guided_grammar": ()}
DEFAULT_MAX_BODY_BYTES = 8_000_000  # `--max-request-mb 8`


def check_text(text: str, param: str) -> str:
    """`text` must be valid Unicode: a lone UTF-16 surrogate (`"\\ud800"` in JSON) has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"`{param}` is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                         f"{e.start} (send UTF-8 text)", param) from None
    return text


class Tokens:
    """Text <-> ids through the checkpoint's tokenizer (`tokenizers.Tokenizer`, or None: ids only), and its chat
    template (a `templates.ChatTemplate`: sandboxed, checked when loaded). Encoding and decoding go through the
    tokenizer's batch calls, which release the GIL: the server runs them on worker threads, so a long text never
    stalls the event loop."""

    def __init__(self, tokenizer, chat_template: "ChatTemplate | str | None" = None):
        from dflash_jax.serve.templates import ChatTemplate

        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate(chat_template) if isinstance(chat_template, str) else chat_template
        self._max_token_bytes: int | None = None

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (at least 1): a text of N bytes has >= N / this tokens."""
        if self._max_token_bytes is None:
            n = self.tokenizer.get_vocab_size(with_added_tokens=True)
            pieces = self.tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
            self._max_token_bytes = max([1] + [len(p.encode("utf-8", "replace")) for p in pieces])
        return self._max_token_bytes

    def encode(self, text: str, param: str, max_tokens: int | None = None) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(f"this checkpoint has no tokenizer.json: send `{param}` as a list of token ids", param)
        check_text(text, param)
        if max_tokens is not None:
            # far too long to fit: refused before tokenizing (4x the bound leaves room for normalizers that shrink
            # text), so no request makes the server tokenize megabytes it will refuse anyway
            size = len(text.encode("utf-8"))
            if size > 4 * max_tokens * self.max_token_bytes:
                raise BadRequest(f"`{param}` is {size} bytes, far more than the {max_tokens} tokens this server takes "
                                 "(shorten the prompt or restart with a larger --max-prompt-len)", param)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode_batch([list(ids)])[0]

    def chat_prompt(self, messages: list[dict]) -> str:
        if self.chat_template is not None:
            from dflash_jax.serve.templates import TemplateRenderError

            try:
                return check_text(self.chat_template.render(messages), "messages")
            except TemplateRenderError as e:
                raise BadRequest(str(e), "messages") from None
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class StreamText:
    """The text of a growing list of token ids, decoded incrementally: each call decodes a few tokens (a window
    from `prefix` on: the tokens before `read` give the context, the new ones the text), not the whole list, so
    streaming a long generation costs O(new tokens) per chunk rather than O(all tokens). `text` is the text of
    `ids[:read]`; ids whose text is still an incomplete UTF-8 character (the decoded window ends in U+FFFD) wait
    for the next tokens. The final text of a request is the whole list decoded (`Tokens.decode`) as before, so a
    finished stream's text is exactly the non-streamed one's."""

    def __init__(self, tokens: "Tokens"):
        self.tokenizer = tokens.tokenizer
        self.text, self.prefix, self.read = "", 0, 0

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (this list extended since the last call) as far as it is complete."""
        if self.tokenizer is None:
            self.read = len(ids)
            return self.text
        if len(ids) <= self.read:
            return self.text
        # `decode`, not `decode_batch`: a batch call hands its work to the tokenizer's thread pool, which for a few
        # tokens costs far more than the decode itself (hundreds of microseconds on a busy CPU, against a few)
        before = self.tokenizer.decode(ids[self.prefix: self.read])
        after = self.tokenizer.decode(ids[self.prefix:])
        if after.startswith(before) and not after.endswith("\ufffd"):  # (tokens without text, e.g. skipped
            # special ones, advance too)
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return self.text


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _number(body: dict, name: str, default, kind, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"`{name}` must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise BadRequest(f"`{name}` must be <= {high}, got {value}", name)
    return kind(value)


LARGE_BODY_BYTES = 1_000_000
DISCONNECT_POLL_S = 0.25  # how often a waiting stream asks whether its client is still there
GONE = object()  # put in a choice's queue when its client went away


def _malloc_trim() -> None:
    """Hands the C heap's free pages back to the system (glibc); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _ReturnMemory:
    """ASGI middleware: after a request whose body was large (its text, parsed JSON and token lists are gone by
    then), the freed heap is handed back, so the server's memory returns to its baseline (measured over 15 refused 8 MB
    bodies: +37 MB that stayed without this, back at the baseline with it)."""

    def __init__(self, app, threshold: int):
        self.app, self.threshold = app, threshold

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = 0

        async def counting():
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting, send)
        finally:
            if size >= self.threshold:
                await asyncio.get_running_loop().run_in_executor(None, _malloc_trim)


OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' probes)


class _RequireKey:
    """ASGI middleware: every request but `OPEN_PATHS` must carry `Authorization: Bearer <key>` (compared in
    constant time, `hmac.compare_digest`), else 401 in OpenAI's error shape before its body is read."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                auth = value
                break
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("no API key: send the header `Authorization: Bearer <key>` (the key this server was started "
                   "with, --api-key or DFLASH_API_KEY)" if not auth else "incorrect API key provided")
        response = JSONResponse(error_body(message, "invalid_request_error", code="invalid_api_key"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class Server:
    """The HTTP layer: parses requests, feeds the engine, streams its tokens back. `api_key`: when set, every
    endpoint but /health needs `Authorization: Bearer <api_key>` (401 otherwise), /metrics included."""

    def __init__(self, engine: Engine, tokens: Tokens, *, model_name: str, eos_ids: tuple[int, ...] = (),
                 grace_s: float = 10.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None):
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError("api_key must be a non-empty string (or None: no key)")
        self.api_key = api_key
        self.engine, self.tokens, self.model_name = engine, tokens, model_name
        self.max_body_bytes = max_body_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dflash-text")
        self.eos_ids = tuple(eos_ids)
        self.grace_s = grace_s
        self.metrics = Metrics()
        self.created = int(time.time())
        engine.observers.append(self._on_round)
        self.app = self._build()

    def _on_round(self, info: RoundInfo) -> None:
        self.metrics.on_round(info, queue_depth=self.engine.queue_depth, slots_in_use=self.engine.slots_in_use)

    # -- request parsing -------------------------------------------------------------------------------

    def _settings(self, body: dict, *, default_max_tokens: int, chat: bool = False) -> dict:
        n = body.get("n")
        n = 1 if n is None else n
        if type(n) is not int or not 1 <= n <= self.engine.slots:
            raise BadRequest(f"`n` must be an integer between 1 and {self.engine.slots} (this server's slots: the "
                             f"samples decode together), got {n!r}", "n")
        for name, no_ops in UNSUPPORTED.items():
            value = body.get(name)
            if value is not None and not any(type(value) is type(v) and value == v for v in no_ops):
                raise BadRequest(f"`{name}` is not supported by this server (it would change the output, so it is "
                                 "refused rather than ignored): drop the field", name)
        max_tokens, max_completion = body.get("max_tokens"), body.get("max_completion_tokens")
        if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
            raise BadRequest("`max_tokens` and `max_completion_tokens` are one setting (its old and new name) and "
                             f"differ ({max_tokens!r} and {max_completion!r}): send one of them",
                             "max_completion_tokens")
        name = "max_tokens" if max_completion is None else "max_completion_tokens"
        max_tokens = max_tokens if max_completion is None else max_completion
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= INT32_MAX:
            raise BadRequest(f"`{name}` must be a positive integer (at most {INT32_MAX}), got {max_tokens!r}", name)
        logprobs, echo = self._logprob_settings(body, chat)
        temperature = _number(body, "temperature", 1.0, float, low=0, high=2)
        top_p = _number(body, "top_p", 1.0, float, low=0, high=1, low_open=True)
        top_k = _number(body, "top_k", 0, int, low=0, high=INT32_MAX)
        # no seed: a fresh one per request (OpenAI's default); a seed makes a sampled request reproducible
        seed = _number(body, "seed", secrets.randbits(63), int, low=-2**63, high=2**63 - 1)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise BadRequest("`stop` must be a string or a list of up to 4 non-empty strings", "stop")
        for i, x in enumerate(stop):
            check_text(x, "stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(_is_id(t) and 0 <= t <= INT32_MAX for t in stop_ids):
            raise BadRequest("`stop_token_ids` must be a list of token ids", "stop_token_ids")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadRequest("`ignore_eos` must be true or false", "ignore_eos")
        ids = list(stop_ids) + ([] if ignore_eos else [t for t in self.eos_ids if t not in stop_ids])
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("`stream` must be true or false", "stream")
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise BadRequest("`stream_options` is only allowed with `stream: true`", "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                    not isinstance(options.get("include_usage", False), bool):
                raise BadRequest("`stream_options` must be {\"include_usage\": true or false}", "stream_options")
            include_usage = options.get("include_usage", False)
        try:
            sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, mode=self.engine.method)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        return dict(max_new_tokens=max_tokens, sampling=sampling, stop_ids=ids, seed=seed, stop=stop, stream=stream,
                    n=n, logprobs=logprobs, echo=echo, prompt_logprobs=echo and logprobs is not None,
                    include_usage=include_usage, prompt_text=None)

    @staticmethod
    def _logprob_settings(body: dict, chat: bool) -> tuple[int | None, bool]:
        """(alternatives per token, or None for no logprobs; echo). Completions: `logprobs` is the number of
        alternatives (0 .. 20), `echo` returns the prompt (with its logprobs when `logprobs` is set). Chat:
        `logprobs: true` and `top_logprobs` (0 .. 20); no echo."""
        top = body.get("top_logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= TOP_LOGPROBS):
            raise BadRequest(f"`top_logprobs` must be an integer between 0 and {TOP_LOGPROBS}, got {top!r}",
                             "top_logprobs")
        value = body.get("logprobs")
        if chat:
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"`logprobs` must be true or false, got {value!r}", "logprobs")
            if top is not None and top > 0 and not value:
                raise BadRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
            if body.get("echo") not in (None, False):
                raise BadRequest("`echo` is a completions field: chat completions do not echo", "echo")
            return ((top or 0) if value else None), False
        if top is not None:
            raise BadRequest("`top_logprobs` is a chat field: completions take the number of alternatives as "
                             "`logprobs`", "top_logprobs")
        if value is not None and (type(value) is not int or not 0 <= value <= TOP_LOGPROBS):
            raise BadRequest(f"`logprobs` must be an integer between 0 and {TOP_LOGPROBS} (alternatives per token), "
                             f"got {value!r}", "logprobs")
        echo = body.get("echo", False)
        echo = False if echo is None else echo
        if not isinstance(echo, bool):
            raise BadRequest(f"`echo` must be true or false, got {echo!r}", "echo")
        return value, echo

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.model_name!r} "
                             "(GET /v1/models)", "model", status=404, kind="not_found_error")

    def _prompt_list(self, prompt) -> list:
        """The prompts of a completions `prompt` (OpenAI's forms): a string, a list of ids, or a list of strings /
        of id lists (a batch: each prompt one queued request, its choices indexed prompt by prompt, n per prompt;
        at most the queue's length, `--max-queue`)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            limit = max(1, self.engine.max_queue)
            if len(prompt) > limit:
                raise BadRequest(f"{len(prompt)} prompts in one request; this server queues at most {limit} "
                                 "(split the batch, or restart with a larger --max-queue)", "prompt")
            return list(prompt)  # one level only: deeper nesting is not a prompt
        return [prompt]

    def _prompt_ids(self, prompt) -> list[int]:
        """The ids of one completions prompt: a string or a list of ids. Runs on a worker thread (it may
        tokenize)."""
        limit = self.engine.max_prompt_len
        if isinstance(prompt, str):
            ids = self.tokens.encode(prompt, "prompt", max_tokens=limit)
        elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("`prompt` must be a non-empty string, a list of token ids, or a list of those", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty: give at least one token", "prompt")
        return ids

    def chat_ids(self, messages) -> list[int]:
        """The ids of a chat's `messages` through the chat template. Runs on a worker thread."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list of {role, content} objects", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a `role` and a `content`", "messages")
            if m["role"] not in ROLES:
                raise BadRequest(f"messages[{i}].role {check_text(m['role'], 'messages')[:64]!r} is not a chat role: "
                                 f"use one of {', '.join(ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string", "messages")
            clean.append({"role": m["role"], "content": check_text(content, "messages")})
        limit = self.engine.max_prompt_len
        if self.tokens.tokenizer is not None:  # far too long before the template even runs
            size = sum(len(m["content"].encode("utf-8")) for m in clean)
            if size > 4 * limit * self.tokens.max_token_bytes:
                raise BadRequest(f"`messages` hold {size} bytes of text, far more than the {limit} tokens this server "
                                 "takes (shorten them or restart with a larger --max-prompt-len)", "messages")
        return self.tokens.encode(self.tokens.chat_prompt(clean), "messages", max_tokens=limit)

    async def _off_loop(self, fn, *args):
        """`fn(*args)` on a worker thread: tokenizing, templating and decoding never block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- generation ------------------------------------------------------------------------------------

    def _validate(self, ids: list[int], s: dict) -> None:
        try:
            self.engine.validate(ids, max_new_tokens=s["max_new_tokens"], sampling=s["sampling"],
                                 stop_ids=s["stop_ids"], seed=s["seed"], n=s["n"], logprobs=s["logprobs"],
                                 prompt_logprobs=s["prompt_logprobs"])
        except RequestError as e:
            raise BadRequest(str(e)) from None

    def _submit(self, ids: list[int], s: dict, on_tokens, on_finish) -> Request:
        try:
            return self.engine.submit(ids, max_new_tokens=s["max_new_tokens"], sampling=s["sampling"],
                                      stop_ids=s["stop_ids"], seed=s["seed"], on_tokens=on_tokens, on_finish=on_finish,
                                      n=s["n"], logprobs=s["logprobs"], prompt_logprobs=s["prompt_logprobs"])
        except RequestError as e:
            raise BadRequest(str(e)) from None
        except QueueFull as e:
            raise BadRequest(str(e), status=429, kind="rate_limit_exceeded") from None

    def _visible(self, req: Request, s: dict) -> tuple[list[int], str, bool]:
        """(the ids shown, their text cut at the first stop string, whether a stop string ended it). Cut by a stop
        string, the ids shown are the tokens that start before the cut."""
        ids = list(req.tokens)
        if ids and ids[-1] in s["stop_ids"]:
            ids = ids[:-1]
        text = self.tokens.decode(ids)
        cut = [text.index(x) for x in s["stop"] if x in text]
        if cut:
            text = text[: min(cut)]
            starts = self._offsets(ids, 0, len(ids))
            return ids[: sum(1 for o in starts if o < len(text))], text, True
        return ids, text, False

    def _offsets(self, ids: list[int], start: int, end: int) -> list[int]:
        """Where tokens start .. end - 1 of `ids` begin in the text of `ids` (the length of each prefix's text)."""
        if self.tokens.tokenizer is None or start >= end:
            return [0] * max(end - start, 0)
        return [len(t) for t in self.tokens.tokenizer.decode_batch([ids[:i] for i in range(start, end)])]

    @staticmethod
    def _held(text: str, stops: list[str]) -> int:
        """How many characters at the end of `text` could still be the start of a stop string (held back while
        streaming: no text past a stop string is ever sent)."""
        held = 0
        for stop in stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (a token that is part of a character decodes to U+FFFD)."""
        if self.tokens.tokenizer is None:
            return [f"<{i}>" for i in ids]
        return self.tokens.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False) if ids else []

    def _logprobs(self, ids: list[int], logprobs: list, tops: list, offsets: list[int], *, chat: bool, k: int,
                  prompt: bool = False):
        """OpenAI's logprobs of `ids` (completions: tokens / token_logprobs / top_logprobs / text_offset; chat:
        content [{token, logprob, bytes, top_logprobs}]). `prompt`: echo's prompt, whose first token has none."""
        alternatives = [[t for t, _ in top] for top in tops]
        strings = self._pieces(ids + [t for alt in alternatives for t in alt])
        pieces, rest = strings[: len(ids)], iter(strings[len(ids):])
        top_strings = [[next(rest) for _ in alt] for alt in alternatives]
        if chat:
            def entry(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return [dict(entry(p, lp), top_logprobs=[entry(ts, tlp) for ts, (_, tlp) in zip(strs, top)])
                    for p, lp, strs, top in zip(pieces, logprobs, top_strings, tops)]
        top_dicts = [{ts: tlp for ts, (_, tlp) in zip(strs, top)} for strs, top in zip(top_strings, tops)]
        if prompt:
            return {"tokens": pieces, "token_logprobs": [None] + logprobs, "top_logprobs": [None] + top_dicts,
                    "text_offset": offsets}
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}

    def _choice_logprobs(self, req: Request, ids: list[int], start: int, end: int, s: dict, chat: bool, base: int):
        """The logprobs of tokens start .. end - 1 of `ids` (a prefix of the request's tokens); `base`: the
        characters before the generated text (echo's prompt)."""
        offsets = [base + o for o in self._offsets(ids, start, end)]
        return self._logprobs(ids[start:end], req.token_logprobs[start:end], req.top_logprobs[start:end], offsets,
                              chat=chat, k=req.logprobs)

    def _echo(self, req: Request, ids: list[int], s: dict) -> tuple[str, dict | None]:
        """The prompt's text (as sent, or its ids decoded) and, with logprobs, its logprobs (completions)."""
        text = s["prompt_text"]
        scores = req.prompt_scores
        if scores is None:
            return text, None
        k = req.logprobs
        tops = [list(zip(i[:k].tolist(), v[:k].tolist())) for i, v in zip(scores.top_id, scores.top_logprob)]
        lp = self._logprobs(ids[1:], scores.logprob.tolist(), tops, [], chat=False, k=k)
        first = self._pieces(ids[:1])
        lp["tokens"] = first + lp["tokens"]
        lp["token_logprobs"] = [None] + lp["token_logprobs"]
        lp["top_logprobs"] = [None] + lp["top_logprobs"]
        lp["text_offset"] = self._offsets(ids, 0, len(ids))
        return text, lp

    async def _watch(self, http: HttpRequest, req: Request, queue: asyncio.Queue) -> None:
        """Every `DISCONNECT_POLL_S`: a client gone away cancels its request (the slot frees) and ends its stream."""
        while not req.done_event.is_set():
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await http.is_disconnected():
                self.engine.cancel(req)
                queue.put_nowait(GONE)
                return

    async def _choice_stream(self, http: HttpRequest, req: Request, s: dict, queue: asyncio.Queue):
        """Async iterator of (new text, finish_reason or None, new token ids, the first of them's index) as the
        engine produces one choice's tokens. While streaming, text that could still be the start of a stop string
        is held back (and the tokens it comes from), so nothing past a stop string is ever sent.

        Per round on the event loop, no thread hand-off: the engine's wake-ups (several since the last look are one),
        the new tokens decoded incrementally (`StreamText`), the stop strings looked for in the new text only. The
        rare and the last steps take the exact path of the non-streamed response on a worker thread (`_visible`:
        the whole text decoded, cut at the first stop string): a stop string found, text held back, the end."""
        sent, sent_ids = "", 0
        stream = StreamText(self.tokens)
        stops, stop_ids = s["stop"], s["stop_ids"]
        longest = max((len(x) for x in stops), default=0)
        searched = 0  # characters of the stream's text searched for stop strings (none can start before)
        watcher = asyncio.ensure_future(self._watch(http, req, queue))
        try:
            while True:
                event = await queue.get()
                while not queue.empty():  # wake-ups that came meanwhile: one look at the tokens serves them all
                    event = GONE if queue.get_nowait() is GONE else event
                if event is GONE:  # the client went away (its request is cancelled)
                    return
                finished = req.done_event.is_set()  # read first: once set, every token is in req.tokens
                ids_now = list(req.tokens)
                if ids_now and ids_now[-1] in stop_ids:
                    ids_now.pop()
                text, stopped = stream.update(ids_now), False
                if stops and len(text) > searched:
                    start = max(searched - longest + 1, 0)
                    searched = len(text)
                    stopped = any(x in text[start:] for x in stops)
                if finished or stopped:  # exact: the whole text, cut where the non-streamed response cuts it
                    ids_now, text, stopped = await self._off_loop(self._visible, req, s)
                    if stopped:
                        self.engine.cancel(req, reason="stop")
                    finished = finished or stopped
                release = len(ids_now) if finished else min(stream.read, len(ids_now))
                if not finished and stops:
                    held = self._held(text, stops)
                    if held:  # the tokens whose text is wholly sent go out; the held characters wait
                        text = text[: len(text) - held]
                        ends = await self._off_loop(self._offsets, ids_now, sent_ids + 1, release + 1)
                        release = sent_ids + sum(1 for e in ends if e <= len(text))
                reason = None
                if finished:
                    reason = "stop" if stopped else req.finish_reason
                    if reason == "error":
                        raise EngineFailed(req.error)
                if text.startswith(sent) and (len(text) > len(sent) or reason or self.tokens.tokenizer is None
                                              or release > sent_ids):
                    yield text[len(sent):], reason, ids_now[sent_ids:release], sent_ids, ids_now
                    sent, sent_ids = text, release
                elif not text.startswith(sent):
                    sent = text
                if finished:
                    return
        finally:
            watcher.cancel()
            if not req.done_event.is_set():
                self.engine.cancel(req)

    # -- the app ---------------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            try:
                yield
            finally:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.engine.stop(timeout=self.grace_s))
                self._pool.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="dflash_jax", lifespan=lifespan)
        app.add_middleware(_ReturnMemory, threshold=LARGE_BODY_BYTES)
        if self.api_key is not None:  # outermost: a request without the key is answered before anything else runs
            app.add_middleware(_RequireKey, key=self.api_key)

        async def body_of(http: HttpRequest) -> dict:
            """The JSON object of a request body of at most `max_body_bytes` (413 beyond: by its Content-Length before
            anything is read, or as it streams in); parsed on a worker thread."""
            limit = self.max_body_bytes
            too_large = BadRequest(f"the request body is larger than this server's limit of {limit} bytes "
                                   "(send a shorter prompt, or restart with a larger --max-request-mb)",
                                   status=413, kind="request_too_large")
            declared = http.headers.get("content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                raise too_large
            chunks, size = [], 0
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
            raw = b"".join(chunks)
            del chunks
            try:
                body = await self._off_loop(json.loads, raw)
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
                raise BadRequest("the request body is not valid JSON") from None
            except RecursionError:
                raise BadRequest("the request body nests too deeply to be a request (arrays or objects inside "
                                 "each other thousands of levels deep)") from None
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            return body

        @app.exception_handler(BadRequest)
        async def bad_request(http, e: BadRequest):
            return _error(e)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(http, e: StarletteHTTPException):  # 404, 405, ..: OpenAI's error shape too
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
            detail = e.detail if isinstance(e.detail, str) else str(e.detail)
            if e.status_code == 404:
                detail = f"{http.url.path} is not an endpoint of this server ({', '.join(ENDPOINTS)})"
            elif e.status_code == 405:
                detail = f"{http.method} is not allowed on {http.url.path}"
            return JSONResponse(error_body(detail, kind), status_code=e.status_code, headers=e.headers)

        @app.exception_handler(EngineFailed)
        async def engine_failed(http, e: EngineFailed):
            return JSONResponse(error_body(f"generation failed: {e}", "server_error"), status_code=500)

        @app.exception_handler(Exception)
        async def internal_error(http, e: Exception):  # a bug: logged with its traceback, answered in OpenAI's shape
            logger.exception("internal error on %s %s", http.method, http.url.path)
            return JSONResponse(error_body(f"internal server error ({type(e).__name__})", "server_error"),
                                status_code=500)

        @app.get("/health")
        async def health():
            return {"status": "ok", "slots": self.engine.slots, "slots_in_use": self.engine.slots_in_use,
                    "queue_depth": self.engine.queue_depth, "warming": getattr(self.engine, "warming", 0)}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                 "owned_by": "dflash_jax"}]}

        @app.get("/metrics")
        async def metrics():
            self.metrics.set_levels(queue_depth=self.engine.queue_depth, slots_in_use=self.engine.slots_in_use)
            data, content_type = self.metrics.render()
            return PlainTextResponse(data, media_type=content_type)

        @app.post("/v1/completions")
        async def completions(http: HttpRequest):
            body = await body_of(http)
            self._check_model(body)
            if "prompt" not in body:
                raise BadRequest("`prompt` is required", "prompt")
            s = self._settings(body, default_max_tokens=min(16, self.engine.max_new_tokens))
            batch = []
            for prompt in self._prompt_list(body["prompt"]):
                ids = await self._off_loop(self._prompt_ids, prompt)
                text = None
                if s["echo"]:
                    text = prompt if isinstance(prompt, str) else await self._off_loop(self.tokens.decode, ids)
                batch.append((ids, dict(s, prompt_text=text)))
            return await self._respond(http, batch, s, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(http: HttpRequest):
            body = await body_of(http)
            self._check_model(body)
            if "messages" not in body:
                raise BadRequest("`messages` is required", "messages")
            s = self._settings(body, default_max_tokens=self.engine.max_new_tokens, chat=True)
            ids = await self._off_loop(self.chat_ids, body["messages"])
            return await self._respond(http, [(ids, s)], s, chat=True)

        return app

    async def _respond(self, http: HttpRequest, batch: list, s: dict, *, chat: bool):
        """Runs `batch` [(prompt ids, its settings)] (one prompt, or a completions batch) and answers with their
        choices: prompt p's sample i is choice p * n + i (OpenAI's order)."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        loop = asyncio.get_running_loop()
        n = s["n"]
        queues = [asyncio.Queue() for _ in range(n * len(batch))]

        def waker(p: int):
            def on_event(req, new=None):  # from the engine's thread: wakes the choice's stream
                loop.call_soon_threadsafe(queues[p * n + req.index].put_nowait, "event")
            return on_event

        for ids, _ in batch:  # every prompt checked before any is queued: a bad one refuses the whole request
            self._validate(ids, s)
        heads = []
        try:
            for p, (ids, sp) in enumerate(batch):  # a full queue raises here, before any byte
                heads.append(self._submit(ids, sp, waker(p), waker(p)))
        except BadRequest:
            for head in heads:
                for r in head.samples:
                    self.engine.cancel(r)
            raise
        reqs = [r for head in heads for r in head.samples]
        where = [(ids, sp) for ids, sp in batch for _ in range(n)]  # each choice's prompt ids and settings
        streams = [self._choice_stream(http, r, sp, q) for r, (_, sp), q in zip(reqs, where, queues)]
        echo = s["echo"]

        def usage() -> dict:
            done = sum(len(r.tokens) for r in reqs)
            prompt = sum(len(ids) for ids, _ in batch)
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        if not s["stream"]:
            reasons = []
            try:
                for stream in streams:
                    reason = None
                    async for _, reason, _, _, _ in stream:
                        pass
                    reasons.append(reason)
            finally:
                for r in reqs:
                    if not r.done_event.is_set():
                        self.engine.cancel(r)
            if any(reason is None for reason in reasons):  # the client went away
                return JSONResponse(error_body("the request was cancelled", "cancelled"), status_code=499)
            choices = []
            for i, (r, reason) in enumerate(zip(reqs, reasons)):
                choice = await self._off_loop(self._final_choice, r, *where[i], reason, chat)
                choice["index"] = i
                choices.append(choice)
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices,
                    "usage": usage()}

        async def merged():
            """(choice index, item) from every choice's stream, as they come."""
            out: asyncio.Queue = asyncio.Queue()

            async def pump(i, stream):
                try:
                    async for item in stream:
                        await out.put((i, item, None))
                    await out.put((i, None, None))
                except Exception as e:  # an engine failure ends the merged stream with it
                    await out.put((i, None, e))

            tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
            try:
                left = len(tasks)
                while left:
                    i, item, error = await out.get()
                    if error is not None:
                        raise error
                    if item is None:
                        left -= 1
                        continue
                    yield i, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        async def single():
            """The one choice's stream (no merging task and queue per chunk)."""
            async for item in streams[0]:
                yield 0, item

        async def events():
            started = set()
            include_usage = s["include_usage"]
            chunk_obj = obj + ".chunk" if chat else obj
            try:
                items = merged() if len(streams) > 1 else single()
                try:
                    async for i, (piece, reason, new_ids, first, shown) in items:
                        req = reqs[i]
                        ids, sp = where[i]
                        lp = None
                        if req.logprobs is not None and new_ids:
                            base = len(sp["prompt_text"]) if echo else 0
                            lp = await self._off_loop(self._choice_logprobs, req, shown, first, first + len(new_ids),
                                                      sp, chat, base)
                        if i not in started and echo:  # completions' echo: the prompt leads the first chunk
                            text, prompt_lp = await self._off_loop(self._echo, req, ids, sp)
                            piece = text + piece
                            if prompt_lp is not None:
                                lp = prompt_lp if lp is None else {k: prompt_lp[k] + lp[k] for k in prompt_lp}
                        if chat:
                            delta: dict[str, Any] = {"content": piece}
                            if i not in started:
                                delta["role"] = "assistant"
                            choice = {"index": i, "delta": delta, "logprobs": None if lp is None else {
                                "content": lp, "refusal": None}, "finish_reason": reason}
                        else:
                            choice = {"index": i, "text": piece, "logprobs": lp, "finish_reason": reason}
                        started.add(i)
                        choice["token_ids"] = new_ids
                        chunk = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                                 "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = None
                        elif reason is not None and len(reqs) == 1:
                            chunk["usage"] = usage()
                        yield f"data: {json.dumps(chunk)}\n\n"
                except EngineFailed as e:  # the stream ends with an error event, then [DONE] as always
                    yield f"data: {json.dumps(error_body(f'generation failed: {e}', 'server_error'))}\n\n"
                else:
                    if include_usage:
                        chunk = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                                 "choices": [], "usage": usage()}
                        yield f"data: {json.dumps(chunk)}\n\n"
                finally:
                    await items.aclose()
                yield "data: [DONE]\n\n"
            finally:
                for st in streams:
                    await st.aclose()
                for r in reqs:
                    if not r.done_event.is_set():
                        self.engine.cancel(r)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _final_choice(self, req: Request, ids: list[int], s: dict, reason: str, chat: bool) -> dict:
        """One finished choice of a non-streamed response (on a worker thread: it decodes)."""
        shown, text, _ = self._visible(req, s)
        lp = None
        base = 0
        if s["echo"]:
            prompt_text, prompt_lp = self._echo(req, ids, s)
            base = len(prompt_text)
            text = prompt_text + text
        if req.logprobs is not None:
            lp = self._choice_logprobs(req, shown, 0, len(shown), s, chat, base)
            if s["echo"] and prompt_lp is not None:
                lp = {k: prompt_lp[k] + lp[k] for k in prompt_lp}
        if chat:
            choice = {"index": req.index, "message": {"role": "assistant", "content": text},
                      "logprobs": None if lp is None else {"content": lp, "refusal": None}, "finish_reason": reason}
        else:
            choice = {"index": req.index, "text": text, "logprobs": lp, "finish_reason": reason}
        choice["token_ids"] = shown
        return choice


def create_app(engine: Engine, tokenizer=None, *, model_name: str = "dflash", chat_template=None,
               eos_ids=(), grace_s: float = 10.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (the engine thread starts and stops with the app's lifespan).
    `chat_template`: a `templates.ChatTemplate`, its source text (checked and sandboxed here), or None.
    `api_key`: the bearer key every endpoint but /health requires (None: none)."""
    return Server(engine, Tokens(tokenizer, chat_template), model_name=model_name, eos_ids=eos_ids,
                  grace_s=grace_s, max_body_bytes=max_body_bytes, api_key=api_key).app
