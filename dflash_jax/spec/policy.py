"""The adaptive shape policy: which proposer shape a round runs, chosen from the state before the draft.

One chooser, `choose`: the shape of most expected tokens per second summed over the live rows, where every
shape but the cheapest must win by the factor 1 + margin (a prior toward the cheapest, covering the error of
measured figures). It is pure (numpy on a host loop, jnp under jit) and every driver calls it:

  worth[b, S]  expected tokens per round of each live row under each shape, from the row's own evidence:
               `calibrated_worth` (the batch drivers' `AdaptivePolicy`: each shape's measured or modelled tokens
               per round, scaled by the row's decayed calibration, `update_calibration`), or `expected_tokens`
               (the serving engine: a per-request acceptance estimate through one model draft that prices chains
               and trees alike, `acceptance_worth`);
  seconds[S]   a round's cost per shape, data: a static `VerifyCost` (measured at warm-up by `spec.calibrate`,
               or modelled), or a row bucket's `BucketCosts` kept current from the rounds served (`observe_cost`,
               with bounded exploration of stale neighbours, `explore_width`).

The jitted loop runs `choose_shape` inside the program (`spec.round.adaptive_round`, a `lax.switch` over the
shapes); the Python stepping loops and the offloaded loop call it on the host; the serving engine calls
`decide_width` (the same `choose`, over its learned table, then the exploration).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.spec.tree import TreeShape, build_tree


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


def choose(worth, live, seconds, margin: float = 0.0):
    """THE chooser: the index of the shape with the largest expected tokens per second summed over the live rows,
    `argmax_s sum_b live_b * worth[b, s] / seconds[s]`, every shape but the cheapest (least seconds; the first of
    equals) paying the factor 1 + `margin`. worth [b, S] expected tokens per round, live [b] bool, seconds [S].
    Ties go to the earlier shape (list shapes cheapest first). Pure; numpy in, numpy out (no device round trip),
    jnp in, jnp out (traceable)."""
    xp = np if isinstance(worth, np.ndarray) else jnp
    seconds = xp.asarray(seconds, xp.float32)
    cheapest = xp.argmin(seconds)
    scored = xp.where(xp.arange(seconds.shape[0]) == cheapest, seconds, seconds * xp.float32(1.0 + margin))
    total = xp.sum(xp.asarray(worth, xp.float32) * xp.asarray(live).astype(xp.float32)[:, None], axis=0)
    return xp.argmax(total / scored).astype(xp.int32)


def calibrated_worth(policy: AdaptivePolicy, accepted_sum, expected_sum):
    """worth [b, S] of the batch drivers: `1 + c_b * (tau_s - 1)`, tau_s the policy's tokens per round of shape s
    and c_b = (accepted_sum + 1) / (expected_sum + 1) the row's decayed calibration (clipped to
    `calibration_range` when given)."""
    xp = np if isinstance(accepted_sum, np.ndarray) else jnp
    taus = xp.asarray(policy.tokens_per_round(), xp.float32)
    calib = (accepted_sum + xp.float32(1.0)) / (expected_sum + xp.float32(1.0))
    if policy.calibration_range is not None:
        calib = xp.clip(calib, *policy.calibration_range)
    return xp.float32(1.0) + calib[:, None] * (taus[None] - xp.float32(1.0))


def choose_shape(policy: AdaptivePolicy, accepted_sum: jax.Array, expected_sum: jax.Array,
                 live: jax.Array) -> jax.Array:
    """The index of the shape `policy` picks for a batch (see `AdaptivePolicy`): `choose` over
    `calibrated_worth` and the policy's seconds. accepted_sum / expected_sum [b] the decayed proposals accepted /
    predicted per sequence, live [b] bool. Pure and traceable; ties go to the earlier shape."""
    worth = calibrated_worth(policy, accepted_sum, expected_sum)
    return choose(worth, live, policy.seconds(), policy.margin)


def update_calibration(policy: AdaptivePolicy, accepted_sum, expected_sum, choice, accepted, done_before):
    """The decayed sums after a round of shape `choice` that accepted `accepted` [b] proposals (sequences done
    before the round keep theirs)."""
    xp = np if isinstance(accepted_sum, np.ndarray) else jnp
    predicted = xp.asarray(policy.tokens_per_round(), xp.float32)[choice] - xp.float32(1.0)
    d = xp.float32(policy.decay)
    acc = xp.where(done_before, accepted_sum, d * accepted_sum + xp.asarray(accepted).astype(xp.float32))
    exp_ = xp.where(done_before, expected_sum, d * expected_sum + predicted)
    return acc, exp_


# ----------------------------------------------------------------------------------------------------------
# the serving engine's width chooser and its cost table kept current while serving (pure: tested on its own)
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CostRule:
    """How the width chooser's cost table is kept current from served rounds.

    Every served round of a row bucket updates that bucket's table (`observe_cost`: the chosen width's rounds
    the machine's load, which scales every entry; each width's rounds its cost relative to that load; medians of
    the last `window` rounds, so one slow round on a shared machine moves nothing). A
    width the chooser does not pick is measured by exploration (`explore_width`): in one round of every
    `explore_every` rounds of a bucket, a width adjacent to the chosen one (or the narrowest) runs instead when its
    entry is unconfirmed (fewer than `confirm` served times: a warm-up figure) or stale (no served time in
    `stale_after` rounds of the bucket). So at most 1 / `explore_every` of a bucket's rounds explore, an exploring
    round still commits tokens (any width is lossless), and a mispriced entry is re-measured within tens of rounds.
    """

    explore_every: int = 8
    stale_after: int = 64
    confirm: int = 3
    window: int = 5
    accept_after: int = 16  # rounds of a bucket before a drafting width is run again to measure the acceptance
    # the share of the served time the acceptance exploration may lose, at the current estimate (`exploration_loss`)
    accept_budget: float = 0.03

    def __post_init__(self):
        if (int(self.explore_every) < 0 or int(self.stale_after) < 1 or int(self.confirm) < 0 or int(self.window) < 1
                or int(self.accept_after) < 1 or not 0.0 <= float(self.accept_budget) <= 1.0):
            raise ValueError(f"CostRule: explore_every >= 0 (0: never explore), stale_after >= 1, confirm >= 0, "
                             f"window >= 1, accept_after >= 1 and accept_budget in [0, 1], got {self}")


@dataclasses.dataclass(frozen=True)
class BucketCosts:
    """One row bucket's learned costs, as a load factor times a cost per width: a round of width w takes about
    `load * cost[w]` seconds (`seconds`). A shared machine's load moves every width's time together, so the load
    is learned from the rounds of the chosen width (the most recent information, every round) and a width's cost
    relative to it from the width's own rounds, which are thereby compared with rounds of the same minute (paired,
    as the warm-up measurement is), not with figures from another load. `cost` starts as the warm-up table (load
    1); `recent`: each width's last served times divided by the load of their time; `load_recent`: the last
    ratios of a chosen round's time to its width's cost; `age`: rounds of the bucket since the width last ran;
    `rounds`: the bucket's rounds so far; `prior`: the warm-up costs, which count as one sample of a width
    with fewer than `confirm` served ones (one noisy round does not replace a paired measurement)."""

    cost: dict
    recent: dict
    age: dict
    load: float = 1.0
    load_recent: tuple = ()
    rounds: int = 0
    prior: dict = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> dict:
        """{width: seconds} of a round now."""
        return {w: self.load * c for w, c in self.cost.items()}

    @classmethod
    def fresh(cls, seconds: dict, rule: CostRule = CostRule()) -> "BucketCosts":
        """A table measured at warm-up (or given): no served time yet, every entry stale."""
        cost = {w if isinstance(w, TreeShape) else int(w): float(t) for w, t in seconds.items()}
        return cls(cost=cost, recent={w: () for w in cost}, age={w: int(rule.stale_after) for w in cost},
                   prior=dict(cost))

    def stale(self, width: int, rule: CostRule) -> bool:
        return len(self.recent[width]) < rule.confirm or self.age[width] >= rule.stale_after

    def unserved(self, width: int, rule: CostRule) -> bool:
        """No served time of `width` in the bucket lately: none yet, or none in `rule.stale_after` rounds."""
        return not self.recent[width] or self.age[width] >= rule.stale_after


def _geomedian(values) -> float:
    """exp(median(log(values))), in plain Python: a served round calls it twice on a few floats, where numpy's
    median costs tens of microseconds of the host's time per round."""
    logs = sorted(math.log(float(v)) for v in values)
    mid = len(logs) // 2
    return math.exp(logs[mid] if len(logs) % 2 else 0.5 * (logs[mid - 1] + logs[mid]))


