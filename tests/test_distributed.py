"""kvstate across processes: the wire format, shared caches, the process driver and its workers."""
from __future__ import annotations

import signal
import sys
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from procrig import FAST, SPEC, ProcRig, alive

from kvstate import CacheSpec, ConfigError, DriverError, ProtocolError, ValidationError
from kvstate import commands as C
from kvstate.distributed import ProcessDriver, RankDown, RankUp, SharedCaches, WorkerConfig
from kvstate.distributed import _wire as wire
from kvstate.distributed._pdlink import Link

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm, /proc)")


def cmd(cls=C.WriteBlocks, cid=1, keys=("a", "b"), blocks=(3, 4), **kw):
    now = time.monotonic()
    return cls("r", cid, (0, 1), now + 10, tuple(keys), tuple(blocks), fence=now + 20, **kw)


# -- the wire format --------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [cmd(), cmd(C.ReadBlocks), cmd(C.ReadBlocks, window_from=1), cmd(C.LoadLayers),
                               cmd(C.SaveLayers), cmd(states=((1, 0), (2, 3))), cmd(C.ReadBlocks, states=((2, 1),)),
                               cmd(C.SwapOut, host_slots=(0, 1)), cmd(C.SwapIn, host_slots=(5, 6)),
                               cmd(C.FlushHost, blocks=(), host_slots=(1, 2)), cmd(tables=((5, 6), (7, 8))),
                               cmd(C.ReadBlocks, window_from=1, tables=((5, 6),)),
                               cmd(C.WriteBlocks, window_from=1, tables=((5, 6),)), cmd(C.LendBlocks),
                               cmd(C.LendBlocks, stores=True)])
def test_every_command_crosses_the_wire_for_one_rank(c):
    items = wire.unpack(wire.command_message(c, 77))
    assert items[1] == 77
    back = wire.command_of(items, 1)
    assert type(back) is type(c) and back.ranks == (1,)
    assert (back.command_id, back.request_id, back.keys, back.block_ids, back.deadline, back.fence) == \
        (c.command_id, c.request_id, c.keys, c.block_ids, c.deadline, c.fence)
    assert getattr(back, "host_slots", ()) == getattr(c, "host_slots", ())
    assert getattr(back, "window_from", 0) == getattr(c, "window_from", 0)
    assert back.states == c.states and back.tables == c.tables
    assert getattr(back, "stores", False) == getattr(c, "stores", False)


@pytest.mark.parametrize("items, needle", [
    ([wire.CMD, 1, 10, 1, "r", [], [], [], 1.0, 2.0, 0, [], []], "command kind"),
    ([wire.CMD, 1, 1, 0, "r", [], [], [], 1.0, 2.0, 0, [], []], "command id"),
    ([wire.CMD, 1, 1, 1, "", [], [], [], 1.0, 2.0, 0, [], []], "request id"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [], [], 1.0, 2.0, 0, [], []], "do not fit"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [True], [], 1.0, 2.0, 0, [], []], "block ids"),
    ([wire.CMD, 1, 1, 1, "r", [1], [1], [], 1.0, 2.0, 0, [], []], "a key"),
    ([wire.CMD, 1, 5, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [], []], "do not fit"),
    ([wire.CMD, 1, 1, 1, "r", [], [], [], float("nan"), 2.0, 0, [], []], "deadline"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 2, [], []], "window's first key"),
    ([wire.CMD, 1, 5, 1, "r", ["k"], [1], [1], 1.0, 2.0, 1, [], []], "a SwapOut has no window"),
    ([wire.CMD, 1, 9, 1, "r", ["k"], [1], [], 1.0, 2.0, 1, [], []], "a LendBlocks has no window"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [1], []], "states must be"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [2, 0], []], "states must be"),
    ([wire.CMD, 1, 1, 1, "r", ["k", "j"], [1, 2], [], 1.0, 2.0, 0, [2, 0, 1, 1], []], "states must be"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [1, -1], []], "states"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [], [[2, 3]]], "each group table must hold 1"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [], [3]], "a group table"),
    ([wire.CMD, 1, 1, 1, "r", ["k"], [1], [], 1.0, 2.0, 0, [], {}], "group tables must be a list"),
    ([wire.CMD, 1, 1, 1, "r", [], [], [], 1.0, 2.0, 0, []], "items after its type"),
])
def test_a_bad_command_is_refused_with_the_rule(items, needle):
    with pytest.raises(ProtocolError, match=needle):
        wire.command_of(wire.unpack(msgpack.packb(items)), 0)


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([]), msgpack.packb(["x"]),
                                  msgpack.packb([wire.DONE, 0, 0, 1, 1, None]), msgpack.packb([wire.HB, 0, 1]),
                                  msgpack.packb([wire.DONE, -1, 1, 1, 1, None]), msgpack.packb([99, 1, 2]),
                                  msgpack.packb([wire.DONE, 0, 1, 1, 1, 5]), msgpack.packb([wire.HB, True, 1, 0])])
