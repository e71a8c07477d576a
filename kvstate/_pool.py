"""The paged block pool: allocation, refcounted sharing, headroom and accounting.

A block is free (refcount 0) or held by one or more references. The lifecycle takes one
reference per request that owns a block and one per in-flight transfer that pins it, so a
block returns to the free list only when the last of them lets go: nothing is freed, or
handed out again, under a running transfer.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._errors import BlockError, OutOfBlocksError
from ._validate import MAX_BLOCKS, check_int, is_int

__all__ = ["BlockPool", "FREED", "PoolStats"]

#: a block table entry whose block a request freed behind its sliding window (see
#: :attr:`~kvstate._spec.CacheSpec.frees_behind_window`): no block, never read or written
FREED = -1


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool's accounting (``free + used == total`` always; a prefix cache's
    idle blocks count as free)."""

    total: int
    free: int
    used: int
    shared: int
    peak_used: int
    allocations: int
    frees: int
    cached: int = 0  #: blocks published in a GPU prefix cache (:mod:`kvstate._prefixcache`)


class BlockPool:
    """``num_blocks`` block ids ``0 .. num_blocks-1`` with reference counts."""

    __slots__ = ("num_blocks", "_free", "_refs", "_peak", "_allocs", "_frees")

    def __init__(self, num_blocks: int) -> None:
        check_int(num_blocks, "BlockPool: num_blocks", minimum=0, maximum=MAX_BLOCKS)
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._refs = [0] * num_blocks
        self._peak = 0
        self._allocs = 0
        self._frees = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int, headroom: int = 0) -> bool:
        """Whether ``n`` blocks can be allocated while ``headroom`` blocks stay free."""
        if n.__class__ is not int or headroom.__class__ is not int or n < 0 or headroom < 0:
            self._check_count(n, "n")  # bool, float, negative: raise with the rule broken
            self._check_count(headroom, "headroom")
        return len(self._free) - n >= headroom

    def refcount(self, block_id: int) -> int:
        self._check_ids((block_id,), "refcount", allow_free=True)
        return self._refs[block_id]

    def refcounts(self) -> list[int]:
        """Every block's reference count, by block id (a copy: for checks and reports)."""
        return list(self._refs)

    def free_ids(self) -> list[int]:
        """The free block ids, in the order they will be handed out last to first (a copy)."""
        return list(self._free)

    def stats(self) -> PoolStats:
        refs = self._refs  # counted here, in C (refcounts are never negative): pins stay two list ops
        shared = len(refs) - refs.count(0) - refs.count(1)
        return PoolStats(self.num_blocks, len(self._free), self.num_used, shared,
                         self._peak, self._allocs, self._frees)

    # -- mutations (validate everything first, then change) --------------------------------
    def allocate(self, n: int, headroom: int = 0) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each); ``n == 0`` gives ``[]``.

        Raises :class:`OutOfBlocksError` (allocating nothing) unless ``headroom`` blocks
        would still be free afterwards.
        """
        if n.__class__ is not int or headroom.__class__ is not int or n < 0 or headroom < 0:
            self._check_count(n, "n")  # bool, float, negative: raise with the rule broken
            self._check_count(headroom, "headroom")
        if len(self._free) - n < headroom:
            raise OutOfBlocksError(
                f"cannot allocate {n} block(s) keeping {headroom} free: {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        if n == 0:
            return []
        free, refs = self._free, self._refs
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        for b in ids:
            refs[b] = 1
        self._allocs += n
        used = self.num_blocks - len(free)
        self._peak = max(self._peak, used)
        return ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each (already held) block: prefix sharing, transfer pins."""
        self._check_ids(block_ids, "share")
        self.retain(block_ids)

    def free(self, block_ids: Sequence[int]) -> int:
        """Drop one reference from each block; blocks reaching 0 return to the free list.

        Returns how many blocks became free. A double free, a foreign id or a duplicate in
        ``block_ids`` raises :class:`BlockError` naming the block, and changes nothing.
        """
        self._check_ids(block_ids, "free")
        return self.release(block_ids)

    # -- the owner's bookkeeping: ids this pool handed out, unchecked -----------------------
    # The lifecycle holds and pins only block lists this pool allocated to it, several times
    # per request; checking them again (range, type, duplicates, double free) would cost
    # about 4 us a call, 8 % of a request's whole bookkeeping. Everyone else uses share/free.
    def retain(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block: unchecked, for ids this pool allocated (see share)."""
        refs = self._refs
        for b in block_ids:
            refs[b] += 1

    def release(self, block_ids: Sequence[int]) -> int:
        """Drop one reference from each block; returns how many became free. Unchecked, for
        ids this pool allocated and the caller holds (see free)."""
        refs, free = self._refs, self._free
        before = len(free)
        for b in block_ids:
            r = refs[b] - 1
            refs[b] = r
            if not r:
                free.append(b)
        freed = len(free) - before
        self._frees += freed
        return freed

    # -- validation ------------------------------------------------------------------------
    @staticmethod
    def _check_count(n: int, name: str) -> None:
        check_int(n, f"BlockPool: {name}", minimum=0)

    def _check_ids(self, block_ids: Iterable[int], op: str, allow_free: bool = False) -> None:
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise BlockError(f"BlockPool.{op}: block ids must be a sequence of ints, got {block_ids!r}")
        refs, nb = self._refs, self.num_blocks
        seen: set[int] = set()
        for b in block_ids:
            if not is_int(b):
                raise BlockError(f"BlockPool.{op}: block id {b!r} is not an int")
            if b < 0 or b >= nb:
                raise BlockError(f"BlockPool.{op}: block {b} is out of range 0..{nb - 1}")
            if b in seen:
                raise BlockError(f"BlockPool.{op}: block {b} appears twice")
            seen.add(b)
            if not allow_free and refs[b] == 0:
                raise BlockError(f"BlockPool.{op}: block {b} is free (double free or foreign id)")
