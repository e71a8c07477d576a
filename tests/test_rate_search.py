"""The highest rate a configuration holds (kvstate/sim/_capacity.py, ``plan --search-rate``)."""
from __future__ import annotations

import json

import pytest

from kvstate._errors import ConfigError
from kvstate.app._cli import main
from kvstate.sim import Scenario, simulate, with_overrides
from kvstate.sim._capacity import PRECISION, highest_rate
from kvstate.sim._metrics import verdict_of

SMALL = {"workload.num_requests": 300, "workload.input_mean": 600.0, "workload.output_mean": 32.0,
         "workload.prefix_tokens": 64, "cluster.n_prefill": 1, "cluster.n_decode": 1}


@pytest.mark.slow
def test_the_rate_found_holds_and_the_next_one_up_does_not():
    s = with_overrides(Scenario(), SMALL)
    found = highest_rate(s)
    best, p = found["max_rate_rps"], found["max_rate_precision"]
    assert best > 0 and 0 < p <= PRECISION
    probes = {pr["rate_rps"]: pr["verdict"] for pr in found["probes"]}
    assert probes[best] == "meets"
    above = min(r for r in probes if r > best)
    assert probes[above] != "meets" and above / best - 1 == pytest.approx(p, abs=1e-3)
    duration = 300 / 40.0  # every probe offers its rate as long as the target's run did
    n = max(300, round(best * duration))
    again = simulate(with_overrides(s, {"workload.rate": best, "workload.num_requests": n}))
    assert verdict_of(again["slo"]) in ("meets", "too short")  # the same probe, run again


def test_a_configuration_that_holds_nothing_near_the_target_answers_a_low_rate_or_zero():
    s = with_overrides(Scenario(), {**SMALL, "slo.ttft_ms": 1.0})  # no TTFT is that short
    found = highest_rate(s)
    assert found["max_rate_rps"] == 0.0 and found["max_rate_precision"] is None
    assert all(p["verdict"] != "meets" for p in found["probes"])


@pytest.mark.parametrize("precision", [0, 1.5, float("nan"), True])
def test_a_precision_outside_zero_to_one_is_refused(precision):
    with pytest.raises(ConfigError, match="precision must be within"):
        highest_rate(with_overrides(Scenario(), SMALL), precision=precision)


@pytest.mark.slow
def test_plan_search_rate_gives_every_row_its_highest_rate_and_breaks_ties_by_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--quiet", "--search-rate", "--workers", "2", "--out", str(out), "--sweep", "cluster.n_decode=1,2",
            *[f"--set={k}={v}" for k, v in SMALL.items() if k != "cluster.n_decode"]]
    assert main(argv) in (0, 1, 4)
    res = json.loads(out.read_text())
    rows = {r["config"]["cluster.n_decode"]: r for r in res["rows"]}
    assert all(r["max_rate_rps"] > 0 and r["rate_probes"] >= 3 for r in rows.values())
    assert rows[2]["max_rate_rps"] >= rows[1]["max_rate_rps"]  # a second D holds at least as much
    assert res["ties_broken_by"] == "max_rate_rps"
    text = capsys.readouterr().out
    assert "max rate" in text and "ties broken by the highest rate held" in text or "no configuration" in text
