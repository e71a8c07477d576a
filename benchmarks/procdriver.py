"""The cross-process driver against the in-process one, on the same commands, side by side.

    python benchmarks/procdriver.py [--json] [--rounds 12] [--ranks 1 4] [--address ipc|tcp://HOST]

Per-command overhead: one command at a time, submitted and polled until every rank answered,
through a :class:`~kvstate.backends._drivers.ThreadedDriver` (in-process worker threads) and a
:class:`~kvstate.distributed.ProcessDriver` (a rank worker process per rank), alternating
rounds of 200 round trips between the two so a noisy host weighs on both alike. Two
commands: a write of no keys (nothing to move: the drivers' own cost) and a write of one
4 KiB block to a file store under /dev/shm (the smallest real transfer). Throughput: 4,000
empty commands submitted at once, until the last answer, three rounds each. Prints p50 and
p99 in microseconds, what the process driver adds at p50, and the throughput ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate import CacheSpec  # noqa: E402
from kvstate import commands as C  # noqa: E402
from kvstate.backends import FileStore, ReferenceBackend, ThreadedDriver  # noqa: E402
from kvstate.backends._shm import shm_directory  # noqa: E402
from kvstate.distributed import ProcessDriver, SharedCaches  # noqa: E402

BLOCKS = 64
_ids = iter(range(1, 1 << 62))


def spec_for(tp: int) -> CacheSpec:
    return CacheSpec(num_layers=2, kv_heads=2, block_size=16, head_dim=32, dtype="float16", tp_size=tp)  # 4 KiB


def command(tp: int, blocks: int) -> C.WriteBlocks:
    now, cid = time.monotonic(), next(_ids)
    keys = tuple(f"bench-{cid}-{i}" for i in range(blocks))
    return C.WriteBlocks("bench", cid, tuple(range(tp)), now + 30, keys, tuple(range(blocks)), fence=now + 60)


def round_trips(drv, tp: int, blocks: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        cmd = command(tp, blocks)
        t = time.perf_counter()
        drv.submit(cmd)
        got = 0
        while got < tp:
            got += len(drv.poll(5.0))
        out.append(time.perf_counter() - t)
    return out


def throughput(drv, tp: int, n: int = 4000) -> float:
    cmds = [command(tp, 0) for _ in range(n)]
    t = time.perf_counter()
    for cmd in cmds:
        drv.submit(cmd)
    got = 0
    while got < n * tp:
        got += len(drv.poll(5.0))
    return n / (time.perf_counter() - t)


def measure(tp: int, rounds: int, root: str, address: str = "ipc") -> dict:
    spec = spec_for(tp)
    caches = SharedCaches.create(spec, BLOCKS)
    threaded = ThreadedDriver(ReferenceBackend(spec, BLOCKS, FileStore(root), caches=caches.caches), workers=4)
    process = ProcessDriver(spec, BLOCKS, address=address)
    try:
        for r in range(tp):
            process.spawn(r, {"kind": "file", "root": root}, caches={"kind": "shm", "paths": caches.paths})
        process.wait_ready(60)
        drivers = {"threaded": threaded, "process": process}
        row: dict = {"ranks": tp}
        for blocks, label in ((0, "empty"), (1, "one_block")):
            samples: dict[str, list[float]] = {k: [] for k in drivers}
            for drv in drivers.values():
                round_trips(drv, tp, blocks, 100)  # warm-up
            for _ in range(rounds):
                for name, drv in drivers.items():
                    samples[name] += round_trips(drv, tp, blocks, 200)
            for name, xs in samples.items():
                p50, p99 = np.percentile(np.array(xs) * 1e6, [50, 99])
                row[f"{label}_{name}_p50_us"], row[f"{label}_{name}_p99_us"] = round(p50, 1), round(p99, 1)
            row[f"{label}_added_p50_us"] = round(row[f"{label}_process_p50_us"] - row[f"{label}_threaded_p50_us"], 1)
        rates: dict[str, list[float]] = {k: [] for k in drivers}
        for _ in range(3):
            for name, drv in drivers.items():
                rates[name].append(throughput(drv, tp))
        for name, xs in rates.items():
            row[f"{name}_commands_per_s"] = round(float(np.median(xs)))
        row["throughput_ratio"] = round(row["process_commands_per_s"] / row["threaded_commands_per_s"], 3)
        return row
    finally:
        process.close()
        threaded.close()
        caches.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds of 200 round trips per driver")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="TP ranks (one worker process each)")
    ap.add_argument("--address", default="ipc", help="the driver's transport: ipc, or tcp://HOST (CURVE-encrypted)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvstate-bench-", dir=shm_directory())
    try:
        rows = [measure(tp, args.rounds, root, args.address) for tp in args.ranks]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"cpus": os.cpu_count(), "address": args.address, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"ProcessDriver against ThreadedDriver, same commands, alternating rounds ({os.cpu_count()} CPUs)")
    print(f"{'ranks':>5} {'command':>10} {'threaded p50/p99 us':>20} {'process p50/p99 us':>20} {'added p50':>10}")
    for r in rows:
        for label in ("empty", "one_block"):
            t, p = (f"{r[f'{label}_{d}_p50_us']:>9.1f} / {r[f'{label}_{d}_p99_us']:<8.1f}"
                    for d in ("threaded", "process"))
            print(f"{r['ranks']:>5} {label:>10} {t} {p} {r[f'{label}_added_p50_us']:>10.1f}")
        print(f"{'':>5} throughput: threaded {r['threaded_commands_per_s']:,} cmd/s, process "
              f"{r['process_commands_per_s']:,} cmd/s ({r['throughput_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
