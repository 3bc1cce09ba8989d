"""Token-tree verification: more tokens per verify from the distributions one draft forward already gives.

The DFlash draft predicts a distribution at every block position 1..B-1 in one forward; the chain verifies
only the argmax path. A tree verifies the N most probable continuations at once:

  build    best-first by path probability: a node at depth d with token x scores
           log P(path) = sum over its path of log q_d(x_d) (the draft's distribution at block position d);
           candidates of a node are the top-K tokens of the next position. Expanding the best frontier entry
           N-1 times gives the N most probable prefixes (a prefix scores at least as high as its extensions,
           so the set is prefix-closed; ties break by order). The selection order does not depend on N: the
           tree of budget n is the first n nodes of any larger one (the adaptive policy relies on it).
  verify   one width-N target forward: node t at position start + depth(t), attending to the committed
           cache and to its ancestors only (`models.decoder.TreeBlock`, `nn.attention.cached_causal_attention`
           with `tree_mask`); its logits are the target's distribution after that node's path.
  accept   greedy: walk from the root while a child's token equals the target's argmax at its parent; the
           deepest node reached is the accepted path and the target's argmax there is the bonus.
           sampling: the same walk against one target draw per node, each from the processed distribution
           at that node (`spec.sampling`). This is recursive rejection sampling over the siblings with one-hot
           proposals: child c_k (in rank order) is accepted with probability p_res(c_k), p_res being p with the
           earlier siblings removed and renormalized; the telescoping product makes that exactly p(c_k), and
           the bonus after all rejections is drawn from p restricted to the non-candidates, i.e. one draw x ~ p
           decides everything: x = some child's token -> descend, else x is the bonus. Every emitted token is
           a fresh draw of the target given the committed prefix: lossless (tested with a chi-square test).
  commit   the accepted path's K/V rows (slots start + node index) are copied to slots start + depth, then
           the lengths move (slot = position holds again); the draft's next context rows are the verify
           taps of the path's nodes.

Static shapes: the budget N (a static bucket) fixes the verify width, the branching K the candidates per
node; the depth is at most B-1 (the draft's block). Trees of different requests reuse one compiled round.

Every family verifies trees. Attention layers use the tree mask. Qwen3.5's Gated DeltaNet layers carry a
recurrent state along one sequence: there every node's root-to-node path runs as one sequence of a batch
through the delta rule (from the committed state, steps past the node masked) and every node's causal conv
reads its own ancestors' rows (`models.qwen3_5`); the verify keeps the nodes' DeltaNet rows, the commit puts
the accepted path's rows in order, and the usual exact replay (`rollback`) leaves the states after the path.
The cache's rollback width is widened to the widest tree (`widen_for_tree`).

The adaptive policy (`AdaptivePolicy`) picks, each round and before the draft, one of a few static shapes
(chains of B and trees of budget N, each a branch of one `lax.switch` running exactly that shape's round) by
expected tokens per second: each shape's tokens per round (a prior or calibrated figures, scaled per sequence
by the acceptance so far) over its cost (a `VerifyCost` per shape: measured at warm-up, or modelled from rows
and expert bytes). Deterministic given the state. `calibrate_policy` measures both figures in the mode the
policy runs in; a policy compiles and provisions only the shapes it can choose (`AdaptivePolicy.pruned`), and
one reachable shape runs as that fixed shape.

The build's node scores can come from a fitted acceptance model instead of the draft's marginals
(`TreeCalibration`, fitted by `fit_calibration` on `calibration_samples` of training-split prompts).

When the draft carries a branch head (`models.draft.BranchHeadWeights`, attached by `pair.load` from the file
shipped beside the checkpoint), a tree's nodes take their children from it instead: the draft's distribution
at the next position given the node's own token (`build_tree_from_head`). The marginals ignore which branch a
node is on, so below a node off the argmax chain they mostly miss; the head models exactly what a best-first
tree ranks by, P(token | the path so far is the target's). Chains (branch 1) stay the argmax chain.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax import compile_cache
from dflash_jax.errors import CheckpointError, open_regular
from dflash_jax.models import draft as draft_model
from dflash_jax.models.decoder import TreeBlock
from dflash_jax.models.family import family_of
from dflash_jax.pair import pair_fingerprint  # noqa: F401  (re-exported: calibrations use it)
from dflash_jax.spec import requests as rq
from dflash_jax.spec.loop import LOOP_BUCKETS, generation_result, shape_stats
from dflash_jax.spec.sampling import SamplingParams, processed_scores, sample_rows
from dflash_jax.spec.session import (
    Prepared, SpecConfig, SpecState, all_greedy, begin_prepared, check_state, emit_tokens, prepare, spec_round,
    split_rows,
)

DEFAULT_BRANCH = 4
# The draft's per-position distributions are marginals: the product of a path's marginals underrates the
# path (a later position is right more often when the earlier ones were). Building the tree from the
# distributions sharpened by 1/T (T < 1) moves budget from far siblings to depth. T chosen on training-split
# prompts of the shipped pair (docs/tree.md); 1.0 = the plain product.
DEFAULT_TEMPERATURE = 1.0


def tree_supported(cfg) -> bool:
    """Whether a target family can verify token trees: every registered family can (attention layers by the
    tree mask, Qwen3.5's DeltaNet layers along each node's path)."""
    family_of(cfg)
    return True


def widen_for_tree(cfg, cache, width: int):
    """A target cache able to take a tree verify of `width` rows (Qwen3.5 keeps the verify's DeltaNet rows,
    sized by the widest verify; attention caches need nothing)."""
    fam = family_of(cfg)
    return fam.widen_for_tree(cache, width) if hasattr(fam, "widen_for_tree") else cache


def begin_tree(pair, prep: Prepared, widest: int) -> SpecState:
    """`session.begin_prepared` with the target cache widened for trees of up to `widest` nodes."""
    state = begin_prepared(pair, prep)
    return state.replace(target_cache=widen_for_tree(prep.spec.target, state.target_cache, widest))


CALIBRATION_FEATURES = ("1", "log q", "log(1-q)", "argmax", "off", "argmax*off", "argmax*depth/15",
                        "off*log q", "argmax*log q")


def calibration_features(depth, rank, logq, off):
    """The acceptance model's features of a candidate (arrays of one shape, numpy or jax): its depth (block
    position), its rank among the position's candidates (0 = the draft's argmax), its draft log-probability
    log q, and whether its parent's path left the draft's argmax chain (off). Returns [..., 9]
    (`CALIBRATION_FEATURES`)."""
    xp = jnp if any(isinstance(a, jax.Array) for a in (depth, rank, logq, off)) else np
    lq = xp.maximum(xp.asarray(logq, xp.float32), -12.0)
    l1 = xp.log1p(-xp.minimum(xp.exp(lq), 1.0 - 1e-6))
    top = (xp.asarray(rank) == 0).astype(xp.float32)
    off = xp.asarray(off).astype(xp.float32)
    d = xp.asarray(depth).astype(xp.float32) / 15.0
    one = xp.ones_like(lq)
    return xp.stack([one, lq, l1, top, off, top * off, top * d, off * lq, top * lq], axis=-1)


@dataclasses.dataclass(frozen=True)
class TreeCalibration:
    """A logistic model of P(a candidate is the target's token | its parent's path is): the build scores a
    node by the sum over its path of log sigmoid(w . features) (`calibration_features`) instead of the
    draft's log-probabilities. The draft's marginals are not path probabilities: along the argmax chain a
    later position is right more often than its marginal says (given the earlier ones were), and after a
    path leaves the chain the later argmaxes are right less often. Fitted on training-split prompts by
    `fit_calibration`; hashable (a static argument)."""

    weights: tuple[float, ...]

    def __post_init__(self):
        if len(self.weights) != len(CALIBRATION_FEATURES):
            raise ValueError(f"a TreeCalibration needs {len(CALIBRATION_FEATURES)} weights "
                             f"({', '.join(CALIBRATION_FEATURES)}), got {len(self.weights)}")

    def log_accept(self, depth, rank, logq, off):
        """log P(accept) of candidates (`calibration_features`' arguments)."""
        z = calibration_features(depth, rank, logq, off) @ jnp.asarray(self.weights, jnp.float32)
        return -jnp.logaddexp(0.0, -z)


CALIBRATION_FILE = "tree_calibration.json"  # a pair's shipped acceptance model, beside its checkpoint
CALIBRATION_FORMAT = "dflash_jax.tree_calibration/1"


def calibration_digest(body: dict) -> str:
    """The sha256 a calibration file carries of its own fitted content (format, features, weights, pair)."""
    keep = {k: body[k] for k in ("format", "features", "weights", "pair_fingerprint")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def save_calibration(cal: "TreeCalibration", path: str, *, pair=None, fitted_on: dict | None = None) -> str:
    """Writes `cal` as a small JSON file (its weights, the feature names, what it was fitted on, the pair's
    fingerprint and a sha256 over them); `path` a file or a pair's directory (then `CALIBRATION_FILE` in it).
    Written to a temporary file beside it and renamed: no half-written file is left. Returns the file's path."""
    if os.path.isdir(path):
        path = os.path.join(path, CALIBRATION_FILE)
    body = dict(format=CALIBRATION_FORMAT, features=list(CALIBRATION_FEATURES), weights=list(cal.weights),
                pair_fingerprint=None if pair is None else pair_fingerprint(pair), fitted_on=fitted_on or {})
    body["sha256"] = calibration_digest(body)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(body, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


_CALIBRATION_FIX = ("refit it (benchmarks/tree.py --fit-calibration, or spec.tree.fit_calibration + "
                    "save_calibration), or delete the file (trees then build from the draft's distributions)")
_CALIBRATION_MAX_BYTES = 1 << 20  # a calibration file is about 1 KB
_HEX64 = frozenset("0123456789abcdef")


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def load_calibration(path: str, pair=None) -> "TreeCalibration":
    """A `TreeCalibration` from `save_calibration`'s file, its structure (every field, its type and range)
    and checksum checked, and with `pair` the pair's fingerprint (a calibration fitted for another target or
    draft is refused). Anything wrong raises CheckpointError (a ValueError) naming the file and the fix; the
    file is opened non-blocking and must be a regular file (a FIFO is refused, never read)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # a rewritten file is read again
    except OSError:
        stamp = None
    return _load_calibration(path, None if pair is None else pair_fingerprint(pair), stamp)


@functools.lru_cache(maxsize=8)
def _load_calibration(path: str, fingerprint: str | None, stamp) -> "TreeCalibration":
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"tree calibration {path} {why}: {_CALIBRATION_FIX}")

    try:
        with open_regular(path, CheckpointError, what="tree calibration file (JSON)",
                          fix=f"put the real file there, or {_CALIBRATION_FIX}") as fh:
            raw = fh.read(_CALIBRATION_MAX_BYTES + 1)
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    if len(raw) > _CALIBRATION_MAX_BYTES:
        raise bad(f"is larger than {_CALIBRATION_MAX_BYTES} bytes (a calibration file is about 1 KB)")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("cannot be read (it is not UTF-8 text)") from None
    except ValueError as e:
        raise bad(f"cannot be read (it is not valid JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != CALIBRATION_FORMAT:
        got = body.get("format") if isinstance(body, dict) else f"a JSON {type(body).__name__}"
        raise bad(f"is not a {CALIBRATION_FORMAT} file (format: {got!r})")
    missing = [k for k in ("features", "weights", "pair_fingerprint", "sha256") if k not in body]
    if missing:
        raise bad(f"lacks the field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    features, weights = body["features"], body["weights"]
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise bad(f"has 'features' {features!r}, not a list of feature names")
    n = len(CALIBRATION_FEATURES)
    numbers = isinstance(weights, list) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and np.isfinite(w) and abs(w) <= 1e6 for w in weights)
    if not numbers or len(weights) != n:
        raise bad(f"has 'weights' {str(weights)[:80]!s}, not a list of {n} finite numbers (one per feature, "
                  f"|w| <= 1e6)")
    if body["pair_fingerprint"] is not None and not _is_digest(body["pair_fingerprint"]):
        raise bad(f"has 'pair_fingerprint' {str(body['pair_fingerprint'])[:80]!r}, not null or a sha256 hex digest")
    if "fitted_on" in body and not isinstance(body["fitted_on"], dict):
        raise bad(f"has 'fitted_on' {str(body['fitted_on'])[:80]!r}, not a JSON object")
    if not _is_digest(body["sha256"]) or body["sha256"] != calibration_digest(body):
        raise bad("fails its sha256 (edited or truncated)")
    if features != list(CALIBRATION_FEATURES):
        raise bad(f"has features {features}, this version uses {list(CALIBRATION_FEATURES)}")
    stored = body["pair_fingerprint"]
    if fingerprint is not None and stored not in (None, fingerprint):
        raise bad(f"was fitted for another target/draft (fingerprint {stored[:12]} vs the pair's {fingerprint[:12]})")
    return TreeCalibration(tuple(float(w) for w in weights))


def pair_calibration(pair) -> "TreeCalibration | None":
    """The acceptance model shipped beside the pair's checkpoint (`CALIBRATION_FILE`, checked by
    `load_calibration` against the pair), or None (the plain build) when the pair has none. `generate_tree`
    builds from it by default."""
    directory = getattr(pair, "directory", None)
    if not directory or not os.path.exists(os.path.join(directory, CALIBRATION_FILE)):
        return None
    return load_calibration(os.path.join(directory, CALIBRATION_FILE), pair)


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """One static verify shape: `budget` nodes (the root, i.e. the anchor, included) with at most `branch`
    candidates per node. `branch=1` is the chain of width `budget`."""

    budget: int
    branch: int = DEFAULT_BRANCH
    temperature: float = DEFAULT_TEMPERATURE  # the draft's distributions sharpened by 1/T for the build
    # the build's node scores from a fitted acceptance model instead of the draft's marginals
    # (`TreeCalibration`, `fit_calibration`); None = the (sharpened) marginals
    calibration: "TreeCalibration | None" = None
    # a tree (branch >= 2) builds from the draft's branch head when its weights carry one (`build_tree_from_head`);
    # False: from the marginals (and `calibration`) even then
    use_head: bool = True

    def __post_init__(self):
        if self.budget < 1 or self.branch < 1:
            raise ValueError(f"a tree needs budget >= 1 and branch >= 1, got {self.budget}, {self.branch}")
        if not self.temperature > 0:
            raise ValueError(f"a tree's draft temperature must be > 0, got {self.temperature}")
        if self.calibration is not None and not isinstance(self.calibration, TreeCalibration):
            raise TypeError(f"calibration must be a TreeCalibration (spec.tree.fit_calibration), "
                            f"got {type(self.calibration).__name__}")

    @property
    def is_chain(self) -> bool:
        return self.branch == 1

    def label(self) -> str:
        return f"chain B={self.budget}" if self.is_chain else f"tree N={self.budget}"


@struct.dataclass
class Tree:
    """A batch of token trees in topological order (node 0 = the root = the anchor, parents first)."""

    tokens: jax.Array  # [b, N] int32
    parent: jax.Array  # [b, N] int32 (the root is its own parent)
    depth: jax.Array  # [b, N] int32
    mask: jax.Array  # [b, N, N] bool: mask[t, u] = u is t or an ancestor of t
    score: jax.Array  # [b, N] fp32 log path probability under the draft (root 0)
    valid: jax.Array  # [b, N] bool: nodes past the budget (or with no candidate left) are never accepted
    rank: jax.Array  # [b, N] int32: the node's rank among its position's candidates (0 = the draft's argmax)

    def prefix(self, n: int) -> "Tree":
        """The first n nodes: the tree of budget n (best-first order does not depend on the budget)."""
        return Tree(tokens=self.tokens[:, :n], parent=self.parent[:, :n], depth=self.depth[:, :n],
                    mask=self.mask[:, :n, :n], score=self.score[:, :n], valid=self.valid[:, :n],
                    rank=self.rank[:, :n])

    def block(self) -> TreeBlock:
        return TreeBlock(depths=self.depth, mask=self.mask)


def _build(anchor, children, budget: int, branch: int, depth_max: int):
    """The trees of a batch, best first. `children(pos, token, off)` gives a node's candidate children, best
    first (scores non-increasing in rank): pos [b] the index of their block position (position pos + 1),
    token [b] the node's token, off [b] whether its path left the argmax chain; returns (log scores [b, K],
    tokens [b, K]). Node i's candidates are computed once, when it is taken. Frontier slot i holds node i's
    next unexpanded child (rank r): a node's first child enters at its own slot, and taking a candidate
    replaces it by its next sibling. Written batched (the loop index is shared, the chosen frontier slot is a
    per-row one-hot), which XLA runs far faster on the CPU than a vmapped loop of scatters."""
    b = anchor.shape[0]
    n = budget
    neg = jnp.float32(-jnp.inf)
    idx = jnp.arange(n)
    rows = jnp.arange(b)
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(anchor)
    parent = jnp.zeros((b, n), jnp.int32)
    depth = jnp.zeros((b, n), jnp.int32)
    score = jnp.zeros((b, n), jnp.float32)
    valid = jnp.zeros((b, n), bool).at[:, 0].set(True)
    mask = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    rank = jnp.zeros((b, n), jnp.int32)
    off = jnp.zeros((b, n), bool)  # the node's path left the argmax chain (a node of rank > 0 on it)
    lp0, tok0 = children(jnp.zeros((b,), jnp.int32), anchor, jnp.zeros((b,), bool))
    c_lp = jnp.full((b, n, branch), neg).at[:, 0].set(lp0)  # node i's candidate children
    c_tok = jnp.zeros((b, n, branch), jnp.int32).at[:, 0].set(tok0)
    f_score = jnp.full((b, n), neg).at[:, 0].set(lp0[:, 0] if depth_max > 0 else neg)
    f_rank = jnp.zeros((b, n), jnp.int32)

    def step(i, carry):
        tokens, parent, depth, score, valid, mask, rank, off, c_lp, c_tok, f_score, f_rank = carry
        j = jnp.argmax(f_score, axis=1).astype(jnp.int32)  # [b]
        at_j = idx[None] == j[:, None]  # [b, N]
        s, r = f_score[rows, j], f_rank[rows, j]
        ok = s > neg
        d = depth[rows, j] + 1  # the candidate is a child of node j at depth d (block position d)
        tok = c_tok[rows, j, r]
        put = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, axis=1)  # noqa: E731
        tokens = put(tokens, jnp.where(ok, tok, 0))
        parent = put(parent, jnp.where(ok, j, i))
        depth = put(depth, jnp.where(ok, d, 0))
        score = put(score, jnp.where(ok, s, neg))
        valid = put(valid, ok)
        rank = put(rank, jnp.where(ok, r, 0))
        off_i = ok & (off[rows, j] | (r > 0))
        off = put(off, off_i)
        own = idx[None] == i
        row = jnp.where(ok[:, None], mask[rows, j] | own, own)
        mask = put(mask, row)
        # node j's next sibling candidate replaces the one just taken; node i's first child enters slot i
        sib_ok = ok & (r + 1 < branch)
        sib = score[rows, j] + c_lp[rows, j, jnp.minimum(r + 1, branch - 1)]
        f_score = jnp.where(at_j & ok[:, None], jnp.where(sib_ok, sib, neg)[:, None], f_score)
        f_rank = jnp.where(at_j & ok[:, None], (r + 1)[:, None], f_rank)
        lp_i, tok_i = children(jnp.clip(d, 0, max(depth_max - 1, 0)), tok, off_i)
        c_lp = put(c_lp, lp_i)
        c_tok = put(c_tok, tok_i.astype(jnp.int32))
        child_ok = ok & (d < depth_max)
        f_score = put(f_score, jnp.where(child_ok, s + lp_i[:, 0], neg))
        f_rank = put(f_rank, jnp.zeros((b,), jnp.int32))
        return tokens, parent, depth, score, valid, mask, rank, off, c_lp, c_tok, f_score, f_rank

    carry = (tokens, parent, depth, score, valid, mask, rank, off, c_lp, c_tok, f_score, f_rank)
    tokens, parent, depth, score, valid, mask, rank = jax.lax.fori_loop(1, n, step, carry)[:7]
    return Tree(tokens=tokens, parent=parent, depth=depth, mask=mask, score=score, valid=valid, rank=rank)


def build_tree(anchor: jax.Array, draft_logprobs: jax.Array, shape: TreeShape) -> Tree:
    """Best-first trees of `shape.budget` nodes from the draft's log-probabilities [b, D, V] at block
    positions 1..D (anchor [b] is the root), sharpened by 1/`shape.temperature` (path scores in the sharpened
    distributions; the order of candidates at a position does not change). With `shape.calibration` a node
    scores the sum over its path of the fitted log acceptance (`TreeCalibration`), made non-increasing in
    rank (so that the candidates stay in the draft's order)."""
    branch = min(shape.branch, draft_logprobs.shape[-1])
    lp = draft_logprobs.astype(jnp.float32)
    if shape.temperature != 1.0 and not shape.is_chain:
        lp = jax.nn.log_softmax(lp / shape.temperature, axis=-1)
    top_lp, top_tok = jax.lax.top_k(lp, branch)
    off_lp = None
    if shape.calibration is not None and not shape.is_chain:
        b, depth_max, _ = top_lp.shape
        depth = jnp.broadcast_to(jnp.arange(1, depth_max + 1)[None, :, None], top_lp.shape)
        rank = jnp.broadcast_to(jnp.arange(branch)[None, None, :], top_lp.shape)
        on_lp, off_lp = (jax.lax.cummin(shape.calibration.log_accept(depth, rank, top_lp, jnp.full(top_lp.shape, o)),
                                        axis=2) for o in (False, True))
        top_lp = on_lp
    # measured on the CPU: without the barrier XLA rewrites this top-k with its consumers into a 40x slower
    # program (20 ms vs 0.5 ms for top-k + build on [8, 15, 1024]). Not under a mesh: there XLA:CPU's
    # TopkDecomposer fails on a barrier fed by the partitioned top-k (a check failure, jax 0.10.2)
    if jax.sharding.get_abstract_mesh().empty:
        top_lp, top_tok, off_lp = jax.lax.optimization_barrier((top_lp, top_tok, off_lp))
    if off_lp is None:
        off_lp = top_lp
    top_tok = top_tok.astype(jnp.int32)
    depth_max = top_lp.shape[1]
    if depth_max == 0:  # a block of 1: the root alone (a placeholder position nothing reads)
        top_lp, off_lp, top_tok = (jnp.zeros(x.shape[:1] + (1,) + x.shape[2:], x.dtype) for x in (top_lp, off_lp, top_tok))
    rows = jnp.arange(anchor.shape[0])

    def children(pos, token, off):
        return jnp.where(off[:, None], off_lp[rows, pos], top_lp[rows, pos]), top_tok[rows, pos]

    return _build(anchor, children, shape.budget, branch, depth_max)


def build_tree_from_head(anchor: jax.Array, hidden: jax.Array, head, shape: TreeShape, spec_draft, *,
                         embed: jax.Array, lm_head) -> Tree:
    """Best-first trees whose every node's children come from the draft's branch head given the node's token
    (`models.draft.BranchHeadWeights`): a node scores the sum over its path of log q_head(x_d | x_{d-1}),
    sharpened by 1/`shape.temperature`; candidates are the top-`shape.branch` of that distribution. hidden
    [b, D, H]: the draft's final-normed hidden states at block positions 1..D. One head evaluation per node
    (the budget's worth, batched over rows); `shape.calibration` is not used (the head's probabilities are
    conditional already). With branch 1 this is the head's greedy chain."""
    branch = min(shape.branch, spec_draft.vocab_size or embed.shape[0])
    rows = jnp.arange(anchor.shape[0])

    def children(pos, token, off):
        logits = draft_model.branch_head_logits(head, hidden[rows, pos], token, spec_draft, embed=embed,
                                                lm_head=lm_head)
        top = jax.lax.top_k(jax.nn.log_softmax(logits / shape.temperature, axis=-1), branch)
        # as in `build_tree`: without the barrier XLA:CPU fuses this top-k into its consumers in the loop, 11x
        # slower (measured: 20 ms vs 1.8 ms for a 16-node build of 6 rows); not under a mesh (see there)
        return jax.lax.optimization_barrier(top) if jax.sharding.get_abstract_mesh().empty else top

    return _build(anchor, children, shape.budget, branch, hidden.shape[1])


def uses_head(draft_w, shape: TreeShape) -> bool:
    """Whether trees of `shape` are built from the draft's branch head: it has one, the shape asks for it and is
    a tree (branch >= 2). A chain (branch 1) is always the draft's argmax chain, the chain loop's proposals,
    wherever it runs."""
    return getattr(draft_w, "branch_head", None) is not None and shape.use_head and not shape.is_chain


def round_tree(target_w, draft_w, anchor: jax.Array, draft: "TreeDraft", shape: TreeShape, spec: SpecConfig) -> Tree:
    """The round's tree from its draft forward: from the branch head when `uses_head`, else from the marginals
    (`build_tree`)."""
    if not uses_head(draft_w, shape):
        return build_tree(anchor, draft.logprobs, shape)
    return build_tree_from_head(anchor, draft.hidden[:, 1:], draft_w.branch_head, shape, spec.draft,
                                embed=target_w.embed, lm_head=target_w.lm_head)


def accept_tree(tree: Tree, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The walk from the root: node t is reached when every node u on its path (root excluded) is valid and
    its token equals `target_tokens` at u's parent (the target's argmax, or its draw, after the parent's
    path). Returns (accepted [b] = depth of the deepest node reached, bonus [b] = the target's token there,
    path [b, D+1] = the node at each depth of the accepted path; entries past `accepted` are 0)."""
    b, n = tree.tokens.shape
    at_parent = jnp.take_along_axis(target_tokens, tree.parent, axis=1)
    match = (tree.tokens == at_parent) & tree.valid
    match = match.at[:, 0].set(True)
    reached = jnp.all(~tree.mask | match[:, None, :], axis=-1)  # [b, N]
    best = jnp.argmax(jnp.where(reached, tree.depth, -1), axis=1).astype(jnp.int32)
    rows = jnp.arange(b)
    accepted = tree.depth[rows, best]
    bonus = target_tokens[rows, best]
    on_path = tree.mask[rows, best]  # [b, N]: the ancestors of best and best itself
    depth_max = n - 1 if n > 1 else 0
    levels = jnp.arange(depth_max + 1)
    sel = on_path[:, None, :] & (tree.depth[:, None, :] == levels[None, :, None])  # [b, D+1, N]
    path = jnp.argmax(sel, axis=-1).astype(jnp.int32)
    return accepted, bonus, path


def pad_cols(x: jax.Array, width: int) -> jax.Array:
    """`x` [b, n, ...] cut or zero-padded to `width` columns (axis 1)."""
    if x.shape[1] >= width:
        return x[:, :width]
    return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def commit_path(cache, start: jax.Array, path: jax.Array):
    """Moves the accepted path's K/V rows into place: slot start + depth gets the row of the path's node at
    that depth (written at slot start + node index by the tree verify). `path` [b, W] node indices (the
    rows past the accepted depth are copied too, harmlessly: they lie past the length set next). Works on
    any cache whose `keys` / `values` are per-layer slot = position buffers [b, S, ...]."""
    b = path.shape[0]
    rows = jnp.arange(b)[:, None]
    src = start[:, None] + path
    dst = start[:, None] + jnp.arange(path.shape[1], dtype=start.dtype)[None]

    def move(buf):
        return buf.at[rows, dst].set(buf[rows, src], mode="drop")

    return cache.replace(keys=tuple(move(k) for k in cache.keys), values=tuple(move(v) for v in cache.values))


@struct.dataclass
class TreeDraft:
    logprobs: jax.Array  # [b, B-1, V] the draft's log-probabilities at block positions 1..B-1
    draft_cache: object  # with this round's context rows appended
    hidden: jax.Array | None = None  # [b, B, H] the draft's final-normed hidden states (route-ahead input)

    def node_hidden(self, tree: "Tree") -> jax.Array:
        """[b, N, H]: each tree node's draft hidden state (the block position at its depth)."""
        return jnp.take_along_axis(self.hidden, tree.depth[..., None], axis=1)


def tree_draft(target_w, draft_w, state: SpecState, spec: SpecConfig) -> TreeDraft:
    """One draft forward over [anchor, MASK x (B-1)] (as `session.draft_round`), keeping every position's
    distribution instead of its argmax."""
    b = state.anchor.shape[0]
    gamma = spec.block_size - 1
    block = jnp.concatenate(
        [state.anchor[:, None], jnp.full((b, gamma), spec.draft.mask_token_id, jnp.int32)], axis=1)
    logits, hidden, draft_cache = draft_model.draft_forward(
        draft_w, spec.draft, embed=target_w.embed, lm_head=target_w.lm_head, block_tokens=block,
        context_features=state.context, num_context=state.num_context, cache=state.draft_cache)
    return TreeDraft(logprobs=jax.nn.log_softmax(logits[:, 1:].astype(jnp.float32), axis=-1),
                     draft_cache=draft_cache, hidden=hidden)


@struct.dataclass
class TreeRoundInfo:
    """What one tree round did, per sequence: proposals accepted, the verify's distinct experts per MoE
    layer (mean over layers; 0 for dense targets), the draft's expected accepted depth of the tree, and
    whether the accepted path left the draft's argmax chain (a node of rank > 0 was accepted)."""

    accepted: jax.Array  # [b] int32
    expert_union: jax.Array  # [b] fp32
    expected: jax.Array  # [b] fp32
    off_chain: jax.Array  # [b] bool


def _expert_union(router_experts, num_experts: int) -> jax.Array:
    per_layer = [r for r in router_experts if r is not None]
    if not per_layer:
        return jnp.zeros((1,), jnp.float32)
    counts = []
    for r in per_layer:  # r [b, T, k]
        hit = jax.nn.one_hot(r.reshape(r.shape[0], -1), num_experts, dtype=jnp.int32).max(axis=1)
        counts.append(hit.sum(axis=-1))
    return jnp.mean(jnp.stack(counts).astype(jnp.float32), axis=0)


def tree_forward(target_w, state: SpecState, tree: Tree, spec: SpecConfig, implementation: str = "auto"):
    """The width-N target forward over the tree (a `ForwardOutput` with every node's logits and the taps)."""
    return family_of(spec.target).forward(target_w, tree.tokens, state.target_cache, spec.target, tap_layers=spec.taps,
                                          logits="all", tree=tree.block(), implementation=implementation)


def verify_tree(target_w, state: SpecState, tree: Tree, draft_cache, spec: SpecConfig):
    """Width-N target forward over the tree, acceptance (greedy or per-node draws), emission and commit.
    Returns (state, TreeRoundInfo)."""
    return commit_tree(state, tree, draft_cache, tree_forward(target_w, state, tree, spec), spec)


def commit_tree(state: SpecState, tree: Tree, draft_cache, out, spec: SpecConfig):
    """Acceptance, emission and commit of a tree verify's output `out` (`tree_forward`, or the same forward run
    layer by layer with offloaded experts). Returns (state, TreeRoundInfo)."""
    fam = family_of(spec.target)
    start = state.target_cache.lengths
    key, k_acc = split_rows(state.key)
    rows = state.params.sampling
    target_argmax = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)

    def sampled():  # one independent draw per node (see the module doc: the sibling rejection rule)
        draws = sample_rows(k_acc, processed_scores(out.logits, rows))
        return jnp.where(rows.greedy[:, None], target_argmax, draws)

    target_tokens = jax.lax.cond(all_greedy(state), lambda: target_argmax, sampled)
    accepted, bonus, path = accept_tree(tree, target_tokens)
    gamma = spec.block_size - 1
    path = pad_cols(path, spec.block_size)
    proposals = jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)  # [b, B-1]: d_1 .. d_a on the path
    new, produced = emit_tokens(state.replace(key=key), accepted, bonus, proposals[:, :gamma], spec)
    cache = getattr(fam, "commit_tree_path", commit_path)(out.cache, start, path)
    context = draft_model.context_features(out.taps)  # [b, N, F]
    context = jnp.take_along_axis(context, path[..., None], axis=1)  # [b, B, F]: the path's rows
    cfg = spec.target
    num_experts = cfg.moe.num_experts if getattr(cfg, "moe", None) is not None else 1
    info = TreeRoundInfo(accepted=accepted, expert_union=jnp.broadcast_to(
        _expert_union(out.router_experts, num_experts), accepted.shape),
        expected=jnp.sum(jnp.where(tree.valid, jnp.exp(tree.score), 0.0), axis=1) - 1.0,
        off_chain=jnp.any((jnp.take_along_axis(tree.rank, path, axis=1) > 0)
                          & (jnp.arange(path.shape[1])[None] <= accepted[:, None]), axis=1))
    new = new.replace(
        target_cache=fam.rollback(cache, start + produced),
        draft_cache=draft_cache,
        context=context.astype(state.context.dtype),
        num_context=produced,
        last_accepted=accepted,
        last_bonus=bonus,
    )
    return new, info