def test_a_bad_worker_message_is_refused(data):
    with pytest.raises(ProtocolError):
        wire.from_worker(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoders(data):
    for decode in (wire.from_worker, lambda d: wire.command_of(wire.unpack(d), 0)):
        try:
            decode(data)
        except ProtocolError:
            pass


# -- shared caches ----------------------------------------------------------------------------------
def test_shared_caches_are_one_memory_for_creator_and_worker():
    with SharedCaches.create(SPEC, 8) as mine:
        theirs = SharedCaches.attach(SPEC, 8, mine.paths)
        try:
            mine.caches[1]["value"][1][5] = 7.0
            assert np.all(theirs.caches[1]["value"][1][5] == 7.0)
            assert theirs.caches[0]["key"][0].shape == (8,) + SPEC.block_shape("key")
        finally:
            theirs.close()
        assert all(__import__("os").path.exists(p) for p in mine.paths.values())  # a worker's close keeps them
        with SharedCaches.attach(SPEC, 8, mine.paths) as again:
            assert np.all(again.caches[1]["value"][1][5] == 7.0)
        paths = list(mine.paths.values())
    assert not any(__import__("os").path.exists(p) for p in paths)  # the creator removed them


def test_attaching_with_another_geometry_is_refused():
    with SharedCaches.create(SPEC, 8) as mine, pytest.raises(ConfigError, match="geometries differ"):
        SharedCaches.attach(SPEC, 16, mine.paths)


@pytest.mark.parametrize("cfg,needle", [
    ({"kind": "file"}, "takes a root"),
    ({"kind": "file", "root": "ROOT", "size": 1}, "takes a root and a capacity_bytes only"),
    ({"kind": "file", "root": "ROOT", "capacity_bytes": -5}, "capacity_bytes"),
    ({"kind": "memory"}, "no store of kind 'memory'"),
])
def test_a_workers_store_configuration_is_checked_before_it_opens(tmp_path, cfg, needle):
    from kvstate import KVStateError
    from kvstate.distributed._rankworker import build_store

    root = tmp_path / "pool"
    cfg = {k: str(root) if v == "ROOT" else v for k, v in cfg.items()}
    with pytest.raises(KVStateError, match=needle):
        build_store(cfg)
    assert not root.exists()
    store = build_store({"kind": "file", "root": str(root), "capacity_bytes": 64})
    assert store.capacity_bytes == 64


# -- the process driver -----------------------------------------------------------------------------
def test_the_handoff_through_rank_worker_processes_is_byte_exact(tmp_path):
    rig = ProcRig(str(tmp_path))
    try:
        r = rig.run(24)
        assert (r["ended"], r["leaked"], r["pending"], r["live"], r["mismatched"]) == (24, 0, 0, 0, 0)
        assert r["checked"] > 100
        assert [type(n) for n in rig.driver("P").notices()] == [RankUp, RankUp]
        pids = rig.worker_pids()
    finally:
        rig.close()
    assert not [p for p in pids if alive(p)]


@pytest.mark.parametrize("group_tables", [False, True])
def test_window_first_reads_run_in_the_workers_and_bring_every_needed_byte(tmp_path, group_tables):
    """A window layer (8 tokens) beside a full one: D's reads of prompts up to 48 tokens leave
    the window layer's early blocks in the store, and every byte D's decode needs is P's; with
    a block table per group, the commands carry the full group's table to the workers."""
    from kvstate._layers import LayerGroup

    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2,
                     groups=(LayerGroup("window", (0,), window=8), LayerGroup("full", (1,))), group_tables=group_tables)
    rig = ProcRig(str(tmp_path), spec=spec)
    windows = []
    try:
        r = rig.run(24, on_submit=lambda side, c: windows.append((getattr(c, "window_from", 0), len(c.tables)))
                    if isinstance(c, C.TransferCommand) else None)
        assert (r["ended"], r["leaked"], r["pending"], r["live"], r["mismatched"]) == (24, 0, 0, 0, 0)
        assert max(w for w, _ in windows) > 0 and r["checked"] > 100
        assert {t for _, t in windows} == {int(group_tables)}
        # a write-back's freed window entries cross the wire: every transfer answered, none waited out
        assert (rig.P.counters["expired"], rig.D.counters["expired"]) == (0, 0)
    finally:
        rig.close()


