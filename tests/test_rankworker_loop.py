"""A rank worker's loop, driven message by message from a driver the test plays.

The test binds the three sockets a :class:`~kvstate.distributed.ProcessDriver` binds (a
ROUTER for commands, PULLs for answers and control) and serves one :class:`RankWorker` in a
thread, so every message the worker sends is read here, item by item, and every message it
receives is one the test wrote: hellos until a welcome on lane 0, heartbeats with bytes moved
and store faults, answers, stale incarnations and bad messages counted and dropped, a
rejoin, a refusal (its own and a stale one), a stop, a parent gone, and the goodbye each
exit sends."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import zmq

from kvstate import commands as C
from kvstate._spec import CacheSpec
from kvstate.distributed import _rankworker as rankworker
from kvstate.distributed import _wire as wire
from kvstate.distributed._rankworker import SECRET_ENV, RankWorker, WorkerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (ipc sockets)")

SPEC = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2)
BLOCKS = 8
RANK = 1


class Driver:
    """The driver's side of the wire, in the test: what the worker sends, read in order."""

    def __init__(self, root: str) -> None:
        self.ctx = zmq.Context()
        self.addresses = [f"ipc://{root}/{n}" for n in ("cmd", "reply", "control")]
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a lane not yet connected raises
        self.reply, self.control = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PULL)
        for sock, address in zip((self.cmd, self.reply, self.control), self.addresses):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
        self.worker: RankWorker | None = None
        self.thread: threading.Thread | None = None
        self.status: int | None = None

    def config(self, root: str, **kw: Any) -> WorkerConfig:
        fields: dict[str, Any] = dict(rank=RANK, spec={f: getattr(SPEC, f) for f in SPEC.__dataclass_fields__},
                                      num_blocks=BLOCKS, command_address=self.addresses[0],
                                      reply_address=self.addresses[1], control_address=self.addresses[2],
                                      store={"kind": "file", "root": root}, heartbeat_s=0.02, lanes=2)
        fields.update(kw)
        return WorkerConfig(**fields)

    def start(self, cfg: WorkerConfig) -> RankWorker:
        self.worker = RankWorker(cfg)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self.worker

    def _serve(self) -> None:
        assert self.worker is not None
        self.status = self.worker.serve()

    def next(self, sock: zmq.Socket, kinds: tuple[int, ...], timeout: float = 10.0) -> list[Any]:
        """The next message of one of ``kinds`` on ``sock`` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sock.poll(50):
                items = wire.unpack(sock.recv())
                if items[0] in kinds:
                    return items
        raise AssertionError(f"no message of kinds {kinds} within {timeout} s")

    def send(self, lane: int, *items: Any, raw: bytes | None = None) -> None:
        """One message to the worker's lane, once that lane's socket has connected."""
        name = f"r{RANK}:{lane}".encode()
        deadline = time.monotonic() + 10
        while True:
            try:
                self.cmd.send_multipart([name, raw if raw is not None else wire.pack(*items)])
                return
            except zmq.ZMQError:  # EHOSTUNREACH: the lane has not connected yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def welcome(self) -> list[Any]:
        """Take the worker's hello and welcome it on every lane; returns the hello."""
        hello = self.next(self.control, (wire.HELLO,))
        for lane in (1, 0):
            self.send(lane, wire.WELCOME, hello[2])
        self.next(self.control, (wire.HB,))  # welcomed: the beats are heartbeats now
        return hello

    def join(self) -> int | None:
        assert self.thread is not None
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.status

    def close(self) -> None:
        if self.worker is not None and self.thread is not None and self.thread.is_alive():
            self.worker.stop()
            self.thread.join(30)
        for sock in (self.cmd, self.reply, self.control):
            sock.close(0)
        self.ctx.term()


@pytest.fixture
def driver(tmp_path):
    d = Driver(str(tmp_path))
    yield d
    d.close()


def _command(cls: type, cid: int, keys: tuple[str, ...], blocks: tuple[int, ...]) -> C.TransferCommand:
    now = time.monotonic()
    return cls("req", cid, (0, 1), now + 30, keys, blocks, fence=now + 60)