def tree_round(target_w, draft_w, state: SpecState, spec: SpecConfig, shape: TreeShape):
    """One round with a fixed tree shape: draft, build, verify. Returns (state, TreeRoundInfo)."""
    check_state(state, spec)
    draft = tree_draft(target_w, draft_w, state, spec)
    tree = round_tree(target_w, draft_w, state.anchor, draft, shape, spec)
    return verify_tree(target_w, state, tree, draft.draft_cache, spec)


tree_round_jit = jax.jit(tree_round, static_argnames=("spec", "shape"), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("spec", "shape"))
def tree_draft_build(target_w, draft_w, state: SpecState, spec: SpecConfig, shape: TreeShape):
    """The round's draft and its tree, jitted (the first half of a round whose verify runs elsewhere, e.g. layer
    by layer with offloaded experts). Returns (Tree, TreeDraft)."""
    draft = tree_draft(target_w, draft_w, state, spec)
    return round_tree(target_w, draft_w, state.anchor, draft, shape, spec), draft


commit_tree_jit = jax.jit(commit_tree, static_argnames=("spec",))


@functools.partial(jax.jit, static_argnames=("spec", "implementation"))
def verify_tree_pooled(target_w, state: SpecState, tree: Tree, draft_cache, spec: SpecConfig,
                       implementation: str = "auto"):
    """`verify_tree` as one program that also returns the forward's per-layer router experts (an offloaded
    target whose pool holds every expert). Returns (state, TreeRoundInfo, router_experts)."""
    out = tree_forward(target_w, state, tree, spec, implementation)
    new, info = commit_tree(state, tree, draft_cache, out, spec)
    return new, info, out.router_experts


