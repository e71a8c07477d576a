"""CUDA transfer ops and backend handoff on the GPU machine: prints a table, writes JSON.

    python benchmarks/kernels.py [--quick] [--sections ...] [--anchor PATH] [--out FILE] [--json]

1. PCIe limits: one 1 GiB pinned copy each way.
2. ``overhead``: where the host time of one small call goes (105-byte chunks; a profile).
3. ``layout``: ``swap_cache_layout``, 32 layers, 256 of 4096 blocks, contiguous and random GPU ids, both
   directions, chunk sizes 128 KiB, 16 KiB, 4 KiB, 1 KiB and 105 B, for each strategy and
   ``auto``; GB/s of payload = bytes / median wall time of a synchronous call (the same
   method as ../shared/anchors/swap_small.py, which the device run executes alongside);
   every ``auto`` result is checked byte for byte.
4. ``handoff``: the CUDA backend's handoff of one 8k-token request (Llama-3-8B-like cache, TP 1) P GPU →
   MemoryStore → D GPU, against each stage alone (D2H, the store's put+get copy, H2D).

5. ``engine``: calls as an engine makes them (a fresh Python list of ids each call, both
   directions, 128 KiB to 105 B, synchronous and pipelined, rounds; with ``--anchor``, the race
   against the anchor's bare kernel): the rows of benchmarks/engine.py, which also runs alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.kernels._cuda import CudaSwapper, choose_strategy, load_cupy  # noqa: E402

#: the physical limits of ../shared/anchors/README.md (H100, 1 GiB pinned copies)
ANCHOR_LIMIT = {"d2h": 54.7, "h2d": 51.9}

CHUNKS = [  # (chunk bytes, [heads, block_size, head_dim], dtype)
    (131072, (8, 64, 128), "uint16"),
    (16384, (1, 64, 128), "uint16"),
    (4096, (1, 16, 128), "uint16"),
    (1024, (1, 16, 32), "uint16"),
    (105, (3, 5, 7), "uint8"),
]


def median_time(fn, sync, reps: int) -> float:
    fn()
    sync()
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def limits(cp, sw, reps: int) -> dict:
    nbytes = 1 << 30
    dev = cp.cuda.runtime.malloc(nbytes)
    host = sw.pinned((nbytes,), np.uint8)
    hp = host.__array_interface__["data"][0]
    s = sw.stream
    sync = s.synchronize
    d2h = median_time(lambda: cp.cuda.runtime.memcpyAsync(hp, dev, nbytes, 2, s.ptr), sync, reps)
    h2d = median_time(lambda: cp.cuda.runtime.memcpyAsync(dev, hp, nbytes, 1, s.ptr), sync, reps)
    cp.cuda.runtime.free(dev)
    return {"d2h_GBps": nbytes / d2h / 1e9, "h2d_GBps": nbytes / h2d / 1e9}


def layout_rows(cp, sw, lim: dict, reps: int, quick: bool) -> list[dict]:
    L, N, n = 32, 4096, 256
    rows = []
    for chunk, shape, dt in CHUNKS[:2] + CHUNKS[3:] if quick else CHUNKS:
        caches = [cp.random.randint(0, 255, (N,) + shape).astype(dt) for _ in range(L)]
        layers = sw.bind(caches)
        host = sw.pinned((n, L) + shape, dt)
        nbytes = n * L * chunk
        for pattern in ("contig", "random"):
            gids = (np.arange(n) + 7) if pattern == "contig" else np.random.default_rng(1).choice(N, n, replace=False)
            gids = gids.astype(np.int64)
            hids = np.arange(n, dtype=np.int64)
            for direction in ("d2h", "h2d"):
                r = {"chunk": chunk, "pattern": pattern, "direction": direction, "MiB": round(nbytes / 2**20, 2)}
                for strat in ("zero_copy", "staged", "dma", "auto"):
                    if strat == "dma" and pattern == "random" and chunk < 16384:
                        continue  # 8192 single-chunk DMAs: the per-chunk baseline, measured by the anchor
                    def fn(layers=layers, host=host, gids=gids, hids=hids, direction=direction, strat=strat):
                        return sw.swap_cache_layout(layers, host, gids, hids, direction, strategy=strat)
                    r[strat] = nbytes / median_time(fn, lambda: None, reps) / 1e9
                    r[f"{strat}_pipelined"] = nbytes / pipelined_time(cp, sw, layers, host, gids, hids, direction,
                                                                     strat) / 1e9
                plan = sw.swap_cache_layout(layers, host, gids, hids, direction, strategy="auto")
                r["auto_is"] = choose_strategy(plan)
                r["auto_pct_of_limit"] = 100 * r["auto"] / lim[f"{direction}_GBps"]
                r["auto_pct_of_anchor_limit"] = 100 * r["auto"] / ANCHOR_LIMIT[direction]
                r["correct"] = check(cp, sw, layers, caches, host, gids, hids, direction)
                rows.append(r)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        caches = layers = None
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def pipelined_time(cp, sw, layers, host, gids, hids, direction, strategy: str = "auto", calls: int = 20) -> float:
    """Seconds per call when an engine enqueues calls back to back (the async form): between
    two events on the swapper's stream, so host and GPU work overlap."""
    sw.swap_cache_layout(layers, host, gids, hids, direction, strategy=strategy)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(sw.stream)
    for _ in range(calls):
        sw.swap_cache_layout_async(layers, host, gids, hids, direction, strategy=strategy)
    end.record(sw.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / calls


def check(cp, sw, layers, caches, host, gids, hids, direction) -> bool:
    """Poison the destination, run ``auto`` once more, compare every byte."""
    g = cp.asarray(gids)
    if direction == "d2h":
        host[...] = 0x5A if host.dtype == np.uint8 else 0x5A5A
        sw.swap_cache_layout(layers, host, gids, hids, "d2h")
        want = cp.stack([c[g] for c in caches], axis=1)
        return bool((cp.asarray(host[hids]) == want).all())
    src = np.random.default_rng(2).integers(0, 256, host.nbytes, dtype=np.uint8).view(host.dtype).reshape(host.shape)
    host[...] = src
    sw.swap_cache_layout(layers, host, gids, hids, "h2d")
    return all(bool((c[g] == cp.asarray(src[hids, i])).all()) for i, c in enumerate(caches))


def overhead(cp, sw) -> dict:
    """Where the host time of one small call goes (105-byte chunks, 256 random blocks, d2h)."""
    import cProfile
    import io
    import pstats

    from kvstate.kernels._plan import plan_layout

    L, N, n, shape = 32, 4096, 256, (3, 5, 7)
    caches = [cp.random.randint(0, 255, (N,) + shape).astype("uint8") for _ in range(L)]
    layers = sw.bind(caches)
    host = sw.pinned((n, L) + shape, np.uint8)
    gids = np.random.default_rng(1).choice(N, n, replace=False).astype(np.int64)
    hids = np.arange(n, dtype=np.int64)
    reps = 300

    def per_call(fn) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e6

    out = {
        "plan_us": per_call(lambda: plan_layout(layers, host, gids, hids, "d2h")),
        "host_check_us": per_call(lambda: sw.host_pointer(host, "host")),
        "sync_call_us": per_call(lambda: sw.swap_cache_layout(layers, host, gids, hids, "d2h", strategy="zero_copy")),
        "list_call_us": per_call(lambda: sw.swap_cache_layout(caches, host, gids, hids, "d2h", strategy="zero_copy")),
    }
    evs = []
    t = time.perf_counter()
    for _ in range(reps):
        evs.append(sw.swap_cache_layout_async(layers, host, gids, hids, "d2h", strategy="zero_copy"))
    evs[-1].synchronize()
    out["async_pipelined_us"] = (time.perf_counter() - t) / reps * 1e6
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(sw.stream)
    for _ in range(50):
        sw.swap_cache_layout_async(layers, host, gids, hids, "d2h", strategy="zero_copy")
    end.record(sw.stream)
    end.synchronize()
    out["gpu_us_per_call"] = cp.cuda.get_elapsed_time(start, end) * 1e3 / 50
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        sw.swap_cache_layout(layers, host, gids, hids, "d2h", strategy="zero_copy")
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    out["profile"] = buf.getvalue()
    return out


def _stage_times(cp, spec, p, d, store, run, src, dst, reps: int, trusted=None) -> tuple[float, ...]:
    """Median seconds of the handoff, of each stage alone (over whole-request pinned buffers)
    and of the handoff through a trusted store (no checksums: ``trusted``), interleaved rep by
    rep so that drift on a shared machine hits them all alike; last, the median of each rep's
    handoff over its trusted handoff (the pair run back to back)."""
    nblocks = len(src)
    with CudaSwapper() as sw:
        bufs = {k: sw.pinned((nblocks, spec.layers) + spec.block_shape(k), spec.kind_dtype(k)) for k in spec.kinds}
        hids = np.arange(nblocks)
        names = [f"stage:{k}:{i}" for i in range(nblocks) for k in spec.kinds]
        views = [memoryview(bufs[k][i]).cast("B") for i in range(nblocks) for k in spec.kinds]

        def d2h() -> None:
            for k in spec.kinds:
                sw.swap_cache_layout(p.caches(0, k), bufs[k], src, hids, "d2h")

        def h2d() -> None:
            for k in spec.kinds:
                sw.swap_cache_layout(d.caches(0, k), bufs[k], dst, hids, "h2d")

        def copy() -> None:
            store.batch_put_from(names, views)
            store.batch_get_into(names, views)

        stages = {"handoff": run, "d2h": d2h, "store": copy, "h2d": h2d, "trusted": trusted or (lambda: None)}
        times: dict[str, list[float]] = {k: [] for k in stages}
        for fn in stages.values():  # warm-up
            fn()
        for _ in range(reps):
            for name, fn in stages.items():
                cp.cuda.runtime.deviceSynchronize()
                t = time.perf_counter()
                fn()
                cp.cuda.runtime.deviceSynchronize()
                times[name].append(time.perf_counter() - t)
    paired = float(np.median(np.asarray(times["handoff"]) / np.asarray(times["trusted"])))
    return tuple(float(np.median(times[k])) for k in stages) + (paired,)


def handoff(cp, reps: int) -> dict:
    from kvstate import CacheSpec
    from kvstate.backends import CudaBackend, MemoryStore

    spec = CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", tp_size=1)
    nblocks = spec.blocks_for(8192)
    keys = [f"req0:{i}" for i in range(nblocks)]
    src, dst = list(range(nblocks)), list(range(nblocks, 2 * nblocks))
    total = nblocks * spec.bytes_per_block_per_rank
    store, trusted = MemoryStore(3 * total), MemoryStore(3 * total, verify=False)
    p = CudaBackend(spec, 2 * nblocks, store)
    d = CudaBackend(spec, 2 * nblocks, store)
    pt = CudaBackend(spec, 2 * nblocks, trusted, caches=[{k: p.caches(0, k).views for k in spec.kinds}])
    dt = CudaBackend(spec, 2 * nblocks, trusted, caches=[{k: d.caches(0, k).views for k in spec.kinds}])
    try:
        for kind in spec.kinds:
            for v in p.caches(0, kind).views:
                v[...] = cp.random.randint(0, 65535, v.shape, dtype=cp.int64).astype(cp.uint16)

        def run() -> None:  # checksummed: manifests written, every block verified
            assert p.write(0, keys, src) == nblocks
            assert d.read(0, keys, dst) == nblocks

        def run_trusted() -> None:
            assert pt.write(0, keys, src) == nblocks
            assert dt.read(0, keys, dst) == nblocks

        t_handoff, t_d2h, t_store, t_h2d, t_trusted, paired = _stage_times(cp, spec, p, d, store, run, src, dst,
                                                                           reps, run_trusted)
        ok = all(bool((pv[cp.asarray(src)] == dv[cp.asarray(dst)]).all())
                 for kind in spec.kinds
                 for pv, dv in zip(p.caches(0, kind).views, d.caches(0, kind).views))
        slowest = max(t_d2h, t_store, t_h2d)
        return {"request_tokens": 8192, "bytes": total, "handoff_ms": t_handoff * 1e3, "d2h_ms": t_d2h * 1e3,
                "store_copy_ms": t_store * 1e3, "h2d_ms": t_h2d * 1e3, "ratio_to_slowest_stage": t_handoff / slowest,
                "trusted_handoff_ms": t_trusted * 1e3, "checksum_cost": t_handoff / t_trusted,
                "checksum_cost_paired": paired, "reps": reps,
                "pinned_staging_bytes": p.pinned_bytes + d.pinned_bytes, "correct": ok}
    finally:
        for b in (p, d, pt, dt):
            b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--sections", default="limits,overhead,layout,handoff",
                    help="comma-separated: limits (always run), overhead, layout, handoff, engine")
    ap.add_argument("--anchor", help="with the engine section: the anchor probe swap_small.py, raced at 105 B")
    ap.add_argument("--handoff-reps", type=int, default=11,
                    help="repetitions of the handoff and of each stage (a median: the host's copy speed is noisy)")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--json", action="store_true", help="print the JSON object last")
    args = ap.parse_args(argv)
    cp = load_cupy()
    reps = 3 if args.quick else 5
    props = cp.cuda.runtime.getDeviceProperties(0)
    from kvstate.kernels import _ids as ids

    out = {"gpu": props["name"].decode(), "date": time.strftime("%Y-%m-%d"),
           "id_packer": "compiled" if ids.id_packer is not None else "python"}
    sections = set(args.sections.split(","))
    with CudaSwapper() as sw:
        out["limits"] = limits(cp, sw, reps)
        print(json.dumps(out["limits"]), flush=True)
        if "overhead" in sections:
            out["overhead"] = overhead(cp, sw)
            print(out["overhead"].pop("profile") if not args.json else "", flush=True)
            print(json.dumps(out["overhead"]), flush=True)
        if "layout" in sections:
            out["layout"] = layout_rows(cp, sw, out["limits"], reps, args.quick)
        if "engine" in sections:
            out["engine"] = engine_section(cp, sw, 3 if args.quick else 9, args.anchor, out)
    if "handoff" in sections:
        out["handoff"] = handoff(cp, args.handoff_reps)
        print(json.dumps(out["handoff"]), flush=True)
    report(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.json:
        print(json.dumps(out))
    return 0


def engine_section(cp, sw, rounds: int, anchor: str | None, out: dict) -> dict:
    """benchmarks/engine.py's rows (and anchor race) on this swapper, as that script reports them."""
    import engine as engine_mode  # benchmarks/engine.py, beside this script

    res = {"gpu": out["gpu"], "id_packer": out["id_packer"], "rounds": rounds}
    res["engine"], res["limits"] = engine_mode.engine_rows(cp, sw, rounds)
    cp.get_default_memory_pool().free_all_blocks()
    if anchor:
        res["anchor_race"] = engine_mode.anchor_race(cp, sw, anchor)
    return res


def report(out: dict) -> None:
    """The tables of whatever sections ran."""
    lim = out["limits"]
    print(f"\n{out['gpu']} (id packer: {out.get('id_packer')}): "
          f"PCIe limit d2h {lim['d2h_GBps']:.1f} GB/s, h2d {lim['h2d_GBps']:.1f} GB/s")
    if "layout" in out:
        layout_report(out)
    if "engine" in out:
        import engine as engine_mode

        engine_mode.report(out["engine"])
    if "handoff" in out:
        h = out["handoff"]
        print(f"handoff 8k tokens ({h['bytes'] / 2**20:.0f} MiB): {h['handoff_ms']:.1f} ms; "
              f"alone: d2h {h['d2h_ms']:.1f}, "
              f"store {h['store_copy_ms']:.1f}, h2d {h['h2d_ms']:.1f} ms -> {h['ratio_to_slowest_stage']:.2f}x "
              f"slowest; pinned {h['pinned_staging_bytes'] / 2**20:.0f} MiB; correct {h['correct']}; "
              f"checksums cost {h['checksum_cost']:.3f}x, paired {h['checksum_cost_paired']:.3f}x "
              f"(trusted store {h['trusted_handoff_ms']:.1f} ms)")


def layout_report(out: dict) -> None:
    print(f"{'chunk':>7} {'ids':>6} {'dir':>4} {'zero_copy':>9} {'staged':>7} {'dma':>6} {'auto':>6} {'%limit':>6} "
          f"{'%anchor':>7} {'pipelined':>9} auto_is  ok")
    for r in out["layout"]:
        dma = f"{r['dma']:6.1f}" if "dma" in r else "     -"
        print(f"{r['chunk']:>7} {r['pattern']:>6} {r['direction']:>4} {r['zero_copy']:9.1f} {r['staged']:7.1f} "
              f"{dma} {r['auto']:6.1f} {r['auto_pct_of_limit']:6.1f} {r['auto_pct_of_anchor_limit']:7.1f} "
              f"{r['auto_pipelined']:9.1f} {r['auto_is']:<9} {r['correct']}")
    print("\npipelined (async calls back to back), GB/s:")
    print(f"{'chunk':>7} {'ids':>6} {'dir':>4} {'zero_copy':>9} {'staged':>7} {'dma':>6} {'auto':>6} {'%limit':>6}")
    for r in out["layout"]:
        dma = f"{r['dma_pipelined']:6.1f}" if "dma_pipelined" in r else "     -"
        pct = 100 * r["auto_pipelined"] / out["limits"][f"{r['direction']}_GBps"]
        print(f"{r['chunk']:>7} {r['pattern']:>6} {r['direction']:>4} {r['zero_copy_pipelined']:9.1f} "
              f"{r['staged_pipelined']:7.1f} {dma} {r['auto_pipelined']:6.1f} {pct:6.1f}")


if __name__ == "__main__":
    sys.exit(main())
