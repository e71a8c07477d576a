"""Checksummed block objects: what makes a stored block trustworthy, and how a read proves it.

Rules:

- Beside a block's objects on one rank (one per kind, for one layer group), a backend stores a
  *manifest*: a format version, the cache geometry the bytes belong to (layers of the group,
  heads per object and the model's, block size, head dim, each kind's dtype and size), and each object's length
  and XXH3-64 checksum. It is put after the objects (a write of several pieces may put every
  manifest after its last piece).
- A block counts as stored only when its objects and its manifest all are.
- A read verifies each block before it counts: the manifest is one of this format version and
  of this geometry, and each object arrived at its recorded length with its recorded checksum.
  The first block that fails ends the read's leading count, as a miss does (the lifecycle's
  read-failure policy decides: 502, or recompute from the longest prefix verified on every
  rank), and its objects and manifest are evicted, so the next write of that prompt stores
  them again: a fault that cleared stops poisoning the prompt.
- A manifest of an unknown version or another geometry is a failed read, never a crash, and
  bytes of another geometry are never read as this one's.

Two checksum algorithms, named in the manifest: :data:`XXH3`, taken on the host buffers the
objects are put from and got into, and :data:`SUM64`, which the CUDA backend takes on the GPU,
reading the caches from HBM (a few hundred µs a GiB) while PCIe and the store's copy are the
bound. A reader verifies either. Host checksums are never taken over PCIe: the embedded stores
hash each object a cache-sized piece at a time as they copy it, so its bytes are not read from
memory a second time (``Store.batch_put_hashed``, ``batch_get_hashed``); another store hashes
them after the copy. Manifests are put after their objects, so a crash between the two leaves a
block unstored, not unvouched. A store built with ``verify=False`` (a trusted pool) skips
manifests on both sides; both sides of a pool must agree.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from .._spec import CacheSpec

__all__ = ["FORMAT_VERSION", "XXH3", "SUM64", "geometry_id", "pack_manifest", "unpack_manifest", "manifest_size",
           "Hasher", "ManifestError", "sum64", "sum64_weights"]

FORMAT_VERSION = 1
MAGIC = b"KVSM"
XXH3 = 1  #: checksum algorithm: XXH3-64 of the object's bytes (host paths: the stores hash as they copy)
SUM64 = 2  #: checksum algorithm: a position-weighted sum of its 64-bit words (the GPU takes it where the caches are)
ALGORITHMS = (XXH3, SUM64)
_HEAD = struct.Struct("<4sHHHxxQ")  # magic, version, objects, algorithm, geometry id
_ENTRY = struct.Struct("<QQ")  # length, checksum
PARALLEL_BYTES = 8 << 20  #: batches at least this large are hashed on several threads


class ManifestError(ValueError):
    """A manifest that is not one of this format, version or geometry (internal: a failed read)."""


def geometry_id(spec: CacheSpec, group: int | None) -> int:
    """A 64-bit id of the geometry of one head group's objects of a block (every layer, or
    ``group``'s): the same for a P and a D that :func:`~kvstate._spec.check_pair` accepts."""
    a, b = (0, spec.layers) if group is None else spec.group_span(group)
    kinds = ",".join(f"{k}:{spec.kind_dtype(k)}:{spec.object_shape(k)}" for k in spec.kinds)
    text = f"kvstate/{FORMAT_VERSION}/layers {b - a}/block {spec.block_size}/heads {spec.heads_total}/{kinds}"
    return xxhash.xxh3_64_intdigest(text.encode())


def manifest_size(objects: int) -> int:
    return _HEAD.size + objects * _ENTRY.size


def pack_manifest(geometry: int, entries: Sequence[tuple[int, int]], algorithm: int = XXH3) -> bytes:
    """A manifest of ``entries`` ((length, checksum) per object) for ``geometry``."""
    return _HEAD.pack(MAGIC, FORMAT_VERSION, len(entries), algorithm, geometry) + \
        b"".join(_ENTRY.pack(n, c) for n, c in entries)


def unpack_manifest(buf: Any, got: int, geometry: int, objects: int) -> tuple[int, list[tuple[int, int]]]:
    """(the checksum algorithm, the (length, checksum) entries) of a manifest read into ``buf``
    (``got`` bytes), checked against the expected geometry and object count;
    :class:`ManifestError` otherwise."""
    if got != manifest_size(objects):
        raise ManifestError(f"manifest of {got} bytes, expected {manifest_size(objects)}")
    magic, version, n, algorithm, geo = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION or algorithm not in ALGORITHMS:
        raise ManifestError(f"manifest of format {magic!r} version {version} (checksum {algorithm}), expected "
                            f"{MAGIC!r} {FORMAT_VERSION}")
    if n != objects or geo != geometry:
        raise ManifestError(f"manifest of {n} objects of geometry {geo:#x}, expected {objects} of {geometry:#x}")
    return algorithm, [_ENTRY.unpack_from(buf, _HEAD.size + i * _ENTRY.size) for i in range(objects)]


def sum64_weights(xp: Any, words: int, first: int = 0) -> Any:
    """``2i + 1`` for word positions ``first .. first + words`` (``xp``: numpy or CuPy), uint64."""
    return xp.arange(first, first + words, dtype=xp.uint64) * xp.uint64(2) + xp.uint64(1)


def sum64(view: Any) -> int:
    """:data:`SUM64` of one object's bytes: ``Σ w_i (2i + 1) mod 2**64`` over its little-endian
    64-bit words ``w_i`` (a trailing part word zero-padded). Every change confined to one word
    changes it (the weights are odd), as does a change of length (in the manifest beside it);
    it is no cryptographic hash, nor is XXH3. The GPU takes it layer by layer, in place."""
    b = np.frombuffer(view, np.uint8)
    if b.size % 8:
        b = np.concatenate([b, np.zeros(8 - b.size % 8, np.uint8)])
    w = b.view("<u8")
    return int((w * sum64_weights(np, w.size)).sum(dtype=np.uint64))


class Hasher:
    """XXH3-64 of many buffers, on up to ``threads`` threads when they are large together.
    Owns its threads (started on first use, stopped by :meth:`close`)."""

    def __init__(self, threads: int = 4) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, views: Sequence[Any]) -> list[int]:
        digest = xxhash.xxh3_64_intdigest
        if self.threads <= 1 or len(views) < 2 or sum(memoryview(v).nbytes for v in views) < PARALLEL_BYTES:
            return [digest(v) for v in views]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, "kvstate-hash")
        return list(self._pool.map(digest, views))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