# ----------------------------------------------------------------------------------------------------------
# the adaptive policy
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VerifyCost:
    """The cost of one round per candidate shape, in seconds (static: baked into the compiled program).

    `model(...)` builds it from the parts the issue names: a fixed time per round (draft + launch), a time
    per verified row (tokens x compute), and the expert bytes a round's rows route to over the host link
    (offloaded targets; 0 when resident)."""

    seconds: tuple[float, ...]

    @staticmethod
    def model(shapes: Sequence[TreeShape], *, round_s: float, row_s: float,
              expert_bytes: Sequence[float] | None = None, link_bytes_per_s: float | None = None) -> "VerifyCost":
        """seconds(shape) = round_s + row_s * budget + expert_bytes(shape) / link (when both are given)."""
        out = []
        for i, s in enumerate(shapes):
            t = round_s + row_s * s.budget
            if expert_bytes is not None and link_bytes_per_s:
                t += expert_bytes[i] / link_bytes_per_s
            out.append(float(t))
        return VerifyCost(tuple(out))

    @staticmethod
    def fit(shapes: Sequence[TreeShape], seconds: Sequence[float]) -> "VerifyCost":
        """The cost model `round_s + row_s * budget` fitted to measured seconds per round (least squares, both
        coefficients clipped at >= 0): noisy timings (a loaded machine) cannot rank a wider verify below a
        narrower one. Returns the model's seconds per shape."""
        if len(seconds) != len(shapes):
            raise ValueError(f"{len(seconds)} timings for {len(shapes)} shapes")
        budgets = np.asarray([s.budget for s in shapes], np.float64)
        y = np.asarray(seconds, np.float64)
        a = np.stack([np.ones_like(budgets), budgets], axis=1)
        (round_s, row_s), *_ = np.linalg.lstsq(a, y, rcond=None)
        if row_s < 0:
            round_s, row_s = float(np.mean(y)), 0.0
        if round_s < 0:
            round_s, row_s = 0.0, float(np.dot(budgets, y) / np.dot(budgets, budgets))
        return VerifyCost.model(shapes, round_s=float(round_s), row_s=float(row_s))