def observe_cost(costs: BucketCosts, width: int, seconds: float, rule: CostRule = CostRule(),
                 explored: bool = False) -> BucketCosts:
    """The bucket's costs after one served round of `width` took `seconds` (pure). A chosen round (not
    `explored`) first updates the load: the median of the last `rule.window` ratios of a chosen round's time to
    its width's cost, so the whole table follows the machine (one slow round among three or more moves nothing,
    a lasting change shows within `window` // 2 + 1 rounds) and keeps its ratios. Then the width's cost becomes
    the median of its last `window` times divided by the load of their time (and of its warm-up cost while it has
    fewer than `rule.confirm`): for an explored width, its time against the chosen rounds just before it. A
    stale entry keeps only its newest time. Every other width ages by one round."""
    t = max(float(seconds), 1e-9)
    load, window = costs.load, costs.load_recent
    if not explored:
        window = (window + (t / costs.cost[width],))[-int(rule.window):]
        load = _geomedian(window)
    recent = costs.recent[width]
    if costs.age[width] >= rule.stale_after:
        recent = recent[-1:]
    recent = (recent + (t / load,))[-int(rule.window):]
    cost = dict(costs.cost)
    prior = (costs.prior[width],) if width in costs.prior and len(recent) < rule.confirm else ()
    cost[width] = _geomedian(recent + prior)
    times = dict(costs.recent)
    times[width] = recent
    age = {w: a + 1 for w, a in costs.age.items()}
    age[width] = 0
    return BucketCosts(cost=cost, recent=times, age=age, load=load, load_recent=window, rounds=costs.rounds + 1,
                       prior=costs.prior)


