"""The process driver's control side without processes: the restart back-off and the rank
report, every figure exact; and the driver's answers with a fake worker (a lane, a reply and
a control socket in the test's process): goodbyes owing commands, cancels and layer reports
to their lane, stale and bad answers dropped."""
from __future__ import annotations

import threading
import time

import pytest
from fakeworker import FakeWorker, answers, write_command

from kvstate._errors import ConfigError, DriverError
from kvstate._spec import CacheSpec
from kvstate.distributed import ProcessDriver
from kvstate.distributed import _wire as wire
from kvstate.distributed._control import RankControl, RestartBackoff
from kvstate.distributed._liveness import RankDown, RankTable, RankUp


@pytest.mark.parametrize("starts, delay", [(0, 0.25), (1, 0.25), (2, 0.5), (3, 1.0), (4, 2.0), (5, 4.0), (6, 5.0),
                                           (40, 5.0)])
def test_a_worker_that_never_says_hello_is_started_again_later_each_time_up_to_5_s(starts, delay):
    b = RestartBackoff()
    for i in range(starts):
        b.started(0, 100.0 + i)
    assert b.delay(0) == delay and b.delay(1) == 0.25
    last = 100.0 + max(starts - 1, 0) if starts else 0.0
    assert b.may_start(0, last + delay) and not b.may_start(0, last + delay - 1e-6)


def test_a_hello_ends_the_back_off_but_the_last_start_still_counts():
    b = RestartBackoff()
    for t in (10.0, 11.0, 13.0):
        b.started(3, t)
    assert b.delay(3) == 1.0
    b.hello(3)
    assert b.delay(3) == 0.25 and b.may_start(3, 13.25) and not b.may_start(3, 13.2)
    b.started(3, 20.0)
    assert b.delay(3) == 0.25  # one start since the hello
    assert b.may_start(7, 0.25) and not b.may_start(7, 0.2)  # never started: from time 0


def test_the_rank_report_names_up_and_down_ranks():
    ranks = RankTable(3)
    ranks.up(1, 5, 4242, 0.0, 1)
    ctl = RankControl(CacheSpec(2, 1, 4, 8), "g", heartbeat_s=0.1, dead_after_s=1.0, restart=False, ranks=ranks,
                      lock=threading.Lock(), counters={}, send=lambda *a: True, on_down=lambda *a: None,
                      on_up=lambda r: None, on_arrived=lambda *a: None, name="test")
    assert ctl.info() == {"up": [1], "down": [0, 2], "pids": {}}  # it started no worker itself


def test_a_hello_from_a_rank_never_started_here_waits_from_time_0():
    b = RestartBackoff()
    b.hello(2)  # a worker the engine started itself
    assert b.delay(2) == 0.25 and b.may_start(2, 0.25) and not b.may_start(2, 0.24)


def test_waiting_for_ranks_that_never_say_hello_names_them_at_the_deadline():
    with ProcessDriver(CacheSpec(2, 1, 4, 8, tp_size=2), 4) as drv:
        t = time.monotonic()
        with pytest.raises(DriverError) as e:
            drv.wait_ready(0.2)
        assert 0.2 <= time.monotonic() - t < 1.0  # it looks often, not once a second
    assert str(e.value) == "ProcessDriver kvstate: ranks [0, 1] did not say hello within 0.2 s"


SPEC2 = CacheSpec(2, 1, 4, 8, tp_size=2)


