"""The simulated storage pool: which blocks it holds (LRU within a capacity) and its bandwidth.

It answers the transfer commands' questions like a real backend (``query``, ``write``,
``read`` per rank, counting leading keys), so the lifecycle sees evictions exactly as it
would in production: a block evicted between P's write and D's read makes the read
partial, and the configured read-failure policy runs. No bytes are held: a block is a
key with the set of ranks whose shard is stored.

Bandwidth is one FIFO server for the whole pool: an operation of ``b`` bytes starting at
``t`` occupies it from ``max(t, busy_until)`` for ``b / bandwidth`` (a fluid model of an
aggregate-bandwidth pool), plus a fixed per-operation latency.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat, takewhile

from ._scenario import StorageSpec

__all__ = ["SimStore"]


class SimStore:
    """LRU block pool of ``capacity`` bytes shared by every instance of the cluster."""

    def __init__(self, spec: StorageSpec, shard_bytes: int, tp: int) -> None:
        self.capacity = int(spec.capacity_gib * 2**30)
        self.shard_bytes = shard_bytes
        self.bandwidth = spec.bandwidth_gbps * 1e9
        self.latency = spec.latency_ms / 1000.0
        self.query_latency = spec.query_latency_ms / 1000.0
        self._blocks: OrderedDict[str, None] = OrderedDict()  # every key some rank stored, in LRU order
        self._ranks: list[set[str]] = [set() for _ in range(tp)]  # the keys each rank's shard is stored under
        self.used = 0
        self.peak = 0
        self._lru_moves = 0  # LRU reorderings so far (reads, writes)
        self._last_read: tuple[Sequence[str], int, int] | None = None  # keys, count, reordering after it
        self._last_write: tuple[Sequence[str], int] | None = None  # keys, reordering after it
        self._states: dict[str, int] = {}  # key -> bitmask of the TP ranks whose state after it is stored
        self.busy_until = 0.0
        #: blocks evicted so far: while it is unchanged, no stored key went away (read on every
        #: rank's part of a transfer: an attribute, not a property)
        self.evictions = 0
        self.stats = dict.fromkeys(("puts", "gets", "queries", "bytes_written", "bytes_read",
                                    "evicted_blocks", "hits", "misses"), 0)

    # -- time --------------------------------------------------------------------------------
    def occupy(self, now: float, nbytes: int) -> tuple[float, float]:
        """Reserve the pool's bandwidth for ``nbytes``: (start, end) of the transfer."""
        start = now if now > self.busy_until else self.busy_until
        self.busy_until = end = start + nbytes / self.bandwidth
        return start, end + self.latency

    # -- contents (the TransferBackend questions) --------------------------------------------
    def leading(self, rank: int, keys: Sequence[str], known: int = 0) -> int:
        """How many leading ``keys`` hold ``rank``'s shard (a look that counts no query).
        ``known``: so many leading keys were seen stored with no eviction since."""
        stored = self._ranks[rank]
        if known >= len(keys) or keys[known] not in stored:  # nothing more: a write's new keys, a miss
            return known if known < len(keys) else len(keys)
        rest = keys[known:] if known else keys
        if stored.issuperset(rest):  # every key: a read of a stored cache, found in C
            return known + len(rest)
        return known + len(list(takewhile(stored.__contains__, rest)))

    def query(self, rank: int, keys: Sequence[str], known: int = 0) -> int:
        self.stats["queries"] += 1
        return self.leading(rank, keys, known)

    def answer(self, rank: int, keys: Sequence[str], write: bool, known: int = 0, skipped: int = 0) -> int:
        """What :func:`~kvstate.backends._drivers.execute` answers for one rank's write (query,
        then write the rest) or read of ``keys`` here, ``known`` as in :meth:`leading`;
        ``skipped`` bytes of the read were left in the pool (window groups before its window)."""
        if write:
            n = self.query(rank, keys, known)
            return n + self.write(rank, keys[n:]) if n < len(keys) else n
        return self.read(rank, keys, known=known, skipped=skipped)

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int] = (), guard: object = None,
             known: int = 0, skipped: int = 0) -> int:
        n = self.leading(rank, keys, known)
        stats = self.stats
        stats["gets"] += 1
        stats["bytes_read"] += n * self.shard_bytes - (skipped if n == len(keys) else 0)
        stats["hits"] += n
        stats["misses"] += len(keys) - n
        if self._last_read != (keys, n, self._lru_moves):  # else: another rank's read of the same
            # keys just put them at the end, in order; each found key goes to the LRU end (the
            # deque of length 0 runs the map in C and keeps nothing)
            deque(map(self._blocks.move_to_end, keys[:n]), 0)
            self._lru_moves += 1
            self._last_read = (keys, n, self._lru_moves)
        return n

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int] = (), guard: object = None) -> int:
        stored, blocks = self._ranks[rank], self._blocks
        self.stats["puts"] += 1
        self.stats["bytes_written"] += len(keys) * self.shard_bytes
        before = len(stored)
        stored.update(keys)
        self.used += (len(stored) - before) * self.shard_bytes
        if self._last_write != (keys, self._lru_moves):  # else another rank's write of these very keys
            had = len(blocks)                            # just put them all at the end, in order
            blocks.update(zip(keys, repeat(None)))  # new keys are appended in write order
            if len(blocks) - had != len(keys):  # some were in the pool already: each to the LRU end, in order
                deque(map(blocks.move_to_end, keys), 0)
        self._lru_moves += 1
        self._last_write = (keys, self._lru_moves)
        if self.used > self.capacity:
            self._evict()
        self.peak = max(self.peak, self.used)
        return len(keys)

    def states_moved(self, rank: int, keys: Sequence[str], states: Sequence[tuple[int, int]], n: int,
                     write: bool) -> int:
        """A rank's answer to a transfer with states (:mod:`kvstate._statepages`) whose blocks
        moved ``n`` leading: a write stores each state whose blocks were stored, a read loads
        the last candidate stored; either answers the end of the last state moved (0: none).
        A state is stored with the key of the last block it follows, and goes when it does."""
        moved = [e for e, _ in states if e <= n]
        if write:
            for e in moved:
                self._states[keys[e - 1]] = self._states.get(keys[e - 1], 0) | 1 << rank
            return moved[-1] if moved else 0
        return next((e for e in reversed(moved) if self._states.get(keys[e - 1], 0) >> rank & 1), 0)

    def _evict(self) -> None:
        """Drop least recently used keys until the pool fits. A key frees one shard per rank
        holding it, at most one per rank: so while ``excess`` bytes remain, at least the next
        ``ceil(excess / (shard * ranks))`` keys go, and they go as one batch, each rank's set
        shrinking in C. The keys dropped are the ones a key-by-key loop would drop."""
        blocks, shard, ranks = self._blocks, self.shard_bytes, self._ranks
        most = shard * len(ranks)  # the bytes one key frees at most
        excess, n = self.used - self.capacity, 0
        pop = blocks.popitem
        while excess > 0 and blocks:
            batch = [pop(False)[0] for _ in range(min(len(blocks), -(-excess // most)))]
            for stored in ranks:
                before = len(stored)
                stored.difference_update(batch)
                excess -= (before - len(stored)) * shard
            if self._states:
                for k in batch:
                    self._states.pop(k, None)
            n += len(batch)
        self._lru_moves += 1  # keys went from the pool: no earlier read or write is its tail now
        self.used = self.capacity + excess
        self.stats["evicted_blocks"] += n
        self.evictions += n

    def contents(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every stored key with the ranks whose shard it holds, least recently used first
        (a copy: for checks and reports)."""
        return [(k, tuple(r for r, stored in enumerate(self._ranks) if k in stored)) for k in self._blocks]

    def __len__(self) -> int:
        return len(self._blocks)

