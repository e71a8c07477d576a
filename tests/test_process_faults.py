"""Faults with real processes: every request ends, no block leaks, no byte is wrong, nobody is left.

Each test runs P and D engines (tests/procrig.py) whose rank workers are separate processes,
on a FileStore, with short deadlines (transfer 3 s, fence grace 2 s), and breaks something.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq
from needs import mooncake_missing
from procrig import FAST, ProcRig, alive

from kvstate import commands as C
from kvstate.app._demo import DemoConfig
from kvstate.app._procdemo import run_processes
from kvstate.backends._shm import shm_directory
from kvstate.distributed import RankDown, RankUp
from kvstate.distributed._supervise import remove_orphans

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/proc, PR_SET_PDEATHSIG)")

BOUND = FAST.transfer_timeout + FAST.fence_grace + 5.0  #: a request's life with a fault: deadline + grace + slack


def healthy(r: dict) -> None:
    assert r["ended"] == r["requests"], r
    assert (r["leaked"], r["pending"], r["live"], r["mismatched"]) == (0, 0, 0, 0), r
    assert r["checked"] > 0


def lifetimes_within(rig: ProcRig, bound: float) -> None:
    longest = max(rig.ended_at[rid] - rig.started_at[rid] for rid in rig.ended_at)
    assert longest <= bound, f"a request took {longest:.1f} s, over deadline + grace + slack ({bound} s)"


def kill_when(side: str, kind: type, rank: int = 1):
    """An on_submit hook: the first time ``side`` submits a ``kind``, stop rank's worker (so
    the command waits in it unanswered) and kill it 50 ms later."""
    state = {"done": False, "pid": None}

    def hook(rig: ProcRig):
        def on_submit(name: str, cmd: C.Command) -> None:
            if state["done"] or name != side or cmd.__class__ is not kind:
                return
            state["done"] = True
            child = rig.driver(side).child(rank)
            state["pid"] = child.pid
            child.signal(signal.SIGSTOP)
            threading.Timer(0.05, child.signal, (signal.SIGKILL,)).start()
        return on_submit
    return hook, state


@pytest.mark.slow
@pytest.mark.parametrize("side, kind, d_host", [("P", C.WriteBlocks, 0), ("D", C.ReadBlocks, 0),
                                                 ("D", C.SwapOut, 64)], ids=["write", "read", "swap"])
def test_kill_9_of_a_rank_worker_mid_transfer(side, kind, d_host, tmp_path):
    d_policy = dataclasses.replace(FAST, preempt="swap") if d_host else None
    rig = ProcRig(str(tmp_path), d_host_blocks=d_host, d_policy=d_policy)
    hook, state = kill_when(side, kind)
    try:
        r = rig.run(32, on_submit=hook(rig))
        healthy(r)
        lifetimes_within(rig, BOUND)
        assert state["done"], f"no {kind.__name__} was submitted"
        drv = rig.driver(side)
        notes = drv.notices()
        assert any(isinstance(n, RankDown) and n.rank == 1 for n in notes), notes
        assert any(isinstance(n, RankUp) and n.rank == 1 for n in notes[1:]), notes  # restarted, rejoined
        assert drv.counters["restarts"] >= 1 and not alive(state["pid"])
        assert Counter(s for s, *_ in r["outcome"].values())["done"] > 0
    finally:
        pids = rig.worker_pids()
        rig.close()
    assert not [p for p in pids if alive(p)]


@pytest.mark.slow
def test_a_stopped_rank_is_declared_dead_and_its_late_answers_are_stale(tmp_path):
    """SIGSTOP a D worker past the heartbeat limit (restart off: it is not killed), then SIGCONT:
    its read was answered lost, so its late answer is dropped as stale; it rejoins as a new
    incarnation and serves again. The lost read's blocks stay pinned until its fence."""
    rig = ProcRig(str(tmp_path), restart=False, dead_after_s=1.0)
    state = {"cmd": None}

    def on_submit(name, cmd):
        if state["cmd"] is None and name == "D" and cmd.__class__ is C.ReadBlocks:
            state["cmd"] = cmd
            child = rig.driver("D").child(1)
            child.signal(signal.SIGSTOP)
            threading.Timer(1.6, child.signal, (signal.SIGCONT,)).start()
    try:
        r = rig.run(24, on_submit=on_submit, timeout=90)
        healthy(r)
        drv = rig.driver("D")
        notes = drv.notices()
        kinds = [(type(n).__name__, n.rank) for n in notes]
        assert ("RankDown", 1) in kinds and kinds.index(("RankUp", 1), kinds.index(("RankDown", 1))) > 0, kinds
        assert drv.counters["stale"] >= 1 and drv.counters["restarts"] == 0
        assert rig.D.counters["lost_answers"] >= 1 and rig.D.counters["stale_completions"] == 0
    finally:
        rig.close()


