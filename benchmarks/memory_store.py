"""MemoryStore put throughput for one layer group, against a plain copy of the same bytes.

    python benchmarks/memory_store.py [--json] [--reps 40]

One layer group of a Llama-3-8B-shaped request stored one object per layer (128 blocks of 64
tokens x key and value = 256 objects of 128 KiB, 32 MiB), put from two source arrays as a
layer-wise save puts it, into a full pool (it evicts and reuses arrays, as in steady state),
for 1, 2, 4 and 8 copy threads; beside it one numpy copy of the 32 MiB and 256 copies of
128 KiB. A layer-wise save of an 8k-token prompt must keep up with one group per layer of
the prefill (7.6 ms on the H100).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate import rank_key  # noqa: E402
from kvstate.backends import MemoryStore  # noqa: E402
from kvstate.backends._base import as_bytes_view  # noqa: E402

SIZE, BLOCKS, KINDS = 128 << 10, 128, ("key", "value")


def group_put_seconds(src: dict[str, np.ndarray], copy_threads: int, reps: int) -> float:
    """Mean seconds of one group's put into a pool that holds four groups (full after four)."""
    store = MemoryStore(4 * len(KINDS) * BLOCKS * SIZE, copy_threads=copy_threads)
    try:
        def put(rep: int) -> None:
            names = [rank_key(f"{rep}_{i}", kind, 0, 5) for i in range(BLOCKS) for kind in KINDS]
            views = [as_bytes_view(src[kind][i]) for i in range(BLOCKS) for kind in KINDS]
            assert store.batch_put_from(names, views) == [0] * len(names)

        for rep in range(8):  # fill the pool: from here on every put evicts and reuses
            put(rep)
        t = time.perf_counter()
        for rep in range(8, 8 + reps):
            put(rep)
        return (time.perf_counter() - t) / reps
    finally:
        store.close()


def copy_seconds(src: np.ndarray, dst: np.ndarray, pieces: int, reps: int) -> float:
    """Mean seconds to copy ``src`` into ``dst`` in ``pieces`` numpy copies."""
    for _ in range(3):
        np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(reps):
        if pieces == 1:
            np.copyto(dst, src)
        else:
            for i in range(pieces):
                np.copyto(dst[i], src[i])
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    src = {k: rng.integers(0, 256, (BLOCKS, SIZE), dtype=np.uint8) for k in KINDS}
    nbytes = len(KINDS) * BLOCKS * SIZE
    rows = {f"put, {t} copy threads": group_put_seconds(src, t, args.reps) for t in (1, 2, 4, 8)}
    both, dst = np.concatenate([src[k] for k in KINDS]), np.empty((len(KINDS) * BLOCKS, SIZE), np.uint8)
    rows["one numpy copy"] = copy_seconds(both, dst, 1, args.reps)
    rows["256 numpy copies"] = copy_seconds(both, dst, len(both), args.reps)
    out = {name: {"ms": round(s * 1e3, 3), "GBps": round(nbytes / s / 1e9, 2)} for name, s in rows.items()}
    if args.json:
        print(json.dumps({"bytes": nbytes, "objects": len(both), "rows": out}, sort_keys=True))
        return 0
    print(f"{'32 MiB layer group':<24}{'ms':>8}{'GB/s':>8}")
    for name, r in out.items():
        print(f"{name:<24}{r['ms']:>8.2f}{r['GBps']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