def join_widths(costs: BucketCosts, measured: dict, rule: CostRule = CostRule()) -> BucketCosts:
    """The bucket's costs with the widths of `measured` ({width: seconds}, one paired measurement of every width,
    `Engine.measure_rounds`) that it lacks (a width warmed after the bucket began serving). A new width's cost is
    its measured time over the machine's load at the measurement: the geometric median, over the widths both hold,
    of a measured time over its learned cost. It starts unconfirmed and stale (`explore_width` re-measures it from
    served rounds) with that cost as its prior. Pure; the widths already held keep their entries."""
    common = [w for w in measured if w in costs.cost]
    if not common:
        held = sorted(costs.cost, key=shape_order)
        raise ValueError(f"join_widths: the measurement shares no width with the bucket's {held}")
    load = _geomedian([max(float(measured[w]), 1e-9) / costs.cost[w] for w in common])
    new = {w: max(float(t), 1e-9) / load for w, t in measured.items() if w not in costs.cost}
    if not new:
        return costs
    return dataclasses.replace(costs, cost={**costs.cost, **new}, recent={**costs.recent, **{w: () for w in new}},
                               age={**costs.age, **{w: int(rule.stale_after) for w in new}},
                               prior={**costs.prior, **new})


def explore_width(costs: BucketCosts, chosen: int, rule: CostRule = CostRule()) -> int | None:
    """The width to run instead of `chosen` to re-measure its cost, or None (pure, deterministic): only in the
    bucket's rounds numbered explore_every - 1, 2 * explore_every - 1, .. (at most 1 / explore_every of them),
    only a width adjacent to `chosen` in the bucket's widths or the narrowest one (width 1: no speculation, which
    every other width must beat; a price of it that stays too high, learned from short calls, would otherwise keep a
    wide width chosen, since exploration never reached it from there), and only if its entry is stale or
    unconfirmed (`BucketCosts.stale`); of several such widths an unconfirmed one first, then the older entry, then
    the wider. Never with a single width."""
    widths = sorted(costs.cost, key=shape_order)
    if len(widths) < 2 or rule.explore_every <= 0 or chosen not in costs.cost:
        return None
    if (costs.rounds + 1) % rule.explore_every:
        return None
    i = widths.index(chosen)
    near = [widths[j] for j in (i + 1, i - 1) if 0 <= j < len(widths)]
    if i > 1:  # and the narrowest, which every other width must beat (a stale price there steers every choice)
        near.append(widths[0])
    near = [w for w in near if costs.stale(w, rule)]
    if not near:
        return None
    return max(near, key=lambda w: (len(costs.recent[w]) < rule.confirm, costs.age[w], shape_order(w)))


