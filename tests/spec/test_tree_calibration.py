"""The calibrated tree build (`spec.tree.TreeCalibration`: node scores from a fitted acceptance model), its fit,
and the adaptive policy's reachable shapes (what it compiles and provisions)."""

from __future__ import annotations

import heapq
import itertools
import json
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.spec.policy import AdaptivePolicy, VerifyCost, choose_shape
from dflash_jax.spec.tree import TreeCalibration, TreeShape, build_tree, calibration_features
from study.tree_calibration import fit_calibration

WEIGHTS = (0.1, 1.1, -1.2, -0.5, 0.2, -1.3, 1.3, -0.1, -0.6)


def _calibrated_paths(logprobs: np.ndarray, cal: TreeCalibration, branch: int, budget: int):
    """Reference: every rank path scored by the sum of its nodes' calibrated log acceptance (non-increasing in
    rank per node, the parent's path off the argmax chain as a feature); the budget-1 best, by enumeration."""
    depth = logprobs.shape[0]
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :branch]
    top = np.take_along_axis(logprobs, order, axis=1)

    scores = {(d, off): np.minimum.accumulate(np.asarray(cal.log_accept(  # children at block position d + 1
        np.full(branch, d + 1), np.arange(branch), top[d], np.full(branch, off)))) for d in range(depth)
        for off in (False, True)}
    node_scores = lambda d, off: scores[(d, off)]  # noqa: E731

    paths = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(branch), repeat=d):
            score, off = 0.0, False
            for j, r in enumerate(ranks):
                score += float(node_scores(j, off)[r])
                off = off or r > 0
            paths.append((score, tuple(int(order[j, r]) for j, r in enumerate(ranks))))
    return heapq.nlargest(budget - 1, paths, key=lambda p: p[0])


def test_calibrated_build_takes_the_best_calibrated_paths():
    rng = np.random.default_rng(3)
    cal = TreeCalibration(WEIGHTS)
    depth, vocab, branch, budget = 4, 12, 3, 14
    logprobs = np.asarray(jax_log_softmax(rng.normal(size=(2, depth, vocab)) * 2.0))
    tree = build_tree(jnp.array([1, 2]), jnp.asarray(logprobs), TreeShape(budget, branch, calibration=cal))
    for b in range(2):
        want = {p for _, p in _calibrated_paths(logprobs[b], cal, branch, budget)}
        toks, parent = np.asarray(tree.tokens[b]), np.asarray(tree.parent[b])
        got = set()
        for t in range(1, budget):
            path, u = [], t
            while u != 0:
                path.append(int(toks[u]))
                u = int(parent[u])
            got.add(tuple(reversed(path)))
        assert got == want
    # the plain build differs (the calibration changes which paths are taken)
    plain = build_tree(jnp.array([1, 2]), jnp.asarray(logprobs), TreeShape(budget, branch))
    assert not np.array_equal(np.asarray(plain.tokens), np.asarray(tree.tokens))


def jax_log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_fit_calibration_recovers_a_logistic_model():
    rng = np.random.default_rng(0)
    n = 40000
    rows = np.stack([rng.integers(1, 16, n), rng.integers(0, 8, n), -rng.exponential(1.5, n),
                     rng.random(n) < 0.4, np.zeros(n)], axis=1).astype(np.float64)
    feats = calibration_features(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3])
    rows[:, 4] = rng.random(n) < 1.0 / (1.0 + np.exp(-(feats @ np.asarray(WEIGHTS))))
    fitted = fit_calibration(rows)
    got = np.asarray(TreeCalibration(fitted.weights).log_accept(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]))
    want = np.asarray(TreeCalibration(WEIGHTS).log_accept(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]))
    np.testing.assert_allclose(np.exp(got), np.exp(want), atol=0.08)
    with pytest.raises(ValueError, match="calibration_samples"):
        fit_calibration(np.zeros((3, 4)))
    with pytest.raises(TypeError, match="TreeCalibration"):
        TreeShape(8, 4, calibration=WEIGHTS)


