"""The draft's branch head (`models.draft.BranchHeadWeights`): a fresh head is exactly the marginals, the tree
built from a head takes the most probable paths under its conditional distributions (checked by enumeration),
tree generation with a head stays lossless with proposals accepted, and the head file beside a checkpoint is
checked (sha256, the pair it was fitted for, shapes) and attached at load."""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import shutil
import struct
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import testing
from dflash_jax.errors import CheckpointError
from dflash_jax.models import draft as dm
from dflash_jax.pair import BRANCH_HEAD_FILE, load_branch_head, save_branch_head, with_branch_head
from dflash_jax.spec import generate
from dflash_jax.spec.tree import TreeShape, build_tree, build_tree_from_head
from tests.spec.tree_checks import lossless_tree_rounds


@pytest.fixture(scope="module")
def pair():
    cfg = testing.tiny_qwen3_moe_config(num_layers=2)
    return testing.random_pair(cfg, seed=0, target_layer_ids=(0, 1), block_size=8)


def _random_head(pair, seed: int, scale: float):
    fresh = dm.init_branch_head(pair.draft_cfg.hidden_size, jax.random.key(seed))
    w_out = jax.random.normal(jax.random.key(seed + 1), fresh.w_out.shape) * scale / np.sqrt(fresh.w_out.shape[0])
    return fresh.replace(w_out=w_out)


def _logits(pair, head, hidden, parent):
    return dm.branch_head_logits(head, hidden, parent, pair.draft_cfg, embed=pair.target.embed,
                                 lm_head=pair.target.lm_head)


def test_a_fresh_head_is_the_marginals_and_a_trained_one_depends_on_the_parent(pair):
    h = pair.draft_cfg.hidden_size
    hidden = jax.random.normal(jax.random.key(3), (2, 5, h))
    parent = jnp.array([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]], jnp.int32)
    fresh = dm.init_branch_head(h, jax.random.key(0))
    marginal = dm.draft_logits(hidden, pair.draft_cfg, embed=pair.target.embed, lm_head=pair.target.lm_head)
    np.testing.assert_allclose(_logits(pair, fresh, hidden, parent), marginal, rtol=1e-6, atol=1e-6)
    head = _random_head(pair, 1, 1.0)
    a = _logits(pair, head, hidden, parent)
    b = _logits(pair, head, hidden, parent[::-1])
    assert not np.allclose(a, b)  # the same positions, other parents: other distributions


def _reference_paths(pair, head, hidden, anchor, branch, budget):
    """The budget-1 most probable paths by enumeration: a path's children are the top-`branch` tokens of the
    head's distribution at the next position given the path's last token."""
    depth = hidden.shape[0]
    paths, frontier = [], [((), 0.0, int(anchor))]
    for d in range(depth):
        nxt = []
        for toks, score, last in frontier:
            lp = np.asarray(jax.nn.log_softmax(_logits(pair, head, hidden[d], jnp.int32(last))))
            for x in np.argsort(-lp, kind="stable")[:branch]:
                nxt.append((toks + (int(x),), score + float(lp[x]), int(x)))
        paths += nxt
        frontier = nxt
    return heapq.nlargest(budget - 1, paths, key=lambda p: p[1])


def test_the_head_build_takes_the_most_probable_conditional_paths(pair):
    h = pair.draft_cfg.hidden_size
    depth, budget, branch = 3, 11, 3
    hidden = jax.random.normal(jax.random.key(5), (2, depth, h)) * 3.0
    anchor = jnp.array([4, 11], jnp.int32)
    head = _random_head(pair, 2, 4.0)
    kw = dict(embed=pair.target.embed, lm_head=pair.target.lm_head)
    tree = jax.tree.map(np.asarray, build_tree_from_head(anchor, hidden, head, TreeShape(budget, branch),
                                                         pair.draft_cfg, **kw))
    for b in range(2):
        got = {0: ()}
        for t in range(1, budget):
            p = int(tree.parent[b, t])
            assert p < t and tree.depth[b, t] == tree.depth[b, p] + 1
            got[t] = got[p] + (int(tree.tokens[b, t]),)
        want = _reference_paths(pair, head, np.asarray(hidden[b]), anchor[b], branch, budget)
        assert sorted(got[t] for t in range(1, budget)) == sorted(p for p, _, _ in want)
        np.testing.assert_allclose(sorted(tree.score[b, 1:]), sorted(s for _, s, _ in want), rtol=1e-4)
    # a fresh head builds exactly the marginal tree
    fresh = dm.init_branch_head(h, jax.random.key(0))
    marg = build_tree(anchor, jax.nn.log_softmax(dm.draft_logits(hidden, pair.draft_cfg, **kw)), TreeShape(budget, branch))
    same = build_tree_from_head(anchor, hidden, fresh, TreeShape(budget, branch), pair.draft_cfg, **kw)
    for field in ("tokens", "parent", "depth", "mask", "rank"):
        np.testing.assert_array_equal(getattr(same, field), getattr(marg, field))
    np.testing.assert_allclose(same.score, marg.score, rtol=1e-5)
    # branch 1: the head's greedy chain
    chain = build_tree_from_head(anchor, hidden, head, TreeShape(depth + 1, 1), pair.draft_cfg, **kw)
    for b in range(2):
        last = int(anchor[b])
        for d in range(depth):
            last = int(jnp.argmax(_logits(pair, head, hidden[b, d], jnp.int32(last))))
            assert int(chain.tokens[b, d + 1]) == last