def acceptance_upper(alpha, evidence):
    """An optimistic acceptance: `alpha` plus one standard deviation of a proportion estimated from `evidence`
    verified proposals (decayed counts; the prior's weight included), capped below 1. Little evidence (a row held at
    width 1, whose evidence fades) gives a wide margin; a row that verified a long run, a narrow one."""
    alpha = np.asarray(alpha, np.float64)
    spread = np.sqrt(alpha * (1.0 - alpha) / (np.asarray(evidence, np.float64) + 1.0))
    return np.minimum(alpha + spread, 0.98)


def with_host(seconds: dict, host_seconds) -> dict:
    """{shape: seconds per round} plus the host's work per round: one figure for every shape, or {shape: seconds}
    (a shape it lacks: 0). Pure."""
    if isinstance(host_seconds, dict):
        return {w: t + host_seconds.get(w, 0.0) for w, t in seconds.items()}
    return {w: t + host_seconds for w, t in seconds.items()}


def with_drafting(seconds: dict, alphas, per_token: float = 0.0, scale: dict | None = None) -> dict:
    """{shape: seconds per round} with what drafting costs beyond its draft and verify added to every shape that
    proposes (more than one verify row): `per_token` seconds per token it is expected to commit over the live rows
    at the acceptances `alphas` (the serving engine's held context, appended once per admission before drafting
    rounds, `Engine.drafting_per_token`; `scale` as in `worth_sums`). Pure."""
    if not per_token:
        return dict(seconds)
    shapes = list(seconds)
    tokens = worth_sums(alphas, shapes, scale)
    return {w: t + (per_token * float(n) if shape_rows(w) > 1 else 0.0) for (w, t), n in zip(seconds.items(), tokens)}


def exploration_loss(alphas, seconds: dict, chosen, shape, rounds: int, first: float = 0.0,
                     scale: dict | None = None) -> float:
    """The seconds that `rounds` rounds of `shape` are expected to lose against `chosen` at the acceptance estimates
    `alphas` ({shape: seconds per round}, as `choose_width` prices them, `scale` too): each round's time beyond what
    `chosen` takes for the same expected tokens, and `first` (what running it costs up front: a held context
    appended). Never negative; pure."""
    worth = worth_sums(alphas, [chosen, shape], scale)
    per_round = seconds[shape] - seconds[chosen] * worth[1] / max(worth[0], 1e-9)
    return max(0.0, float(rounds) * per_round) + max(0.0, float(first))


def explore_acceptance(upper, costs: BucketCosts, chosen, host_seconds: float = 0.0, margin: float = 0.0,
                       rule: CostRule = CostRule(), drafting_per_token: float = 0.0, scale: dict | None = None):
    """A drafting shape to run instead of `chosen` to measure what the draft accepts, or None (pure,
    deterministic): the shape `choose_width` picks at the optimistic acceptances `upper` (`acceptance_upper` of each
    live row), when it verifies more rows than `chosen` and has not run in this bucket for `rule.accept_after`
    rounds. A narrow width chosen on a pessimistic estimate (the prior, or evidence faded while held at width 1)
    would otherwise never show the draft's real acceptance; a shape that cannot win even then is never tried, and
    one found wanting waits `accept_after` rounds of the bucket before it is tried again (each try adds to the
    engine's long-run acceptance, so a few tries settle it). The caller also bounds what the tries lose
    (`exploration_loss` against its budget, `rule.accept_budget` of its served time). A shape's price is optimistic
    too while it is unconfirmed (fewer than `rule.confirm` served times, `optimistic_seconds`): one slow try would
    otherwise price it out of every later try, and a drafting width held off by the held context is re-measured
    by nothing else. `scale`: as in `worth_sums`."""
    if rule.explore_every <= 0 or len(costs.cost) < 2:
        return None
    seconds = with_drafting(with_host(optimistic_seconds(costs, rule), host_seconds), upper, drafting_per_token,
                            scale)
    hope = choose_width(upper, seconds, margin, scale)
    if shape_rows(hope) <= shape_rows(chosen) or costs.age[hope] < rule.accept_after:
        return None
    return hope


def optimistic_seconds(costs: BucketCosts, rule: CostRule = CostRule()) -> dict:
    """{shape: seconds of a round now} with each unconfirmed entry (fewer than `rule.confirm` served times) at the
    lower of its learned cost and its warm-up measurement (`prior`), at the current load. Pure."""
    out = costs.seconds
    for w, prior in costs.prior.items():
        if w in out and len(costs.recent[w]) < rule.confirm:
            out[w] = min(out[w], costs.load * prior)
    return out


