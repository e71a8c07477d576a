"""The process driver's command flows with a fake worker (its sockets in the test's process):
commands held while a started rank restarts (sent when it is up, failed past their fence,
answered at once when cancelled), a rank whose lane is gone, answers on the wrong channel,
a poll woken by a late answer, layer reports of launched layers forwarded once their event
is done, layer arrivals, and close stopping what it started within its deadline."""
from __future__ import annotations

import threading
import time

import pytest
from fakeworker import FakeWorker, answers, write_command

from kvstate import commands as C
from kvstate._spec import CacheSpec, LayerGroup
from kvstate.distributed import ProcessDriver
from kvstate.distributed import _wire as wire

SPEC1 = CacheSpec(2, 1, 4, 8)


def _row(c):
    return c.command_id, c.rank, c.count, c.error, c.lost


def _on_its_way(drv: ProcessDriver, rank: int, tmp_path) -> None:
    """As if the driver had started ``rank``'s worker and it had not said hello yet."""
    drv.control._configs[rank] = drv.worker_config(rank, {"kind": "file", "root": str(tmp_path)}, parent_pid=0)


def test_commands_for_a_restarting_rank_wait_for_it_and_go_out_when_it_is_up(tmp_path):
    with ProcessDriver(SPEC1, 4, restart=True) as drv:
        _on_its_way(drv, 0, tmp_path)
        for cmd in (write_command(41, (0,)), write_command(42, (0,), fence_s=0.3), write_command(43, (0,))):
            assert drv.submit(cmd)
        assert drv.poll(0.05) == [] and drv.inflight == 3  # held: neither sent nor failed
        assert drv.submit(C.CancelCommand("r1", 43))
        assert [_row(c) for c in answers(drv, 1)] == [(43, 0, 0, "cancelled while its rank restarted", False)]
        time.sleep(0.35)  # command 42's fence passes while its rank is down
        with FakeWorker(drv, inc=7) as w:
            sent = w.take()
            assert sent[:4] == [wire.CMD, 7, 3, 41]  # the held write, to the new incarnation
            assert [_row(c) for c in answers(drv, 1)] == [(42, 0, 0, "rank 0 was down until the command's fence",
                                                           False)]
            w.answer(41, 2)
            assert [_row(c) for c in answers(drv, 1)] == [(41, 0, 2, None, False)]
            assert not w.lane.poll(100) and drv.inflight == 0  # 42 and 43 never went out


def test_a_command_to_a_rank_whose_lane_is_gone_fails_as_not_connected():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        w.lane.close(0)  # its lane is gone; no goodbye, so the rank is still up
        got, cid, deadline = [], 50, time.monotonic() + 10
        while not got and time.monotonic() < deadline:  # until the driver's socket has seen it go
            cid += 1
            drv.submit(write_command(cid, (0,)))
            got = [c for c in drv.poll(0.05) if c.error]
        assert [_row(c) for c in got] == [(cid, 0, 0, "rank 0 lost: its worker is not connected", False)]


def test_the_reply_channel_counts_anything_but_answers_of_known_ranks_as_bad():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        drv.submit(write_command(61, (0,)))
        w.take()
        w.reply.send(wire.pack(wire.DONE, 1, w.inc, 61, 2, None))  # rank 1: this driver has one rank
        w.reply.send(wire.pack(wire.HB, 0, w.inc, 0, [0, 0, 0, 0, 0]))  # a heartbeat belongs on the control channel
        assert drv.poll(0.3) == []
        assert drv.counters["bad_messages"] == 2 and drv.inflight == 1
        w.answer(61, 2)
        assert [_row(c) for c in answers(drv, 1)] == [(61, 0, 2, None, False)]


def test_a_poll_wakes_for_an_answer_that_comes_while_it_waits():
    with ProcessDriver(SPEC1, 4, restart=False, spin_us=0) as drv, FakeWorker(drv) as w:
        drv.submit(write_command(71, (0,)))
        w.take()
        later = threading.Timer(0.3, w.answer, args=(71, 2))
        later.start()
        t = time.monotonic()
        got = drv.poll(10.0)
        later.join()
        assert [_row(c) for c in got] == [(71, 0, 2, None, False)] and 0.25 <= time.monotonic() - t < 5.0