class Rig:
    """A RankControl fed control messages by hand; what it sends and reports is recorded."""

    def __init__(self, secret: str = "s3") -> None:
        self.sent, self.downs, self.ups, self.arrived = [], [], [], []
        self.ranks = RankTable(2)
        self.counters = dict.fromkeys(("stale", "bad_messages", "refused", "foreign_hellos",
                                       "unauthenticated_hellos", "restarts"), 0)
        self.geometry = wire.geometry(SPEC2, 4)
        self.ctl = RankControl(SPEC2, self.geometry, heartbeat_s=0.1, dead_after_s=1.0, restart=False,
                               ranks=self.ranks, lock=threading.Lock(), counters=self.counters,
                               send=lambda r, lane, m: self.sent.append((r, lane, wire.unpack(m))) or True,
                               on_down=lambda r, owed, why, lost: self.downs.append((r, owed, why, lost)),
                               on_up=self.ups.append, on_arrived=lambda *a: self.arrived.append(a),
                               name="ctl", secret=secret)

    def hello(self, rank: int, inc: int, secret: str = "s3", geometry: str | None = None, tp: int = 2,
              lanes: int = 2) -> None:
        self.ctl.receive(wire.pack(wire.HELLO, rank, inc, 900 + rank, tp, geometry or self.geometry, lanes, secret))


def test_a_hello_with_the_secret_is_welcomed_on_every_lane_and_the_rank_is_up():
    rig = Rig()
    for t in (1.0, 2.0, 3.0):
        rig.ctl.backoff.started(1, t)  # a worker that failed to come up twice before
    before = time.monotonic()
    rig.hello(1, 55)
    assert rig.sent == [(1, 1, [wire.WELCOME, 55]), (1, 0, [wire.WELCOME, 55])]
    assert rig.ranks.incarnation(1) == 55 and rig.ranks.lanes(1) == 2 and rig.ups == [1]
    assert rig.ranks.pid(1) == 901 and rig.ranks.live()[0][:2] == (1, 55) and rig.ranks.live()[0][2] >= before
    (up,) = rig.ctl.notices()
    assert type(up) is RankUp and (up.rank, up.pid) == (1, 901) and up.at >= before
    assert rig.ctl.backoff.delay(1) == 0.25  # it came up: the back-off starts over
    rig.hello(1, 55)  # repeated: the welcome crossed it
    rig.hello(1, 56)  # another worker for a live rank: dropped, never answered
    rig.hello(1, 57)
    assert len(rig.sent) == 2 and rig.counters["foreign_hellos"] == 2 and rig.ranks.incarnation(1) == 55


def test_hellos_without_the_secret_or_with_another_geometry_are_refused_their_way():
    rig = Rig()
    rig.hello(0, 7, secret="guess")
    rig.hello(0, 7, secret="")
    assert rig.sent == [] and rig.counters["unauthenticated_hellos"] == 2 and rig.ranks.incarnation(0) == 0
    rig.hello(0, 8, tp=4)
    assert rig.sent == [(0, 0, [wire.REFUSE, 8, "rank 0's worker has TP 4, the scheduler 2"])]
    rig.hello(1, 9, geometry="other")
    assert rig.sent[-1] == (1, 0, [wire.REFUSE, 9, f"rank 1's worker has another cache geometry: other against "
                                                   f"the scheduler's {rig.geometry}"])
    assert rig.counters["refused"] == 2 and rig.ranks.down() == [0, 1] and rig.ups == []


def test_heartbeats_count_for_the_current_incarnation_and_a_stopped_one_is_asked_to_rejoin():
    rig = Rig()
    rig.hello(0, 5)
    rig.sent.clear()
    before = time.monotonic()
    rig.ctl.receive(wire.pack(wire.HB, 0, 5, 4096, [1, 0, 2, 0, 0]))
    assert rig.ranks.bytes_moved() == 4096 and rig.ranks.counts() == (1, 0, 2, 0, 0) and rig.counters["stale"] == 0
    assert rig.ranks.live()[0][2] >= before  # heard from now
    rig.ctl.receive(wire.pack(wire.HB, 0, 6, 1, [0, 0, 0, 0, 0]))  # another incarnation of a live rank
    assert rig.counters["stale"] == 1 and rig.sent == [] and rig.ranks.bytes_moved() == 4096
    rig.ctl.receive(wire.pack(wire.HB, 1, 3, 1, [0, 0, 0, 0, 0]))  # a rank declared dead that lives on
    assert rig.counters["stale"] == 2 and rig.sent == [(1, 0, [wire.REJOIN, 3])]
    rig.ctl.stopping = True
    rig.ctl.receive(wire.pack(wire.HB, 1, 3, 1, [0, 0, 0, 0, 0]))  # stopping: nobody is asked back
    assert rig.counters["stale"] == 3 and len(rig.sent) == 1