@pytest.mark.slow  # the fast set proves it on the shipped pair's own head (tests/spec/test_tree.py)
def test_greedy_trees_from_a_head_equal_plain_greedy(pair):
    # a head that reorders the planted draft's candidates: the output is still the target's, proposals accepted
    with_head = with_branch_head(pair, _random_head(pair, 4, 0.5))
    prompts = [[3, 17, 42, 5, 9, 11, 7, 2], list(range(40, 63))]
    _, accepted, _ = lossless_tree_rounds(with_head, prompts, 32, TreeShape(8, 3))
    assert accepted.mean() >= 0.3 and accepted.max() >= 2, accepted


def _fingerprinted(pair, digest: str):
    return dataclasses.replace(pair, manifest={"checksums": {"files": {"target/model.safetensors": {"sha256": digest}}}})


def test_head_file_round_trip_and_refusals(pair, tmp_path):
    mine, other = _fingerprinted(pair, "a" * 64), _fingerprinted(pair, "b" * 64)
    head = _random_head(pair, 6, 1.0)
    path = save_branch_head(head, str(tmp_path), pair=mine, fitted_on={"seeds": [1]})
    assert path == os.path.join(str(tmp_path), BRANCH_HEAD_FILE)
    assert [p.name for p in tmp_path.iterdir()] == [BRANCH_HEAD_FILE]  # no temporary file left behind
    back = load_branch_head(path, mine)
    np.testing.assert_array_equal(back.w_in, head.w_in)
    np.testing.assert_array_equal(back.w_out, head.w_out)
    with pytest.raises(CheckpointError, match="fitted for another target/draft.*refit it"):
        load_branch_head(path, other)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x40  # one bit of w_out
    bad = tmp_path / "tampered.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its sha256"):
        load_branch_head(str(bad), mine)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_branch_head(str(tmp_path / "junk.safetensors"), mine)
    small = dm.init_branch_head(pair.draft_cfg.hidden_size // 2, jax.random.key(0))
    wrong = save_branch_head(small, str(tmp_path / "small.safetensors"), pair=mine)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_branch_head(wrong, mine)


def test_load_attaches_the_pairs_head(tmp_path):
    shipped = dflash_jax.load(verify=False)
    assert shipped.draft.branch_head is not None  # the shipped pairs carry their fitted heads
    hybrid = dflash_jax.load(dflash_jax.SHIPPED_PAIRS["tiny_pair_qwen3_5"], verify=False)
    assert hybrid.draft.branch_head is not None
    assert hybrid.draft.branch_head.w_in.shape == (2 * hybrid.draft_cfg.hidden_size, 2 * hybrid.draft_cfg.hidden_size)
    bare = dflash_jax.load(verify=False, branch_head=False)
    assert bare.draft.branch_head is None
    with pytest.raises(ValueError, match="has none"):  # the head's chain asked of a draft without a head
        generate(bare, [[1, 2, 3]], max_new_tokens=4, branch_head=True)
    # a copy whose head was fitted for another pair is refused at load, with the fix
    copy = tmp_path / "pair"
    shutil.copytree(dflash_jax.SHIPPED_PAIR, copy)
    save_branch_head(shipped.draft.branch_head, str(copy), pair=_fingerprinted(shipped, "c" * 64))
    with pytest.raises(CheckpointError, match="another target/draft"):
        dflash_jax.load(str(copy), verify=False)
    assert dflash_jax.load(str(copy), verify=False, branch_head=False).draft.branch_head is None



# ----------------------------------------------------------------------------------------------------------
# a damaged or foreign head file: one CheckpointError naming the file and the fix, never a hang
# ----------------------------------------------------------------------------------------------------------

def _split(path) -> tuple[dict, bytes]:
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(header, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _edit(fn):
    def damage(header, data):
        header = json.loads(json.dumps(header))
        fn(header)
        return _join(header, data)
    return damage


_DAMAGES = {
    "empty": (lambda h, d: b"", "no safetensors header"),
    "header_length_past_the_end": (lambda h, d: struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
    "header_not_json": (lambda h, d: struct.pack("<Q", 4) + b"\xff\xfe{[" + d, "not JSON"),
    "header_a_list": (lambda h, d: _join([1, 2], d), "not a JSON object"),
    "no_w_out": (_edit(lambda h: h.pop("w_out")), "needs exactly ['w_in', 'w_out']"),
    "extra_tensor": (_edit(lambda h: h.update(bias=h["w_out"])), "needs exactly"),
    "wrong_format": (_edit(lambda h: h["__metadata__"].update(format="other/1")), "is not a dflash_jax.branch_head/1"),
    "metadata_not_strings": (_edit(lambda h: h["__metadata__"].update(sha256=1)), "map of strings"),
    "entry_not_an_object": (_edit(lambda h: h.update(w_in=[1])), "not a JSON object"),
    "float16": (_edit(lambda h: h["w_in"].update(dtype="F16")), "F32"),
    "one_dimensional": (_edit(lambda h: h["w_in"].update(shape=[h["w_in"]["shape"][0]])), "two sizes"),
    "shape_a_string": (_edit(lambda h: h["w_out"].update(shape="[2, 3]")), "two sizes"),
    "offsets_past_the_end": (_edit(lambda h: h["w_out"].update(data_offsets=[0, 10 ** 9])), "data_offsets"),
    "offsets_not_numbers": (_edit(lambda h: h["w_out"].update(data_offsets=["0", "8"])), "data_offsets"),
    "overlapping": (_edit(lambda h: h["w_out"].update(
        data_offsets=[h["w_in"]["data_offsets"][0], h["w_in"]["data_offsets"][0] + h["w_out"]["data_offsets"][1]
                      - h["w_out"]["data_offsets"][0]])), "share bytes"),
    "truncated": (lambda h, d: _join(h, d[:-8]), "truncated"),
    "transposed": (_edit(lambda h: h["w_out"].update(shape=h["w_out"]["shape"][::-1])), "hidden size"),
}


def _load_in_thread(path, pair, timeout=60.0):
    """load_branch_head(path, pair) in a thread: a read that blocks (a FIFO) fails the test instead of hanging it."""
    out = {}

    def go():
        try:
            out["value"] = load_branch_head(str(path), pair)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"load_branch_head({path}) blocked"
    return out


@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_a_damaged_head_file_is_one_clear_error(pair, tmp_path, damage):
    mine = _fingerprinted(pair, "a" * 64)
    path = save_branch_head(_random_head(pair, 6, 1.0), str(tmp_path), pair=mine)
    header, data = _split(path)
    make, want = _DAMAGES[damage]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(make(header, data))
    with pytest.raises(CheckpointError) as info:
        load_branch_head(str(bad), mine)
    message = str(info.value)
    assert want in message and str(bad) in message and "refit it" in message and "\n" not in message, message


@pytest.mark.parametrize("kind", ["fifo", "directory", "nan"])
def test_a_head_path_that_is_no_head_is_refused_without_reading(pair, tmp_path, kind):
    mine = _fingerprinted(pair, "a" * 64)
    path = tmp_path / BRANCH_HEAD_FILE
    if kind == "fifo":
        os.mkfifo(path)
        want = "is a FIFO (named pipe), not a branch head file"
    elif kind == "directory":
        path.mkdir()
        want = "is a directory, not a branch head file"
    else:
        head = _random_head(pair, 6, 1.0)
        save_branch_head(head.replace(w_out=head.w_out.at[0, 0].set(jnp.nan)), str(path), pair=mine)
        want = "NaN or infinite"
    out = _load_in_thread(path, mine)
    assert isinstance(out.get("error"), CheckpointError), out
    assert want in str(out["error"]) and "refit it" in str(out["error"]), out["error"]
