"""The transfer ops' host-side validation: ``plan_layout`` for one call, lists vs arrays, by pool size.

    python benchmarks/plan.py [--json] [--reps N]

A call of 256 random blocks over 32 layers, ``h2d`` (the GPU side must be distinct) and
``d2h`` (the host side must be), with its ids given as Python lists (a different list object
each call, built beforehand: an engine's block table hands them over) or as int64 arrays,
on pools of 1k, 100k and 1M blocks. The cases are measured interleaved, round after round,
and each reports the median of its rounds in microseconds; ratios are taken within the
same round structure. CPU only (the caches are a validated LayerSet: no memory is
allocated for the pool).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.kernels._plan import LayerSet, plan_layout  # noqa: E402

LAYERS, BLOCKS, CHUNK = 32, 256, (1, 1, 8)
POOLS = (1_000, 100_000, 1_000_000)


def case(pool: int, kind: str, direction: str, rng: np.random.Generator):
    caches = LayerSet(tuple(range(LAYERS)), (pool, *CHUNK), "uint16", 2)  # validated once, as an engine keeps it
    host = np.zeros((BLOCKS, LAYERS, *CHUNK), np.uint16)
    gids = rng.choice(pool, BLOCKS, replace=False)
    hids = rng.permutation(BLOCKS)
    if kind == "list":  # fresh list objects each call, made before the clock runs, as an engine hands them over
        ring = [(gids.tolist(), hids.tolist()) for _ in range(64)]
        it = iter(ring * 10**6)
        return lambda: plan_layout(caches, host, *next(it), direction)
    g, h = gids.astype(np.int64), hids.astype(np.int64)
    return lambda: plan_layout(caches, host, g, h, direction)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = {(p, k, d): case(p, k, d, rng) for p in POOLS for k in ("list", "array") for d in ("h2d", "d2h")}
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c, fn in cases.items():
            fn()
            t = time.perf_counter()
            for _ in range(args.reps):
                fn()
            times[c].append((time.perf_counter() - t) / args.reps * 1e6)
    us = {c: statistics.median(v) for c, v in times.items()}
    rows = []
    for p in POOLS:
        for d in ("h2d", "d2h"):
            rows.append({"pool_blocks": p, "direction": d, "list_us": round(us[(p, "list", d)], 2),
                         "array_us": round(us[(p, "array", d)], 2),
                         "list_over_array": round(us[(p, "list", d)] / us[(p, "array", d)], 3)})
    out = {"rows": rows, "blocks": BLOCKS, "layers": LAYERS, "python": platform.python_version(),
           "numpy": np.__version__,
           "pool_1M_over_1k": {k: round(max(us[(POOLS[-1], k, d)] / us[(POOLS[0], k, d)] for d in ("h2d", "d2h")), 3)
                               for k in ("list", "array")},
           "worst_list_over_array": max(r["list_over_array"] for r in rows)}
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"plan_layout of {BLOCKS} random blocks x {LAYERS} layers, median us per call ({args.rounds} rounds)")
    print(f"{'pool':>10} {'dir':>4} {'list':>8} {'array':>8} {'list/array':>11}")
    for r in rows:
        print(f"{r['pool_blocks']:>10,} {r['direction']:>4} {r['list_us']:>8.2f} {r['array_us']:>8.2f} "
              f"{r['list_over_array']:>11.2f}")
    print(f"1M pool over 1k pool (worst direction): lists {out['pool_1M_over_1k']['list']:.2f}x, "
          f"arrays {out['pool_1M_over_1k']['array']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
