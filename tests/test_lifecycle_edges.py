"""The lifecycle machines on real bytes: deadlines, late and stale answers, aborts, bad events."""
from __future__ import annotations

import pytest
from lifecycle_helpers import TOKS, assert_clean, deliver, fill_p, handoff, running, serve
from rigs import Rig, small_spec

from kvstate import (
    DecodeLifecycle,
    DuplicateRequestError,
    InvalidTransitionError,
    Policy,
    UnknownRequestError,
    ValidationError,
)
from kvstate import commands as C
from kvstate.events import Completion


# -- deadlines, late and stale answers ----------------------------------------------------------------
def test_silent_rank_expires_then_pins_until_grace(rig):
    notes = handoff(rig, "r")
    deliver(rig, notes)
    rig.dd.pump()
    read = next(iter(rig.dd.pending.values()))
    rig.dd.complete(read.command_id, 0)
    rig.dd.drop(read.command_id, 1)  # rank 1 never answers
    rig.clock.advance(10.01)
    rig.D.tick()
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.error_code) == ("failed", 502)
    assert rig.D.live_requests() == []
    pinned = set(read.block_ids)
    assert set(rig.D.pinned_blocks()) == pinned and rig.D.pool.num_used == len(pinned)
    rig.clock.advance(5.0)
    rig.D.tick()
    assert rig.D.pool.num_used == 0 and rig.D.counters["forced_releases"] == 1


def test_late_answer_unpins_and_stale_answer_is_ignored(rig):
    deliver(rig, handoff(rig, "r"))
    rig.dd.pump()
    read = next(iter(rig.dd.pending.values()))
    rig.dd.complete(read.command_id, 0)
    rig.clock.advance(11)
    rig.D.tick()
    assert rig.D.pool.num_used > 0
    rig.dd.complete(read.command_id, 1)  # late: recorded, unpins, changes no request
    assert rig.D.pool.num_used == 0 and rig.D.counters["late_completions"] == 1
    assert rig.D.complete(Completion(read.command_id, 1, 3)) is False
    assert rig.D.counters["stale_completions"] == 1


def test_a_lost_rank_resolves_the_transfer_at_once_and_pins_until_the_fence(rig):
    """A driver declares rank 1's process dead: the read fails now (502 under policy fail),
    and its blocks stay pinned until the fence, in case the rank was only stopped."""
    deliver(rig, handoff(rig, "r"))
    rig.dd.pump()
    read = next(iter(rig.dd.pending.values()))
    rig.dd.complete(read.command_id, 0)
    rig.dd.drop(read.command_id, 1)
    rig.clock.advance(1.0)  # well before the deadline (10 s)
    assert rig.D.complete(Completion(read.command_id, 1, 0, error="rank 1 lost", lost=True)) is True
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.error_code) == ("failed", 502) and rig.D.counters["lost_answers"] == 1
    assert set(rig.D.pinned_blocks()) == set(read.block_ids)  # pinned though every rank answered
    assert rig.D.next_deadline() == pytest.approx(read.fence)
    rig.clock.advance(read.fence - rig.clock.now - 0.01)
    rig.D.tick()
    assert rig.D.pool.num_used == len(read.block_ids)
    rig.clock.advance(0.02)
    rig.D.tick()
    assert rig.D.pool.num_used == 0 and rig.D.pinned_blocks() == {}


def test_a_lost_answer_past_the_fence_unpins_at_once(rig):
    deliver(rig, handoff(rig, "r"))
    rig.dd.pump()
    read = next(iter(rig.dd.pending.values()))
    rig.dd.complete(read.command_id, 0)
    rig.dd.drop(read.command_id, 1)
    rig.clock.advance(read.fence - rig.clock.now + 1)
    rig.D.complete(Completion(read.command_id, 1, 0, error="rank 1 lost", lost=True))
    rig.D.tick()
    assert rig.D.pool.num_used == 0


def test_completion_validation(rig):
    rig.D.reserve("r", TOKS)
    rig.D.deliver_first_token("r", 5)
    rig.dd.pump()
    read = next(iter(rig.dd.pending.values()))
    for bad in (Completion(read.command_id, 7, 1), Completion(read.command_id, 0, 99),
                Completion(read.command_id, 0, -1), Completion(read.command_id, 0, 1, lost=True),
                Completion(read.command_id, 0, 0, lost=1)):
        with pytest.raises(ValidationError):
            rig.D.complete(bad)
    rig.dd.complete(read.command_id, 0)
    with pytest.raises(ValidationError, match="already answered"):
        rig.D.complete(Completion(read.command_id, 0, 1))
    assert rig.D.state_of("r") == "reading"


