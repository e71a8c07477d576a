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
  page up front and every opener maps them all at open, so no put or get page-faults; every
  opener checks the header: another format version, slot size or ``tag`` (the geometry it was
  made for) is refused by name.
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
  pins nothing a dead reader could leak. A get whose slot another put of its key took back
  meanwhile (keys name their content: two prompts sharing a prefix write it at once) copies
  again from the key's new slot, at most :data:`ARENA_REREADS` times. :meth:`locate` and
  :meth:`unchanged` give a device reading slots itself the same check.
- The creator owns the file: :meth:`close` unmaps it and, the creator's, unlinks it (others'
  mappings stay valid). A file whose creator died is removed by the next :meth:`create` in its
  directory (names carry the creator's pid). ``kvstate arena`` is a creator that holds one for
  the engines of a host until it is stopped; :func:`find_arena` finds it there for an engine
  that names no path.
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
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from .._errors import ConfigError, ValidationError
from .._validate import check_int
from ._base import MAX_KEY_LEN, MISSING, TOO_LARGE, Store, check_batch, check_keys
from ._hostcopy import copy_all
from ._hostfiles import creator_pid, pid_alive, remove_orphans, shm_directory
from ._stores import PARALLEL_BYTES, default_threads

__all__ = ["ArenaStore", "Place", "find_arena", "ARENA_VERSION", "ARENA_REREADS"]

#: times a get copies again, from its key's new slot, an object another put replaced meanwhile
ARENA_REREADS = 2

ARENA_VERSION = 1  #: the file format; a file of another version is refused
_MAGIC = b"KVSARENA"
_HEADER = struct.Struct("<8sIIQQQQ64s")  # magic, version, key_max, slots, slot_bytes, small slots, small bytes, tag
_PAGE = 4096
FREE, WRITING, STORED = 0, 1, 2
_FIELDS = (("state", np.uint8, ()), ("gen", np.uint64, ()), ("hash", np.uint64, ()), ("length", np.uint64, ()),
           ("owner", np.int64, ()), ("stamp", np.uint64, ()), ("klen", np.uint16, ()),
           ("key", np.uint8, (MAX_KEY_LEN * 4,)))  # a key's UTF-8 bytes: at most 4 a character


class _Header(NamedTuple):
    """An arena file's first bytes, as both an opener and :func:`find_arena` read them."""

    magic: bytes
    version: int
    key_max: int
    slots: int
    slot_bytes: int
    small_slots: int
    small_bytes: int
    raw_tag: bytes

    @classmethod
    def read(cls, buf: Any) -> _Header:
        return cls(*_HEADER.unpack_from(buf, 0))

    @property
    def readable(self) -> bool:
        """Whether this kvstate reads the format (its version and its keys' longest length)."""
        return self.version == ARENA_VERSION and self.key_max == MAX_KEY_LEN

    @property
    def tag(self) -> str:
        return self.raw_tag.rstrip(b"\0").decode(errors="replace")


class Place(NamedTuple):
    """Where an object is: its big slot (-1: not there), the slot's generation, its length."""

    slot: int
    gen: int
    length: int


class _Keys:
    """A batch of keys as the index holds them: UTF-8 rows zero-padded to the longest, their
    lengths and hashes (0 marks an empty slot's hash, so no key hashes to it)."""

    def __init__(self, keys: Sequence[str]) -> None:
        raw = [k.encode() for k in keys]
        self.lens = np.array(list(map(len, raw)), np.uint16)
        self.width = int(self.lens.max()) if len(raw) else 0
        pad = [self.width] * len(raw)
        self.rows = np.frombuffer(b"".join(map(bytes.ljust, raw, pad, repeat(b"\0"))), np.uint8) \
            .reshape(len(raw), self.width)
        self.hashes = np.array(list(map(xxhash.xxh3_64_intdigest, raw)), np.uint64)
        self.hashes[self.hashes == 0] = 1
        self.sorted = np.sort(self.hashes)  # what the index's hashes are looked up in

    def __len__(self) -> int:
        return len(self.lens)

    def take(self, idx: Any) -> _Keys:
        """The keys at ``idx`` (a sub-batch)."""
        out = _Keys.__new__(_Keys)
        out.lens, out.rows, out.hashes = self.lens[idx], self.rows[idx], self.hashes[idx]
        out.width, out.sorted = self.width, np.sort(out.hashes)
        return out


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

    def find(self, keys: _Keys) -> np.ndarray:
        """Each key's STORED slot, or -1: one pass over the index for the batch (hashes
        matched by sorting, then the key bytes compared; a hash two stored keys share is
        resolved key by key)."""
        out = np.full(len(keys), -1, np.int64)
        if not len(keys):
            return out
        stored = np.flatnonzero(self.state == STORED)
        at = np.minimum(np.searchsorted(keys.sorted, self.hash[stored]), len(keys) - 1)
        cand = stored[keys.sorted[at] == self.hash[stored]]  # slots whose hash is one of the batch's
        if not len(cand):
            return out
        order = np.argsort(self.hash[cand], kind="stable")
        ch, cs = self.hash[cand][order], cand[order]
        pos = np.minimum(np.searchsorted(ch, keys.hashes), len(ch) - 1)
        hit = np.flatnonzero(ch[pos] == keys.hashes)
        s = cs[pos[hit]]
        same = (self.klen[s] == keys.lens[hit]) & (self.key[s, :keys.width] == keys.rows[hit]).all(axis=1)
        out[hit[same]] = s[same]
        for i in hit[~same].tolist():  # another key of the same hash came first: look at each
            for j in range(int(pos[i]), len(ch)):
                if ch[j] != keys.hashes[i]:
                    break
                t = int(cs[j])
                if int(self.klen[t]) == keys.lens[i] and (self.key[t, :keys.width] == keys.rows[i]).all():
                    out[i] = t
                    break
        return out

    def take_back(self, slots: Any) -> None:
        """The slots leave the index: STORED cleared first (a crash leaves them WRITING or FREE)."""
        self.state[slots] = WRITING
        self.hash[slots] = 0
        self.state[slots] = FREE

    def fill(self, slots: np.ndarray, keys: _Keys, sizes: Any) -> None:
        """Claim ``slots`` for ``keys``: WRITING before any field changes (a crash from here
        leaves them WRITING), a new generation, this process as their writer."""
        self.state[slots] = WRITING
        self.gen[slots] += 1
        self.owner[slots] = os.getpid()
        self.length[slots] = sizes
        self.klen[slots] = keys.lens
        self.key[slots] = 0
        self.key[slots, :keys.width] = keys.rows
        self.hash[slots] = keys.hashes


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
        if owner.__class__ is not bool or verify.__class__ is not bool:
            raise ConfigError(f"ArenaStore: owner and verify must be bools, got {owner!r} and {verify!r}")
        self.path, self.owner, self.verify = str(path), owner, verify
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
        #: (thread, key) -> (class, slot, generation) claimed: a thread publishes only its own claims,
        #: so two threads putting one key never let go of each other's slot while it is copied into
        self._claims: dict[tuple[int, str], tuple[_Class, int, int]] = {}
        self.evictions = self.puts = self.gets = self.lost_puts = 0
        self.reclaimed = 0  #: slots taken back from writers that died

    def _attach(self, slot_bytes: int | None, tag: str | None) -> None:
        size = os.fstat(self._fd).st_size
        if size < _PAGE:
            raise ConfigError(f"ArenaStore: {self.path!r} is not an arena ({size} bytes)")
        # its page tables filled now: no copy of this process faults on a page of the file
        self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        head = _Header.read(self._map)
        if head.magic != _MAGIC:
            raise ConfigError(f"ArenaStore: {self.path!r} is not an arena (no header)")
        if not head.readable:
            raise ConfigError(f"ArenaStore: {self.path!r} is format version {head.version}, this kvstate reads "
                              f"{ARENA_VERSION}")
        self.tag = head.tag
        if slot_bytes is not None and slot_bytes != head.slot_bytes:
            raise ConfigError(f"ArenaStore: {self.path!r} has {head.slot_bytes}-byte slots, {slot_bytes} were asked "
                              "for: it was made for another geometry")
        if tag is not None and tag != self.tag:
            raise ConfigError(f"ArenaStore: {self.path!r} was made for geometry {self.tag!r}, not {tag!r}")
        big_at, small_at, need = _layout(head.slots, head.slot_bytes, head.small_slots, head.small_bytes)
        if size != need:
            raise ConfigError(f"ArenaStore: {self.path!r} holds {size:,} bytes, its header needs {need:,}")
        buf = memoryview(self._map)
        self.big = _Class(buf, big_at, head.slots, head.slot_bytes)
        self.small = _Class(buf, small_at, head.small_slots, head.small_bytes)
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
        d = Path(directory) if directory is not None else shm_directory()
        if not d.is_dir():
            raise ConfigError(f"ArenaStore: {str(d)!r} is not a directory")
        remove_orphans(d, "kvstate-arena-")  # arenas whose creator died
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

    def _claim_slots(self, c: _Class, keys: _Keys, sizes: Any) -> np.ndarray:
        """Slots of class ``c`` claimed for ``keys`` (lock held): free ones, then ones whose
        writer died, then the least recently used STORED ones (evicted); -1 for a key past
        them all (every other slot is claimed)."""
        n = len(keys)
        free = np.flatnonzero(c.state == FREE)[:n]
        if len(free) < n:
            free = np.concatenate([free, self._reclaim(c)])[:n]
        if len(free) < n:
            stored = np.flatnonzero(c.state == STORED)
            oldest = stored[np.argsort(c.stamp[stored], kind="stable")[:n - len(free)]]
            c.take_back(oldest)
            self.evictions += len(oldest)
            free = np.concatenate([free, oldest])
        k = len(free)
        c.fill(free, keys.take(slice(0, k)), np.asarray(sizes, np.uint64)[:k])
        return np.concatenate([free, np.full(n - k, -1, np.int64)]).astype(np.int64)

    def _reclaim(self, c: _Class) -> np.ndarray:
        """WRITING slots whose writer died, taken back."""
        writing = np.flatnonzero(c.state == WRITING)
        dead = np.asarray([s for s in writing.tolist()
                           if int(c.owner[s]) != os.getpid() and not pid_alive(int(c.owner[s]))], np.int64)
        c.take_back(dead)
        self.reclaimed += len(dead)
        return dead

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
        with self._locked():
            for k in keys:  # a key claimed again lets its earlier claim go
                if _mine(k) in self._claims:
                    self._release(*self._claims.pop(_mine(k)))
            out = self._claim_slots(self.big, _Keys(keys), np.full(len(keys), self.big.size)).tolist()
            gens = self.big.gen[[s for s in out if s >= 0]].tolist()
            self._claims.update(zip([_mine(k) for k, s in zip(keys, out) if s >= 0],
                                    [(self.big, s, g) for s, g in zip([s for s in out if s >= 0], gens)]))
        return out

    def release(self, keys: Sequence[str]) -> None:
        """Let go of claims of these keys not published (a transfer that failed or stopped short)."""
        check_keys(keys, "ArenaStore.release")
        with self._locked():
            for k in keys:
                held = self._claims.pop(_mine(k), None)
                if held is not None:
                    self._release(*held)

    def locate(self, keys: Sequence[str]) -> list[Place]:
        """Where each key's object is in the big slots (marked used now); ``slot`` -1 if not there."""
        check_keys(keys, "ArenaStore.locate")
        batch = _Keys(keys)
        with self._locked():
            found = self.big.find(batch)
            hit = found[found >= 0]
            self.big.stamp[hit] = self._stamp()
            gens, lengths = self.big.gen[found].tolist(), self.big.length[found].tolist()
        return [Place(s, g, n) if s >= 0 else Place(-1, 0, 0) for s, g, n in zip(found.tolist(), gens, lengths)]

    def unchanged(self, places: Sequence[Place]) -> list[bool]:
        """Whether each place still holds what :meth:`locate` found (read after copying out)."""
        if isinstance(places, (str, bytes)) or not isinstance(places, Sequence) or \
                not all(isinstance(p, Place) and -1 <= p.slot < self.big.slots for p in places):
            raise ValidationError(f"ArenaStore.unchanged: places must be a sequence of what locate answered, got "
                                  f"{places!r:.80}")
        slots = np.asarray([p.slot for p in places], np.int64)
        gens = np.asarray([p.gen for p in places], np.uint64)
        with self._locked():
            ok = (slots >= 0) & (self.big.state[slots] == STORED) & (self.big.gen[slots] == gens)
        return ok.tolist()

    # -- Store ------------------------------------------------------------------------------------
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        staged = self.stage(keys, buffers)
        published = self.publish([k for k, st in zip(keys, staged) if st == 0])
        done = iter(published)
        return [next(done) if st == 0 else st for st in staged]

    def stage(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Copy each buffer into a slot claimed for its key, not yet visible (:meth:`publish`
        makes it so); a buffer that already is its key's claimed slot is not copied. Per key 0,
        ``TOO_LARGE``, or ``MISSING`` (every slot of its class claimed)."""
        views = check_batch(keys, "ArenaStore.stage", buffers)
        out = [0] * len(keys)
        copies: list[tuple[np.ndarray, memoryview]] = []
        with self._locked():
            wanted: dict[int, list[int]] = {}  # class (by id) -> indices of keys needing a slot
            base, last = _address(self.big.data), {k: i for i, k in enumerate(keys)}
            for i, (k, v) in enumerate(zip(keys, views)):
                if last[k] != i:  # a later buffer of the key in this batch replaces it
                    continue
                held = self._claims.get(_mine(k))
                if held is not None and held[0] is self.big and v.nbytes <= self.big.size \
                        and _address(v) == base + held[1] * self.big.size:
                    self.big.length[held[1]] = v.nbytes  # filled in place
                    continue
                if held is not None:  # claimed, but put from elsewhere: the claim is let go
                    self._release(*self._claims.pop(_mine(k)))
                c = self._class_of(v.nbytes)
                if c is None:
                    out[i] = TOO_LARGE
                else:
                    wanted.setdefault(id(c), []).append(i)
            for c in (self.small, self.big):
                idx = wanted.get(id(c), [])
                if not idx:
                    continue
                slots = self._claim_slots(c, _Keys([keys[i] for i in idx]), [views[i].nbytes for i in idx])
                for i, sl, gen in zip(idx, slots.tolist(), c.gen[slots].tolist()):
                    if sl < 0:
                        out[i] = MISSING
                    else:
                        self._claims[_mine(keys[i])] = (c, sl, gen)
                        copies.append((c.data[sl][:views[i].nbytes], views[i]))
        self._copy(copies)
        return out

    def publish(self, keys: Sequence[str]) -> list[int]:
        """Make the objects staged (or claimed and filled) for these keys visible, in one
        step; per key 0, or ``MISSING`` where it holds no claim or its slot was taken back."""
        check_keys(keys, "ArenaStore.publish")
        asked = keys
        with self._locked():
            held = [self._claims.pop(_mine(k), None) for k in dict.fromkeys(keys)]
            keys = list(dict.fromkeys(keys))
            mine = [i for i, h in enumerate(held) if h is not None]
            ok = self._commit([(keys[i], *held[i]) for i in mine])  # type: ignore[misc]
            self.puts += len(mine)
        status = dict.fromkeys(keys, MISSING)
        for i, good in zip(mine, ok):
            status[keys[i]] = 0 if good else MISSING
        return [status[k] for k in asked]

    def _commit(self, puts: Sequence[tuple[str, _Class, int, int]]) -> list[bool]:
        """Make the claimed slots visible, dropping older objects of their keys (lock held); a
        slot no longer its claim (taken back: its writer was thought dead) is a lost put."""
        batch = _Keys([k for k, *_ in puts])
        for cls in (self.big, self.small):
            old = cls.find(batch)
            cls.take_back(old[old >= 0])
        ok = np.zeros(len(puts), bool)
        stamp = self._stamp()
        for c in (self.big, self.small):
            mine = np.asarray([i for i, p in enumerate(puts) if p[1] is c], np.int64)
            if not len(mine):
                continue
            slots = np.asarray([puts[i][2] for i in mine], np.int64)
            gens = np.asarray([puts[i][3] for i in mine], np.uint64)
            good = (c.gen[slots] == gens) & (c.state[slots] == WRITING)
            c.stamp[slots[good]] = stamp
            c.state[slots[good]] = STORED  # last
            ok[mine] = good
        self.lost_puts += int((~ok).sum())
        return ok.tolist()

    def _copy(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each (destination, source) pair, outside the lock: a large batch on the copy
        threads (the copies let go of the GIL), as MemoryStore does."""
        if self._pool is None or len(pairs) < 2 or sum(len(d) for d, _ in pairs) < PARALLEL_BYTES:
            self._copy_part(pairs)
            return
        n = self._threads
        for f in [self._pool.submit(self._copy_part, pairs[i::n]) for i in range(n)]:
            f.result()

    @staticmethod
    def _copy_part(pairs: Sequence[tuple[Any, Any]]) -> None:
        copy_all([d for d, _ in pairs], [np.frombuffer(v, np.uint8) for _, v in pairs])

    def _release(self, c: _Class, s: int, gen: int) -> None:
        if int(c.gen[s]) == gen and int(c.state[s]) == WRITING:
            c.take_back([s])

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        views = check_batch(keys, "ArenaStore.batch_get_into", buffers)
        out = [MISSING] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(1 + ARENA_REREADS):
            todo = self._get_round(keys, views, todo, out)
            if not todo:
                break
        return out

    def _get_round(self, keys: Sequence[str], views: Sequence[memoryview], todo: list[int],
                   out: list[int]) -> list[int]:
        """Copy out the objects of ``keys[i]`` for each ``i`` in ``todo`` into ``out``; answers
        those whose slot was taken back while they copied and whose key is stored again."""
        batch, plan = _Keys([keys[i] for i in todo]), []
        with self._locked():
            stamp = self._stamp()
            for c in (self.small, self.big):
                for j, s in enumerate(c.find(batch).tolist()):
                    if s < 0:
                        continue
                    i, n = todo[j], int(c.length[s])
                    if n > views[i].nbytes:
                        out[i] = TOO_LARGE
                        continue
                    c.stamp[s] = stamp
                    plan.append((i, c, s, int(c.gen[s]), n))
        self._copy([(np.frombuffer(views[i], np.uint8, count=n), c.data[s][:n]) for i, c, s, _, n in plan])
        with self._locked():
            lost = []
            for i, c, s, gen, n in plan:
                good = int(c.gen[s]) == gen and int(c.state[s]) == STORED
                out[i] = n if good else MISSING
                if not good:
                    lost.append(i)
            self.gets += len(plan)
            if not lost:
                return []
            found = self._found(_Keys([keys[i] for i in lost])).tolist()
        return [i for i, f in zip(lost, found) if f]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        check_keys(keys, "ArenaStore.batch_is_exist")
        batch = _Keys(keys)
        with self._locked():
            return self._found(batch).astype(int).tolist()

    def _found(self, batch: _Keys) -> np.ndarray:
        """Whether each key of ``batch`` is stored, in either slot class (lock held)."""
        return np.maximum(self.small.find(batch), self.big.find(batch)) >= 0

    def evict(self, keys: Sequence[str]) -> int:
        check_keys(keys, "ArenaStore.evict")
        batch, n = _Keys(keys), 0
        with self._locked():
            for c in (self.small, self.big):
                found = c.find(batch)
                c.take_back(found[found >= 0])
                n += int((found >= 0).sum())
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


def find_arena(slot_bytes: int, tag: str | None = None, directory: str | os.PathLike[str] | None = None) -> str:
    """The path of the one arena in ``directory`` (default: shared memory) whose creator runs,
    whose format this kvstate reads and whose slots are ``slot_bytes`` (and ``tag``, when
    given): how engines on one host meet without naming a path. None, or several, is a
    :class:`~kvstate._errors.ConfigError` saying how to make one or naming them."""
    check_int(slot_bytes, "find_arena: slot_bytes", minimum=8)
    d = Path(directory) if directory is not None else shm_directory()
    found = []
    for path in sorted(d.glob("kvstate-arena-*")):
        pid = creator_pid(path.name, "kvstate-arena-")
        if not pid or not pid_alive(pid):
            continue
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
        except OSError:
            continue
        if len(head) < _HEADER.size:
            continue
        h = _Header.read(head)
        if h.magic == _MAGIC and h.readable and h.slot_bytes == slot_bytes and (tag is None or h.tag == tag):
            found.append(str(path))
    if len(found) == 1:
        return found[0]
    want = f"{slot_bytes}-byte slots" + (f" and tag {tag!r}" if tag is not None else "")
    if not found:
        raise ConfigError(f"no kvstate arena in {str(d)!r} has {want}: start one beside the engines (`kvstate arena "
                          f"--slot-bytes {slot_bytes} --slots N`), or name a store")
    raise ConfigError(f"{len(found)} kvstate arenas in {str(d)!r} have {want}: name one by its path ({found})")


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


def _mine(key: str) -> tuple[int, str]:
    """A claim's name: the calling thread's, for ``key``."""
    return threading.get_ident(), key


def _address(a: Any) -> int:
    """The first byte's address of a buffer (a memoryview or an array)."""
    return int(np.frombuffer(a, np.uint8).__array_interface__["data"][0]) if not isinstance(a, np.ndarray) \
        else int(a.__array_interface__["data"][0])


def _touch(m: mmap.mmap, size: int) -> None:
    """Write one byte a page: the memory is taken now, not at a put."""
    a = np.frombuffer(m, np.uint8)
    a[::_PAGE] = 0
    del a
