"""Rank workers served in the test's own process, as an engine may host them.

``RankWorker(config).serve()`` runs in a thread here, beside its :class:`ProcessDriver`, so
the worker's side (its hello and welcome, its lanes, its answers, cancels, store faults and
goodbye) runs where a test and a mutation tool can see it; the process tests run the same
code in child processes."""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from procrig import SPEC

from kvstate import commands as C
from kvstate.distributed import ProcessDriver, SharedCaches
from kvstate.distributed._liveness import RankDown, RankUp
from kvstate.distributed._rankworker import RankWorker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm)")

BLOCKS = 16


class Hosted:
    """A driver and its two ranks' workers, each serving in a thread of this process."""

    def __init__(self, root: str, lanes: int = 1) -> None:
        self.caches = SharedCaches.create(SPEC, BLOCKS)
        self.drv = ProcessDriver(SPEC, BLOCKS, heartbeat_s=0.05, dead_after_s=5.0, restart=False)
        self.workers = [RankWorker(self.drv.worker_config(r, {"kind": "file", "root": root}, lanes=lanes,
                                                          caches={"kind": "shm", "paths": self.caches.paths},
                                                          parent_pid=0))  # its host (this test) stops it
                        for r in range(SPEC.tp_size)]
        self.status: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()
        try:
            self.drv.wait_ready(30)
        except BaseException:
            self.close()  # no fixture teardown follows a failed set-up: leave nothing behind
            raise

    def _serve(self, w: RankWorker) -> None:
        self.status[w.rank] = w.serve()

    def answers(self, n: int, timeout: float = 10.0) -> list:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += self.drv.poll(0.2)
        return sorted(got, key=lambda c: (c.command_id, c.rank))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        for t in self.threads:
            t.join(30)
        self.drv.close(timeout=10)
        self.caches.close()


def command(cls: type, cid: int, keys: tuple[str, ...], blocks: tuple[int, ...]) -> C.TransferCommand:
    now = time.monotonic()
    return cls("r", cid, (0, 1), now + 10, keys, blocks, fence=now + 20)


@pytest.fixture
def hosted(tmp_path):
    h = Hosted(str(tmp_path))
    yield h
    h.close()


