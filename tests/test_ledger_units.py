"""The process driver's ledger and rank table, in one process, every figure exact.

The ledger is what a driver owes its lifecycle: which ranks still owe each command an answer,
the layer arrivals of layer-wise loads, the commands held for a rank being restarted. These
cases drive it with a real :class:`RankTable` and hand-made worker answers, no sockets and no
processes, so each rule of its docstring is pinned where a worker process would hide it.
"""
from __future__ import annotations

import time

import pytest

from kvstate import commands as C
from kvstate._errors import ValidationError
from kvstate.distributed import _wire as wire
from kvstate.distributed._ledger import Ledger
from kvstate.distributed._liveness import RankTable
from kvstate.events import Completion

INC = (101, 202)  # the two ranks' incarnations


def cmd(cid: int, cls: type = C.WriteBlocks, keys: tuple[str, ...] = ("a", "b"), fence_in: float = 30.0,
        ranks: tuple[int, ...] = (0, 1)) -> C.TransferCommand:
    now = time.monotonic()
    return cls("r", cid, ranks, now + 10, keys, tuple(range(len(keys))), fence=now + fence_in)


def ledger(up: tuple[int, ...] = (0, 1), restarting: tuple[int, ...] = (), lanes: int = 2) -> Ledger:
    table = RankTable(2)
    for r in up:
        table.up(r, INC[r], 1000 + r, 0.0, lanes)
    counters = {"stale": 0, "bad_messages": 0, "lost": 0}
    return Ledger(table, layers=4, restarting=lambda r: r in restarting, counters=counters)


def done(rank: int, cid: int, leading: int = 2, error: str | None = None, inc: int | None = None) -> wire.Done:
    return wire.Done(rank, INC[rank] if inc is None else inc, cid, leading, error)


def test_a_command_is_owed_by_every_up_rank_and_sent_to_its_least_loaded_lane():
    led = ledger()
    sends, down = led.register(cmd(1))
    assert down == [] and led.inflight == 2
    assert [(r, lane, cid) for r, lane, cid, _ in sends] == [(0, 0, 1), (1, 0, 1)]
    back = wire.command_of(wire.unpack(sends[1][3]), 1)
    assert wire.unpack(sends[1][3])[1] == INC[1] and back.command_id == 1 and back.ranks == (1,)
    sends, _ = led.register(cmd(2))
    assert [(r, lane) for r, lane, _, _ in sends] == [(0, 1), (1, 1)]  # lane 0 owes one already
    assert led.owing(1) == [(0, INC[0], 0), (1, INC[1], 0)]
    with pytest.raises(ValidationError, match="command 1 was submitted already"):
        led.register(cmd(1))
    assert led.inflight == 4


def test_a_down_rank_is_reported_and_owes_nothing():
    led = ledger(up=(0,))
    sends, down = led.register(cmd(3))
    assert down == [1] and [r for r, *_ in sends] == [0] and led.inflight == 1
    assert led.owing(3) == [(0, INC[0], 0)]
    sends, down = ledger(up=()).register(cmd(4))
    assert (sends, down) == ([], [0, 1])


def test_answers_settle_once_and_the_last_one_forgets_the_command():
    led = ledger()
    led.register(cmd(5))
    assert led.answered(done(0, 5)) == Completion(5, 0, 2, error=None)
    assert led.inflight == 1 and led.owing(5) == [(1, INC[1], 0)]
    assert led.answered(done(0, 5)) is None and led.counters["stale"] == 1  # a second answer
    assert led.answered(done(1, 5, leading=1, error="short")) == Completion(5, 1, 1, error="short")
    assert led.inflight == 0 and led.owing(5) == []
    assert led.answered(done(1, 5)) is None and led.counters["stale"] == 2  # the command is gone
    assert led.ranks.owed(0) == [] and led.ranks.owed(1) == []


def test_an_answer_from_another_incarnation_is_refused_and_one_past_the_keys_fails_its_rank():
    """A worker sends one answer a command: one of more blocks than the command has keys is
    counted and settles its rank as failed (waiting for another would hold the command to its
    deadline); a second answer then is stale."""
    led = ledger()
    led.register(cmd(6))
    assert led.answered(done(0, 6, inc=999)) is None
    assert led.counters == {"stale": 1, "bad_messages": 0, "lost": 0}
    got = led.answered(done(0, 6, leading=3))  # 3 leading blocks of 2 keys
    assert got == Completion(6, 0, 0, error="rank 0 answered 3 leading blocks of command 6, which has 2 keys")
    assert led.counters == {"stale": 1, "bad_messages": 1, "lost": 0}
    assert led.inflight == 1 and led.owing(6) == [(1, INC[1], 0)]
    assert led.answered(done(0, 6, leading=2)) is None and led.counters["stale"] == 2
    assert led.answered(done(1, 6, leading=2)) == Completion(6, 1, 2)
    assert led.inflight == 0 and led.owing(6) == []