DEFAULT_SHAPES = (TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 1), TreeShape(8), TreeShape(16), TreeShape(32))


@functools.lru_cache(maxsize=None)
def prior_tokens_per_round(shape: TreeShape, *, alpha: float = 0.8, depth: int = 15) -> float:
    """Tokens per round a shape commits under a calibrated model draft: at every block position the draft's
    r-th candidate is the target's token with probability alpha (1 - alpha)^r, independently; the expected
    accepted depth of a best-first tree is then the sum of its nodes' path probabilities (exact for this
    draft), plus the bonus. Chains of B see B-1 positions, trees `depth`. Deterministic (no data)."""
    d = shape.budget - 1 if shape.is_chain else depth
    if d < 1:
        return 1.0
    full = np.full((1, d, max(shape.branch, 2)), -1e30, np.float32)
    full[0, :, : shape.branch] = np.log(alpha * (1.0 - alpha) ** np.arange(shape.branch))
    with jax.ensure_compile_time_eval():  # also when called while a loop is traced
        tree = build_tree(jnp.zeros((1,), jnp.int32), jnp.asarray(full),
                          dataclasses.replace(shape, temperature=1.0, calibration=None))
        return float(np.sum(np.where(np.asarray(tree.valid), np.exp(np.asarray(tree.score)), 0.0)))


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Each round, before drafting, picks one of `shapes` for the batch: the shape with the largest expected
    tokens per second summed over the live sequences,

        rate(s) = (1 + c * (tau_s - 1)) / seconds(s),

    where tau_s is the shape's tokens per round (`taus`: calibrated, e.g. measured at warm-up; default the
    model-draft prior `prior_tokens_per_round`), seconds(s) its round time (`cost`; default 1 + budget / 16,
    compute-bound) and c the sequence's calibration: proposals accepted so far over the proposals the chosen
    shapes' tau predicted, both decayed by `decay` per round (prior 1), clipped to `calibration_range` when
    given. The chosen shape's round is exactly the fixed loop's (a chain drafts at its own B, a tree at the
    draft's block), one branch of a `lax.switch`. Only the shapes the policy can choose are compiled and
    provisioned (`pruned`); one reachable shape runs as that fixed shape. `calibrate_policy` measures taus
    and costs in the mode the policy runs in. Deterministic given the state (no clocks, no randomness)."""

    shapes: tuple[TreeShape, ...] = DEFAULT_SHAPES
    cost: VerifyCost | None = None
    taus: tuple[float, ...] | None = None
    decay: float = 0.9
    # (lo, hi): the calibration c is clipped to it (None: c >= 0 unclipped). With taus measured on
    # calibration prompts, a range around 1 says how far a sequence may drift from them.
    calibration_range: tuple[float, float] | None = None
    # a prior toward the cheapest shape (least seconds per round): every other shape's rate is divided by
    # 1 + margin, so it is chosen only when its figures promise more than `margin` above the cheapest's (figures
    # measured on a few calibration prompts, on a loaded machine, are that uncertain)
    margin: float = 0.0

    def __post_init__(self):
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0 (a prior toward the cheapest shape), got {self.margin}")

    def scored_seconds(self) -> tuple[float, ...]:
        """The seconds per round the choice divides by: `seconds()`, every shape but the cheapest times 1 + margin."""
        secs = self.seconds()
        if not self.margin:
            return secs
        cheapest = int(np.argmin(secs))
        return tuple(float(t) if i == cheapest else float(t) * (1.0 + self.margin) for i, t in enumerate(secs))

    def reachable(self) -> tuple[int, ...]:
        """The indices of the shapes the policy can ever choose: those of the largest rate for some calibration c
        in `calibration_range` (or c >= 0). The rate is linear in c per shape, so the winners over c are the
        upper envelope of lines: checked at the range's ends and at every pairwise crossing inside it."""
        taus = np.asarray(self.tokens_per_round(), np.float32) - 1.0
        secs = np.asarray(self.scored_seconds(), np.float32)
        lo, hi = self.calibration_range or (0.0, np.inf)
        cs = {lo} | ({hi} if np.isfinite(hi) else {1e6})
        for i in range(len(taus)):
            for j in range(i + 1, len(taus)):
                den = taus[i] / secs[i] - taus[j] / secs[j]
                if den != 0:
                    c = (1.0 / secs[j] - 1.0 / secs[i]) / den
                    cs |= {c * (1 - 1e-6), c * (1 + 1e-6)}
        win = {int(np.argmax((1.0 + np.float32(c) * taus) / secs)) for c in cs if lo <= c <= hi}
        return tuple(sorted(win))

    def pruned(self) -> "AdaptivePolicy":
        """The same policy over its reachable shapes only (it makes the same choices): an adaptive loop
        compiles, and sizes its caches for, only what it can run; one reachable shape runs as that fixed shape."""
        keep = self.reachable()
        if len(keep) == len(self.shapes):
            return self
        pick = lambda xs: None if xs is None else tuple(xs[i] for i in keep)  # noqa: E731
        # the margin is baked into the kept shapes' seconds (the cheapest shape may be among those pruned)
        return dataclasses.replace(self, shapes=pick(self.shapes), taus=pick(self.tokens_per_round()),
                                   cost=VerifyCost(pick(self.scored_seconds())), margin=0.0)

    def seconds(self) -> tuple[float, ...]:
        if self.cost is not None:
            if len(self.cost.seconds) != len(self.shapes):
                raise ValueError(f"VerifyCost has {len(self.cost.seconds)} entries for {len(self.shapes)} shapes")
            return self.cost.seconds
        return tuple(1.0 + s.budget / 16.0 for s in self.shapes)

    def tokens_per_round(self) -> tuple[float, ...]:
        if self.taus is not None:
            if len(self.taus) != len(self.shapes):
                raise ValueError(f"taus has {len(self.taus)} entries for {len(self.shapes)} shapes")
            return tuple(float(t) for t in self.taus)
        return tuple(prior_tokens_per_round(s) for s in self.shapes)


def choose_shape(policy: AdaptivePolicy, accepted_sum: jax.Array, expected_sum: jax.Array,
                 live: jax.Array) -> jax.Array:
    """The index of the shape `policy` picks for a batch (see `AdaptivePolicy`): accepted_sum / expected_sum
    [b] the decayed proposals accepted / predicted per sequence, live [b] bool. Pure and traceable (the serving
    engine can call it per round on its own slots); ties go to the earlier shape."""
    xp = np if isinstance(accepted_sum, np.ndarray) else jnp  # numpy on a host loop: no device round trip
    taus = xp.asarray(policy.tokens_per_round(), xp.float32)
    seconds = xp.asarray(policy.scored_seconds(), xp.float32)
    calib = (accepted_sum + xp.float32(1.0)) / (expected_sum + xp.float32(1.0))
    if policy.calibration_range is not None:
        calib = xp.clip(calib, *policy.calibration_range)
    rate = (xp.float32(1.0) + calib[:, None] * (taus[None] - xp.float32(1.0))) / seconds[None]
    return xp.argmax(xp.sum(rate * xp.asarray(live).astype(xp.float32)[:, None], axis=0)).astype(xp.int32)


def update_calibration(policy: AdaptivePolicy, accepted_sum, expected_sum, choice, accepted, done_before):
    """The decayed sums after a round of shape `choice` that accepted `accepted` [b] proposals (sequences done
    before the round keep theirs)."""
    xp = np if isinstance(accepted_sum, np.ndarray) else jnp
    predicted = xp.asarray(policy.tokens_per_round(), xp.float32)[choice] - xp.float32(1.0)
    d = xp.float32(policy.decay)
    acc = xp.where(done_before, accepted_sum, d * accepted_sum + xp.asarray(accepted).astype(xp.float32))
    exp_ = xp.where(done_before, expected_sum, d * expected_sum + predicted)
    return acc, exp_


@struct.dataclass
class AdaptiveState:
    spec_state: SpecState
    accepted_sum: jax.Array  # [b] fp32, decayed
    expected_sum: jax.Array  # [b] fp32, decayed
    chosen: jax.Array  # [num shapes] int32: rounds per shape


def shape_round(target_w, draft_w, state: SpecState, spec: SpecConfig, shape: TreeShape) -> SpecState:
    """One round of a fixed shape on a state whose draft block is `spec.block_size`: a chain drafts and
    verifies at its own width (`session.spec_round`, the chain loop's round; the context rows it hands the
    draft are padded back to the state's width), a tree runs `tree_round`."""
    if not shape.is_chain:
        return tree_round(target_w, draft_w, state, spec, shape)[0]
    width = state.context.shape[1]
    if shape.budget > width:
        raise ValueError(f"a chain of {shape.budget} is wider than the draft block {width}")
    new = spec_round(target_w, draft_w, state, dataclasses.replace(spec, block_size=shape.budget))
    return new.replace(context=pad_cols(new.context, width))


def adaptive_round(target_w, draft_w, astate: AdaptiveState, spec: SpecConfig, policy: AdaptivePolicy):
    """Pick the shape (`choose_shape`, from the state only), run its round (one branch of a `lax.switch`),
    update the calibration. Returns the new AdaptiveState."""
    state = astate.spec_state
    choice = choose_shape(policy, astate.accepted_sum, astate.expected_sum, ~state.done)
    branches = [functools.partial(shape_round, target_w, draft_w, spec=spec, shape=s) for s in policy.shapes]
    new = jax.lax.switch(choice, branches, state)
    acc, exp_ = update_calibration(policy, astate.accepted_sum, astate.expected_sum, choice, new.last_accepted,
                                   state.done)
    return AdaptiveState(spec_state=new, accepted_sum=acc, expected_sum=exp_,
                         chosen=astate.chosen.at[choice].add(1))
def measure_round_seconds(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64,
                          repeats: int = 3, block_size: int | None = None) -> VerifyCost:
    """Each shape's seconds per round on this machine, measured at warm-up: the shape's round (`shape_round`,
    jitted) on the state after the prefill of `prompts` (calibration prompts of the batch and length the run
    will use; the outputs are dropped), the shapes interleaved, the fastest of `repeats`. Hand the result (or
    `VerifyCost.fit(shapes, result.seconds)` on a noisy machine) to `AdaptivePolicy(cost=)`: the policy's
    choices are then deterministic given these figures."""
    widest = max(s.budget for s in shapes)
    prep = prepare_tree(pair, prompts, widest=widest, max_new_tokens=max_new_tokens, block_size=block_size)
    state = begin_tree(pair, prep, widest)
    rounds = [jax.jit(functools.partial(shape_round, spec=prep.spec, shape=s)) for s in shapes]
    for fn in rounds:
        jax.block_until_ready(fn(pair.target, pair.draft, state).output)
    best = [float("inf")] * len(rounds)
    for _ in range(repeats):
        for i, fn in enumerate(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(pair.target, pair.draft, state).output)
            best[i] = min(best[i], time.perf_counter() - t0)
    return VerifyCost(tuple(best))


def calibrate_policy(pair, prompts, shapes: Sequence[TreeShape], *, max_new_tokens: int = 64, repeats: int = 3,
                     calibration_range: tuple[float, float] | None = (0.5, 2.0), decay: float = 0.9,
                     clock: str = "wall", statistic: str = "min", margin: float = 0.0, log=None) -> AdaptivePolicy:
    """An `AdaptivePolicy` whose figures are measured on calibration prompts in the mode it will run in (the
    resident jitted loops): each shape's fixed loop (a chain: `spec.loop.generate` at block B; a tree:
    `generate_tree`) runs `prompts`, compiled first, then `repeats` times interleaved; its seconds per round
    are the fastest run's seconds over its rounds, its tokens per round the run's mean. With the prompts' own
    figures and c = 1 the policy picks the fastest fixed shape there; `calibration_range` bounds how far a
    sequence's acceptance may move it (and so which shapes it provisions). clock: "wall" (seconds of the run)
    or "cpu" (this process's CPU seconds over the call, prefill included: the work, which other jobs on a
    shared machine do not inflate). statistic: "min" (the fastest repeat) or "median" (of the repeats: robust to
    one lucky or loaded run). margin: the policy's prior toward the cheapest shape (`AdaptivePolicy.margin`)."""
    from dflash_jax.spec.loop import generate

    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")

    def timed(s):
        c0 = time.process_time()
        seconds = run(s).stats["seconds"]
        return seconds if clock == "wall" else time.process_time() - c0

    def run(s):
        if s.is_chain:
            return generate(pair, prompts, max_new_tokens=max_new_tokens, block_size=s.budget)
        return generate_tree(pair, prompts, max_new_tokens=max_new_tokens, tree_budget=s.budget, branch=s.branch,
                             temperature=s.temperature, calibration=s.calibration)

    taus, rounds, times = [], [], [[] for _ in shapes]
    for s in shapes:
        res = run(s)
        taus.append(float(np.mean([a for seq in res.acceptance_lengths for a in seq])))
        rounds.append(max(1, int(res.stats["rounds"])))
    stat = np.min if statistic == "min" else np.median
    for r in range(repeats):
        for i, s in enumerate(shapes):
            times[i].append(timed(s))
        if log:
            log(f"calibration repeat {r + 1}/{repeats}: " + ", ".join(
                f"{s.label()} {stat(t) / n * 1e3:.1f} ms/round" for s, t, n in zip(shapes, times, rounds)))
    return AdaptivePolicy(tuple(shapes), VerifyCost(tuple(float(stat(t)) / n for t, n in zip(times, rounds))),
                          taus=tuple(round(t, 4) for t in taus), decay=decay, calibration_range=calibration_range,
                          margin=margin)


@functools.partial(jax.jit, static_argnames=("spec", "k"))
def _draft_top_k(target_w, draft_w, state: SpecState, spec: SpecConfig, k: int):
    return jax.lax.top_k(tree_draft(target_w, draft_w, state, spec).logprobs, k)


def calibration_samples(pair, prompts, *, max_new_tokens: int = 64, branch: int = 8,
                        shape: TreeShape | None = None) -> np.ndarray:
    """Training rows for `fit_calibration`: the tree loop (`shape`, default N = 32 with `branch` candidates)
    runs greedy on `prompts`; at every round and live sequence, for each depth d whose parent on the target's
    greedy path is still among the draft's candidates, one row per candidate: (depth, rank, log q, parent off
    the argmax chain, is the target's token). The target's path is its plain greedy continuation."""
    from dflash_jax.spec.loop import generate as chain_generate

    shape = shape or TreeShape(32, branch)
    prep = prepare_tree(pair, prompts, widest=shape.budget, max_new_tokens=max_new_tokens)
    spec = prep.spec
    gamma = spec.block_size - 1
    # the target's greedy continuation: the chain loop's greedy output is the plain greedy output (lossless)
    plain = chain_generate(pair, prompts, max_new_tokens=max_new_tokens + gamma + 1).tokens
    state = begin_tree(pair, prep, shape.budget)
    rows = []
    while not np.asarray(state.done).all():
        top_lp, top_tok = jax.device_get(_draft_top_k(pair.target, pair.draft, state, spec, branch))
        made, done = np.asarray(state.num_generated), np.asarray(state.done)
        state, _ = tree_round_jit(pair.target, pair.draft, state, spec, shape)
        for i in np.flatnonzero(~done):
            truth = plain[i][made[i]: made[i] + gamma]
            off = False
            for d, tok in enumerate(truth):
                hit = np.flatnonzero(top_tok[i, d] == tok)
                for r in range(branch):
                    rows.append((d + 1, r, top_lp[i, d, r], off, len(hit) > 0 and hit[0] == r))
                if not len(hit):
                    break
                off = off or hit[0] > 0
    return np.asarray(rows, np.float64).reshape(-1, 5)


def fit_calibration(samples: np.ndarray, *, l2: float = 1e-2, iters: int = 50) -> TreeCalibration:
    """The logistic acceptance model (`TreeCalibration`) fitted to `calibration_samples` rows by Newton's
    method (L2 `l2`). Deterministic given the rows."""
    samples = np.asarray(samples, np.float64)
    if samples.ndim != 2 or samples.shape[1] != 5 or not len(samples):
        raise ValueError("fit_calibration needs calibration_samples rows [n, 5] (depth, rank, log q, off, hit)")
    x = np.asarray(calibration_features(samples[:, 0], samples[:, 1], samples[:, 2], samples[:, 3]), np.float64)
    y = samples[:, 4]
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) + l2 * w
        hess = x.T @ (x * (p * (1.0 - p))[:, None]) + l2 * np.eye(len(w))
        w = w - np.linalg.solve(hess, grad)
    return TreeCalibration(tuple(round(float(v), 6) for v in w))


