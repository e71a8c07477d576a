"""Embedded storage pools (the :class:`~kvstate.backends.base.Store` interface): in memory and in files.

A full :class:`MemoryStore` evicts its least recently used objects silently, as a full
Mooncake pool does, so later reads can miss. A :class:`FileStore` keeps one file per object
and survives a restart.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..validate import check_int
from .base import MISSING, Store, check_batch, check_keys

__all__ = ["MemoryStore", "FileStore"]


class MemoryStore(Store):
    """An in-process pool with a byte capacity and silent LRU eviction."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        check_int(capacity_bytes, "MemoryStore: capacity_bytes", minimum=1)
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
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
        views = check_batch(keys, "MemoryStore.batch_put_from", buffers)
        out = []
        with self._lock:
            for k, v in zip(keys, views):
                size = v.nbytes
                if size > self.capacity_bytes:
                    out.append(MISSING)
                    continue
                old = self._data.pop(k, None)
                if old is not None:
                    self._used -= len(old)
                while self._used + size > self.capacity_bytes:
                    _, ev = self._data.popitem(last=False)
                    self._used -= len(ev)
                    self.evictions += 1
                self._data[k] = v.tobytes()
                self._used += size
                self.puts += 1
                out.append(0)
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "MemoryStore.batch_get_into", buffers)
        out = []
        with self._lock:
            for k, v in zip(keys, views):
                data = self._data.get(k)
                if data is None or len(data) > v.nbytes:
                    out.append(MISSING)
                    continue
                self._data.move_to_end(k)
                v[:len(data)] = data
                self.gets += 1
                out.append(len(data))
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
                    self._used -= len(data)
                    self.evictions += 1
                    n += 1
        return n

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._used = 0


class FileStore(Store):
    """One file per object under a directory; writes are atomic (temp file + rename), so a
    crash never leaves a torn object and the pool survives a restart."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
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
        out = []
        for k, v in zip(keys, views):
            path = self._path(k)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(v)
                    os.replace(tmp, path)
                except BaseException:
                    os.unlink(tmp)
                    raise
                out.append(0)
            except OSError:
                out.append(MISSING)
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "FileStore.batch_get_into", buffers)
        out = []
        for k, v in zip(keys, views):
            try:
                with open(self._path(k), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size > v.nbytes:
                        out.append(MISSING)
                        continue
                    out.append(f.readinto(v[:size]))
            except OSError:
                out.append(MISSING)
        return out

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        check_keys(keys, "FileStore.batch_is_exist")
        return [1 if self._path(k).is_file() else 0 for k in keys]

    def evict(self, keys: Sequence[str]) -> int:
        check_keys(keys, "FileStore.evict")
        n = 0
        for k in keys:
            try:
                self._path(k).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n
