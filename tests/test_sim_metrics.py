"""The steady window's rates: offered, throughput and goodput over one cohort of requests."""
from __future__ import annotations

import json

import pytest

from kvstate.app._cli import main
from kvstate.sim import Cluster, Scenario, with_overrides
from kvstate.sim._metrics import (
    cohort,
    merged_hist,
    rate_uncertainty,
    service_stretch,
    steady_window,
    summarize,
    weighted_stats,
)


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
    finishes inside the steady window itself trail its arrivals by ~15 %. Counted over the
    window's arrivals, the ample cluster serves what it is offered."""
    cl, r = run_trace(ramp_trace(tmp_path / "ramp.jsonl", 60, 160, 2000))
    reqs = list(cl.reqs.values())
    start, end, steady = steady_window(reqs)
    assert steady and r["reasons"] == {"done": 220} and r["slo"]["attainment"] == 1.0
    unshifted = sum(1 for q in reqs if start <= q.finish <= end) / (end - start)
    assert unshifted < 0.9 * r["offered_rps"]  # finishes counted in the window itself: the lag
    group = cohort(reqs, start, end, steady)
    assert r["cohort"] == len(group) == sum(1 for q in reqs if start <= q.arrival <= end)
    assert r["offered_rps"] == pytest.approx(len(group) / (end - start), rel=1e-3)
    assert r["service_stretch"] > 0.97
    assert r["throughput_rps"] == pytest.approx(r["offered_rps"] * r["service_stretch"], rel=1e-3)
    assert r["goodput_rps"] == r["throughput_rps"] and r["slo"]["meets"], r["slo"]["unmet"]


def test_the_stretch_is_the_sustained_share_of_the_offered_rate_and_never_above_one():
    arrivals = [float(i) for i in range(100)]  # 1 req/s
    assert service_stretch(arrivals, [5.0] * 100) == 1.0  # kept up
    served_at_half = [2.0 * a - a + 1.0 for a in arrivals]  # finish i at 2i + 1: 0.5 req/s
    assert service_stretch(arrivals, served_at_half) == pytest.approx(0.5, rel=0.02)
    assert service_stretch(arrivals, [100.0 - a for a in arrivals]) == 1.0  # catching up: capped
    one_stuck = [1.0] * 99 + [10_000.0]
    assert service_stretch(arrivals, one_stuck) == 1.0  # one slow answer is not a climb
    assert service_stretch([3.0] * 10, [float(i) for i in range(10)]) == 1.0  # arrived at once: no span


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


def test_a_run_without_a_steady_window_counts_over_the_arrivals_span_and_is_not_judged():
    """40 requests in ~8 ms: the offered rate and the window are the arrivals' span, every
    request is the cohort, and a burst that ended before the cluster filled is not a verdict."""
    s = with_overrides(Scenario(), {"workload.rate": 5000.0, "workload.num_requests": 40})
    cl = Cluster(s)
    r = summarize(cl, cl.run())
    reqs = list(cl.reqs.values())
    first, last = min(q.arrival for q in reqs), max(q.arrival for q in reqs)
    assert r["window"] == "arrival span" and r["window_s"] == [round(first, 6), round(last, 6)]
    assert r["offered_rps"] == pytest.approx(39 / (last - first), rel=1e-3)
    start, end, steady = steady_window(reqs)
    assert not steady and (start, end) == (first, last) and r["cohort"] == 40
    assert r["throughput_rps"] <= r["offered_rps"]
    assert r["slo"]["meets"] is False and "never held the load" in r["slo"]["too_short"]
    assert r["slo"]["requests_needed"] >= 80


def test_requests_arriving_at_once_offer_no_rate_and_say_so(tmp_path):
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": 256, "output_length": 4}) + "\n"
                            for _ in range(20)))
    cl, r = run_trace(str(path))
    assert r["window"] == "whole run" and r["window_s"] == [0.0, r["duration_s"]]


