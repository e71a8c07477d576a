"""The host memory tier's bookkeeping: pinned host block slots keyed by content key.

The tier sits between GPU blocks and the storage pool. Its bytes live in the backend (one
pinned block-major arena per TP rank, slot ``i`` at the same place on every rank); this pool
only says which slot holds which key. Rules:

- A key holds at most one slot. An entry is *filling* from the moment a swap-out is granted
  its slot until that swap-out answers on every rank; then it is *ready* (``commit``). Only
  ready entries count as hits.
- Every holder takes a reference: a swapped-out request on each of its keys, and each
  in-flight transfer on the keys it touches, until it retires. An entry with a reference is
  never evicted, so no slot is reused under a running copy.
- An entry whose last reference goes is kept while ready (least recently used first to go:
  a later prompt may hit it) and dropped while filling (its bytes never arrived whole).
- ``acquire`` is all or nothing: it grants every key a slot, evicting unreferenced ready
  entries in LRU order, or raises :class:`HostTierFullError` and changes nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import BlockError, HostTierFullError
from ._validate import check_int

__all__ = ["HostBlockPool", "HostStats"]


@dataclass(frozen=True, slots=True)
class HostStats:
    """A snapshot of the tier (``free + entries == slots``)."""

    slots: int
    free: int
    entries: int  #: keys holding a slot (ready or filling)
    referenced: int  #: entries some holder references
    hits: int  #: keys found ready by lookups
    misses: int  #: keys looked up and not found ready
    evictions: int


class _Entry:
    __slots__ = ("slot", "refs", "ready")

    def __init__(self, slot: int) -> None:
        self.slot, self.refs, self.ready = slot, 1, False


class HostBlockPool:
    """``num_slots`` host block slots with content keys, reference counts and LRU eviction."""

    def __init__(self, num_slots: int) -> None:
        check_int(num_slots, "HostBlockPool: num_slots", minimum=1)
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._entries: dict[str, _Entry] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # ready, unreferenced: LRU first
        self.hits = self.misses = self.evictions = 0

    # -- queries ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are ready here (counted as hits and misses)."""
        n = self.ready_prefix(keys)
        self.hits += n
        self.misses += len(keys) - n
        return n

    def ready_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are ready (a look that counts nothing)."""
        entries, n = self._entries, 0
        for k in keys:
            e = entries.get(k)
            if e is None or not e.ready:
                break
            n += 1
        return n

    def slots(self, keys: Sequence[str]) -> list[int]:
        """The slots of ``keys`` (each must hold one)."""
        return [self._get(k, "slots").slot for k in keys]

    def can_acquire(self, keys: Sequence[str]) -> bool:
        """Whether :meth:`acquire` of ``keys`` would succeed now."""
        entries, idle = self._entries, self._idle
        missing = sum(1 for k in keys if k not in entries)
        reused_idle = sum(1 for k in keys if k in idle)  # taken back, so not evictable for the rest
        return missing <= len(self._free) + len(idle) - reused_idle

    def refcount(self, key: str) -> int:
        """References to ``key``'s entry (0: absent or idle)."""
        e = self._entries.get(key)
        return 0 if e is None else e.refs

    def stats(self) -> HostStats:
        referenced = sum(1 for e in self._entries.values() if e.refs)
        return HostStats(self.num_slots, len(self._free), len(self._entries), referenced,
                         self.hits, self.misses, self.evictions)

    # -- mutations (validate first, then change) -------------------------------------------
    def acquire(self, keys: Sequence[str]) -> tuple[list[int], list[int]]:
        """Reference every key, granting a slot to each key without one; returns the slots (one
        per key) and the indexes of the keys granted a new (filling) slot, which the caller
        must fill and then :meth:`commit`."""
        if len(set(keys)) != len(keys):
            raise BlockError(f"HostBlockPool.acquire: a key appears twice in {list(keys)[:4]}...")
        if not self.can_acquire(keys):
            missing = sum(1 for k in keys if k not in self._entries)
            raise HostTierFullError(f"host tier: {missing} new block(s) needed, {len(self._free)} free and "
                                    f"{len(self._idle)} evictable of {self.num_slots}")
        entries = self._entries
        fresh = [i for i, k in enumerate(keys) if k not in entries]
        for k in keys:  # reference the present entries first: none of them may be evicted below
            e = entries.get(k)
            if e is not None:
                self._ref(k, e)
        for i in fresh:
            entries[keys[i]] = _Entry(self._take_slot())
        return [entries[k].slot for k in keys], fresh

    def retain(self, keys: Sequence[str]) -> None:
        """One more reference to each key's entry (an in-flight transfer's pin)."""
        entries = [self._get(k, "retain") for k in keys]
        for k, e in zip(keys, entries):
            self._ref(k, e)

    def commit(self, keys: Sequence[str]) -> None:
        """The filling entries of ``keys`` now hold their bytes on every rank."""
        for e in [self._get(k, "commit") for k in keys]:
            e.ready = True

    def release(self, keys: Sequence[str]) -> None:
        """Drop one reference from each key's entry (see the module's rules)."""
        entries = [self._get(k, "release") for k in keys]
        for k, e in zip(keys, entries):
            if e.refs <= 0:
                raise BlockError(f"HostBlockPool.release: key {k[:16]!r}... has no reference to drop")
        for k, e in zip(keys, entries):
            e.refs -= 1
            if e.refs:
                continue
            if e.ready:
                self._idle[k] = None
            else:
                del self._entries[k]
                self._free.append(e.slot)

    # -- internals ---------------------------------------------------------------------------
    def _get(self, key: str, op: str) -> _Entry:
        e = self._entries.get(key)
        if e is None:
            raise BlockError(f"HostBlockPool.{op}: key {str(key)[:16]!r}... holds no slot")
        return e

    def _ref(self, key: str, e: _Entry) -> None:
        if not e.refs:
            del self._idle[key]
        e.refs += 1

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        key, _ = self._idle.popitem(last=False)
        self.evictions += 1
        return self._entries.pop(key).slot