# ----------------------------------------------------------------------------------------------------------
# loops
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("spec", "shape"), donate_argnames=("state",))
def run_tree_loop(target_w, draft_w, state: SpecState, spec: SpecConfig, shape: TreeShape) -> SpecState:
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                              lambda s: tree_round(target_w, draft_w, s, spec, shape)[0], state)


@functools.partial(jax.jit, static_argnames=("spec", "policy"), donate_argnames=("astate",))
def run_adaptive_loop(target_w, draft_w, astate: AdaptiveState, spec: SpecConfig,
                      policy: AdaptivePolicy) -> AdaptiveState:
    return jax.lax.while_loop(lambda a: ~jnp.all(a.spec_state.done),
                              lambda a: adaptive_round(target_w, draft_w, a, spec, policy), astate)


def prepare_tree(pair, prompts, *, widest: int, block_size=None, buckets=None, **request) -> Prepared:
    """`session.prepare` with the cache sized for a verify of `widest` rows (a tree may be wider than B)."""
    compile_cache.ensure_enabled()
    buckets = LOOP_BUCKETS if buckets is None else buckets
    prep = prepare(pair, prompts, block_size=block_size, buckets=buckets, **request)
    spec = prep.spec
    need = prep.tokens.shape[1] + spec.output_len + max(widest, spec.block_size)
    max_len = min(buckets.cache_len(need), spec.target.max_position_embeddings)
    budget = int(np.max(prep.params.budget))
    if int(np.max(prep.lengths)) + budget + widest > max_len:
        raise ValueError(f"prompt + max_new_tokens + the tree budget {widest} exceeds the target's "
                         f"{spec.target.max_position_embeddings} positions")
    return dataclasses.replace(prep, spec=dataclasses.replace(spec, max_len=max_len))


