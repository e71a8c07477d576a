"""Storage pools behind one batch interface shaped like Mooncake's store API.

``batch_put_from`` writes whole objects from buffers, ``batch_get_into`` reads objects into
buffers and returns the bytes read per key (negative: missing or failed), and
``batch_is_exist`` answers 1 / 0 per key. A full :class:`MemoryStore` evicts its least
recently used objects silently, as a full Mooncake pool does, so later reads can miss.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError, ValidationError

__all__ = ["Store", "MemoryStore", "FileStore", "MISSING", "MAX_KEY_LEN"]

MISSING = -1  #: ``batch_get_into`` / ``batch_put_from`` code for a missing key or failed op
MAX_KEY_LEN = 512


_NO_BUFFERS: Any = object()  # the op takes keys only


def _check_batch(keys: Sequence[str], buffers: Sequence[Any], op: str) -> list[memoryview]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValidationError(f"{op}: keys must be a sequence of str")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValidationError(f"{op}: key {k!r} is not a non-empty str")
        if len(k) > MAX_KEY_LEN:
            raise ValidationError(f"{op}: key {k[:40]!r}... is {len(k)} chars, over {MAX_KEY_LEN}")
    if buffers is _NO_BUFFERS:
        return []
    if isinstance(buffers, (str, bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
        raise ValidationError(f"{op}: buffers must be a sequence (one per key), got {type(buffers).__name__}")
    if len(buffers) != len(keys):
        raise ValidationError(f"{op}: {len(keys)} keys but {len(buffers)} buffers")
    views = []
    for k, b in zip(keys, buffers):
        try:
            v = memoryview(b)
        except TypeError:
            raise ValidationError(f"{op}: buffer for key {k!r} does not expose the buffer protocol") from None
        if not v.contiguous:
            raise ValidationError(f"{op}: buffer for key {k!r} is not contiguous")
        views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return views


class Store(ABC):
    """A KV storage pool. Implementations must be safe to call from several threads."""

    @abstractmethod
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Store each buffer's bytes under its key; per key 0 on success, negative on failure."""

    @abstractmethod
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Fill each buffer with its key's object; per key the bytes read, negative if missing."""

    @abstractmethod
    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 if stored, 0 if not."""

    def close(self) -> None:
        """Release the store's resources (idempotent)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStore(Store):
    """An in-process pool with a byte capacity and silent LRU eviction."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValidationError(f"MemoryStore: capacity_bytes must be an int > 0, got {capacity_bytes!r}")
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
        views = _check_batch(keys, buffers, "MemoryStore.batch_put_from")
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
        views = _check_batch(keys, buffers, "MemoryStore.batch_get_into")
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
        _check_batch(keys, _NO_BUFFERS, "MemoryStore.batch_is_exist")
        with self._lock:
            return [1 if k in self._data else 0 for k in keys]

    def evict(self, keys: Sequence[str]) -> int:
        """Drop these keys now (as a full pool would); returns how many existed."""
        _check_batch(keys, _NO_BUFFERS, "MemoryStore.evict")
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
            probe = tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-", delete=True)
            probe.close()
        except OSError as e:
            raise StoreError(f"FileStore: directory {str(directory)!r} is not writable ({e})") from None

    def _path(self, key: str) -> Path:
        h = hashlib.sha256(key.encode()).hexdigest()
        return self.root / h[:2] / h

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = _check_batch(keys, buffers, "FileStore.batch_put_from")
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
        views = _check_batch(keys, buffers, "FileStore.batch_get_into")
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
        _check_batch(keys, _NO_BUFFERS, "FileStore.batch_is_exist")
        return [1 if self._path(k).is_file() else 0 for k in keys]

    def evict(self, keys: Sequence[str]) -> int:
        _check_batch(keys, _NO_BUFFERS, "FileStore.evict")
        n = 0
        for k in keys:
            try:
                self._path(k).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n


def as_bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (what the stores read and write)."""
    return memoryview(a).cast("B")
