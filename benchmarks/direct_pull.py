"""The direct handoff across processes: D's GPU pulls P's 8k-token cache (1 GiB) over NVLink.

    python3 benchmarks/direct_pull.py [--reps 9] [--out direct_pull.json]

P is a process of its own with a CudaBackend on GPU 0 that lends a Llama-3-8B-shaped request
(32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens: 512 blocks, 1 GiB) on a lend board,
rep after rep. D, this process, has a CudaBackend on GPU 1 (GPU 0 when there is one) and
pulls each: the board's take, one kernel a kind reading P's GPU through CUDA IPC, the sums of
what landed compared with P's, the release; each pull is timed from when P's entry is on the
board (in serving, P posts it with the first token), D's keys made before. Pulls alternate:
one armed before P posts (``CudaBackend.arm_pull``, as D arms it when it reserves its blocks:
the copy queued behind a flag, so the pull takes the entry and raises the flag), one not.
After each pull, in the same run, the plain peer copy of the same bytes: ``torch.Tensor.copy_``
from a GPU 0 tensor to a GPU 1 tensor, both allocated once. Prints a table (medians) and
writes JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstate import CacheSpec  # noqa: E402
from kvstate.backends import CudaBackend, MemoryStore  # noqa: E402
from kvstate.backends._lends import LendBoard  # noqa: E402

SPEC = CacheSpec(num_layers=32, kv_heads=8, block_size=16, head_dim=128, dtype="bfloat16", tp_size=1)
BLOCKS, REQUEST = 1024, 512  # blocks in each cache; blocks of the request (8k tokens)


def _keys(rep: int) -> list[str]:
    return [f"rep{rep}-block{i}" for i in range(REQUEST)]


def _within(seconds: float):
    """A lend's ``until``: True for ``seconds`` from now."""
    end = time.monotonic() + seconds
    return lambda: time.monotonic() < end


def lender(root: str, reps: int, ready, done) -> None:
    """P: fill the caches, then lend rep after rep (each until D released it)."""
    import cupy as cp
    import numpy as np

    be = CudaBackend(SPEC, BLOCKS, MemoryStore(1 << 20), device=0, lends=LendBoard(root, wait=0))
    with cp.cuda.Device(0):
        for kind in SPEC.kinds:
            for arr in be.caches(0, kind).views:
                raw = arr.view(cp.uint8)
                raw[...] = cp.random.randint(0, 256, raw.shape, dtype=cp.uint8)
        cp.cuda.runtime.deviceSynchronize()
    ids = np.random.default_rng(1).permutation(BLOCKS)[:REQUEST].tolist()
    ready.set()
    pulled = 0
    for rep in range(reps):
        pulled += be.lend(0, _keys(rep), ids, _within(60.0)) > 0
    done.put(pulled)
    be.close()


class PeerCopy:
    """torch ``copy_`` of the request's bytes from GPU 0 to GPU 1 (the issue's baseline), into
    tensors allocated once: freeing them between pulls would change the GPUs' mappings under
    the pulls."""

    def __init__(self) -> None:
        import torch

        self.torch, n = torch, REQUEST * SPEC.bytes_per_block_per_rank
        self.dev = 1 if torch.cuda.device_count() > 1 else 0
        self.a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        self.b = torch.empty(n, dtype=torch.uint8, device=f"cuda:{self.dev}")
        self.ms()  # the first copy sets the peer mapping up

    def ms(self) -> float:
        """One copy, timed by CUDA events around it on the destination's stream."""
        torch = self.torch
        with torch.cuda.device(self.dev):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self.b.copy_(self.a, non_blocking=True)
            e.record()
            e.synchronize()
        return float(s.elapsed_time(e))

    def close(self) -> None:
        del self.a, self.b
        self.torch.cuda.empty_cache()


def measure(reps: int) -> dict:
    """The pulls (the first, which maps P's caches, apart) and the peer copies, in turn, in
    one run."""
    import cupy as cp
    import numpy as np

    d_dev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    root = tempfile.mkdtemp(prefix="kvstate-bench-lends-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=lender, args=(root, 2 * reps + 1, ready, done), daemon=True)
    proc.start()
    db = CudaBackend(SPEC, BLOCKS, MemoryStore(1 << 20), device=d_dev, pulls=LendBoard(root, wait=30))
    dst = np.random.default_rng(2).permutation(BLOCKS)[:REQUEST].tolist()
    out: dict = {"d_device": d_dev, "pulls": [], "armed": [], "copy": []}
    peer = PeerCopy()
    try:
        if not ready.wait(120):
            raise SystemExit("the lender did not start")
        for rep in range(2 * reps + 1):
            keys = _keys(rep)  # D holds its request's keys before its read
            armed = rep % 2 == 0 and rep > 0 and db.arm_pull(0, keys, dst)  # as at reservation, before P posts
            while not list(Path(root).glob("*.lend")):  # the pull is timed from P's post on, as after a
                time.sleep(0.0001)                      # first token that follows the post
            t0 = time.perf_counter()
            n = db.pull(0, keys, dst, lambda: True)
            ms = (time.perf_counter() - t0) * 1e3
            if n != REQUEST:
                raise SystemExit(f"rep {rep}: pulled {n} of {REQUEST} blocks")
            if rep == 0:
                out["first"] = ms
            else:
                out["armed" if armed else "pulls"].append(ms)
                out["copy"].append(peer.ms())
        out["armed_counts"] = db.armed_counts()
        out["pulled_by_p"] = done.get(timeout=60)
        proc.join(30)
    finally:
        peer.close()
        db.close()
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="direct_pull.json")
    args = ap.parse_args()
    got = measure(args.reps)
    size = REQUEST * SPEC.bytes_per_block_per_rank
    copy = statistics.median(got["copy"])
    if len(got["armed"]) != args.reps:
        raise SystemExit(f"{len(got['armed'])} of {args.reps} pulls were armed: {got['armed_counts']}")
    pull, armed = statistics.median(got["pulls"]), statistics.median(got["armed"])
    row = {"bytes": size, "gib": size / 2**30, "d_device": got["d_device"], "reps": args.reps,
           "pull_ms": got["pulls"], "armed_ms": got["armed"], "first_pull_ms": got["first"],
           "peer_copy_ms": got["copy"],
           "pulled_by_p": got["pulled_by_p"], "armed_counts": got["armed_counts"], "pull_median_ms": pull,
           "armed_median_ms": armed, "copy_median_ms": copy, "ratio": pull / copy, "armed_ratio": armed / copy,
           "armed_worst_ratio": max(got["armed"]) / copy, "pull_gbps": size / pull / 1e6,
           "armed_gbps": size / armed / 1e6}
    print(f"P on GPU 0 (its own process) -> D on GPU {got['d_device']}, {row['gib']:.2f} GiB, medians of {args.reps}")
    print("| path | ms | GB/s | / copy_ |")
    print("| --- | --- | --- | --- |")
    print(f"| direct pull armed at reservation (take, flag, sums, release) | {armed:.2f} | {row['armed_gbps']:.0f} | "
          f"{row['armed_ratio']:.3f}x (slowest {row['armed_worst_ratio']:.3f}x) |")
    print(f"| direct pull, not armed (take, launch, sums, release) | {pull:.2f} | {row['pull_gbps']:.0f} | "
          f"{row['ratio']:.3f}x |")
    print(f"| torch copy_ GPU 0 -> GPU {got['d_device']} | {copy:.2f} | {size / copy / 1e6:.0f} | 1.000x |")
    print(f"| first pull (maps P's caches) | {got['first']:.2f} | | |")
    Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