def test_no_rejoin_is_asked_while_a_refusal_stands():
    rig = Rig()
    rig.hello(0, 8, tp=4)
    rig.sent.clear()
    rig.ctl.receive(wire.pack(wire.HB, 1, 3, 1, [0, 0, 0, 0, 0]))
    assert rig.sent == [] and rig.counters["stale"] == 1


def test_a_goodbye_declares_its_rank_down_and_hands_back_what_it_owed():
    rig = Rig()
    rig.hello(0, 5)
    rig.ranks.owe(0, 41)
    rig.ranks.owe(0, 40)
    rig.ctl.receive(wire.pack(wire.BYE, 0, 4, "old"))  # another incarnation's goodbye: changes nothing
    assert rig.downs == [] and rig.ranks.incarnation(0) == 5
    rig.ctl.receive(wire.pack(wire.BYE, 0, 5, "exit 0"))
    assert rig.downs == [(0, [40, 41], "rank 0 lost: its worker said goodbye (exit 0)", True)]
    notices = rig.ctl.notices()
    assert [type(n) for n in notices] == [RankUp, RankDown] and notices[1].rank == 0
    assert notices[1].reason == "its worker said goodbye (exit 0)" and rig.ranks.down() == [0, 1]


def test_arrivals_are_forwarded_and_bad_messages_counted():
    rig = Rig()
    rig.ctl.receive(wire.pack(wire.ARRIVED, 1, 5, 12, 3))
    assert rig.arrived == [(1, 5, 12, 3)]
    for bad in (b"junk", wire.pack(wire.DONE, 0, 5, 1, 1, None), wire.pack(wire.HB, 2, 5, 0, [0, 0, 0, 0, 0]),
                wire.pack(wire.HELLO, 0, 5, 9)):
        rig.ctl.receive(bad)
    assert rig.counters["bad_messages"] == 4 and rig.sent == [] and rig.arrived == [(1, 5, 12, 3)]


class FakeChild:
    """A started worker as RankControl sees it: alive or exited, killed when told."""

    def __init__(self, alive: bool = True, status: int | None = None, pid: int = 4242) -> None:
        self._alive, self.returncode, self.pid, self.kills, self.waits, self.stops = alive, status, pid, 0, [], []

    def alive(self) -> bool:
        return self._alive

    def kill(self) -> int:
        self.kills += 1
        self._alive = False
        return -9

    def wait(self, timeout: float) -> None:
        self.waits.append(timeout)

    def stop(self, timeout: float) -> int:
        self.stops.append(timeout)
        return 0


def test_a_started_worker_that_exited_is_declared_down_with_its_status_and_reaped():
    rig = Rig()
    rig.hello(0, 5)
    rig.hello(1, 6)
    rig.ranks.owe(0, 7)
    rig.ctl.children[0] = child = FakeChild(alive=False, status=-11)
    rig.ctl.children[1] = alive = FakeChild()
    rig.ctl._check()
    assert rig.downs == [(0, [7], "rank 0 lost: its worker process exited (status -11)", False)]
    assert child.kills == 1 and alive.kills == 0 and rig.ranks.down() == [0]
    assert rig.ctl.info() == {"up": [1], "down": [0], "pids": {1: 4242}}