class Shim:
    """Forwards a worker's answers to the driver, dropping every ``drop``-th and sending every
    ``dup``-th twice."""

    def __init__(self, address: str, target: str, drop: int, dup: int) -> None:
        self.ctx = zmq.Context()
        self.pull, self.push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.pull.bind(address)
        self.push.connect(target)
        self.drop, self.dup = drop, dup
        self.counts = Counter()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while self.running:
            if not self.pull.poll(50):
                continue
            data = self.pull.recv()
            n += 1
            if n % self.drop == 0:
                self.counts["dropped"] += 1
                continue
            self.push.send(data)
            if n % self.dup == 0:
                self.counts["duplicated"] += 1
                self.push.send(data)

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()


@pytest.mark.slow
def test_lost_and_duplicated_answers_are_counted_never_applied(tmp_path):
    """Rank 1 of P answers through a shim that drops every 9th answer and repeats every 4th:
    every repeat is counted stale by the driver and never reaches the lifecycle; every drop
    is a command that expires at its deadline and resolves as the policy says."""
    rig = ProcRig(str(tmp_path))
    drv = rig.driver("P")
    child = drv.child(1)
    drv.control.restart = False
    child.stop(5)  # replace rank 1's worker with one that answers through the shim
    deadline = time.monotonic() + 10
    while not any(isinstance(n, RankDown) for n in drv.notices()) and time.monotonic() < deadline:
        time.sleep(0.05)
    shim = Shim(f"ipc://{tmp_path}/shim", drv.addresses[1], drop=9, dup=4)
    try:
        cfg = drv.worker_config(1, rig.store, caches={"kind": "shm", "paths": rig.sides["P"].caches.paths})
        cfg.reply_address = f"ipc://{tmp_path}/shim"
        drv.control.spawn(cfg)
        drv.wait_ready(30)
        r = rig.run(40, timeout=120)
        healthy(r)
        assert shim.counts["duplicated"] > 0 and shim.counts["dropped"] > 0
        assert drv.counters["stale"] == shim.counts["duplicated"]
        assert rig.P.counters["stale_completions"] == 0  # none reached the lifecycle
        assert rig.P.counters["expired"] >= shim.counts["dropped"] - 1  # each dropped answer's command expired
    finally:
        rig.close()
        shim.close()


@pytest.mark.slow
def test_kill_9_of_the_d_scheduler_while_p_writes():
    """The whole demo as processes; the D scheduler is killed early. P goes on: its requests
    end, nothing of its is left pending or holding a block, and no process survives."""
    killed = {}

    def on_start(children):
        d = children["decode"]
        killed["pid"] = d.pid
        threading.Timer(0.4, d.signal, (signal.SIGKILL,)).start()

    s = run_processes(DemoConfig(requests=300, concurrency=32), timeout=120, on_start=on_start)
    assert s["schedulers_reported"] == ["prefill"] and s["unfinished"] > 0
    assert s["leaked_blocks"] == 0 and s["pending_commands"] == 0 and s["blocks_mismatched"] == 0
    assert s["live_requests"] == 0
    pids = [p for pids in s["pids"].values() for p in pids]
    assert not [p for p in pids if alive(p)], "processes left"
    left = [e for d in (shm_directory(), Path(tempfile.gettempdir())) for e in d.glob("kvstate-*")
            if any(e.name.startswith((f"kvstate-{p}-", f"kvstate-ipc-{p}-")) for p in pids)]
    assert not left, f"files left by the schedulers: {left}"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("handoff", ["direct", "both"])
def test_kill_9_of_a_lending_rank_worker(handoff):
    """P's rank worker is killed while it lends: its lends fail (the driver answers for the
    dead rank), D skips the dead worker's entries and reads the store (``both``) or fails or
    recomputes by its policy (``direct``); the worker restarts and lends again. Every request
    ends, no byte D kept differs, no block leaks, no lend file is left."""
    killed = []

    def on_start(children):
        def kill():
            workers = _children(children["prefill"].pid)
            if workers:
                killed.append(workers[0])
                os.kill(workers[0], signal.SIGKILL)
        threading.Timer(0.3, kill).start()

    s = run_processes(DemoConfig(requests=160, concurrency=16, handoff=handoff), timeout=120, on_start=on_start)
    assert killed and s["rank_restarts"] >= 1
    assert s["unfinished"] == 0 and s["finished"] + s["aborted"] + s["failed"] == 160 and s["finished"] > 0
    assert s["leaked_blocks"] == 0 and s["pending_commands"] == 0 and s["live_requests"] == 0
    assert s["blocks_mismatched"] == 0 and s["lends_pulled"] > 0


