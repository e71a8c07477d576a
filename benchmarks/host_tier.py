"""A preemption round trip on the GPU: through the host tier against through MemoryStore.

    python3 benchmarks/host_tier.py [--tokens 8192] [--reps 5] [--out results/host_tier.json]

A Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, bf16, blocks of 64 tokens,
TP 1) holds one request of ``--tokens`` prompt tokens plus its first token, with random
bytes. Through the public API only (``DecodeLifecycle``, ``StepDriver``, ``CudaBackend``),
each repetition preempts a fresh request (new tokens, so nothing is shared or already
stored), runs the driver until its blocks are free, resumes it and runs the driver until it
decodes again; the bytes back in its new blocks are compared with the bytes it had.

- ``host``: ``Policy(preempt="swap")`` with a host tier: a SwapOut and a SwapIn.
- ``store``: ``Policy(preempt="write")`` over a ``MemoryStore``: the write-back and the reload
  through 64 MiB pinned staging.
- ``pcie``: one copy of the same bytes each way between a device buffer and pinned memory
  (the bar: the host tier's round trip within 1.2 x their sum).
Medians over ``--reps``; everything in one run, so the ratios are side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate import CacheSpec, DecodeLifecycle, Policy  # noqa: E402
from kvstate.backends import (  # noqa: E402
    CudaBackend,  # noqa: E402
    MemoryStore,
    StepDriver,
)

SPEC = CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", tp_size=1)


def pcie_seconds(cp, nbytes: int, reps: int) -> tuple[float, float]:
    """Median seconds of one device->pinned and one pinned->device copy of ``nbytes``."""
    import cupyx
    dev = cp.empty(nbytes, cp.uint8)
    host = cupyx.empty_pinned(nbytes, cp.uint8)
    d2h, h2d = [], []
    for _ in range(reps + 1):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        dev.get(out=host)
        cp.cuda.Device().synchronize()
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        dev.set(host)
        cp.cuda.Device().synchronize()
        h2d.append(time.perf_counter() - t)
    return statistics.median(d2h[1:]), statistics.median(h2d[1:])


def decoding(lc, drv, backend, cp, rid: str, toks: list[int]) -> None:
    """``rid`` running with random cache bytes (nothing stored: the read misses, it recomputes)."""
    lc.reserve(rid, toks)
    lc.deliver_first_token(rid, 1)
    drv.run_until_idle()
    lc.recompute_done(rid)
    ids = cp.asarray(lc.blocks_of(rid))
    for kind in SPEC.kinds:
        for layer in backend.caches(0, kind).views:
            layer[ids] = cp.random.standard_normal(layer[ids].shape, dtype=cp.float32).astype(layer.dtype)


def snapshot(backend, cp, blocks, n: int) -> list:
    ids = cp.asarray(blocks[:n])
    return [layer[ids].copy() for kind in SPEC.kinds for layer in backend.caches(0, kind).views]


def round_trip(policy: Policy, host_blocks: int, tokens: int, reps: int, cp) -> dict:
    nblocks = 2 * SPEC.blocks_for(tokens + 2) + 4
    store = MemoryStore((reps + 1) * SPEC.blocks_for(tokens + 1) * SPEC.bytes_per_block_per_rank + (1 << 30))
    lc = DecodeLifecycle(SPEC, nblocks, policy, host_blocks=host_blocks)
    backend = CudaBackend(SPEC, nblocks, store, host_blocks=host_blocks)
    drv = StepDriver(lc, backend)
    out, back, ok = [], [], True
    try:
        for rep in range(reps + 1):  # the first is a warm-up
            rid = f"r{rep}"
            toks = [(rep * 7919 + i) % 32000 for i in range(tokens)]
            decoding(lc, drv, backend, cp, rid, toks)
            n = SPEC.blocks_for(tokens)  # the cache before the newest token: what is copied
            before = snapshot(backend, cp, lc.blocks_of(rid), n)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            lc.preempt(rid)
            drv.run_until_idle()
            t1 = time.perf_counter()
            assert lc.state_of(rid) in ("swapped", "preempted"), lc.state_of(rid)
            new = lc.resume(rid)
            drv.run_until_idle()
            t2 = time.perf_counter()
            assert lc.state_of(rid) == "running", lc.state_of(rid)
            after = snapshot(backend, cp, list(new), n)
            ok = ok and all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all()) for a, b in zip(before, after))
            lc.finish(rid)
            if rep:
                out.append(t1 - t0)
                back.append(t2 - t1)
    finally:
        backend.close()
    total = [a + b for a, b in zip(out, back)]
    return {"out_s": statistics.median(out), "in_s": statistics.median(back),
            "round_trip_s": statistics.median(total), "round_trip_min_s": min(total), "bytes_ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import cupy as cp
    nbytes = SPEC.blocks_for(args.tokens) * SPEC.bytes_per_block_per_rank
    d2h, h2d = pcie_seconds(cp, nbytes, args.reps)
    slots = 2 * SPEC.blocks_for(args.tokens) + 2
    # nothing is stored: a request's first read misses and it recomputes (random bytes stand in)
    common = dict(read_failure="recompute", transfer_timeout=120.0)
    host = round_trip(Policy(preempt="swap", **common), slots, args.tokens, args.reps, cp)
    store = round_trip(Policy(preempt="write", **common), 0, args.tokens, args.reps, cp)
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "tokens": args.tokens,
           "bytes": nbytes, "pcie_d2h_s": d2h, "pcie_h2d_s": h2d,
           "pcie_GBps": [nbytes / d2h / 1e9, nbytes / h2d / 1e9], "host": host, "store": store,
           "host_vs_pcie": host["round_trip_s"] / (d2h + h2d),
           "store_vs_host": store["round_trip_s"] / host["round_trip_s"]}
    print(f"{'path':<8}{'out ms':>10}{'in ms':>10}{'round trip ms':>16}{'bytes ok':>10}")
    print(f"{'pcie':<8}{d2h * 1e3:>10.2f}{h2d * 1e3:>10.2f}{(d2h + h2d) * 1e3:>16.2f}{'':>10}")
    for name, r in (("host", host), ("store", store)):
        print(f"{name:<8}{r['out_s'] * 1e3:>10.2f}{r['in_s'] * 1e3:>10.2f}{r['round_trip_s'] * 1e3:>16.2f}"
              f"{str(r['bytes_ok']):>10}")
    print(f"host tier round trip = {res['host_vs_pcie']:.3f} x PCIe time of its bytes (bar 1.2); "
          f"MemoryStore round trip = {res['store_vs_host']:.2f} x the host tier's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if host["bytes_ok"] and store["bytes_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