def test_a_silent_rank_is_declared_down_past_the_heartbeat_limit_and_a_live_one_is_only_stopped_not_killed():
    rig = Rig()
    rig.hello(0, 5)
    rig.ctl.children[0] = child = FakeChild()
    rig.ctl.dead_after_s = 10.0
    rig.ctl._check()
    assert rig.downs == []  # heard from just now
    rig.ctl.dead_after_s = 0.0
    time.sleep(0.01)
    rig.ctl._check()
    ((rank, owed, why, lost),) = rig.downs
    assert (rank, owed, lost) == (0, [], True) and why.startswith("rank 0 lost: no heartbeat for 0.0")
    assert why.endswith(" s") and child.kills == 0  # without restart a live worker may only be stopped


def test_declaring_a_later_incarnation_down_changes_nothing_and_restart_kills_a_live_worker():
    rig = Rig()
    rig.hello(0, 5)
    rig.ctl.declare_down(0, "stale", 4)
    assert rig.downs == [] and rig.ranks.incarnation(0) == 5
    rig.ctl.restart = True
    rig.ctl.children[0] = child = FakeChild()
    before = time.monotonic()
    rig.ctl.declare_down(0, "told", 5)
    assert child.kills == 1 and rig.downs == [(0, [], "rank 0 lost: told", False)]
    down = rig.ctl.notices()[-1]
    assert type(down) is RankDown and down.reason == "told" and before <= down.at <= time.monotonic()


def test_a_dead_started_worker_is_started_again_as_the_back_off_allows_and_counted(monkeypatch):
    rig = Rig()
    rig.ctl.restart = True
    started = []
    monkeypatch.setattr(rig.ctl, "spawn", lambda cfg, log: started.append((cfg, log)))
    rig.ctl.children[0] = FakeChild(alive=False, status=1)
    rig.ctl._configs[0], rig.ctl._logs[0] = "cfg0", "log0"
    rig.ctl.children[1] = FakeChild(alive=False, status=1)  # started by hand elsewhere: no config kept
    rig.ctl._check()
    assert started == [("cfg0", "log0")] and rig.counters["restarts"] == 1
    rig.ctl.backoff.started(0, time.monotonic())
    rig.ctl.backoff.started(0, time.monotonic())
    rig.ctl._check()  # inside the back-off now
    assert len(started) == 1 and rig.ctl.restarting(0) and not rig.ctl.restarting(1)
    rig.ctl.backoff = type(rig.ctl.backoff)()
    rig.ctl._check()  # the back-off forgotten: a second start, counted on top
    assert len(started) == 2 and rig.counters["restarts"] == 2
    rig.ctl.stopping = True
    rig.ctl.backoff = type(rig.ctl.backoff)()
    rig.ctl._check()
    assert len(started) == 2 and not rig.ctl.restarting(0)


def test_lanes_come_from_the_started_config_else_the_last_hello_at_least_one():
    rig = Rig()
    assert rig.ctl.lanes(0) == 1
    rig.hello(0, 5, lanes=3)
    assert rig.ctl.lanes(0) == 3
    rig.ctl._configs[0] = type("Cfg", (), {"lanes": 5})()
    assert rig.ctl.lanes(0) == 5


def test_stopping_children_waits_out_the_deadline_then_stops_each_within_two_seconds():
    rig = Rig()
    a, b = FakeChild(), FakeChild()
    rig.ctl.children = {0: a, 1: b}
    rig.ctl.stop_children(time.monotonic() + 5.0)
    assert 4.5 < a.waits[0] <= 5.0 and 4.5 < b.waits[0] <= 5.0
    assert a.stops == [2.0] and b.stops == [2.0]
    c = FakeChild()
    rig.ctl.children = {0: c}
    rig.ctl.stop_children(time.monotonic() - 1.0)
    assert c.waits == [0.0] and c.stops == [0.0]


