"""The checksum work inside the 8k-token handoff, timed step by step (GPU machine).

    python3 benchmarks/checksum_work.py [--reps 16] [--json PATH]

The handoff's end-to-end ratio against a trusted store moves by ±9 % from repetition to
repetition on a shared host, more than the checksums cost; so this times the checksum steps
themselves while the handoff runs: each step of the backend's manifest and SUM64 path is
wrapped with a timer (by name, on the classes that hold them), and their sum per handoff is
set against the handoff's time. A Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128,
bf16, blocks of 64 tokens: 128 blocks, 1 GiB), P GPU -> ``MemoryStore`` -> D GPU through
``CudaBackend``, beside the same handoff through a trusted store. Medians over the
repetitions after the first.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from kvstate import CacheSpec  # noqa: E402
from kvstate.backends import MemoryStore  # noqa: E402
from kvstate.backends._cuda_sums import DeviceSums  # noqa: E402
from kvstate.backends._manifested import BlockObjects  # noqa: E402

#: the checksum path's steps: (class, method name, what it does)
#: (D's SUM64 of what landed is a launch and a fetch: counted there, not twice)
STEPS = [(DeviceSums, "_launch_sums", "P and D: SUM64 kernels launched"),
         (BlockObjects, "put_manifests", "P: manifests packed and put"),
         (BlockObjects, "read_manifests", "D: manifests got and parsed"),
         (BlockObjects, "arrived", "D: lengths checked"),
         (BlockObjects, "expected", "D: recorded sums gathered"),
         (BlockObjects, "verify_deferred", "D: sums compared")]


def instrument(acc: collections.defaultdict[str, float]) -> Callable[[], None]:
    """Wrap each step (and the fetch ``_launch_sums`` hands back) with a timer adding to
    ``acc``; returns what undoes it."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in STEPS]

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = f(*a, **k)
            acc[name] += time.perf_counter() - t
            return timed("fetch", r) if name == "_launch_sums" and r is not None else r
        return g

    def undo() -> None:
        for cls, name, f in saved:
            setattr(cls, name, f)

    for cls, name, f in saved:
        setattr(cls, name, timed(name, f))
    return undo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy as cp

    from kvstate.backends import CudaBackend
    spec = CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", tp_size=1)
    n = spec.blocks_for(8192)
    keys, src, dst = [f"r:{i}" for i in range(n)], list(range(n)), list(range(n, 2 * n))
    total = n * spec.bytes_per_block_per_rank
    store, trusted = MemoryStore(3 * total), MemoryStore(3 * total, verify=False)
    p, d = CudaBackend(spec, 2 * n, store), CudaBackend(spec, 2 * n, store)
    views = [{k: p.caches(0, k).views for k in spec.kinds}, {k: d.caches(0, k).views for k in spec.kinds}]
    pt, dt = CudaBackend(spec, 2 * n, trusted, caches=[views[0]]), CudaBackend(spec, 2 * n, trusted, caches=[views[1]])
    acc: collections.defaultdict[str, float] = collections.defaultdict(float)
    undo = instrument(acc)
    rows = []
    try:
        for kind in spec.kinds:
            for v in p.caches(0, kind).views:
                v[...] = cp.random.randint(0, 65535, v.shape, dtype=cp.int64).astype(cp.uint16)
        for _ in range(args.reps):
            row: dict[str, float] = {}
            for name, (w, r) in (("handoff", (p, d)), ("trusted", (pt, dt))):
                acc.clear()
                cp.cuda.runtime.deviceSynchronize()
                t = time.perf_counter()
                assert w.write(0, keys, src) == n and r.read(0, keys, dst) == n
                cp.cuda.runtime.deviceSynchronize()
                row[name] = (time.perf_counter() - t) * 1e3
                if name == "handoff":
                    row.update({k: v * 1e3 for k, v in acc.items()})
            rows.append(row)
    finally:
        undo()
        for b in (p, d, pt, dt):
            b.close()
    return report(rows[1:], args.json)


def report(rows: list[dict[str, float]], path: str | None) -> int:
    med = {k: float(np.median([r.get(k, 0.0) for r in rows])) for k in rows[0]}
    work = sum(v for k, v in med.items() if k not in ("handoff", "trusted"))
    print(f"{'step':<34} {'ms per handoff':>14}")
    for _, name, what in STEPS[:1] + [(None, "fetch", "P and D: sums fetched")] + STEPS[1:]:
        print(f"{what:<34} {med.get(name, 0.0):>14.3f}")
    print(f"{'checksum work':<34} {work:>14.3f}\n{'handoff / trusted handoff':<34} "
          f"{med['handoff']:>8.1f} / {med['trusted']:.1f} ms\nwork / handoff: {work / med['handoff']:.3f}")
    if path:
        with open(path, "w") as f:
            json.dump({"median_ms": med, "work_ms": work, "work_share": work / med["handoff"], "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