def test_policy_provisions_only_the_shapes_it_can_choose():
    shapes = (TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 4))
    # measured figures: at c = 1 the chain of 4 is fastest (2.5 / 1.0 vs 3.2 / 1.5 vs 4.3 / 2.0 tokens per s);
    # the tree wins from c = 3.3 on
    policy = AdaptivePolicy(shapes, VerifyCost((1.0, 1.5, 2.0)), taus=(2.5, 3.2, 4.3), calibration_range=(0.5, 2.0))
    assert policy.reachable() == (0,)
    only = policy.pruned()
    assert only.shapes == shapes[:1] and only.taus == (2.5,) and only.cost.seconds == (1.0,)
    # unclipped, a sequence accepting far more than calibrated makes the tree win: it stays reachable
    wide = AdaptivePolicy(shapes, VerifyCost((1.0, 1.5, 2.0)), taus=(2.5, 3.2, 4.3))
    assert wide.reachable() == (0, 2) and wide.pruned().shapes == (shapes[0], shapes[2])
    live = np.ones(2, bool)
    assert int(choose_shape(wide, np.full(2, 50.0), np.zeros(2, np.float32), live)) == 2
    # the clipped policy never leaves its reachable set, on the host (numpy) and traced (jax) alike
    for acc in (0.0, 50.0, 1e4):
        for xp in (np, jnp):
            assert int(choose_shape(policy, xp.full(2, acc, xp.float32), xp.zeros(2, xp.float32), live)) == 0
    # every shape reachable: the policy is returned as is
    assert AdaptivePolicy(shapes[:1]).pruned().shapes == shapes[:1]


@pytest.mark.slow  # the marginal build's model; the shipped pair's trees build from its branch head by default
def test_calibration_samples_from_the_shipped_pair_fit_a_model_that_ranks_the_argmax_first():
    """`calibration_samples` on the shipped pair (a small tree loop, greedy): rows (depth, rank, log q, off, hit)
    with at most one hit per (round, depth) group, hits at depth 1 (the target's next token is the draft's
    candidate often), and a fitted model that scores the draft's argmax above its second choice."""
    import dflash_jax
    from dflash_jax.train.data import file_windows
    from study.tree_calibration import calibration_samples

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    prompts = file_windows(pair, "train", 1, 48, 3)
    rows = calibration_samples(pair, prompts, max_new_tokens=12, branch=2, shape=TreeShape(8, 2))
    assert rows.ndim == 2 and rows.shape[1] == 5 and len(rows) >= 8
    depth, rank, lq, hit = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 4]
    assert set(np.unique(rank)) == {0.0, 1.0} and (lq <= 0).all() and depth.min() == 1
    first = rows[depth == 1]
    assert first[:, 4].sum() >= 1  # the target's token is among the draft's 2 candidates at depth 1 somewhere
    assert hit.sum() <= len(rows) / 2  # one hit at most per group of 2 candidates
    cal = fit_calibration(rows)
    a0, a1 = cal.log_accept(np.array([1, 1]), np.array([0, 1]), np.array([-0.2, -2.0]), np.array([False, False]))
    assert float(a0) > float(a1)