def test_a_started_worker_gone_before_its_hello_is_named_with_its_status_unless_it_restarts():
    rig = Rig()
    rig.ctl.children[0] = FakeChild(alive=False, status=2)
    with pytest.raises(ConfigError) as e:
        rig.ctl.wait_ready(5.0)
    assert str(e.value) == "ctl: rank 0's worker exited with status 2 before it said hello (see its stderr)"
    rig.ctl.restart = True
    t = time.monotonic()
    with pytest.raises(DriverError, match=r"^ctl: ranks \[0, 1\] did not say hello within 0.1 s$"):
        rig.ctl.wait_ready(0.1)
    assert time.monotonic() - t < 0.5
    rig.hello(1, 4, tp=4)
    with pytest.raises(ConfigError, match="^ctl: rank 1's worker has TP 4, the scheduler 2$"):
        rig.ctl.wait_ready(5.0)


def test_a_second_worker_for_a_rank_with_a_live_one_is_refused_and_none_is_started(monkeypatch):
    from kvstate.distributed import _control

    rig = Rig()
    monkeypatch.setattr(_control, "ChildProcess", lambda *a, **k: pytest.fail("a worker was started"))
    rig.ctl.children[0] = FakeChild(pid=77)
    with pytest.raises(ConfigError) as e:
        rig.ctl.spawn(type("Cfg", (), {"rank": 0})())
    assert str(e.value) == "ctl: rank 0 already has a worker (pid 77)"


def test_a_started_worker_gets_its_secret_by_environment_never_on_its_command_line(monkeypatch):
    import dataclasses

    from kvstate.distributed import _control
    from kvstate.distributed._rankworker import SECRET_ENV

    @dataclasses.dataclass
    class Cfg:
        rank: int
        secret: str
        lanes: int = 1

        def to_json(self) -> str:
            return f"rank={self.rank} secret={self.secret}"

    made = []
    monkeypatch.setattr(_control, "ChildProcess", lambda *a, **k: made.append((a, k)) or FakeChild(pid=88))
    rig = Rig()
    rig.ctl.children[1] = FakeChild(alive=False)  # an exited worker may be replaced
    child = rig.ctl.spawn(Cfg(1, "hush"), "/tmp/w1.log")
    ((args, kw),) = made
    assert args == ("kvstate.distributed", ["rankworker", "rank=1 secret="], "ctl rank 1 worker")
    assert kw["env"][SECRET_ENV] == "hush" and kw["log_path"] == "/tmp/w1.log"
    assert rig.ctl.children[1] is child and rig.ctl._logs[1] == "/tmp/w1.log" and rig.ctl.lanes(1) == 1
    assert not rig.ctl.backoff.may_start(1, time.monotonic()), "the start is noted for the back-off"


def test_without_a_secret_a_hello_with_none_is_welcomed():
    ranks = RankTable(2)
    sent = []
    ctl = RankControl(SPEC2, wire.geometry(SPEC2, 4), heartbeat_s=0.1, dead_after_s=1.0, restart=False,
                      ranks=ranks, lock=threading.Lock(), counters=dict.fromkeys(("unauthenticated_hellos",), 0),
                      send=lambda r, lane, m: sent.append(wire.unpack(m)) or True, on_down=lambda *a: None,
                      on_up=lambda r: None, on_arrived=lambda *a: None, name="open")
    ctl.receive(wire.pack(wire.HELLO, 0, 3, 900, 2, wire.geometry(SPEC2, 4), 1, ""))
    assert sent == [[wire.WELCOME, 3]] and ranks.incarnation(0) == 3


# -- the driver's own answers: ranks down, lists refused whole ---------------------------------------


def test_a_command_for_ranks_down_fails_at_once_rank_by_rank():
    with ProcessDriver(SPEC2, 4, restart=False) as drv:  # no worker ever said hello
        assert drv.submit(write_command(7))
        got = sorted(drv.poll(2.0) + drv.poll(0.2), key=lambda c: c.rank)
        assert [(c.command_id, c.rank, c.count, c.error, c.lost) for c in got] == [
            (7, 0, 0, "rank 0 is down", False), (7, 1, 0, "rank 1 is down", False)]
        assert drv.inflight == 0