def test_a_worker_says_hello_until_lane_0_welcomes_it_then_beats(driver, tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    w = driver.start(driver.config(str(tmp_path)))
    hello = driver.next(driver.control, (wire.HELLO,))
    assert hello == [wire.HELLO, RANK, w.incarnation, os.getpid(), 2, wire.geometry(SPEC, BLOCKS), 2,
                     "from-the-environment"]  # the config's secret is empty: the environment's goes
    driver.send(1, wire.WELCOME, w.incarnation)  # lane 1 alone: lane 0 may not be reachable yet
    time.sleep(0.1)
    assert not w.welcomed
    assert driver.next(driver.control, (wire.HELLO, wire.HB))[0] == wire.HELLO
    driver.send(0, wire.WELCOME, w.incarnation)
    beat = driver.next(driver.control, (wire.HB,))
    assert beat == [wire.HB, RANK, w.incarnation, 0, [0, 0, 0]] and w.welcomed
    driver.send(0, wire.STOP)
    assert driver.join() == 0
    assert driver.next(driver.control, (wire.BYE,)) == [wire.BYE, RANK, w.incarnation, "exit 0"]


def test_a_config_s_secret_goes_before_the_environment_s(driver, tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    driver.start(driver.config(str(tmp_path), secret="from-the-config", lanes=1))
    assert driver.next(driver.control, (wire.HELLO,))[-2:] == [1, "from-the-config"]


def test_commands_are_answered_on_the_reply_channel_and_short_reads_counted(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    write = _command(C.WriteBlocks, 5, ("a", "b"), (1, 2))
    driver.send(1, raw=wire.command_message(write, w.incarnation))
    assert driver.next(driver.reply, (wire.DONE,)) == [wire.DONE, RANK, w.incarnation, 5, 2, None]
    read = _command(C.ReadBlocks, 6, ("a", "b", "never"), (3, 4, 5))
    driver.send(0, raw=wire.command_message(read, w.incarnation))
    assert driver.next(driver.reply, (wire.DONE,)) == [wire.DONE, RANK, w.incarnation, 6, 2, None]
    per_block = SPEC.bytes_per_block_per_rank
    deadline = time.monotonic() + 10
    beat = driver.next(driver.control, (wire.HB,))
    while beat[4] != [0, 1, 0] and time.monotonic() < deadline:
        beat = driver.next(driver.control, (wire.HB,))
    assert beat[3:] == [4 * per_block, [0, 1, 0]]  # two blocks written, two read; one read short
    assert w.store_faults() == [0, 1, 0] and w.counters["commands"] == 2


def test_a_failed_command_is_a_failure_not_a_short_read(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    write = _command(C.WriteBlocks, 7, ("a",), (BLOCKS + 3,))  # a block the worker's caches lack
    driver.send(0, raw=wire.command_message(write, w.incarnation))
    done = driver.next(driver.reply, (wire.DONE,))
    assert done[:5] == [wire.DONE, RANK, w.incarnation, 7, 0] and done[5]
    assert w.store_faults() == [0, 0, 1]
    short_write = _command(C.WriteBlocks, 8, ("b", "c"), (1, 2))
    driver.send(0, raw=wire.command_message(short_write, w.incarnation))
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [8, 2, None]
    assert w.store_faults() == [0, 0, 1]  # a write is never short


def test_stale_and_bad_messages_are_counted_and_dropped(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    stale = _command(C.WriteBlocks, 9, ("a",), (1,))
    driver.send(0, raw=wire.command_message(stale, w.incarnation + 1))
    driver.send(0, wire.CMD)  # no incarnation at all
    driver.send(0, raw=b"\xc1 not msgpack")
    driver.send(0, 99, w.incarnation)  # no such type
    driver.send(0, wire.CANCEL, w.incarnation, "nine")
    driver.send(0, wire.LAYERS, w.incarnation, 9)
    driver.send(0, wire.LAYERS, w.incarnation, 9, 1.5)
    driver.send(0, wire.CANCEL, w.incarnation, 9, 1)
    driver.send(0, wire.CMD, w.incarnation, 1, 10)  # a command missing its items
    driver.send(0, wire.CANCEL, w.incarnation, 9)  # nothing owed under 9: a cancel of nothing
    driver.send(0, wire.LAYERS, w.incarnation, 9, 2)
    answer = _command(C.WriteBlocks, 11, ("b",), (1,))
    driver.send(0, raw=wire.command_message(answer, w.incarnation))
    assert driver.next(driver.reply, (wire.DONE,))[3] == 11  # the first answer: none for the dropped
    assert w.counters == {"commands": 1, "stale": 2, "bad_messages": 7, "cancels": 1}


def test_a_rejoin_draws_a_new_incarnation_and_says_hello_again(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    old = driver.welcome()[2]
    driver.send(0, wire.REJOIN, old + 1)  # another incarnation's: stale
    time.sleep(0.1)
    assert w.incarnation == old and w.welcomed
    driver.send(0, wire.REJOIN, old)
    hello = driver.next(driver.control, (wire.HELLO,))
    assert hello[2] == w.incarnation != old and not w.welcomed
    assert driver.next(driver.control, (wire.HELLO,))[:3] == [wire.HELLO, RANK, w.incarnation]  # again, unwelcomed
    stale = _command(C.WriteBlocks, 12, ("a",), (1,))
    driver.send(0, raw=wire.command_message(stale, old))
    time.sleep(0.1)
    assert w.counters["stale"] == 2 and w.counters["commands"] == 0


def test_a_refusal_of_its_own_hello_ends_it_with_status_2(driver, tmp_path, capfd):
    w = driver.start(driver.config(str(tmp_path)))
    hello = driver.next(driver.control, (wire.HELLO,))
    driver.send(0, wire.REFUSE, hello[2] + 1, "not you")  # a stale refusal changes nothing
    time.sleep(0.1)
    assert driver.thread is not None and driver.thread.is_alive() and w.counters["stale"] == 1
    driver.send(0, wire.REFUSE, hello[2], "geometry differs")
    assert driver.join() == 2
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 2"
    assert f"kvstate rank worker {RANK}: refused by the scheduler: ['geometry differs']" in capfd.readouterr().err


def test_a_worker_whose_parent_is_gone_exits_with_status_3(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path), parent_pid=os.getppid() + 1))
    assert driver.join() == 3
    assert driver.next(driver.control, (wire.BYE,)) == [wire.BYE, RANK, w.incarnation, "exit 3"]


def test_a_stop_from_the_host_closes_the_store_and_every_socket(driver, tmp_path, monkeypatch):
    closed: list[str] = []
    opened = rankworker.build_store

    def recording(cfg: dict[str, Any]) -> Any:
        store = opened(cfg)
        close = store.close
        store.close = lambda: (closed.append("store"), close())[1]
        return store

    monkeypatch.setattr(rankworker, "build_store", recording)
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    assert closed == []
    w.stop()
    assert driver.join() == 0
    assert closed == ["store"] and w._sockets == [] and w._resources == [] and w._ctx.closed


def test_main_refuses_a_bad_command_line_and_configuration_with_status_2(capfd):
    assert rankworker.main([]) == 2
    assert capfd.readouterr().err == "usage: python -m kvstate.distributed rankworker CONFIG_JSON\n"
    assert rankworker.main(["a", "b"]) == 2
    assert rankworker.main(["{not json"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("usage:") and "kvstate rank worker: error: a rank worker's configuration is not valid JSON " \
                                         "of its fields (" in err


def _main(argv: list[str]) -> int:
    """``main`` in this (the main) thread, its signal handlers put back after."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return rankworker.main(argv)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_main_serves_until_stopped_and_ignores_ctrl_c_meanwhile(driver, tmp_path):
    import signal

    seen: dict[str, Any] = {}

    def play() -> None:
        hello = driver.next(driver.control, (wire.HELLO,))
        seen["sigint"] = signal.getsignal(signal.SIGINT)
        seen["hello"] = hello
        driver.send(0, wire.STOP)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    assert _main([driver.config(str(tmp_path)).to_json()]) == 0
    player.join(10)
    assert seen["sigint"] == signal.SIG_IGN and seen["hello"][:2] == [wire.HELLO, RANK]
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 0"


def test_main_reports_a_store_it_cannot_open_with_status_2(driver, tmp_path, capfd):
    cfg = driver.config(str(tmp_path), store={"kind": "file", "root": str(tmp_path), "bogus": 1})
    assert _main([cfg.to_json()]) == 2
    assert capfd.readouterr().err == (f"kvstate rank worker {RANK}: error: a file store takes a root and a "
                                      "capacity_bytes only, got ['bogus', 'kind', 'root']\n")
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 2"  # the goodbye still goes, and says why