def test_shipped_calibration_file_is_checked_and_loaded_by_default(tmp_path):
    """The shipped pair's acceptance model (`CALIBRATION_FILE`) loads with its checksum and the pair's
    fingerprint; `save_calibration` round-trips; an edited file or another pair's file is refused with the fix."""
    import json

    import dflash_jax
    from dflash_jax.spec.calibration_file import CALIBRATION_FILE, load_calibration, pair_calibration, save_calibration

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR, verify=False)
    cal = pair_calibration(pair)
    assert isinstance(cal, TreeCalibration)
    with open(f"{pair.directory}/{CALIBRATION_FILE}") as fh:
        body = json.load(fh)
    assert cal.weights == tuple(body["weights"]) and body["fitted_on"]["split"] == "train"
    path = save_calibration(TreeCalibration(WEIGHTS), str(tmp_path / "cal.json"), pair=pair, fitted_on={"rows": 1})
    assert load_calibration(path, pair).weights == WEIGHTS
    body = json.loads(open(path).read())
    body["weights"][0] += 1.0
    (tmp_path / "edited.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="sha256.*refit"):
        load_calibration(str(tmp_path / "edited.json"))

    class Other:  # another checkpoint: different file checksums
        manifest = {"checksums": {"files": {"draft/x": {"sha256": "0" * 64}}}}

    with pytest.raises(ValueError, match="another target/draft"):
        load_calibration(path, Other())
    assert pair_calibration(Other()) is None  # no directory: the plain build


def test_margin_prefers_the_cheapest_shape_and_survives_pruning():
    shapes = (TreeShape(4, 1), TreeShape(8, 1), TreeShape(16, 4))
    # figures from a small calibration set: the tree promises 8% more tokens/s than the chain of 4
    cost, taus = VerifyCost((0.0566, 0.0604, 0.0687)), (1.879, 2.0, 2.48)
    live = np.ones(3, bool)
    plain = AdaptivePolicy(shapes, cost, taus=taus, calibration_range=(0.5, 2.0))
    prior = AdaptivePolicy(shapes, cost, taus=taus, calibration_range=(0.5, 2.0), margin=0.15)
    zero = np.zeros(3, np.float32)
    assert int(choose_shape(plain, zero, zero, live)) == 2
    assert int(choose_shape(prior, zero, zero, live)) == 0
    # a sequence accepting twice what was calibrated still earns the tree under the prior
    assert int(choose_shape(prior, np.full(3, 40.0, np.float32), np.full(3, 10.0, np.float32), live)) == 2
    pruned = prior.pruned()
    assert pruned.margin == 0.0 and 0 in prior.reachable()
    for acc in (0.0, 10.0, 40.0):
        for xp in (np, jnp):
            a, e = xp.full(3, acc, xp.float32), xp.full(3, 10.0, xp.float32)
            assert pruned.shapes[int(choose_shape(pruned, a, e, live))] == shapes[int(choose_shape(prior, a, e, live))]
    with pytest.raises(ValueError, match="margin"):
        AdaptivePolicy(shapes, margin=-0.1)


def _edited(change, resign=True):
    def make(body):
        change(body)
        from dflash_jax.spec.calibration_file import calibration_digest

        if resign and {"format", "features", "weights", "pair_fingerprint", "sha256"} <= set(body):
            try:
                body["sha256"] = calibration_digest(body)  # edits that keep the checksum right
            except (TypeError, ValueError):
                pass
        return json.dumps(body).encode()
    return make


_BAD_CALIBRATIONS = {
    "no_weights": (_edited(lambda b: b.pop("weights")), "lacks the field 'weights'"),
    "no_sha256_nor_features": (_edited(lambda b: (b.pop("sha256"), b.pop("features"))), "lacks the fields"),
    "weights_too_few": (_edited(lambda b: b["weights"].pop()), "not a list of 9 finite numbers"),
    "weights_a_string": (_edited(lambda b: b.update(weights="0.1")), "not a list of 9"),
    "weight_nan": (_edited(lambda b: b["weights"].__setitem__(0, float("nan"))), "finite"),
    "weight_huge": (_edited(lambda b: b["weights"].__setitem__(0, 1e300)), "finite"),
    "weight_a_bool": (_edited(lambda b: b["weights"].__setitem__(0, True)), "finite numbers"),
    "weight_null": (_edited(lambda b: b["weights"].__setitem__(0, None)), "finite numbers"),
    "features_a_string": (_edited(lambda b: b.update(features="1, log q")), "not a list of feature names"),
    "other_features": (_edited(lambda b: b["features"].__setitem__(0, "bias")), "this version uses"),
    "fingerprint_a_number": (_edited(lambda b: b.update(pair_fingerprint=7)), "sha256 hex digest"),
    "fitted_on_a_list": (_edited(lambda b: b.update(fitted_on=[1])), "'fitted_on'"),
    "sha256_a_number": (_edited(lambda b: b.update(sha256=3), resign=False), "fails its sha256"),
    "format_missing": (_edited(lambda b: b.pop("format")), "is not a dflash_jax.tree_calibration/1 file"),
    "a_list": (lambda b: b"[1, 2]", "is not a dflash_jax.tree_calibration/1 file"),
    "null": (lambda b: b"null", "is not a dflash_jax.tree_calibration/1 file"),
    "invalid_json": (lambda b: b'{"format": ', "not valid JSON"),
    "not_utf8": (lambda b: b"\xff\xfe\x00{", "not UTF-8"),
    "huge": (lambda b: b" " * (1 << 20) + b"{}", "larger than"),
}


@pytest.mark.parametrize("damage", sorted(_BAD_CALIBRATIONS))
def test_a_damaged_calibration_file_is_one_clear_error(tmp_path, damage):
    """Every field of the file is checked (type, length, range) before use: one CheckpointError (a ValueError,
    printed by the CLIs as one line) naming the file and the fix, never a KeyError or TypeError."""
    from dflash_jax.errors import CheckpointError
    from dflash_jax.spec.calibration_file import load_calibration, save_calibration

    body = json.loads(open(save_calibration(TreeCalibration(WEIGHTS), str(tmp_path / "good.json"))).read())
    make, want = _BAD_CALIBRATIONS[damage]
    bad = tmp_path / "tree_calibration.json"
    bad.write_bytes(make(body))
    with pytest.raises(CheckpointError) as info:
        load_calibration(str(bad))
    message = str(info.value)
    assert want in message and str(bad) in message and "refit it" in message and "\n" not in message, message


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_calibration_path_that_is_no_file_is_refused_without_reading(tmp_path, kind):
    from dflash_jax.errors import CheckpointError
    from dflash_jax.spec.calibration_file import load_calibration

    path = tmp_path / "tree_calibration.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    out = {}

    def go():
        try:
            load_calibration(str(path))
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "load_calibration blocked on a FIFO"
    assert isinstance(out.get("error"), CheckpointError), out
    want = "is a FIFO (named pipe)" if kind == "fifo" else "is a directory"
    assert want in str(out["error"]) and "refit it" in str(out["error"])


def test_a_rewritten_calibration_file_is_read_again(tmp_path):
    from dflash_jax.spec.calibration_file import load_calibration, save_calibration

    path = save_calibration(TreeCalibration(WEIGHTS), str(tmp_path / "cal.json"))
    assert load_calibration(path).weights == WEIGHTS
    other = tuple(w + 1.0 for w in WEIGHTS)
    save_calibration(TreeCalibration(other), path)
    assert load_calibration(path).weights == other
    assert [p.name for p in tmp_path.iterdir()] == ["cal.json"]  # written through a renamed temporary file


@pytest.mark.slow  # compiles two loops and two rounds of the shipped pair
def test_policy_figures_are_measured_by_the_paired_timing():
    """`calibrate_policy` and `measure_round_seconds` time each shape through `timing.paired_runs`: one positive
    seconds figure per shape, the loops' tokens per round, the clock and statistic checked."""
    import dflash_jax
    from dflash_jax.spec.calibrate import calibrate_policy, measure_round_seconds
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    prompts = file_windows(pair, "train", 1, 32, 5)
    shapes = (TreeShape(2, 1), TreeShape(4, 1))
    lines = []
    policy = calibrate_policy(pair, prompts, shapes, max_new_tokens=8, repeats=2, clock="cpu", statistic="median",
                              log=lines.append)
    assert len(policy.cost.seconds) == 2 and all(s > 0 for s in policy.cost.seconds)
    assert all(t >= 1 for t in policy.taus) and len(lines) == 2 and "calibration repeat 2/2" in lines[1]
    cost = measure_round_seconds(pair, prompts, shapes, max_new_tokens=8, repeats=2)
    assert len(cost.seconds) == 2 and all(s > 0 for s in cost.seconds)
    with pytest.raises(ValueError, match="clock"):
        calibrate_policy(pair, prompts, shapes, clock="gpu")


def test_plain_decoding_is_a_shape_the_policy_chooses_from_its_figures():
    """`spec.calibrate.PLAIN` (width 1, no draft forward) is chosen where the chain's measured tokens per second do
    not beat it by the margin, the chain where they do; with the calibration range pinned at 1 one shape is
    reachable, and the run plan runs it as that fixed shape (plain: the chain of width 1)."""
    from dflash_jax.spec.calibrate import PLAIN
    from dflash_jax.spec.loop import plan_run
    from dflash_jax.spec.round import Chain

    shapes = (PLAIN, TreeShape(8, 1))
    cost = VerifyCost((0.002, 0.006))  # a width-8 round costs 3 width-1 rounds
    for tau, want in ((2.9, 0), (3.1, 0), (3.3, 1)):  # 3.1 is within the 5% margin
        policy = AdaptivePolicy(shapes, cost, taus=(1.0, tau), calibration_range=(1.0, 1.0), margin=0.05)
        assert policy.reachable() == (want,)
        plan = plan_run(None, policy)
        assert plan.policy is None and plan.proposer == (Chain(1) if want == 0 else Chain(8))
    both = AdaptivePolicy(shapes, cost, taus=(1.0, 3.3), calibration_range=(0.5, 2.0), margin=0.05)
    assert both.reachable() == (0, 1)  # a sequence accepting half as much falls back to plain decoding
    zero, live = np.zeros(1, np.float32), np.ones(1, bool)
    assert int(choose_shape(both, zero, zero, live)) == 1
    assert int(choose_shape(both, zero, np.full(1, 20.0, np.float32), live)) == 0


@pytest.mark.slow  # compiles plain and chain loops of the shipped pair, and their adaptive loop
def test_measured_policy_runs_lossless_whatever_it_chooses():
    """`measured_policy` measures plain decoding against the chain on the run's prompts; the loop under the
    measured policy, and under an adaptive policy switching between the two, emits plain greedy's tokens."""
    import dflash_jax
    from dflash_jax.spec import generate
    from dflash_jax.decode import generate_default, measured_policy
    from dflash_jax.spec.calibrate import PLAIN
    from dflash_jax.spec.lanes import lane_slices
    from dflash_jax.train.data import file_windows

    pair = dflash_jax.load(dflash_jax.SHIPPED_PAIR)
    prompts = file_windows(pair, "train", 2, 32, 5)
    plain = generate(pair, prompts, max_new_tokens=24, block_size=1)
    policy = measured_policy(pair, prompts, block_size=8, max_new_tokens=8)
    assert policy.shapes == (PLAIN, TreeShape(8, 1)) and len(policy.reachable()) == 1
    assert all(s > 0 for s in policy.seconds()) and policy.tokens_per_round()[0] == 1.0
    assert generate(pair, prompts, max_new_tokens=24, proposer=policy).tokens == plain.tokens
    for chosen in policy.shapes:  # the run of either choice (plain: the fastest plain loop)
        pinned = AdaptivePolicy((chosen,), VerifyCost((1.0,)), taus=(1.0,))
        res = generate_default(pair, prompts, pinned, max_new_tokens=24)
        assert res.tokens == plain.tokens and res.stats["block_size"] == chosen.budget
    # both reachable: a sequence's acceptance moves it between plain rounds and chain rounds in one loop
    both = AdaptivePolicy(policy.shapes, VerifyCost((0.002, 0.006)), taus=(1.0, 3.3), calibration_range=(0.5, 2.0),
                          margin=0.05)
    res = generate(pair, prompts, max_new_tokens=24, proposer=both)
    rounds = [len(a) for a in res.acceptance_lengths]  # each lane's loop runs its slowest row's rounds
    loops = sum(max(rounds[i] for i in g) for g in lane_slices(len(prompts), res.stats["lanes"]))
    assert res.tokens == plain.tokens and sum(res.stats["adaptive_rounds"].values()) == loops