def test_a_host_tier_swap_runs_in_the_workers(tmp_path):
    import dataclasses
    rig = ProcRig(str(tmp_path), d_host_blocks=48, d_policy=dataclasses.replace(FAST, preempt="swap"))
    kinds = set()
    try:
        r = rig.run(24, on_submit=lambda side, c: kinds.add(type(c).__name__))
        assert (r["ended"], r["leaked"], r["pending"], r["mismatched"]) == (24, 0, 0, 0)
    finally:
        rig.close()
    assert {"SwapOut", "SwapIn"} <= kinds


def test_layer_wise_commands_cross_processes(tmp_path):
    """A SaveLayers waits in its worker for the layers reported from the scheduler; a
    LoadLayers reports its arrivals back, already in place."""
    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2, layer_groups=4)
    with SharedCaches.create(spec, 16) as caches, ProcessDriver(spec, 16) as drv:
        store = {"kind": "file", "root": str(tmp_path)}
        for r in range(2):
            drv.spawn(r, store, caches={"kind": "shm", "paths": caches.paths})
        drv.wait_ready(60)
        caches.caches[0]["key"][2][3] = 5.0
        save = cmd(C.SaveLayers, cid=1, keys=("k1",), blocks=(3,))
        drv.submit(save)
        assert drv.poll(0.3) == []  # waiting for its layers
        drv.submit(C.LayersReady("r", 1, 2))
        assert drv.poll(0.3) == []  # two of four layers: half the groups stored
        drv.submit(C.LayersReady("r", 1, 4))
        answers = []
        while len(answers) < 2:
            answers += drv.poll(5)
        assert sorted((a.rank, a.count, a.error) for a in answers) == [(0, 1, None), (1, 1, None)]
        load = cmd(C.LoadLayers, cid=2, keys=("k1",), blocks=(7,))
        drv.submit(load)
        arrivals = drv.arrivals(2, 0)
        ok, event = arrivals.wait(4, 10)
        assert ok and event is None
        while len(answers) < 4:
            answers += drv.poll(5)
        assert np.all(caches.caches[0]["key"][2][7] == 5.0)


def test_a_rank_count_mismatch_is_one_config_error_at_start(tmp_path):
    other = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=4)
    with ProcessDriver(SPEC, 16, restart=False) as drv:
        cfg = drv.worker_config(1, {"kind": "file", "root": str(tmp_path)})
        cfg.spec = {**cfg.spec, "tp_size": other.tp_size}
        drv.control.spawn(cfg)
        with pytest.raises(ConfigError, match="rank 1's worker has TP 4, the scheduler 2"):
            drv.wait_ready(30)
        assert drv.child(1).wait(10) == 2  # refused: it exits on its own


