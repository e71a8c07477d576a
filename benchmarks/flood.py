"""Forged and malformed messages at every socket a peer can reach, while handoffs run (CPU).

    python benchmarks/flood.py [--seconds 30] [--blocks 32] [--out flood.json]

A ``ProcessDriver`` with two rank workers (caches in shared memory, an ``ArenaStore``) runs
handoffs back to back: a ``WriteBlocks`` of ``--blocks`` blocks, then a ``ReadBlocks`` of them
into other blocks, every byte compared. For ``--seconds``, three flooders send as fast as they
can, each at one of the driver's sockets:

- the command socket (ROUTER): garbage frames and 100 MB frames;
- the reply socket (PULL): garbage, truncated msgpack, and ``DONE`` / ``ARRIVED`` answers for
  the commands in flight and for unknown ones, from incarnations that are not the workers';
- the control socket (PULL): hellos without the driver's secret, hellos with it for the live
  ranks, heartbeats of other incarnations, garbage.

Then handoffs run for a few more seconds without the flood. Reported: the handoffs done and
checked during and after, the messages sent by kind, the driver's counters, the restarts, and
this (the driver's) process's resident memory before and after. The bars (issue "Nothing a bad
clock, a stray process or a second worker can break"): nothing applied (every handoff's counts
and bytes exact), 0 restarts, memory growth <= 10 MB, and handoffs served after the flood.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from kvstate import CacheSpec  # noqa: E402
from kvstate import commands as C  # noqa: E402
from kvstate.backends import ArenaStore  # noqa: E402
from kvstate.distributed import ProcessDriver, SharedCaches  # noqa: E402
from kvstate.distributed import _wire as wire

SPEC = CacheSpec(num_layers=4, kv_heads=4, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Handoffs:
    """Write then read ``n`` blocks, back to back, checking each answer and every byte."""

    def __init__(self, drv: ProcessDriver, caches: SharedCaches, n: int) -> None:
        self.drv, self.caches, self.n = drv, caches, n
        self.cid, self.done, self.bad, self.inflight = 0, 0, [], set[int]()
        rng = np.random.default_rng(0)
        for r in range(SPEC.tp_size):
            for layers in caches.caches[r].values():
                for a in layers:
                    a[:n] = rng.integers(0, 1 << 16, a[:n].shape, dtype=np.uint16).view(a.dtype)

    def _run(self, cls: type, keys: tuple[str, ...], blocks: tuple[int, ...]) -> None:
        self.cid += 1
        now = time.monotonic()
        self.inflight.add(self.cid)
        self.drv.submit(cls("flood", self.cid, tuple(range(SPEC.tp_size)), now + 20, keys, blocks, fence=now + 40))
        got: list[Any] = []
        deadline = now + 30
        while len(got) < SPEC.tp_size and time.monotonic() < deadline:
            got += [c for c in self.drv.poll(0.5) if c.command_id == self.cid]
        self.inflight.discard(self.cid)
        counts = sorted(c.count for c in got)
        if counts != [len(keys)] * SPEC.tp_size:
            self.bad.append(f"command {self.cid} ({cls.__name__}): counts {counts}")

    def one(self) -> None:
        keys = tuple(f"h{self.cid}-{i}" for i in range(self.n))
        src, dst = tuple(range(self.n)), tuple(range(self.n, 2 * self.n))
        self._run(C.WriteBlocks, keys, src)
        self._run(C.ReadBlocks, keys, dst)
        for r in range(SPEC.tp_size):
            for kind, layers in self.caches.caches[r].items():
                for i, a in enumerate(layers):
                    if not np.array_equal(a[:self.n], a[self.n:2 * self.n]):
                        self.bad.append(f"handoff {self.cid}: rank {r} {kind} layer {i} differs")
                    a[self.n:2 * self.n] = 0
        self.done += 1


def flood(addresses: tuple[str, ...], secret: str, inflight: set[int], stop: threading.Event,
          sent: dict[str, int]) -> list[threading.Thread]:
    """Start one flooder a socket; each counts what it sent into ``sent``."""
    ctx = zmq.Context.instance()
    geometry = wire.geometry(SPEC, 64)

    def run(kind: int, address: str, messages: list[tuple[str, Any]]) -> None:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 100)
        sock.connect(address)
        i = 0
        try:
            while not stop.is_set():
                name, make = messages[i % len(messages)]
                i += 1
                try:
                    sock.send(make() if callable(make) else make)
                    sent[name] = sent.get(name, 0) + 1
                except zmq.Again:
                    time.sleep(0.001)
        finally:
            sock.close()

    def forged_done() -> bytes:
        cid = next(iter(inflight), 999_999)
        return wire.pack(wire.DONE, 0, 12345, cid, 1, None)

    big = b"\0" * (100 << 20)
    plans = [
        (zmq.DEALER, addresses[0], [("command garbage", b"\x93garbage"), ("command 100 MB frame", big)]),
        (zmq.PUSH, addresses[1], [("reply garbage", os.urandom(64)), ("reply truncated msgpack",
                                                                     msgpack.packb([wire.DONE, 0, 1, 2, 3])[:-2]),
                                  ("reply DONE, wrong incarnation", forged_done),
                                  ("reply ARRIVED, wrong incarnation", wire.pack(wire.ARRIVED, 1, 777, 1, 2))]),
        (zmq.PUSH, addresses[2], [("hello without the secret",
                                   wire.pack(wire.HELLO, 0, 4242, 1, SPEC.tp_size, geometry, 1, "not-the-secret")),
                                  ("hello with the secret, rank live",
                                   wire.pack(wire.HELLO, 1, 4343, 1, SPEC.tp_size, geometry, 1, secret)),
                                  ("heartbeat, wrong incarnation", wire.pack(wire.HB, 0, 31337, 0, [0, 0, 0])),
                                  ("control garbage", b"\xc1\xc1")]),
    ]
    threads = [threading.Thread(target=run, args=p, daemon=True, name="flood") for p in plans]
    for t in threads:
        t.start()
    return threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--out", help="write the figures here (JSON)")
    a = ap.parse_args()
    nb = 2 * a.blocks + 8
    slot = SPEC.block_bytes("key")
    with SharedCaches.create(SPEC, nb) as caches, \
            ArenaStore.create(slot, 8 * a.blocks * SPEC.tp_size, small_bytes=512) as store, \
            ProcessDriver(SPEC, nb, heartbeat_s=0.1, dead_after_s=2.0) as drv:
        for r in range(SPEC.tp_size):
            drv.spawn(r, {"kind": "arena", "path": store.path}, caches={"kind": "shm", "paths": caches.paths})
        drv.wait_ready(60)
        pids = [drv.child(r).pid for r in range(SPEC.tp_size)]
        h = Handoffs(drv, caches, a.blocks)
        for _ in range(3):
            h.one()  # warm: the driver's memory is what serving takes
        before, sent, stop = rss_mb(), dict[str, int](), threading.Event()
        threads = flood(drv.addresses, drv.secret, h.inflight, stop, sent)
        t0, during = time.monotonic(), h.done
        while time.monotonic() - t0 < a.seconds:
            h.one()
        during = h.done - during
        stop.set()
        for t in threads:
            t.join(10)
        time.sleep(1.0)
        after_flood = rss_mb()
        t1, served = time.monotonic(), h.done
        while time.monotonic() - t1 < 3.0:
            h.one()
        served = h.done - served
        restarts = drv.counters.get("restarts", 0)
        same = [drv.child(r).pid for r in range(SPEC.tp_size)] == pids
        out = {"seconds": a.seconds, "blocks": a.blocks, "handoffs_during_flood": during,
               "handoffs_after_flood": served, "wrong": h.bad[:10], "wrong_count": len(h.bad),
               "sent": sent, "sent_total": sum(sent.values()), "driver_counters": dict(drv.counters),
               "restarts": restarts, "workers_unchanged": same, "rss_mb_before": round(before, 1),
               "rss_mb_after": round(after_flood, 1), "rss_growth_mb": round(after_flood - before, 1)}
    print(f"flood of {out['sent_total']:,} messages over {a.seconds:g} s while handoffs of {a.blocks} blocks ran "
          f"(TP {SPEC.tp_size}, ArenaStore)")
    for name, n in sorted(sent.items()):
        print(f"  {name:<36}{n:>10,}")
    print(f"handoffs: {during} during the flood, {served} in the 3 s after; wrong: {len(h.bad)}")
    print(f"driver counters: {out['driver_counters']}")
    print(f"restarts {restarts}, workers unchanged {same}; driver RSS {out['rss_mb_before']} -> "
          f"{out['rss_mb_after']} MB ({out['rss_growth_mb']:+.1f})")
    ok = not h.bad and restarts == 0 and same and served > 0 and out["rss_growth_mb"] <= 10
    print("bars met" if ok else "BARS NOT MET")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