def generate_tree(pair, prompts, *, max_new_tokens, tree_budget: int = 16, branch: int = DEFAULT_BRANCH,
                  temperature: float = DEFAULT_TEMPERATURE, calibration: TreeCalibration | str | None = "pair",
                  adaptive: AdaptivePolicy | bool = False, block_size: int | None = None,
                  sampling=SamplingParams(), stop_ids=(), seed=0, warmup: bool = False,
                  buckets: rq.Buckets | None = None, branch_head: bool = True):
    """Tree-verified DFlash generation in one jitted while_loop (`spec.loop.generate`'s contract and result).

    tree_budget N: nodes per verify (the anchor included); branch: candidates per node (1 = a chain of
    width N); temperature: the draft's distributions sharpened by 1/T for the build (`TreeShape`);
    calibration: a fitted acceptance model for the build (`TreeCalibration`, `fit_calibration`); "pair" (the
    default) the one shipped with the pair (`pair_calibration`; the plain build when it has none); None the
    plain build (the draft's marginals).
    branch_head: build from the draft's branch head when the pair carries one (`build_tree_from_head`; the
    shipped pair does); False: from the marginals (and `calibration`).
    adaptive: True (the default policy) or an `AdaptivePolicy`: the shape is chosen per round.
    Every family verifies trees (Qwen3.5's DeltaNet layers along each node's path)."""
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"tree_budget must be a positive integer, got {tree_budget!r}")
    if isinstance(branch, bool) or not isinstance(branch, int) or branch < 1:
        raise ValueError(f"branch must be a positive integer, got {branch!r}")
    if isinstance(calibration, str):
        if calibration != "pair":
            raise ValueError(f"calibration must be a TreeCalibration, None or 'pair', got {calibration!r}")
        calibration = pair_calibration(pair)
    request = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed)
    full = (AdaptivePolicy() if adaptive is True else adaptive) or None
    policy = full.pruned() if full else None  # only the shapes it can choose are compiled and provisioned

    def label(s):
        return s.label() + ("" if s.is_chain else f" K={s.branch}")

    if policy is not None and len(policy.shapes) == 1:  # one reachable shape: exactly its fixed loop
        only = policy.shapes[0]
        if only.is_chain:
            from dflash_jax.spec.loop import generate

            res = generate(pair, prompts, block_size=only.budget, warmup=warmup, buckets=buckets, **request)
        else:
            res = generate_tree(pair, prompts, tree_budget=only.budget, branch=only.branch,
                                temperature=only.temperature, calibration=only.calibration, block_size=block_size,
                                warmup=warmup, buckets=buckets, branch_head=only.use_head, **request)
        rounds = max((len(a) for a in res.acceptance_lengths), default=0)
        res.stats["adaptive_rounds"] = {label(s): rounds if s == only else 0 for s in full.shapes}
        return res
    if policy is not None and block_size is None and all(s.is_chain for s in policy.shapes):
        block_size = max(s.budget for s in policy.shapes)  # chains only: the draft block of the widest
    widest = max(s.budget for s in policy.shapes) if policy else tree_budget
    prep = prepare_tree(pair, prompts, widest=widest, block_size=block_size, buckets=buckets, **request)
    spec = prep.spec
    if spec.block_size < 2:
        raise ValueError("tree verification needs a draft block of at least 2 (one proposal position)")
    shape = TreeShape(tree_budget, branch, temperature, calibration, use_head=branch_head)

    def run(state):
        if policy is None:
            return run_tree_loop(pair.target, pair.draft, state, spec, shape), None
        b = state.anchor.shape[0]
        astate = AdaptiveState(spec_state=state, accepted_sum=jnp.zeros((b,), jnp.float32),
                               expected_sum=jnp.zeros((b,), jnp.float32),
                               chosen=jnp.zeros((len(policy.shapes),), jnp.int32))
        astate = run_adaptive_loop(pair.target, pair.draft, astate, spec, policy)
        return astate.spec_state, astate.chosen

    if warmup:
        state = begin_tree(pair, prep, widest)
        jax.block_until_ready(run(state.replace(done=jnp.ones_like(state.done)))[0].output)
    t0 = time.perf_counter()
    state, chosen = run(begin_tree(pair, prep, widest))
    jax.block_until_ready(state.output)
    seconds = time.perf_counter() - t0
    stats = dict(shape_stats(prep), loop="jit", seconds=seconds, tree_budget=tree_budget, branch=branch)
    if chosen is not None:
        counts = dict(zip(policy.shapes, np.asarray(chosen)))
        stats["adaptive_rounds"] = {label(s): int(counts.get(s, 0)) for s in full.shapes}
    return generation_result(state, stats, rows=prep.num_prompts)