def test_a_geometry_mismatch_is_refused(tmp_path):
    with ProcessDriver(SPEC, 16, restart=False) as drv:
        cfg = drv.worker_config(0, {"kind": "file", "root": str(tmp_path)})
        cfg.num_blocks = 32
        drv.control.spawn(cfg)
        with pytest.raises(ConfigError, match="another cache geometry"):
            drv.wait_ready(30)


def test_a_refused_workers_output_goes_to_its_log_file(tmp_path):
    """With ``log_path`` a worker's stderr (here: the scheduler's refusal) lands in its file,
    not in the engine's; a log path that cannot be opened is refused before any start."""
    log = tmp_path / "rank1.log"
    with ProcessDriver(SPEC, 16, restart=False) as drv:
        cfg = drv.worker_config(1, {"kind": "file", "root": str(tmp_path)})
        cfg.num_blocks = 32
        drv.control.spawn(cfg, str(log))
        with pytest.raises(ConfigError, match="another cache geometry"):
            drv.wait_ready(30)
        assert drv.child(1).wait(10) is not None
        assert "rank worker 1: refused by the scheduler" in log.read_text()
        with pytest.raises(ConfigError, match="cannot open its log file"):
            drv.spawn(0, {"kind": "file", "root": str(tmp_path)}, log_path=tmp_path / "no" / "such.log")
        assert drv.child(0) is None


@pytest.mark.parametrize("kw, needle", [
    ({"address": "udp://x"}, "address must be 'ipc' or 'tcp://HOST'"),
    ({"address": "tcp://127.0.0.1:5555"}, "ports are chosen"),
    ({"address": "tcp://no-such-host.invalid"}, "cannot listen"),
    ({"heartbeat_s": 0}, "heartbeat_s"),
    ({"heartbeat_s": 1.0, "dead_after_s": 1.5}, "must exceed two heartbeats"),
    ({"spin_us": -1}, "spin_us"),
])
def test_driver_configuration_errors(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ProcessDriver(SPEC, 16, **kw)


def test_a_port_in_use_is_a_config_error():
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            Link(f"tcp://127.0.0.1:{port}")
    finally:
        s.close(0)
        ctx.term()


@pytest.mark.parametrize("field, value, needle", [
    ("rank", 2, "outside the spec's 2 TP ranks"), ("store", {"kind": "memory"}, "other processes reach too"),
    ("command_address", "http://x", "tcp://, ipc://"), ("lanes", 0, "lanes"), ("backend", "tpu", "backend"),
])
def test_worker_configuration_errors(field, value, needle, tmp_path):
    with ProcessDriver(SPEC, 16) as drv:
        cfg = drv.worker_config(0, {"kind": "file", "root": str(tmp_path)})
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=needle):
        cfg.validate()
    with pytest.raises(ConfigError):
        WorkerConfig.from_json("{not json")


def test_bad_and_stale_messages_are_counted_never_applied(tmp_path):
    """Garbage, a DONE from another incarnation, for an unknown command, or of an unknown
    rank: counted, dropped, and the driver and its workers go on serving."""
    with SharedCaches.create(SPEC, 16) as caches, ProcessDriver(SPEC, 16) as drv:
        for r in range(2):
            drv.spawn(r, {"kind": "file", "root": str(tmp_path)}, caches={"kind": "shm", "paths": caches.paths})
        drv.wait_ready(60)
        ctx = zmq.Context()
        rogue = {ch: ctx.socket(zmq.PUSH) for ch in ("reply", "control")}
        rogue["reply"].connect(drv.addresses[1])
        rogue["control"].connect(drv.addresses[2])
        inc = drv.control.ranks.incarnation(0)
        drv.submit(cmd(cid=5, keys=(), blocks=()))
        beat = wire.pack(wire.HB, 0, inc, 0, [0, 0, 0, 0, 0])  # a heartbeat on the reply channel: refused
        for ch, data in (("reply", b"garbage"), ("control", b"\x93\x01"), ("reply", beat),
                         ("reply", wire.pack(wire.DONE, 7, inc, 5, 0, None)),
                         ("control", wire.pack(wire.HELLO, 9, 1, 1, 2, "x", 1))):
            rogue[ch].send(data)
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += drv.poll(0.5)
        rogue["reply"].send(wire.pack(wire.DONE, 0, inc + 1, 5, 0, None))  # another incarnation
        rogue["reply"].send(wire.pack(wire.DONE, 0, inc, 5, 0, None))  # answered already: a duplicate
        rogue["reply"].send(wire.pack(wire.DONE, 0, inc, 999, 0, None))  # never sent
        time.sleep(0.3)
        assert drv.poll(0.2) == []
        assert sorted((c.rank, c.count) for c in got) == [(0, 0), (1, 0)]
        assert drv.counters["bad_messages"] == 5 and drv.counters["stale"] == 3
        for s in rogue.values():
            s.close(0)
        ctx.term()
        drv.submit(cmd(cid=6, keys=(), blocks=()))  # still serving
        again = []
        while len(again) < 2:
            again += drv.poll(5)