def decide_width(alphas, costs: BucketCosts, host_seconds: float = 0.0, margin: float = 0.0,
                 rule: CostRule | None = CostRule(), drafting_per_token: float = 0.0,
                 scale: dict | None = None, incumbent=None) -> tuple[int, bool]:
    """(the round's width, whether it explores): `choose_width` over the bucket's table plus the per-round host
    time (one figure, or one per shape: `with_host`; and drafting's own cost on every drafting shape:
    `with_drafting`), the expected tokens scaled by `scale` (`worth_sums`), the margin paid by every shape but
    `incumbent` where given, then `explore_width` (rule None: no exploration). Pure."""
    seconds = with_drafting(with_host(costs.seconds, host_seconds), alphas, drafting_per_token, scale)
    chosen = choose_width(alphas, seconds, margin, scale, incumbent)
    other = None if rule is None else explore_width(costs, chosen, rule)
    return (chosen, False) if other is None else (other, True)


def default_widths(block_size: int) -> tuple[int, ...]:
    """The verify widths an adaptive engine chooses from: 1, the powers of two below `block_size`, and it."""
    out, w = [], 1
    while w < block_size:
        out.append(w)
        w *= 2
    return tuple(out) + (block_size,)


def shape_rows(shape) -> int:
    """The verify rows of a shape key: a chain width (int), or a `TreeShape`'s budget."""
    return shape.budget if isinstance(shape, TreeShape) else int(shape)


def shape_order(shape) -> tuple:
    """Shapes in order of cost: by verify rows, a chain before a tree of as many rows, then the branching."""
    tree = isinstance(shape, TreeShape) and not shape.is_chain
    return (shape_rows(shape), tree, shape.branch if tree else 0)


def width_label(shape) -> str:
    """A shape key's name in metrics and stats: the chain width ("8"), or the tree ("tree16x4": budget x branch)."""
    if isinstance(shape, TreeShape) and not shape.is_chain:
        return f"tree{shape.budget}x{shape.branch}"
    return str(shape_rows(shape))


ALPHA_GRID = 50  # a tree's expected tokens are evaluated at alpha rounded to 1/50 (cached per shape and step)


def expected_tokens(alpha, shape):
    """Tokens a verify of `shape` commits when the draft's argmax is accepted with probability `alpha` given the
    path before it (the bonus included). A chain of `width` (an int, or a branch-1 `TreeShape`): 1 + alpha + ... +
    alpha^(width-1). A tree: the same model draft as `prior_tokens_per_round`, whose r-th candidate is right with
    probability alpha (1 - alpha)^r, so a tree and a chain are priced by one model (for a chain both agree)."""
    if isinstance(shape, TreeShape) and not shape.is_chain:
        alpha = np.clip(np.asarray(alpha, np.float64), 0.0, 0.98)
        steps = np.rint(alpha * ALPHA_GRID).astype(int)
        table = {int(k): prior_tokens_per_round(shape, alpha=k / ALPHA_GRID) if k else 1.0 for k in np.unique(steps)}
        return np.vectorize(table.__getitem__, otypes=[np.float64])(steps) if steps.ndim else table[int(steps)]
    width = shape_rows(shape)
    alpha = np.minimum(np.asarray(alpha, np.float64), 0.999)
    return (1.0 - alpha ** width) / (1.0 - alpha)


def acceptance_worth(alphas, shapes):
    """worth [b, S] of the serving engine: `expected_tokens(alpha_b, shape_s)` for each live row's acceptance
    estimate."""
    alphas = np.asarray(alphas, np.float64).reshape(-1)
    return np.stack([np.broadcast_to(expected_tokens(alphas, w), alphas.shape) for w in shapes], axis=1)


def worth_sums(alphas, shapes, scale: dict | None = None) -> list[float]:
    """`acceptance_worth(alphas, shapes).sum(axis=0)` as floats: the expected tokens of a round of each shape over
    the live rows, each times `scale[shape]` where given (what that shape's verifies committed over what this model
    expected of them: `Engine.worth_scale`). Chains in plain Python (a serving step's chooser runs this on a few
    rows and widths, where numpy's per-call overhead is most of the cost), trees through `expected_tokens`."""
    if any(isinstance(w, TreeShape) and not w.is_chain for w in shapes):
        out = [float(x) for x in acceptance_worth(alphas, shapes).sum(axis=0)]
    else:
        rows = [min(float(a), 0.999) for a in np.asarray(alphas, np.float64).reshape(-1).tolist()]
        out = []
        for w in shapes:
            n = shape_rows(w)
            out.append(sum((1.0 - a ** n) / (1.0 - a) for a in rows))
    if scale:
        out = [t * scale.get(w, 1.0) for t, w in zip(out, shapes)]
    return out


