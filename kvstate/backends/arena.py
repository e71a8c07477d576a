"""The zero-copy embedded store: objects in fixed slots of one shared-memory file.

Every process of a host that opens the file (P's and D's workers, vLLM's engines) maps the
same bytes; a device gathers a block straight into its object's slot and scatters straight
out of one (:meth:`ArenaStore.claim`, :meth:`ArenaStore.locate`), so a handoff crosses the
host's memory once each way, with no staging copy.

Rules:

- The file holds a header, then two slot classes, each an index and its data: *big* slots
  of ``slot_bytes`` (a block's object: its creator sizes them to the cache's geometry) and
  *small* slots of ``small_bytes`` (manifests). An object goes to the smallest class it fits;
  one larger than a big slot is refused (``TOO_LARGE``). The creator takes and touches every
  page up front, so no put or get page-faults, and every opener checks the header: another
  format version, slot size or ``tag`` (the geometry it was made for) is refused by name.
- A slot is FREE, WRITING (claimed: the claiming process's pid noted) or STORED (its key and
  length visible). Its generation grows on every claim. The index changes only under the
  file's ``flock`` (the kernel lets go of it when its holder dies) and the opener's thread
  lock, in an order a crash cannot tear: STORED is set last when a put commits and cleared
  first when a slot is taken back, so a process killed anywhere leaves at worst a WRITING slot.
- A put claims a slot: a free one, else one whose writer died, else the least recently used
  STORED one (evicted and counted). It copies in outside the lock, then commits only if the
  slot is still its claim (same generation): a writer whose slot was taken back loses its put.
  A put of a buffer that already is its claimed slot (a device gathered into it) copies nothing.
- A get locates the key (and marks it used), copies out outside the lock, then counts only if
  the slot's generation is unchanged: a get never returns bytes a later put overwrote, and
  pins nothing a dead reader could leak. :meth:`locate` and :meth:`unchanged` give a device
  reading slots itself the same check.
- The creator owns the file: :meth:`close` unmaps it and, the creator's, unlinks it (others'
  mappings stay valid). A file whose creator died is removed by the next :meth:`create` in its
  directory (names carry the creator's pid).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ..errors import ConfigError, ValidationError
from ..validate import check_int
from .base import MAX_KEY_LEN, MISSING, TOO_LARGE, Store, check_batch, check_keys
from .hostcopy import copy_all
from .stores import PARALLEL_BYTES, default_threads

__all__ = ["ArenaStore", "Place", "ARENA_VERSION", "arena_directory"]

ARENA_VERSION = 1  #: the file format; a file of another version is refused
_MAGIC = b"KVSARENA"
_HEADER = struct.Struct("<8sIIQQQQ64s")  # magic, version, key_max, slots, slot_bytes, small slots, small bytes, tag
_PAGE = 4096
FREE, WRITING, STORED = 0, 1, 2
_FIELDS = (("state", np.uint8, ()), ("gen", np.uint64, ()), ("hash", np.uint64, ()), ("length", np.uint64, ()),
           ("owner", np.int64, ()), ("stamp", np.uint64, ()), ("klen", np.uint16, ()),
           ("key", np.uint8, (MAX_KEY_LEN * 4,)))  # a key's UTF-8 bytes: at most 4 a character


class Place(NamedTuple):
    """Where an object is: its big slot (-1: not there), the slot's generation, its length."""

    slot: int
    gen: int
    length: int


def arena_directory() -> Path:
    """Where arenas live by default: ``/dev/shm`` where it can be written, else the temp dir."""
    d = Path("/dev/shm")
    if d.is_dir() and os.access(d, os.W_OK):
        return d
    import tempfile

    return Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a writer's liveness; the file is host-local)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _key_hash(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key) or 1  # 0 marks an empty slot's hash


