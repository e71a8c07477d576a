"""The steady window's rates: what throughput and goodput count, and against what."""
from __future__ import annotations

import json
import statistics

import pytest

from kvstate.sim import Cluster, Scenario, with_overrides
from kvstate.sim.metrics import finish_window, rate_uncertainty, steady_window, summarize


def ramp_trace(path, slow: int, fast: int, output: int) -> str:
    """``slow`` requests at 1 req/s, then ``fast`` at 4 req/s: a load that rises late."""
    times = [1000.0 * i for i in range(slow)] + [1000.0 * slow + 250.0 * i for i in range(fast)]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512, "output_length": output}) + "\n"
                            for t in times))
    return str(path)


def run_trace(path: str, **over) -> tuple[Cluster, dict]:
    s = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": path, **over})
    cl = Cluster(s)
    return cl, summarize(cl, cl.run())


def test_a_cluster_that_keeps_up_shows_its_offered_rate_though_answers_take_long(tmp_path):
    """Answers of 2,000 tokens take ~20 s, a fifth of the window, and the load rises late: the
    finishes inside the steady window itself trail its arrivals by ~15 %. Counted in the
    window shifted by the median latency, the ample cluster serves what it is offered."""
    cl, r = run_trace(ramp_trace(tmp_path / "ramp.jsonl", 60, 160, 2000))
    reqs = list(cl.reqs.values())
    start, end, steady = steady_window(reqs)
    assert steady and r["reasons"] == {"done": 220} and r["slo"]["attainment"] == 1.0
    unshifted = sum(1 for q in reqs if start <= q.finish <= end) / (end - start)
    assert unshifted < 0.9 * r["offered_rps"]  # the lag the shift removes
    a, b = finish_window(reqs, start, end, steady)
    assert r["finish_window_s"] == [round(a, 6), round(b, 6)]
    lag = statistics.median(q.finish - q.arrival for q in reqs if start <= q.arrival <= end)
    assert a == pytest.approx(start + lag, abs=1e-9)  # by the median latency of the offered requests
    assert b == pytest.approx(min(end + lag, max(q.finish for q in reqs)), abs=1e-9)  # clipped at the last finish
    assert abs(r["throughput_rps"] / r["offered_rps"] - 1) < 0.05
    assert r["goodput_rps"] == r["throughput_rps"] and r["slo"]["meets"], r["slo"]["unmet"]


def test_a_cluster_that_falls_behind_shows_the_rate_it_sustains(tmp_path):
    """One P and one D offered twice what they serve, SLOs so loose every answer meets them:
    the shift does not hide that finishes come at the rate the cluster sustains."""
    s = with_overrides(Scenario(), {"cluster.n_prefill": 1, "cluster.n_decode": 1, "workload.rate": 80.0,
                                    "workload.num_requests": 3000, "slo.ttft_ms": 1e6, "slo.tpot_ms": 1e4})
    cl = Cluster(s)
    r = summarize(cl, cl.run())
    assert r["slo"]["attainment"] == 1.0
    assert r["throughput_rps"] < 0.7 * r["offered_rps"]
    assert not r["slo"]["meets"] and any("goodput" in u for u in r["slo"]["unmet"])


def test_a_run_without_a_steady_window_counts_over_the_arrivals_span():
    """40 requests in ~8 ms: the offered rate and the window are the arrivals' span, the
    finishes are counted in it shifted by the median latency, as a steady window's are."""
    s = with_overrides(Scenario(), {"workload.rate": 5000.0, "workload.num_requests": 40})
    cl = Cluster(s)
    r = summarize(cl, cl.run())
    reqs = list(cl.reqs.values())
    first, last = min(q.arrival for q in reqs), max(q.arrival for q in reqs)
    assert r["window"] == "arrival span" and r["window_s"] == [round(first, 6), round(last, 6)]
    assert r["offered_rps"] == pytest.approx(39 / (last - first), rel=1e-3)
    start, end, steady = steady_window(reqs)
    assert not steady and (start, end) == (first, last)
    lag = statistics.median(q.finish - q.arrival for q in reqs)
    assert finish_window(reqs, start, end, steady)[0] == pytest.approx(first + lag)


def test_requests_arriving_at_once_offer_no_rate_and_say_so(tmp_path):
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": 256, "output_length": 4}) + "\n"
                            for _ in range(20)))
    cl, r = run_trace(str(path))
    assert r["window"] == "whole run" and r["window_s"] == [0.0, r["duration_s"]]


def test_the_uncertainty_follows_the_noise_not_a_climbing_latency():
    """Latencies that climb across the window (a queue growing) are a shortfall of the rates,
    not noise: measured against their running median they leave a small uncertainty."""
    from kvstate.sim.request import SimRequest
    reqs = []
    for i in range(500):
        q = SimRequest.__new__(SimRequest)
        q.arrival, q.state = i * 0.1, "done"
        q.finish = q.arrival + 1.0 + 0.02 * i + 0.05 * (i % 3)  # +10 s over the window, +-0.05 s of noise
        reqs.append(q)
    u = rate_uncertainty(reqs, 0.0, 49.9)
    assert 0 < u < 0.05 / 49.9 * 1.01  # at most the noise's reach over the window
    flat = [SimRequest.__new__(SimRequest) for _ in range(500)]
    for i, q in enumerate(flat):
        q.arrival, q.state, q.finish = i * 0.1, "done", i * 0.1 + 1.0 + (2.0 if i % 4 == 1 else 0.0)
    assert rate_uncertainty(flat, 0.0, 49.9) == pytest.approx(0.5 / 49.9, rel=0.02)  # a quarter 2 s late
