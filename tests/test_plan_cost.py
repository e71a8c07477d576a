"""The planner's questions: cost in money (each GPU kind's price an hour, P and D on different
GPU kinds, cost per hour and per million output tokens, rows sorted by it, a recommendation per
mode) and latency percentiles asked for as ``vllm bench serve`` spells them."""
from __future__ import annotations

import math

import pytest

from kvstate._errors import ConfigError
from kvstate.app._cli import main
from kvstate.sim import Scenario, simulate, with_overrides
from kvstate.sim._capacity import plan
from kvstate.sim._gpus import GPUS

SMALL = {"workload.num_requests": 300, "workload.input_mean": 600.0, "workload.output_mean": 32.0,
         "workload.prefix_tokens": 64, "cluster.n_prefill": 1, "cluster.n_decode": 1}


def test_cost_per_hour_counts_each_role_s_gpus_at_its_own_price():
    s = with_overrides(Scenario(), {"cluster.n_prefill": 2, "cluster.tp": 2, "cluster.n_decode": 3,
                                    "cluster.d_tp": 4, "cluster.d_gpu": "H200"})
    assert s.cost_per_hour == pytest.approx(2 * 2 * GPUS["H100-SXM"]["price_per_hour"]
                                            + 3 * 4 * GPUS["H200"]["price_per_hour"])
    own = with_overrides(s, {"cluster.d_price_per_hour": 1.5})
    assert own.cost_per_hour == pytest.approx(2 * 2 * 3.95 + 3 * 4 * 1.5)
    co = with_overrides(Scenario(), {"cluster.mode": "colocated", "cluster.n_instances": 3, "gpu.price_per_hour": 2.0})
    assert co.cost_per_hour == pytest.approx(3 * 2 * 2.0)
    assert with_overrides(Scenario(), {"gpu.price_per_hour": 0.0}).cost_per_hour is None  # not known: no figure


def test_d_on_a_slower_gpu_decodes_slower_and_p_prefills_as_before():
    base = with_overrides(Scenario(), {**SMALL, "workload.rate": 8.0})
    same, slow = simulate(base), simulate(with_overrides(base, {"cluster.d_gpu": "L40S"}))
    assert slow["tpot_ms"]["p50"] > 1.5 * same["tpot_ms"]["p50"]  # L40S reads its HBM at 864 GB/s, H100 3,350
    assert slow["ttft_ms"]["p50"] == pytest.approx(same["ttft_ms"]["p50"], rel=0.25)


def test_plan_rows_carry_cost_and_sort_by_it_and_recommend_per_mode():
    base = with_overrides(Scenario(), {**SMALL, "workload.rate": 6.0, "cluster.n_instances": 2})
    res = plan(base, {"cluster.mode": ["pd", "colocated"], "cluster.d_gpu": ["", "H200"]}, workers=1)
    assert res["cost_by"] == "cost_per_hour"
    feasible = [r for r in res["rows"] if r["feasible"]]
    costs = [r["cost_per_hour"] for r in feasible]
    assert costs == sorted(costs)
    for r in feasible:
        assert r["cost_per_mtok"] == pytest.approx(r["cost_per_hour"] / (r["output_tokens_per_s"] * 3600 / 1e6),
                                                   rel=1e-3)
    assert set(res["best_by_mode"]) == {"pd", "colocated"}
    assert res["best"] is res["rows"][[r["meets_slo"] for r in res["rows"]].index(True)]


def test_without_a_price_for_every_gpu_the_plan_counts_gpus_and_says_so(capsys):
    base = with_overrides(Scenario(), {**SMALL, "workload.rate": 6.0, "gpu.price_per_hour": 0.0})
    res = plan(base, {"cluster.n_decode": [1, 2]}, workers=1)
    assert res["cost_by"] == "gpus" and all(r["cost_per_hour"] is None for r in res["rows"])
    assert main(["plan", "default", "--num-prompts", "200", "--rate", "6", "--sweep", "cluster.n_decode=1,2",
                 "--sweep", "cluster.mode=pd,colocated", "--n-instances", "2", "--set", "gpu.price_per_hour=0"]) == 0
    out = capsys.readouterr().out
    assert "cost counted in GPUs" in out and "best" in out


def test_the_recommendation_names_money_where_every_gpu_has_a_price(capsys):
    assert main(["plan", "default", "--num-prompts", "200", "--rate", "6", "--sweep", "cluster.d_gpu=,H200"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "$" in out and "cost counted in money" in out


@pytest.mark.parametrize("override, rule", [
    ({"gpu.price_per_hour": -1.0}, "price_per_hour"),
    ({"gpu.price_per_hour": math.nan}, "price_per_hour"),
    ({"gpu.price_per_hour": math.inf}, "price_per_hour"),
    ({"cluster.d_price_per_hour": -2.0}, "d_price_per_hour"),
    ({"cluster.d_gpu": "B9000"}, "d_gpu 'B9000': not a preset"),
    ({"cluster.mode": "colocated", "cluster.d_gpu": "H200"}, "d_gpu"),
])
def test_bad_prices_and_gpu_kinds_are_refused_by_name(override, rule):
    with pytest.raises(ConfigError, match=rule):
        with_overrides(Scenario(), override)


def test_percentiles_asked_as_vllm_bench_serve_spells_them_are_the_requests_own(capsys):
    import json

    import numpy as np

    from kvstate.sim._metrics import percentiles

    r = simulate(with_overrides(Scenario(), {**SMALL, "workload.rate": 8.0}))
    got = percentiles(r, ["ttft", "tpot", "itl", "e2el"], [25.0, 50.0, 90.0, 99.0, 99.9])
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        a = r["_latencies_ms"][label]
        assert got[key]["p25"] == pytest.approx(float(np.percentile(a, 25)), abs=1e-3)
        assert got[key]["p50"] == r[key]["p50"] and got[key]["p99"] == r[key]["p99"]
    assert got["itl_ms"]["p50"] == r["itl_ms"]["p50"] and got["itl_ms"]["p90"] == r["itl_ms"]["p90"]
    assert got["ttft_ms"]["p25"] <= got["ttft_ms"]["p50"] <= got["ttft_ms"]["p99.9"]
    assert main(["simulate", "default", "--num-prompts", "200", "--quiet", "--json", "--percentile-metrics",
                 "ttft,e2el", "--metric-percentiles", "50,99.9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["percentiles"]) == {"ttft_ms", "e2e_ms"} and set(out["percentiles"]["ttft_ms"]) == {"p50", "p99.9"}


@pytest.mark.parametrize("argv, rule", [
    (["--percentile-metrics", "ttft,latency"], "unknown metric 'latency'"),
    (["--metric-percentiles", "0"], "not a percentile"),
    (["--metric-percentiles", "nan"], "not a percentile"),
    (["--metric-percentiles", "50,x"], "not a percentile"),
])
def test_bad_percentile_options_are_refused_before_the_run(argv, rule, capsys):
    assert main(["simulate", "default", "--num-prompts", "200", *argv]) == 2
    assert rule in capsys.readouterr().err