def row_worths(alphas, shape) -> list[float]:
    """`expected_tokens(alpha, shape)` of each live row, as floats (chains in plain Python, as `worth_sums`)."""
    if isinstance(shape, TreeShape) and not shape.is_chain:
        return [float(x) for x in np.atleast_1d(expected_tokens(np.asarray(alphas, np.float64), shape))]
    n = shape_rows(shape)
    return [(1.0 - a ** n) / (1.0 - a) for a in (min(float(x), 0.999) for x in alphas)]


def call_occupancy(alphas, remaining, rounds: dict, scale: dict | None = None) -> dict:
    """{shape: the share of a device call's rows x rounds that commit tokens}, for calls of `rounds[shape]` rounds
    over the live rows, row b at the acceptance `alphas[b]` with `remaining[b]` tokens left to its budget (`scale`
    as in `worth_sums`). A call with no request waiting runs its rounds until every row is done, and a row that
    finishes sits out the call's other rounds: its client hears of it when the call ends. Row b is taken to finish
    after remaining[b] / worth[b] rounds; the call runs min(rounds, the last row's), and commits min(remaining[b],
    rounds x worth[b]) tokens of each row, which over (its rounds x the rows' summed worth) is the share. A shape
    whose rounds commit more tokens fills its rows' budgets in fewer rounds, so in a call of as many rounds more of
    its rows sit idle: at 4 rows of 64 - 192 tokens on the shipped pair, width-4 calls of 50 - 64 rounds held every
    row's whole request, and served 0.66x - 0.83x width 1's tokens per row-second where the round model, which took
    every row as busy every round, expected 1.3x. 1.0 where every row outlasts the call (and for one row: its call
    ends when it finishes). Pure."""
    out = {}
    left = [max(float(r), 1.0) for r in remaining]
    for w, n in rounds.items():
        worth = row_worths(alphas, w)
        if scale and w in scale:
            worth = [x * scale[w] for x in worth]
        total = sum(worth)
        ran = min(float(n), max(r / x for r, x in zip(left, worth)))
        if total <= 0.0 or ran <= 0.0:
            out[w] = 1.0
            continue
        out[w] = min(1.0, sum(min(r, n * x) for r, x in zip(left, worth)) / (ran * total))
    return out


def choose_width(alphas, seconds: dict, margin: float = 0.0, scale: dict | None = None, incumbent=None):
    """The shape (a chain width, or a `TreeShape`) with the most expected tokens per second over the live rows:
    `choose` over `acceptance_worth` (times `scale`, `worth_sums`) and `seconds` ({shape: seconds per round}), the
    shapes in cost order (`shape_order`): ties go to the cheaper, and every shape but the cheapest must win by
    1 + `margin` (the table's error: a round speculates only where the gain is clear). With `incumbent` (one of the
    shapes: the one running now), every shape but it pays the margin instead, so a change of shape needs the clear
    gain both ways (noise in the estimates near a tie does not flip the choice back and forth; each flip costs: a
    width-1 call holds the draft's context, the drafting call after it appends the hold). Pure and deterministic."""
    shapes = sorted(seconds, key=shape_order)
    free = shapes.index(incumbent) if incumbent in seconds else None
    return shapes[_best(worth_sums(alphas, shapes, scale), [seconds[w] for w in shapes], margin, free)]


def _best(totals, seconds, margin: float, free: int | None = None) -> int:
    """`choose` over summed worths `totals` [S] and `seconds` [S] in plain Python (the same rule: every shape but
    the cheapest, the first of equals, pays 1 + `margin`, or every shape but `free` where given; ties go to the
    earlier)."""
    cheapest = min(range(len(seconds)), key=seconds.__getitem__) if free is None else free
    best, top = 0, None
    for i, (t, sec) in enumerate(zip(totals, seconds)):
        rate = t / (sec if i == cheapest else sec * (1.0 + margin))
        if top is None or rate > top:
            best, top = i, rate
    return best
