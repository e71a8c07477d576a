"""The simulator with P and D of different TP degrees: each role computes at its own degree,
the pool holds head groups both split, and it charges the bytes and objects that layout moves."""
from __future__ import annotations

import pytest
from test_sim import assert_clean, run, small

from kvstate._errors import ConfigError
from kvstate.sim import with_overrides


def test_a_pair_moves_the_bytes_of_the_same_tp_run_through_head_groups():
    same, hetero = (run(small(**kw)) for kw in ({"cluster.tp": 2}, {"cluster.tp": 4, "cluster.d_tp": 2}))
    for cl, _ in (same, hetero):
        assert_clean(cl)
    (_, rs), (ch, rh) = same, hetero
    assert rs["states"] == rh["states"] and rh["states"].get("done") == 120
    assert rs["storage"]["bytes_written"] == rh["storage"]["bytes_written"] > 0
    assert rs["storage"]["bytes_read"] == rh["storage"]["bytes_read"] > 0
    # P ranks hold one head group each, D ranks two: D asks the pool twice as often a rank
    p_spec, d_spec = ch.sv.sides["prefill"].cache_spec, ch.sv.sides["decode"].cache_spec
    assert (p_spec.tp_size, p_spec.head_groups, d_spec.tp_size, d_spec.head_groups) == (4, 1, 2, 2)
    assert ch.decode[0].side.tp == 2 and len(ch.decode[0].link_free) == 2 and len(ch.prefill[0].link_free) == 4


def test_each_role_computes_at_its_own_degree():
    base = run(small(**{"cluster.tp": 2}))[1]
    wide_d = run(small(**{"cluster.tp": 2, "cluster.d_tp": 4}))[1]
    wide_p = run(small(**{"cluster.tp": 4, "cluster.d_tp": 2}))[1]
    assert wide_d["tpot_ms"]["mean"] < 0.8 * base["tpot_ms"]["mean"]  # decode steps on 4 GPUs
    assert wide_p["ttft_ms"]["mean"] < 0.8 * base["ttft_ms"]["mean"]  # prefill on 4 GPUs
    assert abs(wide_p["tpot_ms"]["mean"] / base["tpot_ms"]["mean"] - 1) < 0.05


def test_objects_are_charged_when_the_pool_charges_them():
    free, charged = (run(small(**{"cluster.tp": 1, "cluster.d_tp": 8, "storage.object_us": us}))[1]
                     for us in (0.0, 200.0))
    assert charged["ttft_ms"]["mean"] > free["ttft_ms"]["mean"] + 1.0  # P's one rank puts 8 head groups a block


def test_the_plan_counts_each_role_s_gpus():
    s = small(**{"cluster.tp": 4, "cluster.d_tp": 2, "cluster.n_prefill": 1, "cluster.n_decode": 3})
    assert s.cluster.gpus == 10


@pytest.mark.parametrize("over,rule", [
    ({"cluster.d_tp": 3}, "d_tp"),
    ({"cluster.mode": "colocated", "cluster.d_tp": 2}, "d_tp"),
    ({"cluster.d_tp": -1}, "d_tp"),
])
def test_pairs_that_cannot_be_simulated_are_refused(over, rule):
    with pytest.raises(ConfigError, match=rule):
        with_overrides(small(), over)
