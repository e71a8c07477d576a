"""P and D of different TP degrees: the handoff of one request through the store, side by side
with the same-TP handoff, in one run.

    python benchmarks/hetero_handoff.py [--backend cuda|ref] [--tokens 8192] [--reps 5] [--json PATH]

A Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, bf16, blocks of 64 tokens; 1 GiB for
8k tokens). Each pair writes the request from every P rank, then reads it into every D rank,
each rank on its own thread as a threaded driver runs them, through a ``MemoryStore``:

- ``TP 2 -> TP 2``: the default layout, one object per rank, block and kind;
- ``TP 4 -> TP 2``: head groups of 2 heads (``kvstate._spec.paired``), each D rank reading two;
- ``TP 1 -> TP 8`` and ``TP 8 -> TP 1``: head groups of one head.

Reported per pair: bytes P stored, objects in the store, the handoff's median time over
``--reps`` runs (interleaved pair by pair so drift hits them alike), its ratio to TP 2 -> TP 2
(the bar: TP 4 -> TP 2 at ≤ 1.1×), and whether every D rank holds exactly its heads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from kvstate import CacheSpec, paired  # noqa: E402
from kvstate.backends import MemoryStore, ReferenceBackend  # noqa: E402

HEADS, LAYERS, BLOCK, DIM = 8, 32, 64, 128
PAIRS = [(2, 2), (4, 2), (1, 8), (8, 1)]


def spec_for(tp: int) -> CacheSpec:
    return CacheSpec(num_layers=LAYERS, kv_heads=HEADS // tp, block_size=BLOCK, head_dim=DIM, dtype="bfloat16",
                     tp_size=tp, total_kv_heads=HEADS)


class Side:
    """One instance's backend over the shared store, on the GPU or in numpy."""

    def __init__(self, kind: str, spec: CacheSpec, blocks: int, store: MemoryStore) -> None:
        self.kind, self.spec = kind, spec
        if kind == "ref":
            self.b: Any = ReferenceBackend(spec, blocks, store)
        else:
            from kvstate.backends import CudaBackend
            self.b = CudaBackend(spec, blocks, store)

    def layers(self, r: int, kind: str) -> list[Any]:
        return self.b.caches[r][kind] if self.kind == "ref" else list(self.b.caches(r, kind).views)

    def fill(self, rng: np.random.Generator) -> None:
        for r in range(self.spec.tp_size):
            for kind in self.spec.kinds:
                for v in self.layers(r, kind):
                    data = rng.integers(0, 1 << 16, v.shape, dtype=np.uint16)
                    if self.kind == "ref":
                        v[...] = data.view(v.dtype)
                    else:
                        import cupy as cp
                        v.view(cp.uint16)[...] = cp.asarray(data)

    def heads(self, r: int, kind: str, ids: list[int]) -> np.ndarray:
        """Rank ``r``'s blocks ``ids`` of ``kind``, every layer, as ``[layers, blocks, heads, ...]`` uint16."""
        return np.stack([np.asarray(v[ids] if self.kind == "ref" else v[ids].get()).view(np.uint16)
                         for v in self.layers(r, kind)])


def exact(p: Side, d: Side, src: list[int], dst: list[int]) -> bool:
    """Every D rank's heads equal those P's ranks hold (the monolithic cache, cut two ways)."""
    whole = {k: np.concatenate([p.heads(r, k, src) for r in range(0, p.spec.tp_size, p.spec.replicas)], axis=2)
             for k in p.spec.kinds}
    for r in range(d.spec.tp_size):
        first = r // d.spec.replicas * d.spec.kv_heads
        for k in d.spec.kinds:
            if not np.array_equal(d.heads(r, k, dst), whole[k][:, :, first:first + d.spec.kv_heads]):
                return False
    return True


def pair_run(kind: str, p_tp: int, d_tp: int, tokens: int, pool: ThreadPoolExecutor,
             verify: bool = True) -> dict[str, Any]:
    p_spec, d_spec = spec_for(p_tp), spec_for(d_tp)
    if p_tp != d_tp:
        p_spec, d_spec = paired(p_spec, d_spec)
    n = p_spec.blocks_for(tokens)
    store = MemoryStore(3 * n * p_spec.bytes_per_block, verify=verify)
    p, d = Side(kind, p_spec, 2 * n, store), Side(kind, d_spec, 2 * n, store)
    p.fill(np.random.default_rng(p_tp * 10 + d_tp))
    keys = [f"req:{i}" for i in range(n)]
    src, dst = list(range(n)), list(range(n, 2 * n))

    split = {"write": [], "read": []}

    def run() -> None:
        store.evict(store.keys())
        t = time.perf_counter()
        assert all(c == n for c in pool.map(lambda r: p.b.write(r, keys, src), range(p_tp)))
        t2 = time.perf_counter()
        assert all(c == n for c in pool.map(lambda r: d.b.read(r, keys, dst), range(d_tp)))
        split["write"].append(t2 - t)
        split["read"].append(time.perf_counter() - t2)

    run()
    out = {"pair": f"TP {p_tp} -> TP {d_tp}", "heads_per_object": p_spec.object_heads,
           "bytes_stored": p.b.bytes_moved,
           "objects": len([k for k in store if "_sum_" not in k]), "exact": exact(p, d, src, dst),
           "run": run, "split": split, "close": lambda: (p.b.close(), d.b.close())}
    return out


def timed(fn: Callable[[], None], kind: str) -> float:
    sync: Callable[[], Any] = time.perf_counter  # nothing to wait for on the CPU
    if kind == "cuda":
        import cupy as cp
        sync = cp.cuda.runtime.deviceSynchronize
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["cuda", "ref"], default="cuda")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trusted", action="store_true", help="stores without checksums (verify off)")
    ap.add_argument("--serial", action="store_true", help="ranks one after another, not a thread each")
    args = ap.parse_args(argv)
    with ThreadPoolExecutor(1 if args.serial else 8) as pool:
        runs = [pair_run(args.backend, p, d, args.tokens, pool, not args.trusted) for p, d in PAIRS]
        try:
            times: list[list[float]] = [[] for _ in runs]
            for _ in range(args.reps):
                for i, r in enumerate(runs):
                    times[i].append(timed(r["run"], args.backend))
        finally:
            for r in runs:
                r.pop("close")()
    base = float(np.median(times[0]))
    rows = []
    print(f"{'pair':<14} {'heads/obj':>9} {'GiB stored':>10} {'objects':>8} {'ms':>8} {'write':>7} {'read':>7} "
          f"{'vs 2->2':>8} exact")
    for r, t in zip(runs, times):
        r.pop("run")
        split = r.pop("split")
        r["handoff_ms"], r["ratio_to_same_tp"] = float(np.median(t)) * 1e3, float(np.median(t)) / base
        r["write_ms"], r["read_ms"] = (float(np.median(split[k][1:])) * 1e3 for k in ("write", "read"))
        rows.append(r)
        print(f"{r['pair']:<14} {r['heads_per_object']:>9} {r['bytes_stored'] / 2**30:>10.3f} {r['objects']:>8} "
              f"{r['handoff_ms']:>8.1f} {r['write_ms']:>7.1f} {r['read_ms']:>7.1f} {r['ratio_to_same_tp']:>7.3f}x "
              f"{r['exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "tokens": args.tokens, "reps": args.reps, "verify": not args.trusted,
                       "serial": args.serial, "pairs": rows}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