# -- abort -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["waiting", "reading_prefix", "prefilling", "writing"])
def test_abort_prefill_in_every_state_frees_after_transfer(stage):
    rig = Rig(blocks=3, policy=Policy(transfer_timeout=10.0))
    if stage == "waiting":
        rig.P.admit("hog", TOKS)
    rig.P.admit("r", TOKS)
    rig.pd.pump()
    if stage not in ("waiting", "reading_prefix"):
        for (cid, rank) in list(rig.pd.pending):
            rig.pd.complete(cid, rank)
        rig.pd.pump()
        if stage == "writing":
            rig.P.prefill_done("r", 1)
            rig.pd.pump()
    assert rig.P.state_of("r") == stage
    rig.P.abort("r")
    [end] = [n for n in rig.notices(rig.pd, C.RequestEnded) if n.request_id == "r"]
    assert (end.state, end.error_code) == ("aborted", 499)
    assert "r" not in rig.P.live_requests()
    pinned = rig.P.pinned_blocks()
    assert rig.P.pool.num_used == len(set(pinned) | set(rig.P.blocks_of("hog") if stage == "waiting" else ()))
    for (cid, rank) in list(rig.pd.pending):
        rig.pd.complete(cid, rank)
    if stage == "waiting":
        rig.P.abort("hog")
    assert rig.P.pool.num_used == 0


def test_abort_mid_read_keeps_blocks_until_read_answers(rig):
    deliver(rig, handoff(rig, "r"))
    rig.dd.pump()
    blocks = set(rig.D.blocks_of("r"))
    rig.D.abort("r")
    assert rig.D.pool.num_used == len(next(iter(rig.dd.pending.values())).block_ids)
    assert all(rig.D.pool.refcount(b) == 1 for b in rig.D.pinned_blocks())
    pinned = set(rig.D.pinned_blocks())
    assert pinned and pinned <= blocks
    rig.D.reserve("other", list(range(4 * 60)))  # takes every free block, never a pinned one
    assert pinned.isdisjoint(rig.D.blocks_of("other"))
    rig.dd.run_until_idle()
    rig.D.abort("other")
    assert_clean(rig)


# -- bad events change nothing -------------------------------------------------------------------
def test_unknown_and_recycled_requests(rig):
    with pytest.raises(UnknownRequestError, match="unknown"):
        rig.D.finish("nope")
    for call in (lambda: rig.D.deliver_first_token("nope", 1), lambda: rig.P.prefill_done("nope", 1),
                 lambda: rig.D.recompute_done("nope"), lambda: rig.D.abort("nope")):
        with pytest.raises(UnknownRequestError, match="'nope' is unknown"):
            call()  # an id never seen is a bug of the caller, not a late event
    running(rig)
    rig.D.finish("r")
    with pytest.raises(UnknownRequestError, match="already ended"):
        rig.D.finish("r")  # the scheduler's own actions on an ended request are its bug


def test_late_events_for_ended_requests_are_dropped_and_counted():
    """D's first-token deadline fires while P still computes: P's first token, a late
    abort and a late recompute result change nothing, are counted and reported."""
    rig = Rig(first_token_timeout=3.0)
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    rig.pd.run_until_idle()
    rig.clock.advance(3.5)
    rig.D.tick()
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.reason) == ("failed", "first_token_timeout")
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, "r", TOKS, sp.block_ids)
    assert rig.P.prefill_done("r", 7) is True
    rig.pd.run_until_idle()
    [ft] = rig.notices(rig.pd, C.SendFirstToken)
    before = snapshot_d(rig)
    assert rig.D.deliver_first_token("r", ft.token, ft.error_code) is False
    assert rig.D.abort("r") is False
    assert rig.D.recompute_done("r") is False
    assert rig.P.abort("r") is False and rig.P.prefill_done("r", 1) is False
    assert snapshot_d(rig) == before
    assert rig.D.stats()["late_events"] == 3 and rig.P.stats()["late_events"] == 2
    late = rig.notices(rig.dd, C.LateEvent)
    assert [(n.event, n.ended) for n in late] == [("first_token", "failed"), ("abort", "failed"),
                                                   ("recompute_done", "failed")]
    assert_clean(rig)