def test_submit_after_close_and_a_close_that_leaves_nothing(tmp_path):
    drv = ProcessDriver(SPEC, 16)
    for r in range(2):
        drv.spawn(r, {"kind": "file", "root": str(tmp_path)})
    drv.wait_ready(60)
    pids = [drv.child(r).pid for r in range(2)]
    drv.close(timeout=10)
    assert not [p for p in pids if alive(p)]
    with pytest.raises(DriverError, match="after close"):
        drv.submit(cmd())
    drv.close()  # idempotent


def test_a_worker_killed_is_declared_down_at_once_and_restarted(tmp_path):
    with ProcessDriver(SPEC, 16, dead_after_s=1.0) as drv:
        for r in range(2):
            drv.spawn(r, {"kind": "file", "root": str(tmp_path)})
        drv.wait_ready(60)
        drv.notices()
        old = drv.child(0).pid
        drv.child(0).signal(signal.SIGKILL)
        t0 = time.monotonic()
        notes: list = []
        while not any(isinstance(n, RankUp) for n in notes) and time.monotonic() - t0 < 20:
            notes += drv.notices()
            time.sleep(0.01)
        assert isinstance(notes[0], RankDown) and "exited" in notes[0].reason
        assert isinstance(notes[-1], RankUp) and notes[-1].pid != old
        assert drv.counters["restarts"] == 1


def test_link_refuses_bad_messages_and_never_blocks_a_sender(tmp_path):
    with Link(f"ipc://{tmp_path}/a") as a, Link(f"ipc://{tmp_path}/b") as b:
        a.connect("b", b.address)
        a.connect("nobody", f"ipc://{tmp_path}/nobody")
        assert a.send("b", "first_token", "r1", 7, 200) and a.send("b", "abort", "r2")
        with pytest.raises(ProtocolError):
            a.send("b", "first_token", "r1")
        ctx = zmq.Context()
        raw = ctx.socket(zmq.PUSH)
        raw.connect(b.address)
        for data in (b"junk", msgpack.packb(["first_token", "r", "x", 200]), msgpack.packb(["nope"]),
                     msgpack.packb(["abort", 3]), msgpack.packb(["first_token", "r", True, 200])):
            raw.send(data)
        time.sleep(0.2)
        got = b.receive(1.0)
        assert got == [("first_token", ["r1", 7, 200]), ("abort", ["r2"])]
        assert b.counters["bad_messages"] == 5
        raw.close(0)
        ctx.term()
        t = time.monotonic()
        sent = sum(a.send("nobody", "abort", f"r{i}") for i in range(20_000))  # nobody reads: queue fills
        assert time.monotonic() - t < 5 and a.counters["dropped"] == 20_000 - sent > 0


