"""Mooncake store throughput: kvstate's batched path against plain per-key put/get.

A local mooncake_master on loopback (tcp). For each block size, the same bytes go
through (a) ``MooncakeStore.batch_put_from`` / ``batch_get_into`` (one call per batch,
through the registered staging buffer) and (b) plain ``put(key, bytes)`` /
``get_into(key, ptr, size)`` per key on the raw ``MooncakeDistributedStore`` (into a
registered buffer; the bytes-returning ``get`` of 0.3.10.post2 crashes the process on
repeated runs, so it is not used). Throughput = payload
bytes / (put time + get time), median of the repeats, both paths alternated in one run.

    python benchmarks/store.py [--mib 32] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstate.backends import MooncakeMaster, MooncakeStore  # noqa: E402

SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16,
                    help="payload per round (MiB); the run keeps 2 x 5 x repeats rounds in a 768 MiB pool")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = args.mib << 20
    rows = []
    with MooncakeMaster() as master:
        # room for every object of the run: nothing is evicted mid-measurement
        store = MooncakeStore(master.config(global_segment_size=768 << 20,
                                            staging_bytes=total, local_buffer_size=max(64 << 20, total)))
        raw = store._store
        landing = np.empty(4 << 20, np.uint8)
        assert raw.register_buffer(landing.ctypes.data, landing.nbytes) == 0
        try:
            for size in SIZES:
                n = max(1, total // size)
                bufs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(min(n, 8))]
                blocks = [bufs[i % len(bufs)] for i in range(n)]
                outs = [np.empty(size, np.uint8) for _ in range(n)]
                batched, plain = [], []
                for rep in range(args.repeats):
                    keys = [f"b{size}-{rep}-{i}" for i in range(n)]
                    t0 = time.perf_counter()
                    assert all(r == 0 for r in store.batch_put_from(keys, blocks))
                    got = store.batch_get_into(keys, outs)
                    batched.append(time.perf_counter() - t0)
                    assert got == [size] * n and (outs[-1] == blocks[-1]).all()
                    pkeys = [f"p{size}-{rep}-{i}" for i in range(n)]
                    data = [b.tobytes() for b in blocks]
                    t0 = time.perf_counter()
                    for k, d in zip(pkeys, data):
                        assert raw.put(k, d) == 0
                    for k in pkeys:
                        assert raw.get_into(k, landing.ctypes.data, size) == size
                    plain.append(time.perf_counter() - t0)
                    assert landing[:size].tobytes() == data[-1]
                b, p = statistics.median(batched), statistics.median(plain)
                rows.append({"block_bytes": size, "blocks": n, "batched_gb_s": round(2 * n * size / b / 1e9, 3),
                             "plain_gb_s": round(2 * n * size / p / 1e9, 3), "ratio": round(p / b, 2)})
        finally:
            raw.unregister_buffer(landing.ctypes.data)
            store.close()
    out = {"rows": rows, "ratio_64k": next(r["ratio"] for r in rows if r["block_bytes"] == 64 << 10),
           "payload_mib": args.mib, "repeats": args.repeats, "protocol": "tcp", "host": "127.0.0.1"}
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"Mooncake over loopback tcp, {args.mib} MiB put+get per size, median of {args.repeats}")
        print(f"{'block':>8}{'blocks':>8}{'batched GB/s':>14}{'per-key GB/s':>14}{'ratio':>8}")
        for r in rows:
            print(f"{r['block_bytes'] // 1024:>6}Ki{r['blocks']:>8}{r['batched_gb_s']:>14.2f}{r['plain_gb_s']:>14.2f}"
                  f"{r['ratio']:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
