"""Checksummed block objects: what makes a stored block trustworthy, and how a read proves it.

Rules:

- Beside a block's objects on one rank (one per kind, for one layer group), a backend stores a
  *manifest*: a format version, the cache geometry the bytes belong to (layers of the group,
  heads per rank, block size, head dim, each kind's dtype and size), and each object's length
  and XXH3-64 checksum. It is put right after the objects.
- A block counts as stored only when its objects and its manifest all are.
- A read verifies each block before it counts: the manifest is one of this format version and
  of this geometry, and each object arrived at its recorded length with its recorded checksum.
  The first block that fails ends the read's leading count, as a miss does (the lifecycle's
  read-failure policy decides: 502, or recompute from the longest prefix verified on every
  rank), and its objects and manifest are evicted, so the next write of that prompt stores
  them again: a fault that cleared stops poisoning the prompt.
- A manifest of an unknown version or another geometry is a failed read, never a crash, and
  bytes of another geometry are never read as this one's.

Checksums are taken on the host buffers the objects are put from and got into (the backends'
staging), never again over PCIe: the embedded stores hash each object a cache-sized piece at a
time as they copy it, so its bytes are not read from memory a second time
(``Store.batch_put_hashed``, ``batch_get_hashed``); another store hashes them after the copy.
Manifests are put after their objects, so a crash between the two leaves a block unstored, not
unvouched. A store built with ``verify=False`` (a
trusted pool) skips manifests on both sides; both sides of a pool must agree.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ..spec import CacheSpec

__all__ = ["FORMAT_VERSION", "geometry_id", "pack_manifest", "unpack_manifest", "manifest_size", "Hasher",
           "ManifestError"]

FORMAT_VERSION = 1
MAGIC = b"KVSM"
_HEAD = struct.Struct("<4sHHQ")  # magic, version, objects, geometry id
_ENTRY = struct.Struct("<QQ")  # length, checksum
PARALLEL_BYTES = 8 << 20  #: batches at least this large are hashed on several threads


class ManifestError(ValueError):
    """A manifest that is not one of this format, version or geometry (internal: a failed read)."""


def geometry_id(spec: CacheSpec, group: int | None) -> int:
    """A 64-bit id of the geometry of one rank's objects of a block (every layer, or ``group``'s)."""
    a, b = (0, spec.layers) if group is None else spec.group_span(group)
    kinds = ",".join(f"{k}:{spec.kind_dtype(k)}:{spec.block_shape(k)}" for k in spec.kinds)
    text = f"kvstate/{FORMAT_VERSION}/layers {b - a}/block {spec.block_size}/{kinds}"
    return xxhash.xxh3_64_intdigest(text.encode())


def manifest_size(objects: int) -> int:
    return _HEAD.size + objects * _ENTRY.size


def pack_manifest(geometry: int, entries: Sequence[tuple[int, int]]) -> bytes:
    """A manifest of ``entries`` ((length, checksum) per object) for ``geometry``."""
    return _HEAD.pack(MAGIC, FORMAT_VERSION, len(entries), geometry) + b"".join(_ENTRY.pack(n, c) for n, c in entries)


def unpack_manifest(buf: Any, got: int, geometry: int, objects: int) -> list[tuple[int, int]]:
    """The (length, checksum) entries of a manifest read into ``buf`` (``got`` bytes), checked
    against the expected geometry and object count; :class:`ManifestError` otherwise."""
    if got != manifest_size(objects):
        raise ManifestError(f"manifest of {got} bytes, expected {manifest_size(objects)}")
    magic, version, n, geo = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ManifestError(f"manifest of format {magic!r} version {version}, expected {MAGIC!r} {FORMAT_VERSION}")
    if n != objects or geo != geometry:
        raise ManifestError(f"manifest of {n} objects of geometry {geo:#x}, expected {objects} of {geometry:#x}")
    return [_ENTRY.unpack_from(buf, _HEAD.size + i * _ENTRY.size) for i in range(objects)]


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
