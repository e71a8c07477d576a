"""Transfer calls as an engine makes them, on the GPU machine: prints a table, writes JSON.

    python benchmarks/engine.py [--rounds N] [--anchor PATH] [--out FILE]

``swap_cache_layout`` over 32 layers x 256 random blocks of 4,096, the block ids a different
Python list each call (an engine's block table hands them over), the caches the engine's own
list of per-layer arrays, both directions, chunks of 128 KiB, 16 KiB, 4 KiB, 1 KiB and 105 B:

- *sync*: one call, then wait for it (median of many);
- *pipelined*: async calls enqueued back to back, all but the first timed between two CUDA
  events (steady state: the first call's host time, before any GPU work, is left out): 40
  timed, or as many as move 4 GiB where that is fewer (at least 8: 8 of 1 GiB at 128 KiB),
  so that no case's window is much longer than another's and than the limit's copy.

Every case is measured once per round and the rounds go round-robin over all cases, so a burst
of interference from other tenants of the host spoils one round of a case, not the case: the
figures are medians over rounds. Each case is checked byte for byte. The limits are one 1 GiB
pinned copy each way, measured in the same rounds.

``--anchor`` names the reference probe (../shared/anchors/swap_small.py): its bare zero-copy
kernel (ids already on the device, no validation) is loaded from that file and raced against a
synchronous 105-byte call, the two alternating call by call in this process.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.kernels._cuda import CudaSwapper, load_cupy  # noqa: E402

L, N, n = 32, 4096, 256
CHUNKS = [(131072, (8, 64, 128), "uint16"), (16384, (1, 64, 128), "uint16"), (4096, (1, 16, 128), "uint16"),
          (1024, (1, 16, 32), "uint16"), (105, (3, 5, 7), "uint8")]
CALLS = 40  # timed async calls per pipelined round ...
WINDOW = 4 << 30  # ... or as many as move this many bytes, where that is fewer (8 at least)


class Case:
    """One chunk size: its caches, host buffer and a ring of fresh id lists."""

    def __init__(self, cp, sw, chunk: int, shape: tuple[int, ...], dtype: str, rng) -> None:
        self.chunk = chunk
        self.calls = max(8, min(CALLS, WINDOW // (n * L * chunk)))  # timed calls per pipelined round
        self.caches = [cp.random.randint(0, 255, (N,) + shape).astype(dtype) for _ in range(L)]
        self.host = sw.pinned((n, L) + shape, dtype)
        # ids a new list object on every call: an engine's block table hands them over
        self.ring = [(rng.choice(N, n, replace=False).tolist(), list(range(n))) for _ in range(CALLS + 2)]
        self.k = 0
        self.sync: dict[str, list[float]] = {"d2h": [], "h2d": []}
        self.pipe: dict[str, list[float]] = {"d2h": [], "h2d": []}

    def ids(self) -> tuple[list[int], list[int]]:
        self.k = (self.k + 1) % len(self.ring)
        g, h = self.ring[self.k]
        return list(g), list(h)


def sync_time(cp, sw, c: Case, direction: str) -> float:
    reps = 6 if c.chunk >= 16384 else 60
    sw.swap_cache_layout(c.caches, c.host, *c.ids(), direction)
    ts = []
    for _ in range(reps):
        g, h = c.ids()
        t = time.perf_counter()
        sw.swap_cache_layout(c.caches, c.host, g, h, direction)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def pipelined_time(cp, sw, c: Case, direction: str) -> float:
    """Seconds per call in steady state: from the end of the first call's GPU work to the end
    of the last (the GPU idles through the first call's host time, which a transfer thread
    issuing calls back to back hides behind the calls before)."""
    ids = [c.ids() for _ in range(c.calls + 1)]
    start, end = cp.cuda.Event(), cp.cuda.Event()
    sw.swap_cache_layout_async(c.caches, c.host, *ids[0], direction)
    start.record(sw.stream)
    for g, h in ids[1:]:
        sw.swap_cache_layout_async(c.caches, c.host, g, h, direction)
    end.record(sw.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / c.calls


def check(cp, sw, c: Case, direction: str) -> bool:
    """Poison the destination, move one call's blocks, compare every byte."""
    g, h = c.ids()
    gi = cp.asarray(np.asarray(g))
    if direction == "d2h":
        c.host[...] = 0x5A
        sw.swap_cache_layout(c.caches, c.host, g, h, "d2h")
        return bool((cp.asarray(c.host[h]) == cp.stack([x[gi] for x in c.caches], axis=1)).all())
    src = np.random.default_rng(2).integers(0, 255, c.host.shape).astype(c.host.dtype)
    c.host[...] = src
    sw.swap_cache_layout(c.caches, c.host, g, h, "h2d")
    return all(bool((x[gi] == cp.asarray(src[h, i])).all()) for i, x in enumerate(c.caches))


def limits_once(cp, sw, dev: int, host) -> dict[str, float]:
    hp, nbytes, s = host.__array_interface__["data"][0], host.nbytes, sw.stream
    out = {}
    for name, args in (("d2h", (hp, dev, nbytes, 2)), ("h2d", (dev, hp, nbytes, 1))):
        s.synchronize()
        t = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(*args, s.ptr)
        s.synchronize()
        out[name] = nbytes / (time.perf_counter() - t) / 1e9
    return out


