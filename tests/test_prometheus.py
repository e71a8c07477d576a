"""Prometheus metrics read from the lifecycles and backends at scrape time, and transfers timed
from the engine loop: names, labels and values against what the run did."""
from __future__ import annotations

import pytest
from lifecycle_helpers import TOKS, fill_p
from needs import has_module
from rigs import Rig

from kvstate import commands as C

pytestmark = pytest.mark.skipif(not has_module("prometheus_client"),
                                reason="needs prometheus_client (pip install 'kvstate[metrics]')")


def scrape(registry) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def answer_all(drv, role, metrics, short: int | None = None) -> None:
    """Answer every pending (command, rank), timing each; ``short``: rank 1 answers that many keys."""
    while True:
        drv.pump()
        metrics.submitted(role, {cmd.command_id: cmd for cmd in drv.pending.values()}.values())
        if not drv.pending:
            return
        for cid, rank in list(drv.pending):
            outcome = short if (short is not None and rank == 1) else None
            metrics.completed(role, [drv.complete(cid, rank, outcome)])


def rig_and_metrics():
    from prometheus_client import CollectorRegistry

    from kvstate.prometheus import KVStateCollector, TransferMetrics

    rig = Rig(tp=2)
    reg = CollectorRegistry()
    reg.register(KVStateCollector({"P": rig.P, "D": rig.D}, {"P": rig.pb, "D": rig.db}))
    return rig, reg, TransferMetrics(reg, clock=rig.clock)


def test_a_served_request_is_counted_by_state_outcome_tier_and_transfer():
    rig, reg, tm = rig_and_metrics()
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    answer_all(rig.pd, "P", tm)
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, "r", TOKS, sp.block_ids)
    m = scrape(reg)
    assert m[("kvstate_requests", (("role", "P"), ("state", "prefilling")))] == 1
    assert m[("kvstate_blocks", (("role", "P"), ("tier", "gpu"), ("use", "used")))] == 3
    rig.P.prefill_done("r", 7)
    answer_all(rig.pd, "P", tm)
    for n in rig.notices(rig.pd, C.SendFirstToken):
        rig.D.deliver_first_token(n.request_id, n.token, n.error_code)
    answer_all(rig.dd, "D", tm)
    m = scrape(reg)
    assert m[("kvstate_requests", (("role", "D"), ("state", "running")))] == 1
    assert m[("kvstate_transfers_total", (("kind", "WriteBlocks"), ("outcome", "ok"), ("role", "P")))] == 2
    assert m[("kvstate_transfers_total", (("kind", "ReadBlocks"), ("outcome", "ok"), ("role", "D")))] == 2
    assert m[("kvstate_transfer_seconds_count", (("kind", "WriteBlocks"), ("role", "P")))] == 2
    assert m[("kvstate_bytes_moved_bytes_total", (("role", "P"), ("tier", "store")))] == \
        3 * rig.spec.bytes_per_block  # three blocks, both ranks
    rig.D.finish("r")
    m = scrape(reg)
    assert m[("kvstate_requests_ended_total", (("outcome", "done"), ("role", "D")))] == 1
    assert m[("kvstate_requests_ended_total", (("outcome", "done"), ("role", "P")))] == 1
    assert m[("kvstate_blocks", (("role", "D"), ("tier", "gpu"), ("use", "used")))] == 0
    assert m[("kvstate_pinned_transfers", (("role", "D"),))] == 0
    assert tm.open_commands == 0


def test_a_short_answer_is_partial_and_a_fired_deadline_is_counted():
    rig, reg, tm = rig_and_metrics()
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    answer_all(rig.pd, "P", tm)
    rig.notices(rig.pd, C.StartPrefill)
    rig.P.prefill_done("r", 7)
    answer_all(rig.pd, "P", tm, short=1)
    m = scrape(reg)
    assert m[("kvstate_transfers_total", (("kind", "WriteBlocks"), ("outcome", "partial"), ("role", "P")))] >= 1
    rig.clock.advance(1000.0)  # D's first token never comes
    rig.D.tick()
    m = scrape(reg)
    assert m[("kvstate_deadlines_fired_total", (("role", "D"),))] >= 1


def test_the_collector_refuses_what_is_not_a_lifecycle():
    from kvstate._errors import KVStateError
    from kvstate.prometheus import KVStateCollector

    with pytest.raises(KVStateError, match="lifecycle"):
        KVStateCollector({"P": object()})
    with pytest.raises(KVStateError, match="lifecycles"):
        KVStateCollector({})
