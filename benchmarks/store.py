"""Mooncake store throughput: kvstate's batched paths against plain per-key put/get.

A local mooncake_master on loopback (tcp). For each block size, the same bytes go
through (a) ``MooncakeStore.batch_put_from`` / ``batch_get_into`` (one call per batch,
through the registered staging buffer), (a') the same calls from and into memory the caller
registered (``MooncakeStore.register_memory``: a backend's staging; no copy in Python) and
(b) plain ``put(key, bytes)`` /
``get_into(key, ptr, size)`` per key on the raw ``MooncakeDistributedStore`` (into a
registered buffer; the bytes-returning ``get`` of 0.3.10.post2 crashes the process on
repeated runs, so it is not used). Throughput = payload
bytes / (put time + get time), median of the repeats, the paths alternated in one run.

    python benchmarks/store.py [--mib 32] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstate.backends import MooncakeMaster, MooncakeStore  # noqa: E402

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(store: MooncakeStore, size: int, total: int, repeats: int, landing: np.ndarray) -> dict[str, float]:
    """The three paths for one block size, alternated ``repeats`` times: one row."""
    raw, n = store._store, max(1, total // size)
    bufs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(min(n, 8))]
    blocks = [bufs[i % len(bufs)] for i in range(n)]
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    reg_src, reg_dst = np.concatenate(blocks), np.empty(n * size, np.uint8)
    assert store.register_memory(reg_src) and store.register_memory(reg_dst)
    reg_blocks = [reg_src[i * size:(i + 1) * size] for i in range(n)]
    reg_outs = [reg_dst[i * size:(i + 1) * size] for i in range(n)]
    data = [b.tobytes() for b in blocks]
    times: dict[str, list[float]] = {"batched": [], "registered": [], "plain": []}

    def batched(keys: list[str], srcs: list[np.ndarray], dsts: list[np.ndarray]) -> None:
        assert all(r == 0 for r in store.batch_put_from(keys, srcs))
        assert store.batch_get_into(keys, dsts) == [size] * n

    def plain(keys: list[str]) -> None:
        for k, d in zip(keys, data):
            assert raw.put(k, d) == 0
        for k in keys:
            assert raw.get_into(k, landing.ctypes.data, size) == size

    for rep in range(repeats):
        bk, rk, pk = ([f"{c}{size}-{rep}-{i}" for i in range(n)] for c in "brp")
        times["batched"].append(timed(lambda bk=bk: batched(bk, blocks, outs)))
        assert (outs[-1] == blocks[-1]).all()
        direct = store.direct_batches
        times["registered"].append(timed(lambda rk=rk: batched(rk, reg_blocks, reg_outs)))
        assert np.array_equal(reg_dst, reg_src) and store.direct_batches == direct + 2  # no staging
        times["plain"].append(timed(lambda pk=pk: plain(pk)))
        assert landing[:size].tobytes() == data[-1]
    store.unregister_memory(reg_src)
    store.unregister_memory(reg_dst)
    b, r, p = (statistics.median(times[k]) for k in ("batched", "registered", "plain"))
    return {"block_bytes": size, "blocks": n, "batched_gb_s": round(2 * n * size / b / 1e9, 3),
            "registered_gb_s": round(2 * n * size / r / 1e9, 3), "plain_gb_s": round(2 * n * size / p / 1e9, 3),
            "ratio": round(p / b, 2), "registered_ratio": round(b / r, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16,
                    help="payload per round (MiB); the run keeps 3 x 5 x repeats rounds in a 1 GiB pool")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = args.mib << 20
    with MooncakeMaster() as master:
        # room for every object of the run: nothing is evicted mid-measurement
        store = MooncakeStore(master.config(global_segment_size=1 << 30,
                                            staging_bytes=total, local_buffer_size=max(64 << 20, total)))
        landing = np.empty(4 << 20, np.uint8)
        assert store._store.register_buffer(landing.ctypes.data, landing.nbytes) == 0
        try:
            rows = [measure(store, size, total, args.repeats, landing) for size in SIZES]
        finally:
            store._store.unregister_buffer(landing.ctypes.data)
            store.close()
    out = {"rows": rows, "ratio_64k": next(r["ratio"] for r in rows if r["block_bytes"] == 64 << 10),
           "registered_ratio_4m": next(r["registered_ratio"] for r in rows if r["block_bytes"] == 4 << 20),
           "payload_mib": args.mib, "repeats": args.repeats, "protocol": "tcp", "host": "127.0.0.1"}
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"Mooncake over loopback tcp, {args.mib} MiB put+get per size, median of {args.repeats}")
    print(f"{'block':>8}{'blocks':>8}{'batched GB/s':>14}{'registered':>12}{'per-key GB/s':>14}"
          f"{'batched/per-key':>17}{'registered/batched':>20}")
    for r in rows:
        print(f"{r['block_bytes'] // 1024:>6}Ki{r['blocks']:>8}{r['batched_gb_s']:>14.2f}"
              f"{r['registered_gb_s']:>12.2f}{r['plain_gb_s']:>14.2f}{r['ratio']:>16.2f}x"
              f"{r['registered_ratio']:>19.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
