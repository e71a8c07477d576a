"""The GPU prefix cache: a block pool that remembers what its blocks hold.

Rules:

- A block is *published* under a content key (:mod:`kvstate._keys`) once its bytes are that
  key's: P publishes a prompt's blocks when its prefill is done, D a request's when it
  becomes runnable. Only full blocks are published (a partial last block still grows). A key
  already published keeps its first block.
- A published block whose last reference goes is *idle*: it counts as free, but keeps its
  key, so a later prompt with that prefix takes it back (:meth:`PrefixCachingPool.claim`)
  instead of moving its bytes again.
- Allocation hands out blocks holding no key first, then evicts idle blocks, the one idle
  longest first (its key is forgotten). Blocks released together turn idle last block first,
  so a prompt's tail is evicted before its head: a lookup matches leading blocks only, and a
  head without its tail still serves every prompt sharing it. Only idle blocks are evicted:
  one a request holds or a transfer pins (refcount > 0) never is.
- A claimed block is shared: every request holding it has a reference, and none writes to
  it (reads, swap-ins and prefills start after the claimed prefix).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import OutOfBlocksError
from ._keys import full_blocks
from ._pool import BlockPool, PoolStats

__all__ = ["PrefixCachingPool", "PrefixCacheStats"]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The cache's accounting: blocks published (``idle`` of them free), hits and evictions."""

    cached: int
    idle: int
    hit_blocks: int
    evictions: int


class PrefixCachingPool(BlockPool):
    """A :class:`~kvstate._pool.BlockPool` whose freed blocks keep their content keys (see the
    module's rules); ``num_free`` counts idle blocks, which allocation may evict."""

    __slots__ = ("_block_of", "_key_of", "_idle", "_hits", "_evictions")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._block_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle published blocks, longest idle first
        self._hits = 0
        self._evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._idle)

    def can_allocate(self, n: int, headroom: int = 0) -> bool:
        self._check_count(n, "n")
        self._check_count(headroom, "headroom")
        return self.num_free - n >= headroom

    def free_ids(self) -> list[int]:
        """The free block ids, idle ones included, in the order they will be handed out last
        to first (a copy)."""
        return [*reversed(self._idle), *self._free]

    def stats(self) -> PoolStats:
        base = super().stats()
        free = self.num_free
        return PoolStats(base.total, free, base.total - free, base.shared, base.peak_used,
                          base.allocations, base.frees, len(self._key_of))

    def prefix_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(len(self._key_of), len(self._idle), self._hits, self._evictions)

    def cached_blocks(self) -> dict[str, int]:
        """Key -> its published block (a copy: for checks and reports)."""
        return dict(self._block_of)

    def cached_prefix(self, keys: Sequence[str]) -> tuple[int, int]:
        """How many leading ``keys`` have a published block, and how many of those blocks are
        idle (claiming them takes them out of the free count)."""
        block_of, refs = self._block_of, self._refs
        n = idle = 0
        for k in keys:
            b = block_of.get(k)
            if b is None:
                break
            n += 1
            if not refs[b]:
                idle += 1
        return n, idle

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, n: int, headroom: int = 0) -> list[int]:
        """As :meth:`BlockPool.allocate`, evicting idle blocks once no keyless block is free."""
        if n.__class__ is not int or headroom.__class__ is not int or n < 0 or headroom < 0:
            self._check_count(n, "n")
            self._check_count(headroom, "headroom")
        if self.num_free - n < headroom:
            raise OutOfBlocksError(f"cannot allocate {n} block(s) keeping {headroom} free: {self.num_free} of "
                                   f"{self.num_blocks} are free")
        if n > len(self._free):
            self._evict(n - len(self._free))
        peak = self._peak
        ids = super().allocate(n)
        self._peak = max(peak, self.num_used)
        return ids

    def claim(self, keys: Sequence[str]) -> list[int]:
        """A reference to each key's published block (every key must have one: see
        :meth:`cached_prefix`), in order; an idle block leaves the free count."""
        block_of, refs, idle = self._block_of, self._refs, self._idle
        blocks = [block_of[k] for k in keys]
        for b in blocks:
            if not refs[b]:
                del idle[b]
            refs[b] += 1
        self._hits += len(blocks)
        self._peak = max(self._peak, self.num_used)
        return blocks

    def allocate_after(self, keys: Sequence[str], n: int, headroom: int = 0) -> tuple[list[int], int] | None:
        """``n`` blocks whose leading ones are claimed where ``keys`` hit, and the number of
        hits; None, changing nothing, unless ``headroom`` blocks would stay free."""
        hits, idle = self.cached_prefix(keys)
        if self.num_free - idle - (n - hits) < headroom:  # claiming an idle hit takes it from the free
            return None
        blocks = self.claim(keys[:hits])
        blocks += self.allocate(n - hits, headroom)
        return blocks, hits

    def publish(self, keys: Sequence[str], blocks: Sequence[int]) -> None:
        """Record that held ``blocks`` hold ``keys``' bytes, the full ones only (unchecked,
        like ``retain``: the owner's own blocks); a key or block already published keeps its
        entry."""
        block_of, key_of = self._block_of, self._key_of
        for k, b in zip(keys[:full_blocks(keys)], blocks):
            if k not in block_of and b not in key_of:
                block_of[k] = b
                key_of[b] = k

    def release(self, block_ids: Sequence[int]) -> int:
        """As :meth:`BlockPool.release`; a published block reaching 0 turns idle, keeping its key."""
        refs, free, idle, key_of = self._refs, self._free, self._idle, self._key_of
        freed = 0
        for b in reversed(block_ids):  # a prompt's last blocks turn idle first, so go first
            r = refs[b] - 1
            refs[b] = r
            if not r:
                freed += 1
                if b in key_of:
                    idle[b] = None
                else:
                    free.append(b)
        self._frees += freed
        return freed

    def _evict(self, n: int) -> None:
        idle, free, key_of, block_of = self._idle, self._free, self._key_of, self._block_of
        for _ in range(n):
            b = idle.popitem(last=False)[0]
            del block_of[key_of.pop(b)]
            free.append(b)
        self._evictions += n