def test_frames_sent_to_the_command_socket_are_dropped_and_memory_stays_flat():
    """No worker sends on the command socket, so a peer's frames there are refused at the
    socket (the peer is disconnected): 20 MB frames used to stay queued in the driver, one after
    another."""
    import os
    import time

    import zmq

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with ProcessDriver(SPEC, 16, restart=False) as drv:
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.SNDTIMEO, 2000)
        peer.connect(drv.addresses[0])
        frame = b"x" * (20 << 20)
        try:
            peer.send(frame)  # the first costs a frame's buffer once, wherever it is dropped
            time.sleep(0.5)
            base = rss()
            for _ in range(4):
                peer.send(frame)
            # the frames in flight hold their buffers for a moment (here up to 0.7 s, longer on a
            # busy machine): wait for the memory to come back; queued frames would hold +80 MB
            deadline = time.monotonic() + 10.0
            while rss() - base >= 10 << 20 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert rss() - base < 10 << 20  # the next four do not add up
        finally:
            peer.close()


def test_a_foreign_hello_for_a_live_rank_changes_nothing(tmp_path):
    """Hellos for a rank whose worker is live (another incarnation, with the right geometry or
    a wrong one) are dropped and counted: the live worker is neither replaced, nor killed, nor
    sent the refusal (which used to go down its route, and it obeyed and exited)."""
    with ProcessDriver(SPEC, 16, restart=True, heartbeat_s=0.1, dead_after_s=2.0) as drv:
        drv.spawn(0, {"kind": "file", "root": str(tmp_path)})
        drv.spawn(1, {"kind": "file", "root": str(tmp_path)})
        drv.wait_ready(60)
        pid = drv.child(0).pid
        forger = zmq.Context.instance().socket(zmq.PUSH)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(drv.addresses[2])
        geometry = wire.geometry(SPEC, 16)
        try:
            for inc in range(1, 41):  # with the start's secret (a second worker of this engine's, say)
                forger.send(wire.pack(wire.HELLO, 0, 10_000 + inc, 4242, SPEC.tp_size, geometry, 1, drv.secret))
                forger.send(wire.pack(wire.HELLO, 0, 20_000 + inc, 4242, SPEC.tp_size, "other-geometry", 1,
                                      drv.secret))
            time.sleep(1.0)
        finally:
            forger.close()
        assert drv.counters["foreign_hellos"] == 80 and drv.counters["refused"] == 0
        assert drv.counters["restarts"] == 0 and drv.child(0).pid == pid and drv.child(0).alive()
        assert not any(isinstance(n, RankDown) for n in drv.notices())
        assert drv.control.info()["up"] == [0, 1]