def test_a_lost_rank_answers_a_failure_once_and_keeps_the_pins_when_asked():
    led = ledger()
    led.register(cmd(7))
    assert led.lost(0, 7, "worker down", lost=True) == Completion(7, 0, 0, error="worker down", lost=True)
    assert led.counters["lost"] == 1 and led.inflight == 1 and led.owing(7) == [(1, INC[1], 0)]
    assert led.lost(0, 7, "again", lost=True) is None and led.counters["lost"] == 1  # owes nothing now
    assert led.lost(1, 7, "timed out", lost=False) == Completion(7, 1, 0, error="timed out", lost=False)
    assert led.counters["lost"] == 2 and led.inflight == 0 and led.owing(7) == []
    assert led.lost(1, 99, "never sent", lost=True) is None and led.counters["lost"] == 2
    assert led.answered(done(1, 7)) is None  # a late answer after the loss is stale


def test_a_layer_wise_loads_arrivals_are_kept_per_rank_until_it_answers_or_is_lost():
    led = ledger()
    led.register(cmd(8, C.LoadLayers))
    a0, a1 = led.arrivals(8, 0), led.arrivals(8, 1)
    assert a0 is not None and a1 is not None and a0 is not a1
    led.arrived(0, INC[0], 8, 2)
    led.arrived(1, 999, 8, 3)  # an earlier incarnation's report: ignored
    assert (a0.layers, a1.layers) == (2, 0)
    assert led.answered(done(0, 8, leading=2)) == Completion(8, 0, 2)
    assert a0.layers == 4 and a0.closed and led.arrivals(8, 0) is None  # read whole: every layer arrived
    assert led.lost(1, 8, "down", lost=True) is not None
    assert a1.closed and a1.layers == 0 and led.arrivals(8, 1) is None
    led.arrived(1, INC[1], 8, 4)  # after the end: nobody keeps it
    assert a1.layers == 0
    led.register(cmd(9, C.LoadLayers))
    a = led.arrivals(9, 0)
    assert led.answered(done(0, 9, leading=1)) == Completion(9, 0, 1)
    assert a.closed and a.layers == 0  # a partial read: its missing layers never arrive
    assert led.arrivals(9, 1) is not None and led.arrivals(10, 0) is None


def test_a_restarting_rank_holds_its_commands_in_order_until_it_is_up():
    led = ledger(up=(0,), restarting=(1,))
    sends, down = led.register(cmd(10))
    assert down == [] and [r for r, *_ in sends] == [0] and led.inflight == 2
    led.register(cmd(11, fence_in=-1.0))  # its fence passes before the rank is back
    led.register(cmd(12))
    assert led.owing(10)[1] == (1, 0, None)  # owed, on no lane yet
    led.ranks.up(1, INC[1], 1001, 0.0, 2)
    sends, expired = led.release_held(1)
    assert [(r, lane, cid) for r, lane, cid, _ in sends] == [(1, 0, 10), (1, 1, 12)] and expired == [11]
    assert wire.unpack(sends[0][3])[1] == INC[1]
    assert led.release_held(1) == ([], [])  # nothing held twice


def test_a_command_behind_held_ones_is_held_too_even_when_the_rank_is_up():
    led = ledger(up=(0,), restarting=(1,))
    led.register(cmd(13))
    led.ranks.up(1, INC[1], 1001, 0.0, 1)  # up, but its held commands not yet released
    sends, _ = led.register(cmd(14))
    assert [r for r, *_ in sends] == [0]  # rank 1 gets it after 13, in order
    sends, _ = led.release_held(1)
    assert [cid for _, _, cid, _ in sends] == [13, 14]


def test_held_commands_of_a_rank_still_down_expire_and_answered_ones_are_skipped():
    led = ledger(up=(0,), restarting=(1,))
    led.register(cmd(15))
    led.register(cmd(16))
    assert led.lost(1, 16, "cancelled", lost=False) is not None  # settled while held
    sends, expired = led.release_held(1)  # the rank is still down: nothing can go
    assert sends == [] and expired == [15]


