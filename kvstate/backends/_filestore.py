"""A file-backed embedded storage pool (the :class:`~kvstate.backends._base.Store` interface).

A :class:`FileStore` keeps one file per object under a directory that several processes may
share (P's and D's rank workers on one host, on tmpfs), and survives a restart.

Rules:

- A put is atomic: the bytes go to a temp file renamed over the object's name, so no reader
  ever sees a torn object, and a crash leaves none.
- A reader that opened an object keeps reading its bytes even if it is replaced or removed
  meanwhile (the file stays until its last reader closes it).
- With ``capacity_bytes``, each client bounds the objects its own puts keep: after each
  batch it removes the objects it wrote first until they fit (a re-put counts as new). Other
  processes' objects are theirs to bound, so a directory holds at most the sum of its
  clients' capacities. Without it the directory grows until the file system refuses a put,
  which then fails as a put to a full pool does.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from .._errors import StoreError, ValidationError
from .._validate import check_int
from ._base import MISSING, TOO_LARGE, Store, check_batch, check_keys, check_verify
from ._stores import HASH_PIECE, PARALLEL_BYTES, default_threads

__all__ = ["FileStore"]


class FileStore(Store):
    """One file per object under a directory (the module's docstring gives the rules)."""

    def __init__(self, directory: str | os.PathLike[str], *, verify: bool = True,
                 io_threads: int | None = None, capacity_bytes: int | None = None) -> None:
        """``verify``: as :class:`~kvstate.backends._stores.MemoryStore`'s; every client of one
        directory must agree. ``io_threads``: threads writing or reading a large batch's files
        in parallel (file reads and writes release the GIL; default: up to 8, one a core; 1:
        the caller's). ``capacity_bytes``: the most bytes of objects this client's puts keep
        (None: no bound)."""
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValidationError(f"FileStore: directory must be a path, got {directory!r}")
        self.verify = check_verify(verify, "FileStore")
        io_threads = default_threads() if io_threads is None else io_threads
        check_int(io_threads, "FileStore: io_threads", minimum=1, maximum=256)
        if capacity_bytes is not None:
            check_int(capacity_bytes, "FileStore: capacity_bytes", minimum=1, maximum=1 << 60)
        self._threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self.capacity_bytes = capacity_bytes
        self._written: OrderedDict[str, int] = OrderedDict()  # this client's objects, oldest first: bytes
        self._written_bytes = 0
        self._lock = threading.Lock()  # the two above
        self.evictions = 0  #: objects removed to keep this client within its capacity
        try:
            self.root = Path(directory)
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-", delete=True):
                pass
        except OSError as e:
            raise StoreError(f"FileStore: directory {str(directory)!r} is not writable ({e})") from None

    def _path(self, key: str) -> Path:
        h = hashlib.sha256(key.encode()).hexdigest()
        return self.root / h[:2] / h

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "FileStore.batch_put_from", buffers)
        status = [st for st, _ in self._each(lambda k, v: self._put(k, v, False), keys, views)]
        self._bound(keys, views, status)
        return status

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "FileStore.batch_get_into", buffers)
        return [n for n, _ in self._each(lambda k, v: self._get(k, v, False), keys, views)]

    def batch_put_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        views = check_batch(keys, "FileStore.batch_put_hashed", buffers)
        pairs = self._each(lambda k, v: self._put(k, v, True), keys, views)
        self._bound(keys, views, [st for st, _ in pairs])
        return [st for st, _ in pairs], [h for _, h in pairs]

    def _bound(self, keys: Sequence[str], views: Sequence[memoryview], status: Sequence[int]) -> None:
        """Note the batch's stored objects as this client's newest, then remove its oldest
        while they exceed the capacity."""
        if self.capacity_bytes is None:
            return
        victims = []
        with self._lock:
            for k, v, st in zip(keys, views, status):
                if st == 0:
                    self._written_bytes += v.nbytes - self._written.pop(k, 0)
                    self._written[k] = v.nbytes
            while self._written_bytes > self.capacity_bytes:
                k, size = self._written.popitem(last=False)
                self._written_bytes -= size
                victims.append(k)
            self.evictions += len(victims)
        self._unlink(victims)

    def batch_get_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        views = check_batch(keys, "FileStore.batch_get_hashed", buffers)
        pairs = self._each(lambda k, v: self._get(k, v, True), keys, views)
        return [n for n, _ in pairs], [h for _, h in pairs]

    def _each(self, fn: Any, keys: Sequence[str], views: list[memoryview]) -> list[tuple[int, int]]:
        """``fn(key, view)`` for each object: on the I/O threads when the batch is large."""
        if self._threads == 1 or len(keys) < 2 or sum(v.nbytes for v in views) < PARALLEL_BYTES:
            return [fn(k, v) for k, v in zip(keys, views)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, "kvstate-filestore")
        return list(self._pool.map(fn, keys, views))

    def _put(self, key: str, view: memoryview, hashed: bool) -> tuple[int, int]:
        """Write one object (atomically: a temp file renamed over it); (status, its XXH3-64 if
        ``hashed``, taken a piece at a time right after the piece is written)."""
        path, h = self._path(key), xxhash.xxh3_64() if hashed else None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    if h is None:
                        f.write(view)
                    else:
                        for a in range(0, view.nbytes, HASH_PIECE):
                            f.write(view[a:a + HASH_PIECE])
                            h.update(view[a:a + HASH_PIECE])
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            return 0, h.intdigest() if h is not None else 0
        except OSError:
            return MISSING, 0

    def _get(self, key: str, view: memoryview, hashed: bool) -> tuple[int, int]:
        """Read one object into ``view``; (bytes read or MISSING, their XXH3-64 if ``hashed``)."""
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > view.nbytes:
                    return TOO_LARGE, 0
                if not hashed:
                    return f.readinto(view[:size]), 0
                h, n = xxhash.xxh3_64(), 0
                while n < size:
                    got = f.readinto(view[n:min(size, n + HASH_PIECE)])
                    if not got:
                        break
                    h.update(view[n:n + got])
                    n += got
                return n, h.intdigest()
        except OSError:
            return MISSING, 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        check_keys(keys, "FileStore.batch_is_exist")
        return [1 if self._path(k).is_file() else 0 for k in keys]

    def evict(self, keys: Sequence[str]) -> int:
        check_keys(keys, "FileStore.evict")
        with self._lock:
            for k in keys:
                self._written_bytes -= self._written.pop(k, 0)
        return self._unlink(keys)

    def _unlink(self, keys: Sequence[str]) -> int:
        """Remove these objects' files (a reader holding one open keeps its bytes); how many existed."""
        n = 0
        for k in keys:
            try:
                self._path(k).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n