def test_the_uncertainty_follows_the_noise_not_a_climbing_latency():
    """Latencies that climb across the window (a queue growing) are a shortfall of the rates,
    not noise: measured against their running median they leave a small uncertainty."""
    arrivals = [i * 0.1 for i in range(500)]
    climbing = [1.0 + 0.02 * i + 0.05 * (i % 3) for i in range(500)]  # +10 s over the window, +-0.05 s
    flat = [1.0 + (2.0 if i % 4 == 1 else 0.0) for i in range(500)]  # a quarter 2 s late, no trend
    u_climb, u_flat = rate_uncertainty(arrivals, climbing), rate_uncertainty(arrivals, flat)
    assert 0 < u_climb < 0.01  # only the +-0.05 s of noise
    assert service_stretch(arrivals, climbing) == pytest.approx(37.5 / (37.5 + 7.5), rel=0.01)
    assert service_stretch(arrivals, flat) == 1.0 and u_flat == 0.0  # the median ignores the late quarter
    noisy = [1.0 + (i * 7919 % 13) / 13 for i in range(500)]  # 0-1 s of noise, no trend
    assert 0.001 < rate_uncertainty(arrivals, noisy) < 0.02
    assert service_stretch(arrivals, noisy) >= 1 - rate_uncertainty(arrivals, noisy)


# -- no rate above the rate offered ---------------------------------------------------------------
ISSUE_RUN = ["llama-3-70b-h200", "--mode", "colocated", "--n-instances", "12", "--rate", "30"]


