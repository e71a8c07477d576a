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

from collections import OrderedDict
from collections.abc import Sequence

from .scenario import StorageSpec

__all__ = ["SimStore"]


class SimStore:
    """LRU block pool of ``capacity`` bytes shared by every instance of the cluster."""

    def __init__(self, spec: StorageSpec, shard_bytes: int, tp: int) -> None:
        self.capacity = int(spec.capacity_gib * 2**30)
        self.shard_bytes = shard_bytes
        self.bandwidth = spec.bandwidth_gbps * 1e9
        self.latency = spec.latency_ms / 1000.0
        self.query_latency = spec.query_latency_ms / 1000.0
        self._all = (1 << tp) - 1
        self._blocks: OrderedDict[str, int] = OrderedDict()  # key -> bitmask of ranks stored
        self.used = 0
        self.peak = 0
        self.busy_until = 0.0
        self.stats = dict.fromkeys(("puts", "gets", "queries", "bytes_written", "bytes_read",
                                    "evicted_blocks", "hits", "misses"), 0)

    # -- time --------------------------------------------------------------------------------
    def occupy(self, now: float, nbytes: int) -> tuple[float, float]:
        """Reserve the pool's bandwidth for ``nbytes``: (start, end) of the transfer."""
        start = now if now > self.busy_until else self.busy_until
        self.busy_until = end = start + nbytes / self.bandwidth
        return start, end + self.latency

    # -- contents (the TransferBackend questions) --------------------------------------------
    def leading(self, rank: int, keys: Sequence[str]) -> int:
        """How many leading ``keys`` hold ``rank``'s shard (a look that counts no query)."""
        bit, blocks, n = 1 << rank, self._blocks, 0
        for k in keys:
            m = blocks.get(k)
            if m is None or not m & bit:
                break
            n += 1
        return n

    def query(self, rank: int, keys: Sequence[str]) -> int:
        self.stats["queries"] += 1
        return self.leading(rank, keys)

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int] = (), guard: object = None) -> int:
        n = self.leading(rank, keys)
        self.stats["gets"] += 1
        self.stats["bytes_read"] += n * self.shard_bytes
        self.stats["hits"] += n
        self.stats["misses"] += len(keys) - n
        blocks = self._blocks
        for k in keys[:n]:
            blocks.move_to_end(k)
        return n

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int] = (), guard: object = None) -> int:
        bit, blocks, shard = 1 << rank, self._blocks, self.shard_bytes
        self.stats["puts"] += 1
        self.stats["bytes_written"] += len(keys) * shard
        for k in keys:
            m = blocks.get(k)
            if m is None:
                blocks[k] = bit
                self.used += shard
            else:
                if not m & bit:
                    self.used += shard
                blocks[k] = m | bit
                blocks.move_to_end(k)
        if self.used > self.capacity:
            self._evict()
        if self.used > self.peak:
            self.peak = self.used
        return len(keys)

    def _evict(self) -> None:
        blocks, shard = self._blocks, self.shard_bytes
        while self.used > self.capacity and blocks:
            _, m = blocks.popitem(last=False)
            self.used -= shard * bin(m).count("1")
            self.stats["evicted_blocks"] += 1

    def __len__(self) -> int:
        return len(self._blocks)
