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
from workerfields import SPEC, worker_fields

from kvstate import commands as C
from kvstate._spec import CacheSpec
from kvstate.distributed import _rankworker as rankworker
from kvstate.distributed import _wire as wire
from kvstate.distributed._rankworker import SECRET_ENV, RankWorker, WorkerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (ipc sockets)")

BLOCKS = 8
RANK = 1


class Driver:
    """The driver's side of the wire, in the test: what the worker sends, read in order."""

    def __init__(self, root: str, curve: bool = False) -> None:
        """``curve``: over loopback tcp as a CURVE server (its public key is ``curve_key``),
        else over ipc in ``root``."""
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a lane not yet connected raises
        self.reply, self.control = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PULL)
        self.curve_key = ""
        keys = zmq.curve_keypair() if curve else None
        self.addresses = []
        for sock, name in zip((self.cmd, self.reply, self.control), ("cmd", "reply", "control")):
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey = keys
                sock.curve_server = True
                sock.bind("tcp://127.0.0.1:*")
                self.addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            else:
                sock.bind(f"ipc://{root}/{name}")
                self.addresses.append(f"ipc://{root}/{name}")
        if keys is not None:
            self.curve_key = keys[0].decode()
        self.worker: RankWorker | None = None
        self.thread: threading.Thread | None = None
        self.status: int | None = None

    def config(self, root: str, **kw: Any) -> WorkerConfig:
        return WorkerConfig(**worker_fields(**{
            "rank": RANK, "num_blocks": BLOCKS, "command_address": self.addresses[0],
            "reply_address": self.addresses[1], "control_address": self.addresses[2],
            "store": {"kind": "file", "root": root}, "heartbeat_s": 0.02, "lanes": 2, "curve_key": self.curve_key,
            **kw}))

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

    def submit(self, lane: int, cmd: C.TransferCommand, incarnation: int) -> None:
        """``cmd`` to the worker's lane, as the driver's CMD message naming ``incarnation``."""
        self.send(lane, raw=wire.command_message(cmd, incarnation))

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


def _patch_store(monkeypatch: pytest.MonkeyPatch, method: str, wrap: Any) -> None:
    """Workers started after this build their store as usual, with ``store.method`` replaced by
    ``wrap(store.method)``."""
    opened = rankworker.build_store

    def build(cfg: dict[str, Any]) -> Any:
        store = opened(cfg)
        setattr(store, method, wrap(getattr(store, method)))
        return store

    monkeypatch.setattr(rankworker, "build_store", build)


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
    _settled(driver, w, 201, lane=1)  # one block written: the bytes the beats report
    assert not w.welcomed
    assert driver.next(driver.control, (wire.HELLO, wire.HB))[0] == wire.HELLO
    driver.send(0, wire.WELCOME, w.incarnation)
    beat = driver.next(driver.control, (wire.HB,))
    assert beat == [wire.HB, RANK, w.incarnation, SPEC.bytes_per_block_per_rank, [0, 0, 0, 0, 0]] and w.welcomed
    driver.send(0, wire.STOP)
    assert driver.join() == 0
    assert driver.next(driver.control, (wire.BYE,)) == [wire.BYE, RANK, w.incarnation, "exit 0"]


def test_a_worker_not_yet_serving_has_no_store_faults(tmp_path):
    driver = Driver(str(tmp_path))
    try:
        assert RankWorker(driver.config(str(tmp_path))).store_faults() == [0, 0, 0]
    finally:
        driver.close()