def generate_tree_stepping(pair, prompts, *, max_new_tokens, shape: TreeShape, block_size: int | None = None,
                           sampling=SamplingParams(), stop_ids=(), seed=0, buckets: rq.Buckets | None = None):
    """The tree rounds driven from Python, one jitted round at a time; returns (GenerationResult, rounds)
    where rounds[r] is a dict of numpy arrays [b] per `TreeRoundInfo` field plus `live` (sequences not done
    before the round). For traces, tests and benchmarks (expert union per round)."""
    request = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed)
    prep = prepare_tree(pair, prompts, widest=shape.budget, block_size=block_size, buckets=buckets, **request)
    spec = prep.spec
    t0 = time.perf_counter()
    state = begin_tree(pair, prep, shape.budget)
    rounds = []
    done = np.asarray(state.done)
    while not done.all():
        state, info = tree_round_jit(pair.target, pair.draft, state, spec, shape)
        row = {k: np.asarray(v) for k, v in dataclasses.asdict(info).items()}
        row["live"] = ~done
        rounds.append(row)
        done = np.asarray(state.done)
    seconds = time.perf_counter() - t0
    stats = dict(shape_stats(prep), loop="python", seconds=seconds, tree_budget=shape.budget, branch=shape.branch)
    return generation_result(state, stats, rows=prep.num_prompts), rounds
