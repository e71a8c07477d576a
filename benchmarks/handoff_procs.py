"""The 8k-token handoff through rank-worker processes against the same handoff in-process (GPU).

    python3 benchmarks/handoff_procs.py [--reps 5] [--stores arena file mooncake] [--out handoff_procs.json]

A Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, bf16, blocks of 64 tokens,
TP 1): one 8,192-token prompt is 128 blocks, 1 GiB. P writes them to the store (a
``WriteBlocks``), then D reads them into other blocks (a ``ReadBlocks``); the bytes D read are
compared with P's. Two ways, alternating repetition by repetition, each with fresh keys:

- ``in-process``: each side's ``CudaBackend`` behind a ``ThreadedDriver``;
- ``processes``: each side's caches shared through CUDA IPC with one rank worker process
  (``ProcessDriver``), whose own ``CudaBackend`` moves the blocks.

Stores: ``arena`` (an ArenaStore in shared memory, which every process maps and the GPU
gathers into and scatters out of), ``file`` (a FileStore on tmpfs, the embedded store other processes reach: a
``MemoryStore`` lives in one process, so the rank workers cannot share one), ``mooncake`` (a
master on loopback, each process its own client; in-process, P and D share one), and
``memory`` (in-process only, the reference). The store's own time: the same 256 objects of
4 MiB put and got back from a host buffer, without a GPU. The link: ``copy_`` of the same bytes
between the GPU and a pinned host buffer, each way, in the same run; ``/ link`` is a way's
handoff over that D2H + H2D. Medians; ratio processes / in-process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate import CacheSpec, rank_key  # noqa: E402
from kvstate import commands as C  # noqa: E402
from kvstate.backends import (  # noqa: E402
    CudaBackend,  # noqa: E402
    FileStore,
    MemoryStore,
    ThreadedDriver,
)
from kvstate.backends._base import as_bytes_view  # noqa: E402
from kvstate.backends._shm import shm_directory  # noqa: E402
from kvstate.distributed import ProcessDriver, share_caches  # noqa: E402

SPEC = CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", tp_size=1)
N = 128  # blocks of an 8,192-token prompt
BLOCKS = 2 * N + 8
_ids = iter(range(1, 1 << 40))


def caches(cp, fill: bool) -> dict:
    shape = (BLOCKS,) + SPEC.block_shape("key")
    arrays = {k: [cp.zeros(shape, cp.uint16) for _ in range(SPEC.layers)] for k in SPEC.kinds}
    if fill:
        for layers in arrays.values():
            for a in layers:
                a[...] = cp.random.randint(0, 1 << 16, shape, dtype=cp.uint16)
    return {0: arrays}


def transfer(drv, cls: type, keys: tuple, blocks: tuple) -> float:
    now, cid = time.monotonic(), next(_ids)
    t = time.perf_counter()
    drv.submit(cls("bench", cid, (0,), now + 120, keys, blocks, fence=now + 240))
    got = []
    while not got:
        got = drv.poll(10.0)
    assert got[0].count == len(keys) and got[0].error is None, got[0]
    return time.perf_counter() - t


class Way:
    """One way to hand off: P's and D's drivers over P's and D's caches."""

    def __init__(self, kind: str, store_cfg: dict | None, store_obj, p_caches: dict, d_caches: dict) -> None:
        self.kind, self.drivers, self.backends = kind, [], []
        for c in (p_caches, d_caches):
            if kind == "in-process":
                b = CudaBackend(SPEC, BLOCKS, store_obj, caches=c)
                self.backends.append(b)
                self.drivers.append(ThreadedDriver(b, workers=2))
            else:
                d = ProcessDriver(SPEC, BLOCKS, dead_after_s=30.0, name=kind)
                d.spawn(0, store_cfg, caches=share_caches(c), backend="cuda", lanes=2)
                d.wait_ready(180)
                self.drivers.append(d)

    def handoff(self, rep: int) -> tuple[float, float]:
        keys = tuple(f"h{rep}-{self.kind}-{i}" for i in range(N))
        w = transfer(self.drivers[0], C.WriteBlocks, keys, tuple(range(N)))
        r = transfer(self.drivers[1], C.ReadBlocks, keys, tuple(range(N, 2 * N)))
        return w, r

    def close(self) -> None:
        for d in self.drivers:
            d.close()
        for b in self.backends:
            b.close()


def store_seconds(store, reps: int) -> tuple[float, float]:
    """Median seconds to put and to get the handoff's 256 objects of 4 MiB from host memory."""
    obj = SPEC.block_bytes("key")
    src = np.random.default_rng(0).integers(0, 255, (2 * N, obj), dtype=np.uint8)
    dst = np.empty_like(src)
    puts, gets = [], []
    for rep in range(reps + 1):
        names = [rank_key(f"raw{rep}-{i}", k, 0) for i in range(N) for k in SPEC.kinds]
        t = time.perf_counter()
        put = store.batch_put_from(names, [as_bytes_view(x) for x in src])
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = store.batch_get_into(names, [as_bytes_view(x) for x in dst])
        gets.append(time.perf_counter() - t)
        if put != [0] * len(names) or got != [obj] * len(names) or not np.array_equal(src, dst):
            raise RuntimeError(f"the store lost objects of the raw round trip (puts {sorted(set(put))}, "
                               f"gets {sorted(set(got))})")
    return statistics.median(puts[1:]), statistics.median(gets[1:])


