"""The server's incremental detokenizer (`serve.server.StreamText`): decoding a growing list of ids a few tokens at a
time gives the same text as decoding the whole list, never a character of an incomplete UTF-8 sequence."""

from __future__ import annotations

import random

import pytest

from dflash_jax.serve.server import StreamText, Tokens

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café — 東京 🙂 ünïcödé\tand\r\nmore 😀😀 text",
    "\u00e9\u00e8\u00ea" * 5 + " import os, sys  # ok",
]


@pytest.fixture(scope="module")
def tokens():
    import dflash_jax
    from dflash_jax.cli.generate import load_tokenizer

    tokenizer = load_tokenizer(dflash_jax.load())
    if tokenizer is None:
        pytest.skip("the shipped pair's tokenizer needs the `tokenizers` package")
    return Tokens(tokenizer)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_the_whole_decode(tokens, text, seed):
    ids = tokens.encode(text, "prompt")
    assert tokens.decode(ids) == text  # byte-level: the text round-trips
    rng = random.Random(seed)
    stream, n = StreamText(tokens), 0
    while n < len(ids):
        n = min(len(ids), n + rng.choice([1, 1, 2, 3, 5]))  # rounds commit 1 .. several tokens
        got = stream.update(ids[:n])
        assert got == tokens.decode(ids[: stream.read])  # the text of the ids it has read
        assert text.startswith(got) and "\ufffd" not in got  # never a partial character
        assert stream.read <= n
    assert stream.update(ids) == text and stream.read == len(ids)


def test_a_split_character_waits_for_its_last_byte(tokens):
    ids = tokens.encode("a🙂", "prompt")
    pieces = [tokens.decode(ids[:i]) for i in range(1, len(ids) + 1)]
    partial = [i for i, p in enumerate(pieces, 1) if p.endswith("\ufffd")]
    if not partial:
        pytest.skip("this tokenizer has the character as one token")
    stream = StreamText(tokens)
    assert stream.update(ids[:1]) == "a" and stream.read == 1
    for n in partial:  # its first bytes decode to U+FFFD: nothing more is text yet, those ids stay unread
        assert stream.update(ids[:n]) == "a" and stream.read == 1
    assert stream.update(ids) == "a🙂" and stream.read == len(ids)


def test_no_tokenizer_reads_every_id():
    stream = StreamText(Tokens(None))
    assert stream.update([1, 2, 3]) == "" and stream.read == 3
