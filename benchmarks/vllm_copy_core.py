"""The connector's copy core on vLLM-shaped CUDA tensors beside a plain ``copy_`` (GPU).

    python3 benchmarks/vllm_copy_core.py [--reps 5] [--store memory|arena] [--out F.json]

A Llama-3-8B-shaped cache in vLLM's GPU layout under ``HND`` (32 layers, each ``[2, blocks, 8,
64, 128]`` bf16, TP 1): one 8,192-token request is 128 blocks, 1 GiB. The save
(``RankTransfers``: gather on the GPU, checksums on the GPU, into the store) and the
load (into other blocks, verified) are timed against ``copy_`` of the same bytes between the
GPU and one pinned host buffer, each way. ``--store memory``: a ``MemoryStore`` (staged through
pinned slots, then copied on the host); ``arena`` (the default): an ``ArenaStore``, whose slots
the GPU gathers into and scatters out of. Medians; the load is checked byte-exact.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def open_store(kind: str, per_object: int, n: int):
    from kvstate.backends import ArenaStore, MemoryStore

    return MemoryStore(4 << 30) if kind == "memory" else ArenaStore.create(per_object, 4 * n, small_bytes=1024)


def main() -> None:
    import torch

    from kvstate import CacheSpec, block_keys
    from kvstate.commands import ReadBlocks, WriteBlocks
    from kvstate.integrations._pagedkv import RankTransfers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--store", choices=["memory", "arena"], default="arena")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    layers, heads, bs, dim, n = 32, 8, 64, 128, 128
    nb = 2 * n + 8
    spec = CacheSpec(num_layers=layers, kv_heads=heads, block_size=bs, head_dim=dim)
    caches = {f"l{i}": torch.randn(2, nb, heads, bs, dim, device="cuda").to(torch.bfloat16) for i in range(layers)}
    tr = RankTransfers(spec, 0, caches, open_store(a.store, layers * heads * bs * dim * 2, n),
                       staging_bytes=256 << 20)
    src, dst = list(range(n)), list(range(n, 2 * n))
    nbytes = n * spec.bytes_per_block_per_rank
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    rows: dict[str, list[float]] = {"save": [], "load": [], "copy_d2h": [], "copy_h2d": []}
    for rep in range(a.reps + 1):
        keys = tuple(block_keys(list(range(rep * 10**6, rep * 10**6 + n * bs)), bs, namespace="b"))
        t0 = time.perf_counter()
        tr.submit("save", [WriteBlocks("r", rep + 1, (0,), time.monotonic() + 60, keys, tuple(src))])
        assert [c.count for c in tr.poll("save", 60)] == [n]
        t1 = time.perf_counter()
        tr.submit("load", [ReadBlocks("r", rep + 1, (0,), time.monotonic() + 60, keys, tuple(dst))])
        assert [c.count for c in tr.poll("load", 60)] == [n]
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        flat.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        if rep:  # the first is a warm-up
            for k, v in zip(rows, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                rows[k].append(v * 1e3)
        for c in caches.values():
            assert torch.equal(c[:, src], c[:, dst])
            c[:, dst].zero_()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"1 GiB ({nbytes / 2**30:.2f} GiB) on {torch.cuda.get_device_name()}, {a.store} store: "
          f"medians of {a.reps}")
    for k, v in med.items():
        print(f"  {k:<9} {v:8.1f} ms  {nbytes / v / 1e6:6.1f} GB/s")
    save, load = med["save"] / med["copy_d2h"], med["load"] / med["copy_h2d"]
    print(f"  save / copy_d2h {save:.2f}x, load / copy_h2d {load:.2f}x")
    tr.close()
    if a.out:
        a.out.write_text(json.dumps({"ms": med, "bytes": nbytes, "reps": a.reps, "store": a.store}, indent=1))


if __name__ == "__main__":
    main()