def test_a_write_then_a_read_move_every_byte_through_hosted_workers(hosted):
    for r in range(2):
        for kind in ("key", "value"):
            for layer in hosted.caches.caches[r][kind]:
                layer[:] = np.random.default_rng(r).standard_normal(layer.shape).astype(layer.dtype)
    before = {r: [a.copy() for a in hosted.caches.caches[r]["key"]] for r in range(2)}
    hosted.drv.submit(command(C.WriteBlocks, 1, ("a", "b", "c"), (2, 3, 4)))
    assert [(c.rank, c.count, c.error) for c in hosted.answers(2)] == [(0, 3, None), (1, 3, None)]
    for r in range(2):
        for layer in hosted.caches.caches[r]["key"]:
            layer[7:10] = 0
    hosted.drv.submit(command(C.ReadBlocks, 2, ("a", "b", "c", "d"), (7, 8, 9, 10)))
    assert [(c.rank, c.count) for c in hosted.answers(2)] == [(0, 3), (1, 3)]  # "d" was never stored
    for r in range(2):
        for layer, old in zip(hosted.caches.caches[r]["key"], before[r]):
            assert np.array_equal(layer[7:10], old[2:5])
    deadline = time.monotonic() + 5
    while hosted.drv.store_faults()["short"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the counts come with each worker's next heartbeat
    assert hosted.drv.store_faults() == {"broken": 0, "short": 2, "failed": 0}  # each rank's short read
    assert all(w.counters["commands"] == 2 for w in hosted.workers)
    assert [type(n) for n in hosted.drv.notices()] == [RankUp, RankUp]


def test_a_worker_the_driver_did_not_start_watches_no_parent(tmp_path):
    """A worker hosted outside the driver's children is configured with no parent to watch:
    watching the driver's pid it would take itself for an orphan and exit (status 3)."""
    with ProcessDriver(SPEC, BLOCKS) as drv:
        assert drv.worker_config(0, {"kind": "file", "root": str(tmp_path)}).parent_pid > 0  # spawn's children watch it
        assert drv.worker_config(0, {"kind": "file", "root": str(tmp_path)}, parent_pid=0).parent_pid == 0


def test_a_cancel_reaches_the_lane_and_stop_says_goodbye(hosted):
    hosted.drv.submit(command(C.ReadBlocks, 3, ("x",), (1,)))
    hosted.answers(2)
    hosted.drv.submit(C.CancelCommand("r", 3))  # answered already: nothing to cancel, nothing breaks
    hosted.drv.submit(command(C.WriteBlocks, 4, ("y",), (1,)))
    assert [(c.command_id, c.count) for c in hosted.answers(2)] == [(4, 1), (4, 1)]
    w = hosted.workers[1]
    w.stop()
    hosted.threads[1].join(30)
    assert hosted.status[1] == 0
    deadline = time.monotonic() + 10
    while not any(isinstance(n, RankDown) for n in hosted.drv.notices()) and time.monotonic() < deadline:
        hosted.drv.poll(0.1)
    assert hosted.drv.control.ranks.down() == [1]
    hosted.drv.submit(command(C.WriteBlocks, 5, ("z",), (2,)))
    got = hosted.answers(2)
    assert [(c.rank, c.count) for c in got] == [(0, 1), (1, 0)] and got[1].error


def test_a_read_armed_ahead_reaches_each_rank_and_is_let_go_when_its_request_ends(hosted, monkeypatch):
    """``ARM`` and ``DISARM`` (kvstate.backends._arming) from the driver to each worker's
    backend, on lane 0; a bad ``ARM`` is counted and arms nothing."""
    from kvstate.backends import ReferenceBackend
    from kvstate.distributed import _wire as wire

    calls = []
    monkeypatch.setattr(ReferenceBackend, "arm_pull", lambda self, rank, keys, blocks, timeout=60.0:
                        calls.append(("arm", rank, tuple(keys), tuple(blocks), timeout)) or True)
    monkeypatch.setattr(ReferenceBackend, "disarm_pull", lambda self, rank, keys:
                        calls.append(("disarm", rank, tuple(keys))) or True)
    hosted.drv.submit(C.ArmRead("late", (0, 1), time.monotonic() - 1, ("z",), (5,)))  # its token is late: not sent
    hosted.drv.submit(C.ArmRead("r", (0, 1), time.monotonic() + 20, ("a", "b"), (5, 6)))
    hosted.drv._send(0, 0, wire.pack(wire.ARM, hosted.workers[0].incarnation, "r", ["a"], [5, 6], 1.0))
    assert hosted.drv.submit(C.RequestEnded("r", "failed", 504, (5, 6), "first_token_timeout")) is False
    deadline = time.monotonic() + 10
    while sum(w.counters["disarmed"] for w in hosted.workers) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(c[:4] for c in calls if c[0] == "arm") == [("arm", 0, ("a", "b"), (5, 6)),
                                                             ("arm", 1, ("a", "b"), (5, 6))]
    assert all(19 < c[4] <= 20 for c in calls if c[0] == "arm")
    assert sorted(c for c in calls if c[0] == "disarm") == [("disarm", 0, ("a", "b")), ("disarm", 1, ("a", "b"))]
    assert [w.counters["armed"] for w in hosted.workers] == [1, 1]
    assert hosted.workers[0].counters["bad_messages"] == 1
    while hosted.drv.armed_reads()["ranks_armed"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the workers' counts come with their heartbeats
    assert hosted.drv.armed_reads() == {"armed": 1, "matched": 0, "let_go": 1, "ranks_armed": 2, "ranks_fired": 0}


def test_an_arm_that_comes_after_its_read_arms_nothing_or_lets_go_at_once(hosted, monkeypatch):
    """``ARM`` goes on lane 0 and the read on any lane: a read that came first, or while the
    backend armed, leaves no slot armed until the deadline."""
    from kvstate.backends import ReferenceBackend

    w = hosted.workers[0]
    calls = []

    def arm(self, rank, keys, blocks, timeout=60.0):
        calls.append(("arm", rank, tuple(keys)))
        if keys[0] == "late-while" and rank == 0:
            w._read_arrives("while")  # the read arrives on another lane as this arms
        return True

    monkeypatch.setattr(ReferenceBackend, "arm_pull", arm)
    monkeypatch.setattr(ReferenceBackend, "disarm_pull", lambda self, rank, keys: calls.append(("disarm", rank,
                                                                                                tuple(keys))) or True)
    now = time.monotonic()
    hosted.drv.submit(C.ReadBlocks("first", 7, (0, 1), now + 10, ("late-first",), (3,), fence=now + 20))
    hosted.answers(2)
    for rid, key in (("first", "late-first"), ("while", "late-while")):
        hosted.drv.submit(C.ArmRead(rid, (0, 1), now + 20, (key,), (3,)))
    deadline = time.monotonic() + 10
    while len([c for c in calls if c[1] == 0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [c for c in calls if c[1] == 0] == [("arm", 0, ("late-while",)), ("disarm", 0, ("late-while",))]
    assert w.counters["armed"] == 1