def test_submit_all_returns_the_notices_and_refuses_a_list_with_no_command_whole():
    from kvstate import ValidationError
    from kvstate import commands as C

    with ProcessDriver(SPEC2, 4, restart=False) as drv:
        notice = C.FreeBlocks("r1", (3,))
        assert drv.submit_all([notice, write_command(8, (1,))]) == [notice]
        assert [(c.command_id, c.rank, c.error) for c in drv.poll(2.0)] == [(8, 1, "rank 1 is down")]
        with pytest.raises(ValidationError, match="ProcessDriver.submit_all"):
            drv.submit_all([write_command(9, (1,)), "not a command"])
        assert drv.inflight == 0 and drv.poll(0.05) == []  # nothing of the refused list was taken


SPEC1 = CacheSpec(2, 1, 4, 8)


def test_a_worker_that_says_goodbye_owing_commands_loses_each_with_its_reason():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        drv.submit(write_command(11, (0,)))
        drv.submit(write_command(12, (0,)))
        assert [w.take()[0], w.take()[0]] == [wire.CMD, wire.CMD]
        w.answer(11, 2)
        got = answers(drv, 1)  # the answer and the goodbye take two sockets: no order between them
        w.bye("exit 0")
        got = sorted(got + answers(drv, 1), key=lambda c: c.command_id)
        assert [(c.command_id, c.rank, c.count, c.error, c.lost) for c in got] == [
            (11, 0, 2, None, False), (12, 0, 0, "rank 0 lost: its worker said goodbye (exit 0)", True)]
        assert drv.inflight == 0 and drv.counters["lost"] == 1 and drv.poll(0.05) == []


def test_a_cancel_and_a_layer_report_follow_their_command_to_its_lane():
    from kvstate import commands as C

    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv, inc=9) as w:
        drv.submit(write_command(21, (0,)))
        assert w.take()[0] == wire.CMD
        assert drv.submit(C.CancelCommand("r1", 21))
        assert w.take() == [wire.CANCEL, 9, 21]
        assert drv.submit(C.LayersReady("r1", 21, 1))
        assert w.take() == [wire.LAYERS, 9, 21, 1]
        drv.submit(C.CancelCommand("r1", 99))  # owed by nobody: nothing is sent
        assert not w.lane.poll(200)
        w.answer(21, 0, "cancelled")
        assert [(c.command_id, c.error) for c in answers(drv, 1)] == [(21, "cancelled")]


def test_poll_gives_answers_as_they_come_drops_stale_ones_and_fails_one_past_the_keys():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv, inc=3) as w:
        for cid in (31, 32):
            drv.submit(write_command(cid, (0,)))
            w.take()
        assert drv.poll(0.0) == [] and drv.inflight == 2
        w.answer(31, 1, inc=4)  # another incarnation's: stale
        w.reply.send(b"not a message")
        t = time.monotonic()
        assert drv.poll(0.3) == [] and time.monotonic() - t >= 0.25  # it waited out its timeout
        assert drv.counters["stale"] == 1 and drv.counters["bad_messages"] == 1
        w.answer(31, 3)  # more than its two keys: its rank fails, at once
        got = answers(drv, 1)
        assert [(c.command_id, c.count, c.error) for c in got] == \
            [(31, 0, "rank 0 answered 3 leading blocks of command 31, which has 2 keys")]
        assert drv.counters["bad_messages"] == 2
        w.answer(32, 2)
        w.answer(31, 1)  # the rank settled already: stale
        got = answers(drv, 1)
        assert [(c.command_id, c.count, c.error) for c in got] == [(32, 2, None)]
        assert drv.poll(0.2) == [] and drv.inflight == 0 and drv.counters["stale"] == 2


def test_closing_tells_every_connected_worker_to_stop():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        drv.close(5.0)
        assert w.take() == [wire.STOP]
