"""The in-memory embedded storage pool (the :class:`~kvstate.backends._base.Store` interface).

A full :class:`MemoryStore` evicts its least recently used objects silently, as a full
Mooncake pool does, so later reads can miss. Its file-backed sibling is
:class:`~kvstate.backends._filestore.FileStore`.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from .._validate import check_int
from ._base import MISSING, TOO_LARGE, Store, check_batch, check_keys, check_verify
from ._hostcopy import copy_all

__all__ = ["MemoryStore", "default_threads", "PARALLEL_BYTES", "HASH_PIECE"]

PARALLEL_BYTES = 8 << 20  #: batches at least this large are copied on several threads
HASH_PIECE = 256 << 10  #: bytes copied then hashed at a time: still in cache when hashed


def default_threads() -> int:
    """Copy threads a store starts by default: one a core, up to 8 (memory bandwidth is
    reached well before)."""
    return max(1, min(8, os.cpu_count() or 1))


class MemoryStore(Store):
    """An in-process pool with a byte capacity and silent LRU eviction.

    Objects are numpy byte arrays: their copies in and out release the GIL, so a transfer
    thread storing a cache does not stall the engine thread launching the model, and a large
    put or get copies its objects on several threads, outside the pool's lock, with streaming
    stores where it can (:mod:`kvstate.backends._hostcopy`). The arrays
    of evicted or overwritten objects are kept as spares for later puts of the same size, so
    a full pool in steady state allocates (and page-faults) nothing; stored and spare bytes
    together stay within ``capacity_bytes``; an array a get is still copying out is never
    reused. ``batch_put_hashed`` and ``batch_get_hashed`` copy as ``batch_put_from`` and
    ``batch_get_into`` do, hashing on the way: a subclass that changes what a put stores
    overrides them too (``Store``'s put, then hash)."""

    def __init__(self, capacity_bytes: int = 1 << 30, copy_threads: int | None = None, *,
                 verify: bool = True) -> None:
        """``copy_threads``: threads copying a large batch's objects in parallel (1: the
        caller's thread only; default: up to 8, one a core); they start on first use and stop
        on :meth:`close`. ``verify``: blocks
        stored here carry checksummed manifests (off: a trusted pool; see
        :mod:`kvstate.backends._integrity`)."""
        check_int(capacity_bytes, "MemoryStore: capacity_bytes (this host's memory at most)", minimum=1,
                  maximum=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        copy_threads = default_threads() if copy_threads is None else copy_threads
        check_int(copy_threads, "MemoryStore: copy_threads", minimum=1, maximum=256)
        self.verify = check_verify(verify, "MemoryStore")
        self.capacity_bytes = capacity_bytes
        self._pool = ThreadPoolExecutor(copy_threads, "kvstate-memorystore") if copy_threads > 1 else None
        self._threads = copy_threads
        self._data: OrderedDict[str, np.ndarray] = OrderedDict()
        self._used = 0
        self._spare: dict[int, list[np.ndarray]] = {}  # size -> arrays of dropped objects
        self._spare_bytes = 0
        self._reading: dict[int, int] = {}  # id of an array being copied out -> gets copying it
        self._lock = threading.Lock()
        self.evictions = 0
        self.puts = 0
        self.gets = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return self._put(keys, check_batch(keys, "MemoryStore.batch_put_from", buffers), None)

    def batch_put_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        views = check_batch(keys, "MemoryStore.batch_put_hashed", buffers)
        sums = [0] * len(keys)  # filled as the objects are copied (0 for one that did not fit)
        return self._put(keys, views, sums), sums

    def _put(self, keys: Sequence[str], views: list[memoryview], sums: list[int] | None) -> list[int]:
        """Store the objects; with ``sums``, each object's XXH3-64 lands in it, taken as it is copied."""
        out, plan = [], []
        with self._lock:  # make room and take arrays; the bytes are copied after the lock
            for k, v in zip(keys, views):
                size = v.nbytes
                if size > self.capacity_bytes:
                    out.append(MISSING)
                    continue
                old = self._data.pop(k, None)
                if old is not None:
                    self._drop(old)
                while self._used + size > self.capacity_bytes and self._data:
                    self._drop(self._data.popitem(last=False)[1])
                    self.evictions += 1
                if self._used + size > self.capacity_bytes:  # other puts' copies hold the room
                    out.append(MISSING)
                    continue
                self._used += size
                plan.append((k, self._array(size), v, len(out)))
                out.append(0)
        self._copy(plan, sums=sums)
        with self._lock:
            for k, arr, _, _ in plan:
                old = self._data.pop(k, None)  # another put of this key landed meanwhile
                if old is not None:
                    self._drop(old)
                self._data[k] = arr
            self.puts += len(plan)
        return out

    def _copy(self, plan: list[tuple[str, np.ndarray, memoryview, int]], out: bool = False,
              sums: list[int] | None = None) -> None:
        """Copy each planned object's bytes into its array (``out``: from its array into the
        buffer); with ``sums``, hash them as they are copied (``sums[i]`` of plan entry ``(...,
        i)``), a cache-sized piece at a time. A batch of 8 MiB or more is split over the copy
        threads (numpy copies and xxhash release the GIL)."""
        def run(part: list[tuple[str, np.ndarray, memoryview, int]]) -> None:
            if sums is None:  # one call for the part (the GIL let go once); streaming: neither side is read soon
                views = [v[:len(arr)] for _, arr, v, _ in part]
                arrays = [arr for _, arr, _, _ in part]
                if out:
                    copy_all(views, arrays)
                else:
                    copy_all(arrays, views)
                return
            for _, arr, v, i in part:
                buf = np.frombuffer(v, np.uint8, count=len(arr))
                dst, src = (buf, arr) if out else (arr, buf)
                h = xxhash.xxh3_64()
                for a in range(0, len(arr), HASH_PIECE):
                    np.copyto(dst[a:a + HASH_PIECE], src[a:a + HASH_PIECE])
                    h.update(dst[a:a + HASH_PIECE].data)
                sums[i] = h.intdigest()

        n = self._threads
        if self._pool is None or len(plan) < 2 or sum(len(a) for _, a, _, _ in plan) < PARALLEL_BYTES:
            run(plan)
            return
        for f in [self._pool.submit(run, plan[i::n]) for i in range(n)]:
            f.result()

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return self._get(keys, check_batch(keys, "MemoryStore.batch_get_into", buffers), None)

    def batch_get_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        sums = [0] * len(keys)
        return self._get(keys, check_batch(keys, "MemoryStore.batch_get_hashed", buffers), sums), sums

    def _get(self, keys: Sequence[str], views: list[memoryview], sums: list[int] | None) -> list[int]:
        out, plan = [], []
        with self._lock:  # find the objects and keep their arrays from reuse; copy after the lock
            for k, v in zip(keys, views):
                data = self._data.get(k)
                if data is None or len(data) > v.nbytes:
                    out.append(MISSING if data is None else TOO_LARGE)
                    continue
                self._data.move_to_end(k)
                self._reading[id(data)] = self._reading.get(id(data), 0) + 1
                plan.append((k, data, v, len(out)))
                out.append(len(data))
            self.gets += len(plan)
        try:
            self._copy(plan, out=True, sums=sums)
        finally:
            with self._lock:
                for _, data, _, _ in plan:
                    left = self._reading.pop(id(data)) - 1
                    if left:
                        self._reading[id(data)] = left
        return out

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        check_keys(keys, "MemoryStore.batch_is_exist")
        with self._lock:
            return [1 if k in self._data else 0 for k in keys]

    def evict(self, keys: Sequence[str]) -> int:
        """Drop these keys now (as a full pool would); returns how many existed."""
        check_keys(keys, "MemoryStore.evict")
        n = 0
        with self._lock:
            for k in keys:
                data = self._data.pop(k, None)
                if data is not None:
                    self._drop(data)
                    self.evictions += 1
                    n += 1
        return n

    def _drop(self, arr: np.ndarray) -> None:
        """An object left the pool: keep its array as a spare while the capacity allows."""
        self._used -= len(arr)
        if id(arr) not in self._reading and self._used + self._spare_bytes + len(arr) <= self.capacity_bytes:
            self._spare.setdefault(len(arr), []).append(arr)
            self._spare_bytes += len(arr)

    def _array(self, size: int) -> np.ndarray:
        """An array for a new object of ``size`` bytes: a spare of that size, else a new one
        (spares of other sizes are let go first if the capacity needs their room)."""
        spares = self._spare.get(size)
        if spares:
            self._spare_bytes -= size
            return spares.pop()
        while self._spare_bytes and self._used + self._spare_bytes + size > self.capacity_bytes:
            other = next(s for s, arrs in self._spare.items() if arrs)
            self._spare[other].pop()
            self._spare_bytes -= other
        return np.empty(size, np.uint8)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    def __iter__(self) -> Iterator[str]:
        """The names stored now (a snapshot: safe while other threads put)."""
        return iter(self.keys())

    def close(self) -> None:
        if self._pool is not None:  # later puts copy in their own thread
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            self._data.clear()
            self._spare.clear()
            self._spare_bytes = 0
            self._used = 0