def test_a_cancel_drops_a_held_command_from_every_rank_holding_it():
    led = ledger(up=(), restarting=(0, 1))
    led.register(cmd(17))
    led.register(cmd(18))
    assert led.drop_held(17) == [0, 1]
    assert led.drop_held(17) == [] and led.drop_held(99) == []
    for r in (0, 1):
        led.ranks.up(r, INC[r], 1000 + r, 0.0, 1)
    assert [cid for _, _, cid, _ in led.release_held(0)[0]] == [18]
    assert [cid for _, _, cid, _ in led.release_held(1)[0]] == [18]


def test_the_rank_table_counts_faults_armed_reads_and_bytes_over_incarnations():
    table = RankTable(2)
    table.up(0, 5, 77, 1.0, 3)
    table.seen(0, 2.0, moved=100, counts=(1, 2, 3, 0, 1))
    table.seen(1, 2.0, moved=7, counts=(0, 0, 1, 0, 1))
    assert table.counts() == (1, 2, 4, 0, 2) and table.bytes_moved() == 107
    assert [table.owe(0, c) for c in (1, 2, 3, 4)] == [0, 1, 2, 0]
    table.paid(0, 2)
    assert table.owe(0, 5) == 1 and table.lane_of(0, 5) == 1 and table.lanes(0) == 3
    assert table.down_now(0) == [1, 3, 4, 5]
    assert table.incarnation(0) == 0 and table.owed(0) == [] and table.lanes(0) == 0
    table.up(0, 6, 78, 3.0, 1)
    table.seen(0, 4.0, moved=10, counts=(1, 0, 0, 0, 1))
    assert table.counts() == (2, 2, 4, 0, 3) and table.bytes_moved() == 117  # the first incarnation's kept
    assert table.live() == [(0, 6, 4.0)] and table.down() == [1] and table.pid(0) == 78
    table.refuse(1, "geometry differs")
    assert table.refusals() == ["geometry differs"]
    table.up(1, 9, 79, 5.0, 1)
    assert table.refusals() == []  # an accepted hello clears the refusal


def test_each_command_goes_to_the_lane_owing_fewest_as_answers_come_and_go():
    table = RankTable(1)
    table.up(0, 5, 77, 0.0, 2)
    lanes = [table.owe(0, 1), table.owe(0, 2), table.owe(0, 3)]  # loads [2, 1]
    table.paid(0, 1)  # [1, 1]
    lanes.append(table.owe(0, 4))  # [2, 1]
    table.paid(0, 2)  # [2, 0]
    table.paid(0, 4)  # [1, 0]
    lanes += [table.owe(0, c) for c in (5, 6, 7)]
    assert lanes == [0, 1, 0, 0, 1, 0, 1]
    table.paid(0, 99)  # never owed: nothing changes
    assert table.owed(0) == [3, 5, 6, 7] and [table.lane_of(0, c) for c in (3, 5, 6, 7)] == [0, 1, 0, 1]


def test_a_held_command_answered_meanwhile_is_skipped_and_the_next_goes_to_a_lane_it_owes_on():
    lg = ledger(up=(), restarting=(0,))
    for cid in (1, 2):
        assert lg.register(cmd(cid, ranks=(0,))) == ([], [])  # held: rank 0 is on its way
    assert lg.lost(0, 1, "cancelled while its rank restarted", False) is not None  # answered, still in the hold
    lg.ranks.up(0, INC[0], 1000, 0.0, 2)
    sends, expired = lg.release_held(0)
    assert [(r, cid) for r, _, cid, _ in sends] == [(0, 2)] and expired == []
    ((_, lane, _, _),) = sends
    assert lg.owing(2) == [(0, INC[0], lane)] and lane is not None


def test_an_answer_counts_as_hearing_from_its_rank():
    lg = ledger()
    lg.register(cmd(3))
    t = time.monotonic()
    lg.answered(done(0, 3))
    assert [(r, last >= t) for r, _, last in lg.ranks.live()] == [(0, True), (1, False)]


def test_a_rank_down_keeps_what_it_moved_and_saw_and_starts_again_from_zero():
    table = RankTable(2)
    table.up(0, 7, 1000, 0.0, 1)
    table.seen(0, 1.0, moved=100, counts=(1, 2, 3, 0, 1))
    table.down_now(0)
    assert table.bytes_moved() == 100 and table.counts()[:3] == (1, 2, 3)
    table.up(0, 8, 1001, 2.0, 1)
    assert table.bytes_moved() == 100 and table.counts()[:3] == (1, 2, 3)  # the new incarnation: nothing yet
    table.seen(0, 3.0, moved=5, counts=(0, 1, 0, 0, 1))
    assert table.bytes_moved() == 105 and table.counts() == (1, 3, 3, 0, 2)