def test_rank_workers_report_their_store_faults_to_the_driver_and_its_metrics(tmp_path):
    """A read of keys the store lacks stops short on every rank: each worker counts it and says
    so in its next heartbeat; the driver sums its workers' reports, and the Prometheus collector
    exposes them beside the lifecycles' counters."""
    pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus_client) is not installed")
    from prometheus_client import CollectorRegistry

    from kvstate import DecodeLifecycle
    from kvstate.prometheus import KVStateCollector

    with SharedCaches.create(SPEC, 16) as caches, ProcessDriver(SPEC, 16, heartbeat_s=0.1) as drv:
        for r in range(2):
            drv.spawn(r, {"kind": "file", "root": str(tmp_path)}, caches={"kind": "shm", "paths": caches.paths})
        drv.wait_ready(60)
        assert drv.store_faults() == {"broken": 0, "short": 0, "failed": 0}
        drv.submit(cmd(C.ReadBlocks, cid=3, keys=("nowhere-0", "nowhere-1"), blocks=(1, 2)))
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += drv.poll(0.5)
        assert sorted((c.rank, c.count) for c in got) == [(0, 0), (1, 0)]
        deadline = time.monotonic() + 5
        while drv.store_faults()["short"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the next heartbeats carry the counts
        assert drv.store_faults() == {"broken": 0, "short": 2, "failed": 0}
        registry = CollectorRegistry()
        registry.register(KVStateCollector({"D": DecodeLifecycle(SPEC, 16)}, {"D": drv}))
        assert registry.get_sample_value("kvstate_store_faults_total", {"role": "D", "kind": "short"}) == 2.0


def test_a_hello_without_the_starts_secret_is_dropped_and_counted(tmp_path):
    """Anyone who reaches the control socket can send a hello; only one carrying the secret
    the driver made for this start (passed to its workers through the environment, never on a
    command line) is a worker's. Others are dropped and counted, whatever rank they claim."""
    with ProcessDriver(SPEC, 16, restart=False, heartbeat_s=0.1) as drv:
        drv.spawn(0, {"kind": "file", "root": str(tmp_path)})
        deadline = time.monotonic() + 60
        while 0 not in drv.control.info()["up"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker it started joins, with the secret from its environment
        forger = zmq.Context.instance().socket(zmq.PUSH)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(drv.addresses[2])
        geometry = wire.geometry(SPEC, 16)
        try:
            for secret in ("", "0" * 32, drv.secret[:-1]):
                forger.send(wire.pack(wire.HELLO, 1, 77, 4242, SPEC.tp_size, geometry, 1, secret))
            deadline = time.monotonic() + 10
            while drv.counters["unauthenticated_hellos"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            forger.close()
        assert drv.counters["unauthenticated_hellos"] == 3
        assert 1 not in drv.control.info()["up"]  # rank 1 has no worker: no forged one took it
        assert drv.secret not in " ".join(drv.child(0).popen.args)  # not on the worker's command line
        assert drv.control.info()["up"] == [0]  # the worker it started joined


def test_over_tcp_the_link_is_encrypted_and_a_peer_without_the_key_is_not_heard(tmp_path):
    """Over tcp the driver's sockets are CURVE servers under a key made for this start: its
    worker (told the public key) joins and serves commands byte-exact, while a peer that
    connects in the clear, even with the start's secret, completes no handshake and is never
    heard, not even counted."""
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=1)
    with SharedCaches.create(spec, 16) as caches, \
            ProcessDriver(spec, 16, address="tcp://127.0.0.1", restart=False, heartbeat_s=0.1) as drv:
        assert len(drv.curve_key) == 40 and all(a.startswith("tcp://127.0.0.1:") for a in drv.addresses)
        cfg = drv.worker_config(0, {"kind": "file", "root": str(tmp_path)}, caches={"kind": "shm",
                                                                                   "paths": caches.paths})
        assert cfg.curve_key == drv.curve_key
        drv.spawn(0, {"kind": "file", "root": str(tmp_path)}, caches={"kind": "shm", "paths": caches.paths})
        drv.wait_ready(60)
        caches.caches[0]["key"][0][3] = 7.0
        with pytest.raises(ValidationError, match="names ranks"):  # a rank this driver does not have
            drv.submit(cmd(cid=9, keys=("k",), blocks=(3,)))
        now = time.monotonic()
        drv.submit(C.WriteBlocks("r", 1, (0,), now + 10, ("k",), (3,), fence=now + 20))
        (done,) = drv.poll(10)
        assert (done.count, done.error) == (1, None)
        drv.submit(C.ReadBlocks("r", 2, (0,), now + 10, ("k",), (9,), fence=now + 20))
        (read,) = drv.poll(10)
        assert read.count == 1 and np.all(caches.caches[0]["key"][0][9] == 7.0)
        clear = zmq.Context.instance().socket(zmq.PUSH)
        clear.setsockopt(zmq.LINGER, 0)
        clear.connect(drv.addresses[2])
        try:
            for secret in ("0" * 32, drv.secret):  # in the clear, a wrong one would be counted
                clear.send(wire.pack(wire.HELLO, 0, 77, 4242, 1, wire.geometry(spec, 16), 1, secret), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no handshake, no peer to queue for: what a clear peer gets
        finally:
            clear.close()
        time.sleep(1.0)
        assert drv.counters["unauthenticated_hellos"] == 0 and drv.counters["foreign_hellos"] == 0
        assert drv.counters["bad_messages"] == 0 and drv.control.info()["up"] == [0]  # its worker, untouched