@pytest.mark.slow
def test_no_worker_outlives_its_parent(tmp_path):
    """A scheduler process killed with SIGKILL takes its rank workers with it."""
    script = (
        "import json, sys, time\n"
        "from kvstate.distributed import ProcessDriver\n"
        "from kvstate import CacheSpec\n"
        "spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype='float16', tp_size=2)\n"
        "d = ProcessDriver(spec, 16)\n"
        f"[d.spawn(r, {{'kind': 'file', 'root': {str(tmp_path)!r}}}) for r in range(2)]\n"
        "d.wait_ready(60)\n"
        "print(json.dumps([d.child(r).pid for r in range(2)]), flush=True)\n"
        "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(p.stdout.readline())
        assert all(alive(x) for x in pids)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        while any(alive(x) for x in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [x for x in pids if alive(x)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        remove_orphans(tempfile.gettempdir(), "kvstate-ipc-")  # the killed process's sockets: its parent cleans
    assert not list(Path(tempfile.gettempdir()).glob(f"kvstate-ipc-{p.pid}-*"))


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(mooncake_missing() is not None, reason=str(mooncake_missing()))
def test_the_mooncake_master_stopped_mid_run_then_restarted(tmp_path):
    """Four rank workers, each with its own Mooncake client; the master is killed with transfers
    in flight: they fail cleanly (every request ends, nothing leaks, no wrong byte). A master
    started again on the same address serves the next requests through the same workers, each
    of which re-joined the pool on its own. Mooncake 0.3.10's client holds the GIL while it
    retries a dead master (seconds; over 10 s on a slow machine), pausing the workers'
    heartbeats: the liveness limit is set above that, as a deployment on Mooncake must. A worker
    that still goes down while the master is away (its client may also exit) is restarted and
    counted; once recovered, the pool serves without another restart."""
    from kvstate.backends._mooncake_master import MooncakeMaster

    m = MooncakeMaster(log_path=tmp_path / "m.log").start()
    cfg = m.config(global_segment_size=64 << 20, local_buffer_size=16 << 20, staging_bytes=8 << 20)
    rig = ProcRig({"kind": "mooncake", **dataclasses.asdict(cfg)}, dead_after_s=30.0, log_dir=tmp_path)
    writes = {"n": 0}

    def kill_master(name, cmd):
        if name == "P" and cmd.__class__ is C.WriteBlocks:
            writes["n"] += 1
            if writes["n"] == 8:
                m.kill()
    m2 = None
    try:
        r = rig.run(24, on_submit=kill_master, timeout=90)
        healthy(r)
        states = Counter(st for st, *_ in r["outcome"].values())
        assert states["failed"] > 0, states  # the writes after the kill failed: their first tokens carried 503
        m2 = MooncakeMaster(rpc_port=m.rpc_port, http_port=m.http_port, log_path=tmp_path / "m2.log").start()
        back = time.monotonic()
        for seed in range(100, 200):  # small rounds until one is served whole: each client re-joined
            rig.outcome.clear()
            r2 = rig.run(4, seed=seed, timeout=90)
            healthy(r2)
            if all(st == "done" for st, *_ in r2["outcome"].values()):
                break
            assert time.monotonic() - back < 60, f"not recovered 60 s after the master came back: {r2['outcome']}"
        rig.outcome.clear()
        restarts = [rig.driver(s).counters["restarts"] for s in "PD"]
        r3 = rig.run(12, seed=7, timeout=90)
        healthy(r3)
        states = Counter(st for st, *_ in r3["outcome"].values())
        assert states["done"] + states["aborted"] == 12, {k: v for k, v in r3["outcome"].items() if v[0] != "done"}
        assert [rig.driver(s).counters["restarts"] for s in "PD"] == restarts
    except AssertionError as e:  # the workers' logs (Mooncake's retries) go to files: show their ends
        logs = rig.log_tails() + "".join(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-800:]
                                         for f in sorted(tmp_path.glob("m*.log")))
        raise AssertionError(f"{e}\n{logs}") from None
    finally:
        rig.close()
        for master in (m2, m):
            if master is not None:
                master.stop()
