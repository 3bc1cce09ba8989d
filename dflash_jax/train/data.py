"""Training data from a corpus present on every machine: the Python standard library's own source.

Files are split by name: a file is held out when the SHA-1 of its path relative to the stdlib root falls
in the held-out bucket, so the split is the same on every machine and never depends on file order.
The tokenizer is a byte-level BPE trained with the `tokenizers` package on the training files only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
MASK = "<|mask|>"


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(*, held_out_percent: int = 5, max_bytes: int = 200_000) -> tuple[list[str], list[str]]:
    """(train, held_out) lists of stdlib `.py` files (tests and site-packages excluded), split by name."""
    root = stdlib_root()
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = rel_dir.split(os.sep)
        if any(p in ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__") for p in parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            if os.path.getsize(path) > max_bytes:
                continue
            rel = os.path.relpath(path, root)
            bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100
            (held if bucket < held_out_percent else train).append(path)
    return train, held


def read_texts(paths: list[str]) -> Iterator[str]:
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                yield fh.read()
        except (UnicodeDecodeError, OSError):
            continue


def train_tokenizer(paths: list[str], vocab_size: int, out_file: str):
    """Byte-level BPE with `<|endoftext|>` and `<|mask|>` as the last two ids; saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(read_texts(paths), trainer=trainer)
    tok.add_special_tokens([EOS, MASK])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(out_file)
    return tok


def encode_files(tok, paths: list[str]) -> np.ndarray:
    """One token stream: every file's tokens followed by EOS."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for text in read_texts(paths):
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def random_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, batch)
    return np.stack([stream[s: s + length] for s in starts])


def file_windows(pair, split: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Up to `n` prompts of `length` tokens, one random window per standard-library file, files in a seeded
    random order. split "held_out": the pair's `split.json` held-out files (never trained on); "train": the
    training side of `stdlib_files()` minus those. `pair` needs `.directory` and `.tokenizer_path`."""
    if split not in ("held_out", "train"):
        raise ValueError(f"split must be 'held_out' or 'train', not {split!r}")
    split_file = os.path.join(pair.directory, "split.json")
    if not os.path.exists(split_file):
        raise FileNotFoundError(f"{split_file} not found: file windows need a pair trained by "
                                f"dflash_jax.train (its split.json lists the held-out files)")
    with open(split_file) as fh:
        held_out = list(json.load(fh)["held_out_files"])
    root = stdlib_root()
    files = held_out if split == "held_out" else sorted(
        set(os.path.relpath(f, root) for f in stdlib_files()[0]) - set(held_out))
    tok = Tokenizer.from_file(pair.tokenizer_path)
    rng = np.random.default_rng(seed)
    prompts = []
    for rel in rng.permutation(np.asarray(files, dtype=object)):
        path = os.path.join(root, str(rel))
        if not os.path.exists(path):
            continue
        ids = tok.encode(open(path, encoding="utf-8", errors="replace").read()).ids
        if len(ids) < length + 8:
            continue
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start: start + length])
        if len(prompts) == n:
            break
    if not prompts:
        raise ValueError(f"no {split} file has {length + 8} tokens or more: use a shorter prompt length")
    return prompts