def snapshot_d(rig):
    return (rig.D.live_requests(), rig.D.pool.stats(), rig.D.pending_commands())


def test_prefill_queue_deadline_fails_and_tells_d():
    """A prompt waiting for P's blocks past Policy.queue_timeout fails (504, queue_timeout),
    its first token carries the error, and D ends it at once with the derived reason."""
    rig = Rig(blocks=4, policy=Policy(read_prefix=False, queue_timeout=2.0, transfer_timeout=10.0,
                                      fence_grace=5.0))
    rig.D.reserve("b", TOKS)
    assert rig.P.admit("a", TOKS) == "prefilling"
    assert rig.P.admit("b", TOKS) == "waiting"
    assert rig.P.next_deadline() == 2.0
    rig.clock.advance(1.9)
    assert rig.P.tick() == 0 and rig.P.state_of("b") == "waiting"
    rig.clock.advance(0.1)
    assert rig.P.tick() == 1
    [ft] = rig.notices(rig.pd, C.SendFirstToken)
    [end] = rig.notices(rig.pd, C.RequestEnded)
    assert (ft.request_id, ft.token, ft.error_code) == ("b", None, 504)
    assert (end.request_id, end.state, end.reason, end.block_ids) == ("b", "failed", "queue_timeout", ())
    rig.D.deliver_first_token("b", ft.token, ft.error_code)
    [dend] = rig.notices(rig.dd, C.RequestEnded)
    assert (dend.state, dend.error_code, dend.reason) == ("failed", 504, "prefill_queue_timeout")
    rig.P.abort("a")  # frees its blocks: the timed-out request does not start
    assert rig.P.live_requests() == [] and rig.P.pool.num_used == 0


def test_a_request_that_got_blocks_has_no_queue_deadline():
    rig = Rig(blocks=4, policy=Policy(read_prefix=False, queue_timeout=2.0))
    rig.P.admit("a", TOKS)
    rig.P.admit("b", TOKS)
    rig.P.abort("a")
    assert rig.P.state_of("b") == "prefilling"
    assert rig.P.next_deadline() is None  # the wait timer went with the wait
    rig.clock.advance(5.0)
    assert rig.P.tick() == 0 and rig.P.state_of("b") == "prefilling"


def test_next_deadline_is_the_time_tick_next_has_work():
    rig = Rig(first_token_timeout=50.0)  # transfer_timeout 10, fence_grace 5
    assert rig.D.next_deadline() is None
    rig.D.reserve("r", TOKS)
    assert rig.D.next_deadline() == 50.0
    rig.clock.advance(1.0)
    rig.D.deliver_first_token("r", 9)  # the wait ends; a read goes out at t=1 (deadline 11)
    rig.dd.pump()
    assert rig.D.next_deadline() == 11.0
    rig.clock.advance(10.0)
    assert rig.D.tick() == 1  # the silent read expires exactly at its deadline ...
    assert rig.D.next_deadline() == 16.0  # ... and its pins at the fence
    rig.clock.advance(5.0)
    assert rig.D.tick() == 1 and rig.D.next_deadline() is None
    assert_clean(rig)


def test_terminal_reasons_of_every_end():
    rig = Rig(policy=Policy(read_failure="fail", transfer_timeout=10.0, fence_grace=5.0))
    serve(rig, "ok")
    ends = {n.request_id: n for n in rig.notices(rig.dd, C.RequestEnded)}
    assert ends["ok"].reason == "done"
    rig.D.reserve("miss", [t + 1000 for t in TOKS])
    rig.D.deliver_first_token("miss", 3)  # nothing was stored for these tokens: the read misses
    rig.dd.run_until_idle()
    rig.D.reserve("gone", TOKS)
    rig.D.abort("gone")
    rig.D.reserve("p503", TOKS)
    rig.D.deliver_first_token("p503", None, 503)
    ends = {n.request_id: (n.state, n.error_code, n.reason) for n in rig.notices(rig.dd, C.RequestEnded)}
    assert ends == {"miss": ("failed", 502, "read_failed"), "gone": ("aborted", 499, "aborted"),
                    "p503": ("failed", 503, "prefill_write_failed")}