def engine_rows(cp, sw, rounds: int) -> tuple[list[dict], dict]:
    rng = np.random.default_rng(5)
    cases = [Case(cp, sw, *spec, rng) for spec in CHUNKS]
    dev, host = cp.cuda.runtime.malloc(1 << 30), sw.pinned((1 << 30,), np.uint8)
    lim: dict[str, list[float]] = {"d2h": [], "h2d": []}
    try:
        for _ in range(rounds):
            for k, v in limits_once(cp, sw, dev, host).items():
                lim[k].append(v)
            for c in cases:
                for d in ("d2h", "h2d"):
                    c.sync[d].append(sync_time(cp, sw, c, d))
                    c.pipe[d].append(pipelined_time(cp, sw, c, d))
    finally:
        cp.cuda.runtime.free(dev)
    limit = {k: float(np.median(v)) for k, v in lim.items()}
    rows = []
    for c in cases:
        nbytes = n * L * c.chunk
        for d in ("d2h", "h2d"):
            sync, pipe = float(np.median(c.sync[d])), float(np.median(c.pipe[d]))
            rows.append({"chunk": c.chunk, "direction": d, "sync_us": sync * 1e6, "sync_GBps": nbytes / sync / 1e9,
                         "sync_pct_of_limit": 100 * nbytes / sync / 1e9 / limit[d],
                         "pipelined_GBps": nbytes / pipe / 1e9, "pipelined_calls": c.calls,
                         "pipelined_pct_of_limit": 100 * nbytes / pipe / 1e9 / limit[d],
                         "pipelined_rounds_pct": [round(100 * nbytes / p / 1e9 / limit[d], 1) for p in c.pipe[d]],
                         "correct": check(cp, sw, c, d)})
    return rows, {"d2h_GBps": limit["d2h"], "h2d_GBps": limit["h2d"], "rounds": lim}


def anchor_race(cp, sw, path: str, reps: int = 400) -> dict:
    """The anchor probe's bare zero-copy kernel against a synchronous 105 B call, alternating."""
    spec = importlib.util.spec_from_file_location("anchor_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the kernel source; its main() is not run
    kernel = cp.RawModule(code=mod.KSRC).get_function("gather_bytes")
    rng = np.random.default_rng(7)
    c = Case(cp, sw, 105, (3, 5, 7), "uint8", rng)
    ptrs = cp.asarray(np.array([x.data.ptr for x in c.caches], dtype=np.uint64))
    hptr = c.host.__array_interface__["data"][0]
    ids_np = rng.choice(N, n, replace=False).astype(np.int64)
    ids = cp.asarray(ids_np)
    dev = cp.cuda.Device()

    def bare() -> None:  # launched and waited for as the anchor does
        kernel((n, L), (256,), (ptrs, ids, cp.uint64(hptr), cp.int64(105), cp.int32(L)))
        dev.synchronize()

    times: dict[str, list[float]] = {"anchor_kernel": [], "kvstate_sync": []}
    bare()
    sw.swap_cache_layout(c.caches, c.host, *c.ids(), "d2h")
    for _ in range(reps):
        g, h = c.ids()  # a fresh pair of lists, made before the timer (as in the sync rows)
        for name in times:
            dev.synchronize()
            t = time.perf_counter()
            if name == "anchor_kernel":
                bare()
            else:
                sw.swap_cache_layout(c.caches, c.host, g, h, "d2h")
            times[name].append(time.perf_counter() - t)
    bare()
    want = cp.stack([x[ids] for x in c.caches], axis=1)
    anchor_ok = bool((cp.asarray(c.host) == want).all())
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    return {"anchor_kernel_us": med["anchor_kernel"], "kvstate_sync_us": med["kvstate_sync"],
            "ratio_anchor_over_kvstate": med["anchor_kernel"] / med["kvstate_sync"],
            "reps": reps, "anchor_correct": anchor_ok, "kvstate_correct": check(cp, sw, c, "d2h")}


def report(out: dict) -> None:
    lim = out["limits"]
    print(f"\n{out['gpu']} (id packer: {out['id_packer']}), {out['rounds']} rounds: PCIe limit (median) "
          f"d2h {lim['d2h_GBps']:.1f} GB/s, h2d {lim['h2d_GBps']:.1f} GB/s")
    print(f"{'chunk':>7} {'dir':>4} {'sync us':>9} {'sync GB/s':>9} {'%limit':>7} {'pipelined':>9} {'%limit':>7}  ok"
          "   pipelined %limit by round")
    for r in out["engine"]:
        print(f"{r['chunk']:>7} {r['direction']:>4} {r['sync_us']:9.1f} {r['sync_GBps']:9.1f} "
              f"{r['sync_pct_of_limit']:7.1f} {r['pipelined_GBps']:9.1f} {r['pipelined_pct_of_limit']:7.1f}  "
              f"{r['correct']!s:5} {r['pipelined_rounds_pct']}")
    if "anchor_race" in out:
        a = out["anchor_race"]
        print(f"105 B d2h, alternating {a['reps']} times: anchor's bare kernel {a['anchor_kernel_us']:.1f} us, "
              f"kvstate sync call {a['kvstate_sync_us']:.1f} us (anchor / kvstate = "
              f"{a['ratio_anchor_over_kvstate']:.2f}); correct {a['anchor_correct']}, {a['kvstate_correct']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9, help="rounds over every case (medians are reported)")
    ap.add_argument("--anchor", help="the anchor probe swap_small.py, raced at 105 B when given")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    cp = load_cupy()
    from kvstate.kernels import _ids as ids

    out = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "date": time.strftime("%Y-%m-%d"),
           "id_packer": "compiled" if ids.id_packer is not None else "python", "rounds": args.rounds}
    with CudaSwapper() as sw:
        out["engine"], out["limits"] = engine_rows(cp, sw, args.rounds)
        cp.get_default_memory_pool().free_all_blocks()
        if args.anchor:
            out["anchor_race"] = anchor_race(cp, sw, args.anchor)
    report(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