class _Class:
    """One slot class: its index arrays and its data, views of the mapped file."""

    def __init__(self, buf: Any, at: int, slots: int, size: int) -> None:
        self.slots, self.size = slots, size
        fields, data_at, self.end = _Class.span(at, slots, size)
        for (name, dtype, shape), where in zip(_FIELDS, fields):
            setattr(self, name, np.ndarray((slots, *shape), dtype, buf, where))
        self.data = np.ndarray((slots, size), np.uint8, buf, data_at)

    @staticmethod
    def span(at: int, slots: int, size: int) -> tuple[list[int], int, int]:
        """(each index field's offset, the data's offset, the end) of a class placed at ``at``."""
        fields = []
        for _, dtype, shape in _FIELDS:
            fields.append(at)
            at = -(-(at + slots * np.dtype(dtype).itemsize * int(np.prod(shape))) // 64) * 64
        data_at = -(-at // _PAGE) * _PAGE
        return fields, data_at, data_at + slots * size

    state: np.ndarray
    gen: np.ndarray
    hash: np.ndarray
    length: np.ndarray
    owner: np.ndarray
    stamp: np.ndarray
    klen: np.ndarray
    key: np.ndarray

    def find(self, hashes: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Each key's STORED slot, or -1 (one scan of the index for the batch)."""
        want = np.asarray(hashes, np.uint64)
        hits = np.flatnonzero(np.isin(self.hash, want) & (self.state == STORED))
        by_hash: dict[int, list[int]] = {}
        for s in hits.tolist():
            by_hash.setdefault(int(self.hash[s]), []).append(s)
        out = []
        for h, k in zip(hashes, keys):
            out.append(next((s for s in by_hash.get(h, ()) if bytes(self.key[s, :self.klen[s]]) == k), -1))
        return out

    def take_back(self, s: int) -> None:
        """Slot ``s`` leaves the index: STORED cleared first (a crash leaves it WRITING or FREE)."""
        self.state[s] = WRITING
        self.hash[s] = 0
        self.state[s] = FREE


def _layout(slots: int, slot_bytes: int, small_slots: int, small_bytes: int) -> tuple[int, int, int]:
    """(offset of the big class, offset of the small class, file size)."""
    small_at = -(-_Class.span(_PAGE, slots, slot_bytes)[2] // _PAGE) * _PAGE
    return _PAGE, small_at, -(-_Class.span(small_at, small_slots, small_bytes)[2] // _PAGE) * _PAGE


class ArenaStore(Store):
    """A store of fixed-size slots in one file every process of the host maps (the rules).

    Build with :meth:`create` (the owner, which sizes it) or :meth:`open` (any other process,
    from :attr:`path`). ``verify`` is the pool's manifest setting, as for every store."""

    def __init__(self, path: str | os.PathLike[str], *, owner: bool = False, slot_bytes: int | None = None,
                 tag: str | None = None, verify: bool = True) -> None:
        self.path, self.owner, self.verify = str(path), owner, bool(verify)
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise ConfigError(f"ArenaStore: cannot open {self.path!r} ({e.strerror})") from None
        self._map: mmap.mmap | None = None
        try:
            self._attach(slot_bytes, tag)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._threads = default_threads()
        self._pool = ThreadPoolExecutor(self._threads, "kvstate-arena") if self._threads > 1 else None
        self._claims: dict[str, tuple[int, int]] = {}  # key -> (big slot, generation) claimed here
        self.evictions = self.puts = self.gets = self.lost_puts = 0
        self.reclaimed = 0  #: slots taken back from writers that died

    def _attach(self, slot_bytes: int | None, tag: str | None) -> None:
        size = os.fstat(self._fd).st_size
        if size < _PAGE:
            raise ConfigError(f"ArenaStore: {self.path!r} is not an arena ({size} bytes)")
        self._map = mmap.mmap(self._fd, size)
        magic, version, key_max, slots, sbytes, small_slots, small_bytes, raw = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC:
            raise ConfigError(f"ArenaStore: {self.path!r} is not an arena (no header)")
        if version != ARENA_VERSION or key_max != MAX_KEY_LEN:
            raise ConfigError(f"ArenaStore: {self.path!r} is format version {version}, this kvstate reads "
                              f"{ARENA_VERSION}")
        self.tag = raw.rstrip(b"\0").decode()
        if slot_bytes is not None and slot_bytes != sbytes:
            raise ConfigError(f"ArenaStore: {self.path!r} has {sbytes}-byte slots, {slot_bytes} were asked for: "
                              "it was made for another geometry")
        if tag is not None and tag != self.tag:
            raise ConfigError(f"ArenaStore: {self.path!r} was made for geometry {self.tag!r}, not {tag!r}")
        big_at, small_at, need = _layout(slots, sbytes, small_slots, small_bytes)
        if size != need:
            raise ConfigError(f"ArenaStore: {self.path!r} holds {size:,} bytes, its header needs {need:,}")
        buf = memoryview(self._map)
        self.big, self.small = _Class(buf, big_at, slots, sbytes), _Class(buf, small_at, small_slots, small_bytes)
        self._tick = np.ndarray((1,), np.uint64, buf, _HEADER.size + 8)

    @classmethod
    def create(cls, slot_bytes: int, slots: int, *, small_bytes: int = 1024, small_slots: int | None = None,
               tag: str = "", directory: str | os.PathLike[str] | None = None, verify: bool = True) -> ArenaStore:
        """A new arena of ``slots`` big slots of ``slot_bytes`` (and ``small_slots``, default as
        many, of ``small_bytes``), every page touched now. ``tag`` names the geometry it is
        for (openers asking for another are refused)."""
        check_int(slot_bytes, "ArenaStore: slot_bytes", minimum=8)
        check_int(slots, "ArenaStore: slots", minimum=1)
        check_int(small_bytes, "ArenaStore: small_bytes", minimum=8, maximum=slot_bytes - 1)
        small_slots = slots if small_slots is None else small_slots
        check_int(small_slots, "ArenaStore: small_slots", minimum=1)
        if not isinstance(tag, str) or len(tag.encode()) > 64:
            raise ValidationError(f"ArenaStore: tag must be a str of at most 64 bytes, got {tag!r}")
        d = Path(directory) if directory is not None else arena_directory()
        if not d.is_dir():
            raise ConfigError(f"ArenaStore: {str(d)!r} is not a directory")
        _remove_orphans(d)
        path = d / f"kvstate-arena-{os.getpid()}-{secrets.token_hex(6)}"
        size = _layout(slots, slot_bytes, small_slots, small_bytes)[2]
        st = os.statvfs(d)
        if st.f_bavail * st.f_frsize < size:  # touching pages past it would kill the process (SIGBUS)
            raise ConfigError(f"ArenaStore: {size:,} bytes do not fit in {str(d)!r} "
                              f"({st.f_bavail * st.f_frsize:,} free)")
        try:
            with open(path, "xb") as new:
                new.truncate(size)
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
                _touch(m, size)
                _HEADER.pack_into(m, 0, b"\0" * 8, ARENA_VERSION, MAX_KEY_LEN, slots, slot_bytes, small_slots,
                                  small_bytes, tag.encode())
                m[:8] = _MAGIC  # last: an opener never sees a half-made header
        except OSError as e:
            path.unlink(missing_ok=True)
            raise ConfigError(f"ArenaStore: cannot make {size:,} bytes in {str(d)!r} ({e})") from None
        return cls(path, owner=True, verify=verify)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, slot_bytes: int | None = None, tag: str | None = None,
             verify: bool = True) -> ArenaStore:
        """Map an arena another process made (``slot_bytes``, ``tag``: what the caller needs)."""
        return cls(path, slot_bytes=slot_bytes, tag=tag, verify=verify)

    # -- the index, under the file's lock ---------------------------------------------------------
    def _locked(self) -> _FileLock:
        if self._map is None:
            raise ValidationError(f"ArenaStore {self.path!r} is closed")
        return _FileLock(self._lock, self._fd)

    def _stamp(self) -> int:
        self._tick[0] += 1
        return int(self._tick[0])

    def _claim_slots(self, c: _Class, keys: Sequence[bytes], sizes: Sequence[int]) -> list[int]:
        """Slots of class ``c`` claimed for ``keys`` (lock held): free ones, then ones whose
        writer died, then the least recently used STORED ones (evicted); -1 for a key past
        them all (every other slot is claimed)."""
        free = np.flatnonzero(c.state == FREE).tolist()
        if len(free) < len(keys):
            free += self._reclaim(c).tolist()
        if len(free) < len(keys):
            stored = np.flatnonzero(c.state == STORED)
            oldest = stored[np.argsort(c.stamp[stored], kind="stable")[:len(keys) - len(free)]].tolist()
            for s in oldest:
                c.take_back(s)
            self.evictions += len(oldest)
            free += oldest
        out = []
        for s, key, size in zip(free, keys, sizes):
            c.state[s] = WRITING  # claimed before its fields change: a crash from here leaves it WRITING
            c.gen[s] += 1
            c.owner[s] = os.getpid()
            c.length[s] = size
            c.klen[s] = len(key)
            c.key[s, :len(key)] = np.frombuffer(key, np.uint8)
            c.hash[s] = _key_hash(key)
            out.append(s)
        return out + [-1] * (len(keys) - len(out))

    def _reclaim(self, c: _Class) -> np.ndarray:
        """WRITING slots whose writer died, taken back."""
        writing = np.flatnonzero(c.state == WRITING)
        dead = [s for s in writing.tolist() if int(c.owner[s]) != os.getpid() and not _alive(int(c.owner[s]))]
        for s in dead:
            c.take_back(s)
        self.reclaimed += len(dead)
        return np.asarray(dead, np.int64)

    def _class_of(self, size: int) -> _Class | None:
        return self.small if size <= self.small.size else self.big if size <= self.big.size else None

    # -- zero copy --------------------------------------------------------------------------------
    def slots(self) -> np.ndarray:
        """The big slots' bytes, ``[slots, slot_bytes]`` uint8 (a device's host buffer)."""
        self._locked()
        return self.big.data

    def claim(self, keys: Sequence[str]) -> list[int]:
        """Big slots for these keys' objects, to be filled in place (then put, from those very
        slots, with :meth:`batch_put_from`): per key a slot, or -1 where every slot is claimed."""
        check_keys(keys, "ArenaStore.claim")
        bs = [k.encode() for k in keys]
        with self._locked():
            out = self._claim_slots(self.big, bs, [self.big.size] * len(bs))
            for k, s in zip(keys, out):
                if s >= 0:
                    self._claims[k] = (s, int(self.big.gen[s]))
        return out

    def release(self, keys: Sequence[str]) -> None:
        """Let go of claims of these keys not put (a transfer that failed or stopped short)."""
        with self._locked():
            for k in keys:
                held = self._claims.pop(k, None)
                if held is not None:
                    self._release(self.big, *held)

    def locate(self, keys: Sequence[str]) -> list[Place]:
        """Where each key's object is in the big slots (marked used now); ``slot`` -1 if not there."""
        check_keys(keys, "ArenaStore.locate")
        bs = [k.encode() for k in keys]
        with self._locked():
            found = self.big.find([_key_hash(b) for b in bs], bs)
            stamp = self._stamp()
            out = []
            for s in found:
                if s >= 0:
                    self.big.stamp[s] = stamp
                    out.append(Place(s, int(self.big.gen[s]), int(self.big.length[s])))
                else:
                    out.append(Place(-1, 0, 0))
        return out

    def unchanged(self, places: Sequence[Place]) -> list[bool]:
        """Whether each place still holds what :meth:`locate` found (read after copying out)."""
        with self._locked():
            return [p.slot >= 0 and int(self.big.state[p.slot]) == STORED and int(self.big.gen[p.slot]) == p.gen
                    for p in places]

    # -- Store ------------------------------------------------------------------------------------
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "ArenaStore.batch_put_from", buffers)
        out = [0] * len(keys)
        plan: list[tuple[int, _Class, int, int, memoryview | None]] = []  # (index, class, slot, gen, to copy)
        with self._locked():
            wanted: dict[int, list[int]] = {}  # class (by id) -> indices of keys needing a slot
            for i, (k, v) in enumerate(zip(keys, views)):
                held = self._claims.pop(k, None)
                if held is not None and v.nbytes <= self.big.size and _address(v) == _address(self.big.data[held[0]]):
                    plan.append((i, self.big, held[0], held[1], None))  # filled in place
                    self.big.length[held[0]] = v.nbytes
                    continue
                if held is not None:  # claimed, but put from elsewhere: the claim is let go
                    self._release(self.big, *held)
                c = self._class_of(v.nbytes)
                if c is None:
                    out[i] = TOO_LARGE
                else:
                    wanted.setdefault(id(c), []).append(i)
            for c in (self.small, self.big):
                idx = wanted.get(id(c), [])
                for i, s in zip(idx, self._claim_slots(c, [keys[i].encode() for i in idx],
                                                       [views[i].nbytes for i in idx])):
                    if s < 0:
                        out[i] = MISSING
                    else:
                        plan.append((i, c, s, int(c.gen[s]), views[i]))
        self._copy([(c.data[s][:v.nbytes], v) for _, c, s, _, v in plan if v is not None])
        with self._locked():
            committed = self._commit([(keys[i], c, s, gen) for i, c, s, gen, _ in plan])
            for (i, *_), ok in zip(plan, committed):
                if not ok:
                    out[i] = MISSING
            self.puts += len(plan)
        return out

    def _commit(self, puts: Sequence[tuple[str, _Class, int, int]]) -> list[bool]:
        """Make the claimed slots visible, dropping older objects of their keys (lock held); a
        slot no longer its claim (taken back: its writer was thought dead) is a lost put."""
        bs = [k.encode() for k, *_ in puts]
        hs = [_key_hash(b) for b in bs]
        for cls in (self.big, self.small):
            for old in cls.find(hs, bs):
                if old >= 0:
                    cls.take_back(old)
        stamp, out = self._stamp(), []
        for _, c, s, gen in puts:
            ok = int(c.gen[s]) == gen and int(c.state[s]) == WRITING
            self.lost_puts += not ok
            if ok:
                c.stamp[s] = stamp
                c.state[s] = STORED  # last
            out.append(ok)
        return out

    def _copy(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each (destination, source) pair, outside the lock: a large batch on the copy
        threads (the copies let go of the GIL), as MemoryStore does."""
        if self._pool is None or len(pairs) < 2 or sum(len(d) for d, _ in pairs) < PARALLEL_BYTES:
            copy_all([d for d, _ in pairs], [np.frombuffer(v, np.uint8) for _, v in pairs])
            return
        n = self._threads
        for f in [self._pool.submit(self._copy_part, pairs[i::n]) for i in range(n)]:
            f.result()

    @staticmethod
    def _copy_part(pairs: Sequence[tuple[Any, Any]]) -> None:
        copy_all([d for d, _ in pairs], [np.frombuffer(v, np.uint8) for _, v in pairs])

    def _release(self, c: _Class, s: int, gen: int) -> None:
        if int(c.gen[s]) == gen and int(c.state[s]) == WRITING:
            c.take_back(s)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "ArenaStore.batch_get_into", buffers)
        bs = [k.encode() for k in keys]
        hs = [_key_hash(b) for b in bs]
        out, plan = [MISSING] * len(keys), []
        with self._locked():
            stamp = self._stamp()
            for c in (self.small, self.big):
                for i, s in enumerate(c.find(hs, bs)):
                    if s < 0:
                        continue
                    n = int(c.length[s])
                    if n > views[i].nbytes:
                        out[i] = TOO_LARGE
                        continue
                    c.stamp[s] = stamp
                    plan.append((i, c, s, int(c.gen[s]), n))
        self._copy([(np.frombuffer(views[i], np.uint8, count=n), c.data[s][:n]) for i, c, s, _, n in plan])
        with self._locked():
            for i, c, s, gen, n in plan:
                out[i] = n if int(c.gen[s]) == gen and int(c.state[s]) == STORED else MISSING
            self.gets += len(plan)
        return out

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        check_keys(keys, "ArenaStore.batch_is_exist")
        bs = [k.encode() for k in keys]
        hs = [_key_hash(b) for b in bs]
        with self._locked():
            found = [max(a, b) for a, b in zip(self.small.find(hs, bs), self.big.find(hs, bs))]
        return [1 if s >= 0 else 0 for s in found]

    def evict(self, keys: Sequence[str]) -> int:
        check_keys(keys, "ArenaStore.evict")
        bs = [k.encode() for k in keys]
        hs = [_key_hash(b) for b in bs]
        n = 0
        with self._locked():
            for c in (self.small, self.big):
                for s in c.find(hs, bs):
                    if s >= 0:
                        c.take_back(s)
                        n += 1
            self.evictions += n
        return n

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects stored now (every process's)."""
        with self._locked():
            return int(sum(int(c.length[c.state == STORED].sum()) for c in (self.big, self.small)))

    def __len__(self) -> int:
        with self._locked():
            return int(sum(int((c.state == STORED).sum()) for c in (self.big, self.small)))

    def close(self) -> None:
        """Unmap (the views of :meth:`slots` end with it); the creator also removes the file."""
        pool, self.__dict__["_pool"] = self.__dict__.get("_pool"), None
        if pool is not None:
            pool.shutdown(wait=True)
        m, self._map = self._map, None
        if m is not None:
            for name in ("big", "small", "_tick"):
                self.__dict__.pop(name, None)
            try:
                m.close()
            except BufferError:  # a caller still holds a view (a device registration): the map goes with it
                pass
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
            if self.owner:
                Path(self.path).unlink(missing_ok=True)


class _FileLock:
    """The thread lock, then the file's ``flock`` (released by the kernel if the holder dies)."""

    def __init__(self, lock: threading.Lock, fd: int) -> None:
        self.lock, self.fd = lock, fd

    def __enter__(self) -> None:
        self.lock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.lock.release()


def _address(a: Any) -> int:
    """The first byte's address of a buffer (a memoryview or an array)."""
    return int(np.frombuffer(a, np.uint8).__array_interface__["data"][0]) if not isinstance(a, np.ndarray) \
        else int(a.__array_interface__["data"][0])


def _touch(m: mmap.mmap, size: int) -> None:
    """Write one byte a page: the memory is taken now, not at a put."""
    a = np.frombuffer(m, np.uint8)
    a[::_PAGE] = 0
    del a


def _remove_orphans(d: Path) -> None:
    """Arenas whose creator died (their names carry its pid) are removed."""
    for p in d.glob("kvstate-arena-*"):
        pid = p.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstate.backends.arena --slot-bytes N --slots M``: make an arena, print its
    path, and hold it (its owner) until SIGTERM or SIGINT, then remove it. What an operator
    runs beside P's and D's engines on a host, whose stores name the path."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="python -m kvstate.backends.arena", description=main.__doc__)
    ap.add_argument("--slot-bytes", type=int, required=True, help="one object: a block of one kind, every layer")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--small-bytes", type=int, default=1024)
    ap.add_argument("--tag", default="")
    ap.add_argument("--directory")
    a = ap.parse_args(argv)
    try:
        store = ArenaStore.create(a.slot_bytes, a.slots, small_bytes=a.small_bytes, tag=a.tag, directory=a.directory)
    except (ConfigError, ValidationError) as e:
        print(f"error: {e}", flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(store.path, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
