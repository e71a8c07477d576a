"""The embedded stores against this host's memory bandwidth, and the host checksum's speed.

    python benchmarks/store_speed.py [--gib 1] [--object-mib 4] [--reps 9] [--json PATH]

One request's cache (``--gib``, default 1 GiB: an 8k-token Llama-3-8B request at TP 1) as
objects of ``--object-mib`` (4 MiB: one block's keys or values). Every row runs once in each of
``--reps`` rounds, the rows one after another within a round, so the host's drift hits them
alike. Reported per row: GB/s of its best round, and its ratio to ``memcpy`` in the same round,
the median over the rounds (the bar's figure):

- ``memcpy``: the same bytes copied by numpy on the stores' copy threads (one a core, up to
  8): this host's multi-threaded memory-copy bandwidth, the bar (puts and gets at ≥ 80 % of it);
- ``MemoryStore`` put and get, ``ArenaStore`` put and get (its shared-memory slots: what the
  numpy backend moves through across processes), ``FileStore`` put and get in ``--dir``
  (``/dev/shm``: tmpfs), each plain and hashed (the checksums of :mod:`kvstate.backends._integrity` taken as they copy);
- ``xxh3``: the checksums of :mod:`kvstate.backends._integrity` over the same bytes, on one core
  and on the stores' threads;
- ``numpy backend write`` and ``read``: a ``ReferenceBackend`` (the CPU rank's backend) moving
  the same bytes as Llama-3-8B-shaped blocks (32 layers, 8 KV heads, head dim 128, bf16; blocks
  of ``--object-mib`` per kind) through an ``ArenaStore`` with manifests: gathered from its
  layer-major caches straight into the arena's slots, checksummed as they copy, then scattered
  straight out of them into other blocks and verified
  (a write takes fresh keys each time; a store holding them would skip them); the read also by
  a backend of another process that opened the arena (the handoff's shape: P and D are processes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from kvstate.backends import (  # noqa: E402
    ArenaStore,  # noqa: E402
    FileStore,
    MemoryStore,
)
from kvstate.backends._integrity import Hasher  # noqa: E402
from kvstate.backends._stores import default_threads  # noqa: E402


def rounds(rows: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each row's times over ``reps`` rounds, the rows run one after another in each round
    (after one warm-up round: pages touched, threads started)."""
    for fn in rows.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(reps):
        for name, fn in rows.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def store_rows(name: str, store: object, keys: list[str], srcs: list, dsts: list) -> dict[str, Callable[[], object]]:
    """A store's four rows: put and get, plain and hashed."""
    return {f"{name} put": lambda: store.batch_put_from(keys, srcs),  # type: ignore[attr-defined]
            f"{name} get": lambda: store.batch_get_into(keys, dsts),  # type: ignore[attr-defined]
            f"{name} put, hashed": lambda: store.batch_put_hashed(keys, srcs),  # type: ignore[attr-defined]
            f"{name} get, hashed": lambda: store.batch_get_hashed(keys, dsts)}  # type: ignore[attr-defined]