class _Event:
    """A device event as ``wait_event`` reads one (``done``), set by the test; or one that fails."""

    def __init__(self, fails: bool = False) -> None:
        self.set, self.fails = False, fails

    @property
    def done(self) -> bool:
        if self.fails:
            raise RuntimeError("the device failed")
        return self.set


def test_a_report_of_launched_layers_goes_out_once_their_event_is_done():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv, inc=4) as w:
        save = C.SaveLayers("r1", 81, (0,), time.monotonic() + 30, ("k0", "k1"), (1, 2))
        drv.submit(save)
        assert w.take()[:4] == [wire.CMD, 4, 4, 81]
        failed, event = _Event(fails=True), _Event()
        drv.submit(C.LayersReady("r1", 81, 1, event=failed))  # never reported: the save stops at its deadline
        drv.submit(C.LayersReady("r1", 81, 2, event=event))
        assert not w.lane.poll(200)  # the event is not done: nothing yet
        watcher = [t for t in threading.enumerate() if t.name == "kvstate-layer-events"]
        event.set = True
        assert len(watcher) == 1 and watcher[0].daemon  # one thread waits on the events; it never holds exit
        assert w.take() == [wire.LAYERS, 4, 81, 2]
        assert not w.lane.poll(100)


def test_layer_arrivals_of_a_load_are_kept_until_it_answers():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv, inc=6) as w:
        load = C.LoadLayers("r1", 91, (0,), time.monotonic() + 30, ("k0", "k1"), (1, 2))
        drv.submit(load)
        w.take()
        w.arrived(91, 1)
        deadline = time.monotonic() + 5
        while drv.arrivals(91).layers < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drv.arrivals(91).layers == 1
        w.answer(91, 2)
        assert [_row(c) for c in answers(drv, 1)] == [(91, 0, 2, None, False)]
        assert drv.arrivals(91) is None


def test_a_driver_of_state_pages_welcomes_a_worker_of_the_same_pages_only():
    groups = (LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4))
    spec = CacheSpec(2, 1, 4, 8, groups=groups)
    with ProcessDriver(spec, 4, restart=False, num_states=3) as drv:
        with FakeWorker(drv, num_states=3) as w:
            assert drv.control.ranks.incarnation(0) == w.inc
        assert drv.counters["refused"] == 0