@pytest.mark.parametrize("n", [300, 1500])
def test_throughput_and_goodput_never_exceed_the_offered_rate(n, capsys):
    """The run that printed 62 req/s of throughput against 32 offered: every rate is now over
    the same requests, so throughput <= offered (the stretch can only lower it), goodput <= it."""
    assert main(["simulate", "--json", "--quiet", *ISSUE_RUN, "--num-prompts", str(n)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 0 < r["goodput_rps"] <= r["throughput_rps"] <= r["offered_rps"] * (1 + r["rate_uncertainty"])
    assert r["throughput_rps"] <= r["offered_rps"]
    good = r["goodput_rps"] / r["offered_rps"]
    assert good <= r["slo"]["attainment"] + 0.5  # the cohort's good share, not twice the offered


def test_timeouts_count_against_goodput_and_show_as_failed_not_as_tpot(capsys):
    """D gives up on first tokens after 0.3 s on an overloaded P: those requests never had a
    TPOT, so TPOT attainment is over the finished ones; they sink goodput and are listed."""
    argv = ["simulate", "--json", "--quiet", "--num-prompts", "400", "--n-prefill", "1", "--rate", "80",
            "--set", "policy.first_token_timeout=0.3"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    failed = sum(r["failed"].values())
    assert failed > 0 and r["failed"] == {k: v for k, v in r["reasons"].items() if k != "done"}
    assert r["slo"]["tpot_attainment"] > 0.9  # the finished requests decoded in time
    assert r["failed_rps"] > 0 and r["goodput_rps"] <= r["offered_rps"] - r["failed_rps"] + 1e-6
    assert any("goodput" in u and "failed" in u for u in r["slo"]["unmet"])
    assert main(argv[:1] + argv[2:]) == 0
    assert f"failed {failed:,} (" in capsys.readouterr().out


def test_every_rate_printed_is_its_definition_over_the_cohort(capsys):
    """Offered, throughput, goodput, failed and token rates recomputed from the requests
    themselves, on a run with failures and a cluster falling behind (stretch below 1)."""
    s = with_overrides(Scenario(), {"workload.num_requests": 800, "workload.rate": 120.0, "cluster.n_prefill": 1,
                                    "cluster.n_decode": 1, "policy.first_token_timeout": 1.0})
    cl = Cluster(s)
    r = summarize(cl, cl.run())
    reqs = list(cl.reqs.values())
    start, end, steady = steady_window(reqs)
    group = [q for q in reqs if start <= q.arrival <= end]
    done = [q for q in group if q.state == "done"]
    assert steady and r["cohort"] == len(group) and len(done) < len(group)
    offered = len(group) / (end - start)
    stretch = service_stretch([q.arrival for q in done], [q.finish - q.arrival for q in done])
    each = offered / len(group) * stretch
    ttft_slo, tpot_slo = s.slo.ttft_ms / 1000, s.slo.tpot_ms / 1000
    good = [q for q in done if q.first_token - q.arrival <= ttft_slo
            and (q.out <= 1 or (q.finish - q.first_token) / (q.out - 1) <= tpot_slo)]
    assert r["offered_rps"] == pytest.approx(offered, rel=1e-3)
    assert r["service_stretch"] == pytest.approx(stretch, abs=1e-4) and stretch < 1
    assert r["throughput_rps"] == pytest.approx(len(done) * each, rel=1e-3)
    assert r["goodput_rps"] == pytest.approx(len(good) * each, rel=1e-3)
    assert r["failed_rps"] == pytest.approx((len(group) - len(done)) * offered / len(group), rel=1e-3)
    assert r["output_tokens_per_s"] == pytest.approx(sum(q.generated for q in done) * each, rel=1e-3)
    reached = [q for q in reqs if q.first_token is not None and q.first_token <= q.finish]
    assert r["slo"]["ttft_attainment"] == pytest.approx(
        sum(q.first_token - q.arrival <= ttft_slo for q in reached) / len(reached), abs=1e-4)
    assert r["gpus"] == 1 * 2 + 1 * 2


# -- SLOs as vllm bench serve spells them --------------------------------------------------------
def test_goodput_slos_count_only_the_slos_named_and_the_verdict_names_the_percentile(capsys):
    """``--goodput ttft:30 e2el:3000``: TPOT is no SLO then; a request is good when it meets
    both named; a failing one is named with the percentile that broke it."""
    argv = ["simulate", "--json", "--quiet", "--num-prompts", "600", "--goodput", "ttft:30", "e2el:3000"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    slo = r["slo"]
    assert (slo["ttft_ms"], slo["tpot_ms"], slo["e2el_ms"]) == (30.0, 0.0, 3000.0)
    assert slo["tpot_attainment"] == 1.0  # no TPOT SLO: nothing fails it
    assert slo["attainment"] <= min(slo["ttft_attainment"], slo["e2el_attainment"])
    broke = [u for u in slo["unmet"] if u.startswith("TTFT attainment")]
    assert broke and f"p90 TTFT {slo['ttft_at_target_ms']:,.1f} ms breaks the 30 ms SLO" in broke[0]
    assert not any(u.startswith("TPOT") for u in slo["unmet"])


@pytest.mark.parametrize("goodput, needle", [
    (["itl:20"], "unknown SLO 'itl'"), (["ttft"], "expected ttft:MS"), (["ttft:-5"], "expected ttft:MS"),
    (["e2el:inf"], "expected e2el:MS"), (["tpot:5", "tpot:6"], "tpot is given twice"),
])
def test_bad_goodput_slos_are_one_line_before_any_run(goodput, needle, capsys, monkeypatch):
    monkeypatch.setattr("kvstate.sim._run.simulate", lambda *a, **k: pytest.fail("a simulation ran"))
    assert main(["simulate", "--quiet", "--goodput", *goodput]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_scenario_with_no_slo_at_all_is_refused():
    from kvstate._errors import ConfigError

    with pytest.raises(ConfigError, match="set at least one SLO"):
        with_overrides(Scenario(), {"slo.ttft_ms": 0.0, "slo.tpot_ms": 0.0})


def test_merged_hist_adds_counts_in_first_appearance_order():
    """Each D's inter-token gaps merge into one histogram: counts add, keys keep the order they
    first appear in (the order the mean is summed in), and no input is changed."""
    a, b, c = {0.5: 2, 0.25: 1}, {0.125: 4, 0.5: 3}, {}
    merged = merged_hist([a, b, c])
    assert merged == {0.5: 5, 0.25: 1, 0.125: 4}
    assert list(merged) == [0.5, 0.25, 0.125]
    assert a == {0.5: 2, 0.25: 1} and b == {0.125: 4, 0.5: 3}
    assert merged_hist([]) == {}


def test_weighted_stats_sums_the_mean_in_the_histograms_order():
    """The mean is the float sum of gap x count in the histogram's order, as a key-by-key loop
    makes it (a report must not change in its last digit); percentiles by nearest rank."""
    hist = {0.1: 3, 0.2: 1, 0.0003: 7, 1.7: 1}
    expect = 0.0
    for v, n in hist.items():
        expect += v * n
    s = weighted_stats(hist)
    assert s["mean"] == round(1000.0 * expect / 12, 3)
    assert (s["p50"], s["p90"], s["p99"]) == (0.3, 200.0, 1700.0)
    assert weighted_stats({}) == {"mean": None, "p50": None, "p90": None, "p99": None}