def bench_spec(object_bytes: int) -> Any:
    """The Llama-3-8B-shaped cache whose (block, kind) object is about ``object_bytes``."""
    from kvstate import CacheSpec

    block = max(1, object_bytes // (32 * 8 * 128 * 2))
    return CacheSpec(num_layers=32, kv_heads=8, block_size=block, head_dim=128, dtype="bfloat16")


def speed_keys(spec: Any, blocks: int, round_no: int) -> list[str]:
    from kvstate import block_keys

    base = round_no * blocks * spec.block_size
    return block_keys(list(range(base, base + blocks * spec.block_size)), spec.block_size, namespace="speed")


def reader(path: str, object_bytes: int, blocks: int) -> int:
    """The other process's side of ``numpy backend read, other process``: per line of stdin (a
    write's round number), read that write's blocks from the arena at ``path``, answer a line."""
    from kvstate.backends import ReferenceBackend

    spec = bench_spec(object_bytes)
    arena = ArenaStore.open(path)
    d = ReferenceBackend(spec, blocks, arena)
    for line in sys.stdin:
        n = d.read(0, speed_keys(spec, blocks, int(line)), list(range(blocks)))
        print(n, flush=True)
    d.close()
    arena.close()
    return 0


def backend_rows(object_bytes: int, n: int) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """The numpy backend's write and read rows over an arena (see the module's docstring), the
    read also by a backend of another process, and what closes them."""
    from kvstate.backends import ReferenceBackend

    spec, blocks = bench_spec(object_bytes), max(1, n // 2)
    arena = ArenaStore.create(spec.bytes_per_block_per_rank // 2, 4 * blocks + 8, small_bytes=1024)
    p, d = ReferenceBackend(spec, blocks, arena), ReferenceBackend(spec, 2 * blocks, arena)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reader", arena.path,
                              "--object-mib", str(object_bytes / 2**20), "--blocks", str(blocks)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fresh = iter(range(1, 1 << 40))
    last = [0]

    def write() -> None:
        last[0] = next(fresh)
        assert p.write(0, speed_keys(spec, blocks, last[0]), list(range(blocks))) == blocks

    def read() -> None:
        assert d.read(0, speed_keys(spec, blocks, last[0]), list(range(blocks, 2 * blocks))) == blocks

    def read_there() -> None:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{last[0]}\n")
        child.stdin.flush()
        assert int(child.stdout.readline()) == blocks, "the other process did not read the blocks whole"

    def close() -> None:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
        p.close()
        d.close()
        arena.close()
    return {"numpy backend write": write, "numpy backend read": read,
            "numpy backend read, other process": read_there}, close


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--object-mib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--reader", help=argparse.SUPPRESS)  # the other process's side: the arena's path
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.reader:
        return reader(a.reader, int(a.object_mib * 2**20), a.blocks)
    size, n = int(a.object_mib * 2**20), int(a.gib * 2**30 / (a.object_mib * 2**20))
    threads = default_threads()
    src = np.random.default_rng(0).integers(0, 255, (n, size), dtype=np.uint8)
    dst = np.empty_like(src)
    keys = [f"obj{i}" for i in range(n)]
    srcs, dsts = [memoryview(r) for r in src], [memoryview(r) for r in dst]
    total = src.nbytes
    pool = ThreadPoolExecutor(threads)

    def memcpy() -> None:
        list(pool.map(lambda i: np.copyto(dst[i::threads], src[i::threads]), range(threads)))

    out: dict[str, float | int | str] = {"bytes": total, "objects": n, "threads": threads, "dir": a.dir}
    rows: dict[str, Callable[[], object]] = {"memcpy": memcpy}
    mem = MemoryStore(2 * total, verify=False)
    rows.update(store_rows("MemoryStore", mem, keys, srcs, dsts))
    arena = ArenaStore.create(size, 2 * n, small_bytes=1024, verify=False)
    rows.update(store_rows("ArenaStore", arena, keys, srcs, dsts))
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvstate-store-speed-") as d:
        files = FileStore(d, verify=False)
        rows.update(store_rows("FileStore", files, keys, srcs, dsts))
        hasher = Hasher(threads)
        rows["xxh3, one core"] = lambda: [xxhash.xxh3_64_intdigest(v) for v in srcs]
        rows[f"xxh3, {threads} threads"] = lambda: hasher(srcs)
        backend, close_backend = backend_rows(size, n)
        rows.update(backend)
        times = rounds(rows, a.reps)
        close_backend()
        files.close()
        hasher.close()
    mem.close()
    arena.close()
    pool.shutdown()
    print(f"{total / 2**30:.2f} GiB in {n} objects of {a.object_mib:g} MiB, {threads} threads, files in {a.dir}, "
          f"{a.reps} rounds")
    print(f"  {'path':<36}{'best GB/s':>10}{'/ memcpy (median of rounds)':>30}")
    for name, ts in times.items():
        ratio = statistics.median(m / t for m, t in zip(times["memcpy"], ts))
        out[f"{name} GB/s"] = round(total / min(ts) / 1e9, 2)
        out[f"{name} / memcpy"] = round(ratio, 3)
        print(f"  {name:<36}{out[f'{name} GB/s']:>10.2f}{ratio:>29.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