def open_store(store: str, tmp: str) -> tuple:
    """(the in-process store, the worker store configuration or None, a master to stop or None)."""
    if store == "mooncake":
        from kvstate.backends import MooncakeMaster, MooncakeStore

        master = MooncakeMaster(log_path=os.path.join(tmp, "master.log")).start()
        mc = master.config(global_segment_size=6 << 30, local_buffer_size=256 << 20, staging_bytes=256 << 20)
        return MooncakeStore(mc), {"kind": "mooncake", **dataclasses.asdict(mc)}, master
    if store == "arena":
        from kvstate.backends import ArenaStore

        arena = ArenaStore.create(SPEC.block_bytes("key"), 4 * N, tag="llama-3-8b-bench")
        return arena, {"kind": "arena", "path": arena.path, "slot_bytes": SPEC.block_bytes("key")}, None
    if store == "file":
        root = tempfile.mkdtemp(prefix="kvstate-handoff-", dir=shm_directory())
        return FileStore(root), {"kind": "file", "root": root}, None
    return MemoryStore(12 << 30), None, None


def link_ms(cp, reps: int) -> dict:
    """Median ms of ``copy_`` of the handoff's bytes between the GPU and pinned host memory, each way."""
    n = N * SPEC.bytes_per_block
    host = cp.cuda.alloc_pinned_memory(n)
    h = np.frombuffer(host, np.uint8, n)
    d = cp.empty(n, cp.uint8)
    d2h, h2d = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        d.get(out=h)
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        d.set(h)
        cp.cuda.runtime.deviceSynchronize()
        h2d.append(time.perf_counter() - t)
    return {"d2h_ms": round(1e3 * statistics.median(d2h[1:]), 1), "h2d_ms": round(1e3 * statistics.median(h2d[1:]), 1)}


def medians(xs: list[tuple[float, float]]) -> dict:
    ws, rs = [x[0] for x in xs[1:]], [x[1] for x in xs[1:]]
    return {"write_ms": round(1e3 * statistics.median(ws), 1), "read_ms": round(1e3 * statistics.median(rs), 1),
            "handoff_ms": round(1e3 * statistics.median([a + b for a, b in zip(ws, rs)]), 1)}


def measure(store: str, reps: int, cp, p_caches: dict, d_caches: dict, tmp: str) -> dict:
    shared, cfg, master = open_store(store, tmp)
    try:
        put, get = store_seconds(shared, max(2, reps // 2))  # first, on an empty store
        ways = [Way("in-process", None, shared, p_caches, d_caches)]
        if cfg is not None:
            ways.append(Way("processes", cfg, None, p_caches, d_caches))
        times: dict[str, list[tuple[float, float]]] = {w.kind: [] for w in ways}
        for rep in range(reps + 1):
            for w in ways:
                times[w.kind].append(w.handoff(rep))
                src, dst = p_caches[0]["key"][5][:N], d_caches[0]["key"][5][N:2 * N]
                assert bool(cp.all(src == dst)), f"{store} {w.kind}: D's blocks differ from P's"
                d_caches[0]["key"][5][N:2 * N] = 0
                if store == "file":  # tmpfs is memory: keep one handoff's objects at a time
                    for sub in os.scandir(cfg["root"]):  # type: ignore[index]
                        shutil.rmtree(sub.path, ignore_errors=True)
        for w in ways:
            w.close()
        row: dict = {"store": store, **{kind: medians(xs) for kind, xs in times.items()}}
        if "processes" in row:
            row["ratio"] = round(row["processes"]["handoff_ms"] / row["in-process"]["handoff_ms"], 3)
        row["store_put_ms"], row["store_get_ms"] = round(1e3 * put, 1), round(1e3 * get, 1)
        shared.close()
        return row
    finally:
        if master is not None:
            master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stores", nargs="+", default=["memory", "file", "mooncake"])
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    import cupy as cp

    tmp = tempfile.mkdtemp(prefix="kvstate-handoff-")
    p_caches, d_caches = caches(cp, True), caches(cp, False)
    try:
        link = link_ms(cp, args.reps)
        rows = [measure(s, args.reps, cp, p_caches, d_caches, tmp) for s in args.stores]
        link_after = link_ms(cp, args.reps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in shm_directory().glob("kvstate-handoff-*"):
            shutil.rmtree(d, ignore_errors=True)
    link = {k: round((link[k] + link_after[k]) / 2, 1) for k in link}  # before and after the stores
    pcie = link["d2h_ms"] + link["h2d_ms"]
    for r in rows:
        for kind in ("in-process", "processes"):
            if kind in r:
                r[kind]["per_link"] = round(r[kind]["handoff_ms"] / pcie, 2)
    result = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "bytes": N * SPEC.bytes_per_block,
              "link": link, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"8k-token handoff (1 GiB), {result['gpu']}: medians of {args.reps}, in-process and processes alternating")
    print(f"pinned copy_: D2H {link['d2h_ms']} ms, H2D {link['h2d_ms']} ms (the link: {pcie:.1f} ms)")
    print(f"{'store':>9} {'way':>11} {'write ms':>9} {'read ms':>8} {'handoff ms':>11} {'/ link':>7}  ratio   "
          f"store put/get ms")
    for r in rows:
        for kind in ("in-process", "processes"):
            if kind in r:
                x = r[kind]
                ratio = f"{r['ratio']:.3f}" if kind == "processes" else ""
                raw = f"{r['store_put_ms']:.0f} / {r['store_get_ms']:.0f}" if kind == "in-process" else ""
                print(f"{r['store']:>9} {kind:>11} {x['write_ms']:>9.1f} {x['read_ms']:>8.1f} {x['handoff_ms']:>11.1f}"
                      f" {x['per_link']:>6.2f}x  {ratio:>5}   {raw}")


if __name__ == "__main__":
    main()