def test_illegal_event_names_request_state_and_changes_nothing(rig):
    rig.D.reserve("r", TOKS)
    before = (rig.D.state_of("r"), rig.D.blocks_of("r"), rig.D.pool.stats())
    for call in (lambda: rig.D.finish("r"), lambda: rig.D.resume("r"), lambda: rig.D.preempt("r"),
                 lambda: rig.D.append_tokens("r", [1])):
        with pytest.raises(InvalidTransitionError, match="'r' is in state 'reserved'"):
            call()
    assert (rig.D.state_of("r"), rig.D.blocks_of("r"), rig.D.pool.stats()) == before
    rig.D.deliver_first_token("r", 3)
    with pytest.raises(InvalidTransitionError):
        rig.D.deliver_first_token("r", 3)  # duplicate first token
    assert rig.D.state_of("r") == "reading"


@pytest.mark.parametrize("call,err", [
    (lambda r: r.P.admit("", TOKS), ValidationError),
    (lambda r: r.P.admit(5, TOKS), ValidationError),
    (lambda r: r.P.admit("x", []), ValidationError),
    (lambda r: r.P.admit("x", [1, -2]), ValidationError),
    (lambda r: r.P.admit("x", [1.0]), ValidationError),
    (lambda r: r.P.admit("x", "abc"), ValidationError),
    (lambda r: r.P.admit("x", list(range(4 * 65))), ValidationError),  # can never fit the pool
    (lambda r: r.P.admit("x", TOKS, extra_keys={9: ["m"]}), ValidationError),
    (lambda r: r.D.reserve("x", [True, "a"]), ValidationError),
    (lambda r: r.D.can_reserve(0), ValidationError),
])
def test_bad_arguments_rejected_before_any_change(rig, call, err):
    before = (rig.P.pool.stats(), rig.D.pool.stats(), rig.P.live_requests(), rig.D.live_requests())
    with pytest.raises(err):
        call(rig)
    assert before == (rig.P.pool.stats(), rig.D.pool.stats(), rig.P.live_requests(), rig.D.live_requests())


def test_duplicate_request_id(rig):
    rig.P.admit("x", TOKS)
    with pytest.raises(DuplicateRequestError, match="'x' is already live"):
        rig.P.admit("x", TOKS)


def test_caller_token_list_is_not_mutated(rig):
    toks = list(TOKS)
    rig.D.reserve("r", toks)
    rig.D.deliver_first_token("r", 9)
    rig.dd.run_until_idle()
    assert toks == TOKS


def test_deadlines_fire_in_order_even_when_the_clock_steps_back(clock):
    """Timers sit in one FIFO per kind; a clock that goes back must not hide an earlier deadline
    behind a later one."""
    D = DecodeLifecycle(small_spec(), 32, Policy(transfer_timeout=10.0, fence_grace=5.0, first_token_timeout=20.0),
                        clock=clock)
    clock.now = 100.0
    D.reserve("late", [1, 2, 3])  # its first-token deadline: 120
    clock.now = 50.0  # the clock steps back
    D.reserve("early", [1, 2, 3])  # deadline 70, queued behind 120
    clock.now = 80.0
    assert D.tick() == 1
    assert D.live_requests() == ["late"] and D.counters["failed"] == 1
    clock.now = 121.0
    assert D.tick() == 1 and D.live_requests() == []


def test_request_ended_reports_the_released_blocks_and_preemption_frees_with_a_notice(rig):
    blocks = rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, "r", TOKS, sp.block_ids)
    rig.P.prefill_done("r", 7)
    rig.pd.run_until_idle()
    p_notes = rig.notices(rig.pd)
    assert not [n for n in p_notes if isinstance(n, C.FreeBlocks)]
    [p_end] = [n for n in p_notes if isinstance(n, C.RequestEnded)]
    assert p_end.block_ids == sp.block_ids and p_end.state == "done"
    deliver(rig, p_notes)
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    rig.D.preempt("r")  # default policy writes the cache back first, then frees with a notice
    rig.dd.run_until_idle()
    [free] = rig.notices(rig.dd, C.FreeBlocks)
    assert free.block_ids == blocks and rig.D.state_of("r") == "preempted"
    rig.D.abort("r")
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert end.block_ids == () and end.state == "aborted"