def test_a_config_s_secret_goes_before_the_environment_s(driver, tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-the-environment")
    driver.start(driver.config(str(tmp_path), secret="from-the-config", lanes=1))
    assert driver.next(driver.control, (wire.HELLO,))[-2:] == [1, "from-the-config"]


def test_commands_are_answered_on_the_reply_channel_and_short_reads_counted(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    write = _command(C.WriteBlocks, 5, ("a", "b"), (1, 2))
    driver.submit(1, write, w.incarnation)
    assert driver.next(driver.reply, (wire.DONE,)) == [wire.DONE, RANK, w.incarnation, 5, 2, None]
    read = _command(C.ReadBlocks, 6, ("a", "b", "never"), (3, 4, 5))
    driver.submit(0, read, w.incarnation)
    assert driver.next(driver.reply, (wire.DONE,)) == [wire.DONE, RANK, w.incarnation, 6, 2, None]
    per_block = SPEC.bytes_per_block_per_rank
    deadline = time.monotonic() + 10
    beat = driver.next(driver.control, (wire.HB,))
    while beat[4] != [0, 1, 0, 0, 0] and time.monotonic() < deadline:
        beat = driver.next(driver.control, (wire.HB,))
    assert beat[3:] == [4 * per_block, [0, 1, 0, 0, 0]]  # two blocks written, two read; one read short
    assert w.store_faults() == [0, 1, 0] and w.counters["commands"] == 2


def test_a_failed_command_is_a_failure_not_a_short_read(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    write = _command(C.WriteBlocks, 7, ("a",), (BLOCKS + 3,))  # a block the worker's caches lack
    driver.submit(0, write, w.incarnation)
    done = driver.next(driver.reply, (wire.DONE,))
    assert done[:5] == [wire.DONE, RANK, w.incarnation, 7, 0] and done[5]
    assert w.store_faults() == [0, 0, 1]
    short_write = _command(C.WriteBlocks, 8, ("b", "c"), (1, 2))
    driver.submit(0, short_write, w.incarnation)
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [8, 2, None]
    assert w.store_faults() == [0, 0, 1]  # a write is never short


def _settled(driver: Driver, w: RankWorker, cid: int, lane: int = 0) -> None:
    """Wait until ``lane`` has run everything sent to it before: a write sent after, answered."""
    driver.submit(lane, _command(C.WriteBlocks, cid, ("sync",), (1,)), w.incarnation)
    assert driver.next(driver.reply, (wire.DONE,))[3] == cid


def test_each_stale_bad_or_notice_message_moves_its_own_counter_alone(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    assert w.counters == {"commands": 0, "stale": 0, "bad_messages": 0, "cancels": 0, "armed": 0, "disarmed": 0}
    inc = driver.welcome()[2]
    later = time.monotonic() + 30
    cases: list[tuple[Any, dict[str, int]]] = [
        (wire.command_message(_command(C.WriteBlocks, 9, ("a",), (1,)), inc + 1), {"stale": 1}),
        ((wire.CMD,), {"stale": 1}),  # no incarnation at all
        (b"\xc1 not msgpack", {"bad_messages": 1}),
        ((99, inc), {"bad_messages": 1}),  # no such type
        ((wire.CANCEL, inc, "nine"), {"bad_messages": 1}),
        ((wire.CANCEL, inc, 9, 1), {"bad_messages": 1}),
        ((wire.LAYERS, inc, 9), {"bad_messages": 1}),
        ((wire.LAYERS, inc, 9, 1.5), {"bad_messages": 1}),
        ((wire.LAYERS, inc, "nine", 1), {"bad_messages": 1}),
        ((wire.CMD, inc, 1, "ten"), {"bad_messages": 1}),  # a command missing its items, and its id
        ((wire.CANCEL, inc, 9), {"cancels": 1}),  # nothing owed under 9: a cancel of nothing
        ((wire.CANCEL, inc, 10), {"cancels": 1}),  # and another: each counts
        ((wire.LAYERS, inc, 9, 2), {}),
        ((wire.ARM, inc + 1, "r", ["a"], [1], later), {"stale": 1}),
        ((wire.ARM, inc, "r", ["a"], [1, 2], later), {"bad_messages": 1}),
        ((wire.DISARM, inc, "a"), {"bad_messages": 1}),
        ((wire.ARM, inc, "r", ["a"], [1], later), {}),  # a reference backend arms nothing
        ((wire.DISARM, inc, ["a"]), {}),
    ]
    for i, (message, moved) in enumerate(cases):
        before = dict(w.counters)
        if isinstance(message, bytes):
            driver.send(0, raw=message)
        else:
            driver.send(0, *message)
        _settled(driver, w, 100 + i)
        after = {k: v - before[k] for k, v in w.counters.items() if v != before[k]}
        assert after == {**moved, "commands": 1}, (message, after)


def test_a_command_it_cannot_take_is_answered_failed_at_once_and_counted(driver, tmp_path):
    """The driver need not wait out the command's deadline: the refusal is the answer."""
    w = driver.start(driver.config(str(tmp_path)))
    inc = driver.welcome()[2]
    msg = wire.unpack(wire.command_message(_command(C.WriteBlocks, 11, ("a",), (1,)), inc))
    msg[6] = [-5]
    driver.send(0, *msg)
    assert driver.next(driver.reply, (wire.DONE,))[1:] == [
        RANK, inc, 11, 0, f"rank {RANK} refused the command: command 11: block ids must be a list of ints >= 0"]
    driver.send(1, wire.CMD, inc, 1, 1)  # too short to be a command; its id is still read
    assert driver.next(driver.reply, (wire.DONE,))[3:5] == [1, 0]
    for bad in ([1 << 63], [0], []):  # no id the driver can owe, or none at all: nothing to answer
        driver.send(0, wire.CMD, inc, 1, *bad)
    _settled(driver, w, 13)
    _settled(driver, w, 14, lane=1)
    assert (w.counters["bad_messages"], w.counters["commands"]) == (5, 2)


def test_a_rejoin_draws_a_new_incarnation_and_says_hello_again(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    old = driver.welcome()[2]
    driver.send(0, wire.REJOIN, old + 1)  # another incarnation's: stale
    _settled(driver, w, 202)
    assert w.incarnation == old and w.welcomed
    driver.send(0, wire.REJOIN, old)
    hello = driver.next(driver.control, (wire.HELLO,))
    assert hello[2] == w.incarnation != old and isinstance(hello[2], int) and hello[2] > 0 and not w.welcomed
    assert driver.next(driver.control, (wire.HELLO,))[:3] == [wire.HELLO, RANK, w.incarnation]  # again, unwelcomed
    stale = _command(C.WriteBlocks, 12, ("a",), (1,))
    driver.submit(0, stale, old)
    _settled(driver, w, 203)
    assert w.counters["stale"] == 2 and w.counters["commands"] == 2  # the two that settled the lane


def test_a_refusal_of_its_own_hello_ends_it_with_status_2(driver, tmp_path, capfd):
    w = driver.start(driver.config(str(tmp_path)))
    hello = driver.next(driver.control, (wire.HELLO,))
    driver.send(0, wire.REFUSE, hello[2] + 1, "not you")  # a stale refusal changes nothing
    _settled(driver, w, 204)
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
    _patch_store(monkeypatch, "close", lambda close: lambda: (closed.append("store"), close())[1])
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


def _main(argv: list[str] | None) -> int:
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
        driver.next(driver.control, (wire.HELLO,))
        hello = driver.next(driver.control, (wire.HELLO,))  # the beats' own: every thread has started
        seen["sigint"] = signal.getsignal(signal.SIGINT)
        names = (f"kvstate-rank{RANK}-lane0", f"kvstate-rank{RANK}-lane1", f"kvstate-rank{RANK}-store")
        seen["daemons"] = {t.name: t.daemon for t in threading.enumerate() if t.name in names}
        seen["hello"] = hello
        driver.send(0, wire.STOP)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    assert _main([driver.config(str(tmp_path)).to_json()]) == 0
    player.join(10)
    assert seen["sigint"] == signal.SIG_IGN and seen["hello"][:2] == [wire.HELLO, RANK]
    assert seen["daemons"] == dict.fromkeys((f"kvstate-rank{RANK}-lane0", f"kvstate-rank{RANK}-lane1",
                                             f"kvstate-rank{RANK}-store"), True)  # served from a main thread
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 0"


def test_main_reports_a_store_it_cannot_open_with_status_2(driver, tmp_path, capfd):
    cfg = driver.config(str(tmp_path), store={"kind": "file", "root": str(tmp_path), "bogus": 1})
    assert _main([cfg.to_json()]) == 2
    assert capfd.readouterr().err == (f"kvstate rank worker {RANK}: error: a file store takes a root and a "
                                      "capacity_bytes only, got ['bogus', 'kind', 'root']\n")
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 2"  # the goodbye still goes, and says why


def test_a_layer_wise_save_waits_for_its_layers_off_the_lane_and_a_cancel_ends_one(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    inc = driver.welcome()[2]
    driver.submit(0, _command(C.SaveLayers, 21, ("s0", "s1"), (1, 2)), inc)
    driver.submit(0, _command(C.WriteBlocks, 22, ("w0",), (3,)), inc)
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [22, 1, None]  # the lane went on reading
    driver.send(0, wire.LAYERS, inc, 21, SPEC.num_layers)
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [21, 2, None]
    driver.submit(1, _command(C.SaveLayers, 23, ("s2",), (4,)), inc)
    driver.send(1, wire.CANCEL, inc, 23)
    done = driver.next(driver.reply, (wire.DONE,))  # stopped at once, nothing stored: before it ran, or
    assert done[3:5] == [23, 0] and done[5] in (None, "cancelled")  # while it waited for its layers
    assert w.counters["cancels"] == 1 and w.store_faults() == [0, 0, 1 if done[5] else 0]


def test_a_lend_waits_for_d_off_the_lane(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path), lends=str(tmp_path / "board")))
    inc = driver.welcome()[2]
    now = time.monotonic()
    lend = C.LendBlocks("req", 31, (0, 1), now + 2.0, ("l0",), (1,), fence=now + 3.0)
    driver.submit(0, lend, inc)
    driver.submit(0, _command(C.WriteBlocks, 32, ("w0",), (2,)), inc)
    assert driver.next(driver.reply, (wire.DONE,))[3] == 32  # answered while the lend waits for a D
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [31, 0, None]  # nobody pulled it by its deadline
    assert w.counters["commands"] == 2


def test_a_layer_wise_load_reports_its_arrivals_before_its_answer(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    inc = driver.welcome()[2]
    driver.submit(0, _command(C.WriteBlocks, 41, ("a", "b"), (1, 2)), inc)
    driver.next(driver.reply, (wire.DONE,))
    driver.submit(0, _command(C.LoadLayers, 42, ("a", "b"), (3, 4)), inc)
    assert driver.next(driver.control, (wire.ARRIVED,)) == [wire.ARRIVED, RANK, inc, 42, SPEC.num_layers]
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [42, 2, None]
    assert w._runner.arrivals(42, RANK) is None  # forgotten once answered


def test_whole_reads_are_not_short_and_every_short_or_broken_one_counts(driver, tmp_path):
    w = driver.start(driver.config(str(tmp_path)))
    inc = driver.welcome()[2]
    driver.submit(0, _command(C.WriteBlocks, 51, ("a", "b"), (1, 2)), inc)
    driver.next(driver.reply, (wire.DONE,))
    driver.submit(0, _command(C.ReadBlocks, 52, ("a", "b"), (3, 4)), inc)
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [52, 2, None]
    assert w.store_faults() == [0, 0, 0]  # whole
    for cid in (53, 54):
        driver.submit(0, _command(C.ReadBlocks, cid, ("a", "gone"), (3, 4)), inc)
        assert driver.next(driver.reply, (wire.DONE,))[3:] == [cid, 1, None]
    assert w.store_faults() == [0, 2, 0]
    for path in (tmp_path).rglob("*"):
        if path.is_file():
            path.write_bytes(b"\0" * path.stat().st_size)  # another process broke every stored byte
    driver.submit(0, _command(C.ReadBlocks, 55, ("a",), (3,)), inc)
    assert driver.next(driver.reply, (wire.DONE,))[3:] == [55, 0, None]
    w._runner.backend.broken_slots = 2  # as if the host tier had found two broken slots
    broken = w._runner.backend.broken_blocks
    assert broken >= 1 and w.store_faults() == [broken + 2, 3, 0]
    beat = driver.next(driver.control, (wire.HB,))
    while beat[4][0] != broken + 2:
        beat = driver.next(driver.control, (wire.HB,))
    assert beat[4] == [broken + 2, 3, 0, 0, 0]


def test_a_hello_carries_no_secret_where_none_is_given_and_the_state_pages_in_its_geometry(driver, tmp_path,
                                                                                          monkeypatch):
    from kvstate._layers import LayerGroup

    monkeypatch.delenv(SECRET_ENV, raising=False)
    groups = (LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4))
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2, groups=groups)
    driver.start(driver.config(str(tmp_path), spec={f: getattr(spec, f) for f in spec.__dataclass_fields__},
                               num_states=3, lanes=1))
    hello = driver.next(driver.control, (wire.HELLO,))
    assert hello[5] == wire.geometry(spec, BLOCKS, 3) and hello[5].endswith("states=3") and hello[7] == ""


def test_a_clean_stop_says_nothing_on_stderr_and_names_its_threads(driver, tmp_path, capfd, monkeypatch):
    checks: list[float] = []
    _patch_store(monkeypatch, "check", lambda check: lambda: (checks.append(time.monotonic()), check())[1])
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    mine = {t.name: t.daemon for t in threading.enumerate() if t.name.startswith(f"kvstate-rank{RANK}-")}
    assert mine == {f"kvstate-rank{RANK}-lane0": True, f"kvstate-rank{RANK}-lane1": True,
                    f"kvstate-rank{RANK}-store": True}
    deadline = time.monotonic() + 5
    while len(checks) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(checks) >= 3  # the store is probed every heartbeat
    sockets = len(w._sockets)
    for _ in range(5):
        driver.next(driver.control, (wire.HB,))
    assert len(w._sockets) == sockets <= 2 + 1  # its lanes and one control socket: a thread's made once
    w.stop()
    assert driver.join() == 0 and capfd.readouterr().err == ""
    assert not [t for t in threading.enumerate() if t.name.startswith(f"kvstate-rank{RANK}-")]


def test_a_resource_that_fails_to_close_is_reported_and_the_rest_still_close(driver, tmp_path, capfd, monkeypatch):
    def failing(close: Any) -> Any:
        def fail() -> None:
            raise RuntimeError("the pool is gone")

        return fail

    _patch_store(monkeypatch, "close", failing)
    w = driver.start(driver.config(str(tmp_path)))
    driver.welcome()
    w.stop()
    assert driver.join() == 0
    assert capfd.readouterr().err == f"kvstate rank worker {RANK}: while closing: RuntimeError: the pool is gone\n"
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 0" and w._ctx.closed


def test_main_reads_its_command_line_and_stops_on_sigterm(driver, tmp_path, monkeypatch):
    import signal

    monkeypatch.setattr(sys, "argv", ["kvstate-rankworker", driver.config(str(tmp_path)).to_json()])

    def play() -> None:
        driver.next(driver.control, (wire.HELLO,))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as the kernel would deliver it

    player = threading.Thread(target=play, daemon=True)
    player.start()
    assert _main(None) == 0
    player.join(10)
    assert driver.next(driver.control, (wire.BYE,))[3] == "exit 0"


def test_over_tcp_a_worker_talks_curve_with_one_keypair_to_the_driver_it_knows_by_key(tmp_path):
    driver = Driver(str(tmp_path), curve=True)
    try:
        w = driver.start(driver.config(str(tmp_path / "pool")))
        inc = driver.welcome()[2]
        driver.submit(1, _command(C.WriteBlocks, 61, ("a",), (1,)), inc)
        assert driver.next(driver.reply, (wire.DONE,))[3:] == [61, 1, None]
        public, secret = w._curve
        assert len(public) == len(secret) == 40 and public != secret  # made once, for every socket
    finally:
        driver.close()
