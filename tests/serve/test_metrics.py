"""The server's Prometheus metrics (`serve.metrics.Metrics`): a round's update keeps a running sum for the tokens/s
window, which must equal the sum over the rounds still inside the window; counters that did not move stay at 0."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dflash_jax.serve.engine import RoundInfo
from dflash_jax.serve.metrics import Metrics


def _values(m: Metrics) -> dict:
    data, _ = m.render()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(data.decode()) for s in f.samples}


def test_tokens_per_second_is_the_windows_sum(monkeypatch):
    import dflash_jax.serve.metrics as metrics

    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    m = Metrics(window_s=10.0)
    rounds = [(0.0, 3), (2.0, 1), (5.0, 4), (11.0, 2), (13.0, 5), (30.0, 1), (31.0, 6)]
    for t, tokens in rounds:
        now[0] = 100.0 + t
        m.on_round(RoundInfo(live=1, verified=1, tokens=tokens, committed=[tokens], width=4, rows=1, seconds=0.01),
                   queue_depth=0, slots_in_use=1)
        inside = [(s, n) for s, n in rounds if t - 10.0 <= s <= t]
        span = max(t - inside[0][0], 1e-3) if len(inside) > 1 else None
        expected = sum(n for _, n in inside) / span if span else 0.0
        assert abs(_values(m)[("dflash_tokens_per_second", ())] - expected) < 1e-9
    v = _values(m)
    assert v[("dflash_generated_tokens_total", ())] == sum(n for _, n in rounds)
    assert v[("dflash_rounds_total", ())] == len(rounds)
    assert v[("dflash_round_width_total", (("width", "4"),))] == len(rounds)
    assert v[("dflash_scheduler_sat_out_total", ())] == 0 and v[("dflash_prefill_tokens_total", ())] == 0


def test_labelled_counters_by_round():
    m = Metrics()
    for reason in ("stop", "length", "stop"):
        m.on_round(RoundInfo(live=2, verified=1, tokens=1, committed=[1], width=2, rows=2, how={0: "deficit"},
                             finished=[reason], seconds=0.01), queue_depth=1, slots_in_use=2)
    v = _values(m)
    assert v[("dflash_requests_finished_total", (("reason", "stop"),))] == 2
    assert v[("dflash_requests_finished_total", (("reason", "length"),))] == 1
    assert v[("dflash_scheduler_admissions_total", (("how", "deficit"),))] == 3
    assert v[("dflash_round_rows_total", (("rows", "2"),))] == 3
    assert v[("dflash_scheduler_sat_out_total", ())] == 3
    assert v[("dflash_queue_depth", ())] == 1 and v[("dflash_slots_in_use", ())] == 2