def test_a_hello_without_the_secret_is_counted_by_the_driver():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        w.control.send(wire.pack(wire.HELLO, 0, 99, 1, 1, wire.geometry(SPEC1, 4), 1, "not the secret"))
        deadline = time.monotonic() + 5
        while drv.counters["unauthenticated_hellos"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drv.counters["unauthenticated_hellos"] == 1 and drv.control.ranks.incarnation(0) == w.inc


class _Child:
    """A started worker as the driver's control sees it; records how long it was given to stop."""

    pid, returncode = 4242, None

    def __init__(self) -> None:
        self.stops: list[float] = []

    def alive(self) -> bool:
        return not self.stops

    def stop(self, timeout: float) -> int:
        self.stops.append(timeout)
        return 0

    def kill(self) -> int:
        return -9

    def wait(self, timeout: float) -> None:
        pass


@pytest.mark.parametrize("timeout", [1.0, 4.0])
def test_close_stops_a_started_worker_within_its_deadline(timeout):
    drv = ProcessDriver(SPEC1, 4, restart=False)
    drv.control.children[0] = child = _Child()
    t = time.monotonic()
    drv.close(timeout)
    assert len(child.stops) == 1 and 0 < child.stops[0] <= timeout and time.monotonic() - t < timeout + 1


def test_a_poll_asleep_wakes_for_an_answer_the_driver_makes_itself():
    with ProcessDriver(SPEC1, 4, restart=False, spin_us=0) as drv, FakeWorker(drv) as w:
        drv.submit(write_command(101, (0,)))
        w.take()
        later = threading.Timer(0.3, w.bye, args=("exit 0",))  # the driver answers the command as lost
        later.start()
        t = time.monotonic()
        got = drv.poll(10.0)
        later.join()
        assert [_row(c) for c in got] == [(101, 0, 0, "rank 0 lost: its worker said goodbye (exit 0)", True)]
        assert time.monotonic() - t < 5.0  # woken, not at its timeout


def test_two_drivers_in_one_process_each_wake_their_own_poll():
    with ProcessDriver(SPEC1, 4, restart=False) as a, ProcessDriver(SPEC1, 4, restart=False) as b:
        for drv in (a, b):
            drv.submit(write_command(111, (0,)))  # no worker: answered at once as down
            assert [_row(c) for c in drv.poll(5.0)] == [(111, 0, 0, "rank 0 is down", False)]


def test_a_started_worker_that_exits_fails_what_it_owed_as_not_lost():
    with ProcessDriver(SPEC1, 4, restart=False, heartbeat_s=0.05) as drv, FakeWorker(drv) as w:
        drv.submit(write_command(121, (0,)))
        w.take()
        exited = _Child()
        exited.returncode = 3
        exited.stops.append(0.0)  # not alive
        drv.control.children[0] = exited
        assert drv.child(0) is exited and drv.child(1) is None
        got = answers(drv, 1)
        assert [_row(c) for c in got] == [(121, 0, 0, "rank 0 lost: its worker process exited (status 3)", False)]


def test_the_workers_store_faults_and_armed_reads_come_with_their_heartbeats():
    with ProcessDriver(SPEC1, 4, restart=False) as drv, FakeWorker(drv) as w:
        assert drv.store_faults() == {"broken": 0, "short": 0, "failed": 0}
        w.control.send(wire.pack(wire.HB, 0, w.inc, 4096, [2, 5, 7, 3, 1]))
        deadline = time.monotonic() + 5
        while drv.store_faults()["short"] != 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drv.store_faults() == {"broken": 2, "short": 5, "failed": 7} and drv.bytes_moved() == 4096
        assert drv.armed_reads() == {"armed": 0, "matched": 0, "let_go": 0, "ranks_armed": 3, "ranks_fired": 1}


def test_a_worker_that_takes_nothing_pushes_back_with_a_timeout_on_submit():
    import zmq

    from kvstate._errors import DriverError

    with ProcessDriver(SPEC1, 4, restart=False, submit_timeout=0.2) as drv, FakeWorker(drv) as w:
        w.lane.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: its queue and the driver's fill
        with pytest.raises(DriverError) as e:
            for cid in range(1, 200_000):
                drv.submit(write_command(cid, (0,)))
        assert str(e.value) == ("ProcessDriver: rank 0 took no command for the submit timeout: its queue is full "
                                "(back-pressure) or it is stuck")


def test_the_driver_s_calls_refuse_bad_arguments_word_for_word():
    from kvstate import ValidationError

    with ProcessDriver(SPEC1, 4, restart=False) as drv:
        t = time.monotonic()
        assert drv.poll() == [] and time.monotonic() - t < 0.5  # by default it does not wait
        with pytest.raises(ValidationError) as e:
            drv.poll(-1)
        assert str(e.value) == "ProcessDriver.poll: timeout must be a finite number of seconds >= 0, got -1"
        with pytest.raises(ValidationError) as e:
            drv.submit_all([1])
        assert str(e.value) == "ProcessDriver.submit_all: item 0 is a int, not a kvstate command"


def test_a_worker_s_config_carries_the_driver_s_addresses_pages_secret_and_key(tmp_path):
    groups = (LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4))
    with ProcessDriver(CacheSpec(2, 1, 4, 8, groups=groups), 4, restart=False, num_states=3,
                       heartbeat_s=0.25) as drv:
        cfg = drv.worker_config(0, {"kind": "file", "root": str(tmp_path)}, lanes=3)
        assert [cfg.command_address, cfg.reply_address, cfg.control_address] == list(drv.addresses)
        assert (cfg.num_states, cfg.secret, cfg.curve_key, cfg.heartbeat_s, cfg.lanes, cfg.num_blocks) == (
            3, drv.secret, "", 0.25, 3, 4)
    with ProcessDriver(SPEC1, 4, restart=False, address="tcp://127.0.0.1") as drv:
        cfg = drv.worker_config(0, {"kind": "file", "root": str(tmp_path)})
        assert cfg.curve_key == drv.curve_key and len(cfg.curve_key) == 40
