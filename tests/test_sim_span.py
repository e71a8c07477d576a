"""The D loop's fast path: event-free decode steps slept through in one wait.

It must change nothing: every report is compared, byte for byte, with the loop that wakes
at every step, on scenarios that cut spans in every way (joins, preemption, write-back,
evictions, faults, deadlines, skewed TP ranks)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.sim import Cluster, Scenario, to_json, with_overrides
from kvstate.sim._decode import DecodeInstance
from kvstate.sim._metrics import summarize
from kvstate.sim._span import StepSpan, delay_to


def step_time(batch: int, context: int) -> float:
    return 1e-3 + 1e-7 * context + 1e-5 * batch


def step_times(batch: int, context: int, count: int) -> list[float]:
    return [step_time(batch, context + i * batch) for i in range(count)]


def test_a_span_sums_its_steps_as_the_clock_does():
    span = StepSpan(0.1, 4, 1000, 5, step_times)
    t, ctx = 0.1, 1000
    for i in range(5):
        t = t + step_time(4, ctx)
        ctx += 4
        assert span.ends[i] == t
    assert span.last == 4 and span.done == 0


def test_a_cut_ends_the_span_with_the_running_step_and_never_lengthens_it():
    span = StepSpan(0.0, 2, 10, 6, step_times)
    assert span.over_at(span.ends[1]) == 2  # a step ending exactly now is over
    assert span.cut((span.ends[1] + span.ends[2]) / 2)
    assert span.last == 2
    assert not span.cut(span.ends[2])  # the step it now ends with is never counted over
    assert span.over_at(1e9) == 2


@pytest.mark.parametrize("now,when", [(0.0, 0.1), (1234.567, 1234.6000000000001), (0.3, 0.30000000000000004),
                                      (1e6 / 3, 1e6 / 3 + 1e-9)])
def test_delay_to_lands_on_the_exact_float(now, when):
    d = delay_to(now, when)
    assert now + d == when and math.isclose(d, when - now, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("now,when", [(1.9853105647502472e-06, 7.456059812186422e-06),
                                      (8774.938249588378, 29783.7144968888)])
def test_an_end_no_single_delay_reaches_is_reached_in_two(now, when):
    d = delay_to(now, when)
    assert now + math.nextafter(d, math.inf) > when  # the sums from ``now`` step over ``when``
    assert now + d < when  # so it lands just before
    t = now + d
    assert t + delay_to(t, when) == when  # and from there the rest is exact


def report(s: Scenario, sleep: bool, monkeypatch) -> tuple[str, list[DecodeInstance]]:
    monkeypatch.setattr(DecodeInstance, "sleep_quiet_steps", sleep)
    cl = Cluster(s)
    out = to_json(summarize(cl, cl.run()))
    assert sleep or sum(d.spans for d in cl.decode) == 0  # off, the loop wakes at every step
    return out, cl.decode


SMALL = {"workload.num_requests": 150, "workload.input_mean": 600.0, "workload.input_max": 4096,
         "workload.output_mean": 60.0, "workload.output_max": 400, "workload.prefix_tokens": 256}
CASES = {
    "plain": {},
    "preempt_write": {"cluster.gpu_blocks": 160, "workload.output_mean": 300.0, "workload.output_max": 600,
                      "workload.rate": 100.0, "policy.preempt": "write"},
    "preempt_swap": {"cluster.gpu_blocks": 160, "workload.output_mean": 300.0, "workload.output_max": 600,
                     "workload.rate": 100.0, "policy.preempt": "swap", "cluster.host_blocks": 40},
    "preempt_recompute": {"cluster.gpu_blocks": 160, "workload.output_mean": 300.0, "workload.output_max": 600,
                          "workload.rate": 100.0, "policy.preempt": "recompute"},
    "evictions_recompute": {"storage.capacity_gib": 0.25, "workload.rate": 200.0, "workload.prefix_groups": 0,
                            "policy.read_failure": "recompute"},
    "faults": {"faults.read_fail": 0.1, "faults.write_fail": 0.1},
    "tp4_skew": {"cluster.tp": 4, "tp.skew_ms": [0, 1, 2, 3]},
    "overload_deadlines": {"workload.rate": 400.0, "workload.input_mean": 3000.0,
                           "policy.first_token_timeout": 1.0, "policy.queue_timeout": 1.0},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sleeping_through_quiet_steps_changes_no_bit_of_the_report(case, monkeypatch):
    s = with_overrides(Scenario(), {**SMALL, **CASES[case]})
    fast, decode = report(s, True, monkeypatch)
    slow, _ = report(s, False, monkeypatch)
    assert sum(d.spans for d in decode) > 0  # the fast path ran
    assert fast == slow
    if case == "overload_deadlines":  # deadlines fired while spans ran
        assert '"first_token_timeout"' in fast and '"done"' in fast


def test_joins_cut_spans_and_the_report_still_matches(monkeypatch):
    s = with_overrides(Scenario(), {**SMALL, "workload.rate": 50.0, "workload.output_mean": 200.0})
    fast, decode = report(s, True, monkeypatch)
    assert sum(d.cuts for d in decode) > 0
    assert fast == report(s, False, monkeypatch)[0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=st.floats(5.0, 400.0), blocks=st.integers(120, 2000), out=st.floats(2.0, 300.0),
       batch=st.integers(1, 64), seed=st.integers(0, 2**16), preempt=st.sampled_from(["write", "recompute"]))
def test_random_scenarios_match_with_and_without_spans(rate, blocks, out, batch, seed, preempt, monkeypatch):
    s = with_overrides(Scenario(), {**SMALL, "workload.num_requests": 60, "workload.rate": rate,
                                    "cluster.gpu_blocks": blocks, "workload.output_mean": out,
                                    "cluster.decode_max_batch": batch, "seed": seed, "policy.preempt": preempt})
    assert report(s, True, monkeypatch)[0] == report(s, False, monkeypatch)[0]


def test_blocks_freed_cut_only_the_spans_of_ds_something_waits_at(monkeypatch):
    """Blocks coming free cut every D's span while arrivals wait in the backlog, and a D's own
    while its preempted requests wait; with nothing waiting, spans go on (a step's end would
    retry nothing). The report is still the step-by-step loop's."""
    s = with_overrides(Scenario(), {**SMALL, **CASES["preempt_write"], "workload.rate": 300.0})
    seen = {"kept": 0, "cut": 0}
    freed = Cluster._blocks_freed

    def watched(self: Cluster) -> None:
        before = [(d.cuts, d._span is not None and d._span.last > d._span.over_at(d.env.now)) for d in self.decode]
        waiting = bool(self.router.backlog)
        freed(self)
        for d, (cuts, cuttable) in zip(self.decode, before):
            if not cuttable:
                continue
            if waiting or d.preempted:
                assert d.cuts == cuts + 1
                seen["cut"] += 1
            else:
                assert d.cuts == cuts, "a span was cut with nothing waiting for blocks"
                seen["kept"] += 1

    monkeypatch.setattr(Cluster, "_blocks_freed", watched)
    fast, _ = report(s, True, monkeypatch)
    assert seen["kept"] > 0 and seen["cut"] > 0
    assert fast == report(s, False, monkeypatch)[0]


@pytest.mark.parametrize("seed,rate", [(5, 0.5), (19, 2.0)])
def test_sleeping_through_quiet_steps_changes_no_float_of_the_clock(seed, rate, monkeypatch):
    """Runs whose spans end past twice the time they began (a quiet start), where one delay
    cannot land on a span's end: every request's times and every gap stay the step-by-step
    loop's to the last bit, not only to the report's rounding."""
    s = with_overrides(Scenario(), {**SMALL, "workload.num_requests": 30, "workload.rate": rate, "seed": seed,
                                    "workload.output_mean": 300.0})

    def raw(sleep: bool) -> tuple[list, list]:
        monkeypatch.setattr(DecodeInstance, "sleep_quiet_steps", sleep)
        cl = Cluster(s)
        cl.run()
        return [(r.rid, r.first_token, r.finish) for r in cl.reqs.values()], [sorted(d.itl.items()) for d in cl.decode]

    assert raw(True) == raw(False)
