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

A tree is one proposer of the round (`spec.round`: `TreeShape` is the tree proposer); the adaptive policy that
picks a shape per round is `spec.policy`, its measured figures `spec.calibrate`.

The build's node scores can come from a fitted acceptance model instead of the draft's marginals
(`TreeCalibration`, fitted by `study.tree_calibration.fit_calibration` on training-split prompts; its file is
`spec.calibration_file`).

When the draft carries a branch head (`models.draft.BranchHeadWeights`, attached by `pair.load` from the file
shipped beside the checkpoint), a tree's nodes take their children from it instead: the draft's distribution
at the next position given the node's own token (`build_tree_from_head`). The marginals ignore which branch a
node is on, so below a node off the argmax chain they mostly miss; the head models exactly what a best-first
tree ranks by, P(token | the path so far is the target's). Chains (branch 1) stay the argmax chain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.cache import move_slots
from dflash_jax.models import draft as draft_model
from dflash_jax.models.decoder import TreeBlock
from dflash_jax.models.family import family_of
from dflash_jax.spec.sampling import greedy_tokens, processed_scores
from dflash_jax.spec.session import RoundOutcome, SpecConfig, SpecState, by_rows, emit_tokens, position_draws

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
    `study.tree_calibration.fit_calibration`; hashable (a static argument)."""

    weights: tuple[float, ...]

    def __post_init__(self):
        if len(self.weights) != len(CALIBRATION_FEATURES):
            raise ValueError(f"a TreeCalibration needs {len(CALIBRATION_FEATURES)} weights "
                             f"({', '.join(CALIBRATION_FEATURES)}), got {len(self.weights)}")

    def log_accept(self, depth, rank, logq, off):
        """log P(accept) of candidates (`calibration_features`' arguments)."""
        z = calibration_features(depth, rank, logq, off) @ jnp.asarray(self.weights, jnp.float32)
        return -jnp.logaddexp(0.0, -z)


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
            raise TypeError(f"calibration must be a TreeCalibration (spec.calibration_file.load_calibration, or "
                            f"study.tree_calibration.fit_calibration), got {type(self.calibration).__name__}")

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
    any cache whose `keys` / `values` are per-layer slot = position buffers (`cache.move_slots`)."""
    src = start[:, None] + path
    dst = start[:, None] + jnp.arange(path.shape[1], dtype=start.dtype)[None]
    return cache.replace(keys=tuple(move_slots(k, src, dst) for k in cache.keys),
                         values=tuple(move_slots(v, src, dst) for v in cache.values))


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


def expert_union(router_experts, num_experts: int) -> jax.Array:
    per_layer = [r for r in router_experts if r is not None]
    if not per_layer:
        return jnp.zeros((1,), jnp.float32)
    counts = []
    for r in per_layer:  # r [b, T, k]
        hit = jax.nn.one_hot(r.reshape(r.shape[0], -1), num_experts, dtype=jnp.int32).max(axis=1)
        counts.append(hit.sum(axis=-1))
    return jnp.mean(jnp.stack(counts).astype(jnp.float32), axis=0)


def commit_tree(state: SpecState, tree: Tree, draft_cache, out, spec: SpecConfig):
    """Acceptance, emission and commit of a tree verify's output `out` (the target forward over `tree.tokens` with
    the tree mask, by any placement: `spec.round.verify_forward`, or layer by layer with offloaded experts).
    Returns (state, RoundOutcome)."""
    fam = family_of(spec.target)
    start = state.target_cache.lengths
    rows = state.params.sampling
    target_argmax = greedy_tokens(out.logits)

    def sampled():  # a node's draw is for the position after it: the key of output position num_generated + depth
        # (`session.position_draws`); siblings share it, and only the accepted path's draws are ever committed
        draws = position_draws(state, processed_scores(out.logits, rows), tree.depth)
        return jnp.where(rows.greedy[:, None], target_argmax, draws)

    target_tokens = by_rows(state, spec, lambda: target_argmax, sampled)
    accepted, bonus, path = accept_tree(tree, target_tokens)
    gamma = spec.block_size - 1
    path = pad_cols(path, spec.block_size)
    proposals = jnp.take_along_axis(tree.tokens, path[:, 1:], axis=1)  # [b, B-1]: d_1 .. d_a on the path
    new, produced = emit_tokens(state, accepted, bonus, proposals[:, :gamma], spec)
    cache = getattr(fam, "commit_tree_path", commit_path)(out.cache, start, path)
    context = draft_model.context_features(out.taps)  # [b, N, F]
    context = jnp.take_along_axis(context, path[..., None], axis=1)  # [b, B, F]: the path's rows
    cfg = spec.target
    num_experts = cfg.moe.num_experts if getattr(cfg, "moe", None) is not None else 1
    info = RoundOutcome(accepted=accepted, expert_union=jnp.broadcast_to(
        expert_union(out.router_experts, num_experts), accepted.shape),
        expected=jnp.sum(jnp.where(tree.valid, jnp.exp(tree.score), 0.0), axis=1) - 1.0,
        off_chain=jnp.any((jnp.take_along_axis(tree.rank, path, axis=1) > 0)
                          & (jnp.arange(path.shape[1])[None] <= accepted[:, None]), axis=1))
    new = new.replace(
        target_cache=fam.rollback(cache, start + produced),
        draft_cache=draft_cache,
        context=pad_cols(context.astype(state.context.dtype), state.context.shape[1]),  # a held width kept
        num_context=produced,
        last_accepted=accepted,
        last_bonus=bonus,
    )
    return new, info
