"""The numpy reference backend: real KV bytes on the CPU, moved through the transfer ops.

Each TP rank owns layer-major caches per kind (``key``, ``value``, fp8 scales), one array
per layer ``[num_blocks, heads, block_size, dim]``. A write gathers the blocks into a
block-major host buffer with :func:`~kvstate.kernels.swap_cache_layout` (``"d2h"``) and
puts one object per (block, kind, rank); a read gets the objects into the host buffer and
scatters the blocks that arrived whole (``"h2d"``). The backend knows nothing of request
states: it answers how many *leading* blocks it stored, read or found.

A ``guard`` (given by the drivers from the command's fence) is asked just before blocks are
gathered or scattered: once it says no, the transfer raises
:class:`~kvstate.errors.FenceError` and touches no block, since the lifecycle may already
have recycled them. Only the slow store operation runs between the check and the end of
the command; the check-to-copy window is a local copy, which ``Policy.fence_grace`` covers.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import FenceError, ValidationError
from ..kernels.reference import swap_cache_layout
from ..keys import rank_key
from ..spec import CacheSpec
from .stores import Store, as_bytes_view

__all__ = ["TransferBackend", "StoreBackend", "ReferenceBackend", "leading", "Guard", "check_fence"]

#: asked just before a transfer touches blocks: True while the command's fence has not passed
Guard = Callable[[], bool]


def leading(flags: Sequence[bool]) -> int:
    """How many leading entries are true."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def check_fence(guard: Guard | None, rank: int, what: str, block_ids: Sequence[int]) -> None:
    """Raise :class:`FenceError` when ``guard`` says the blocks may no longer be touched."""
    if guard is not None and not guard():
        raise FenceError(f"rank {rank}: the command's fence passed before it could {what} "
                         f"blocks {list(block_ids)}: none touched")


_NO_IDS: Any = object()  # the op takes keys only


class TransferBackend:
    """What a driver needs from a backend: per-rank query (how many leading keys are stored;
    :func:`~kvstate.backends.drivers.execute` asks it before a write, to skip them), write and
    read of blocks.

    ``write`` and ``read`` ask ``guard`` (when given) right before they gather or scatter
    blocks, and raise :class:`FenceError` without touching any once it returns False.
    """

    spec: CacheSpec

    def query(self, rank: int, keys: Sequence[str]) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
              guard: Guard | None = None) -> int:  # pragma: no cover
        raise NotImplementedError

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None = None) -> int:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release buffers and devices (idempotent)."""


class StoreBackend(TransferBackend):
    """What backends keeping one object per (block, kind, rank) in a Store share: argument
    checks, object names, the existence query and counting whole blocks."""

    def _setup(self, spec: CacheSpec, num_blocks: int, store: Store) -> None:
        name = type(self).__name__
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"{name}: spec must be a CacheSpec")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValidationError(f"{name}: num_blocks must be an int > 0, got {num_blocks!r}")
        if not isinstance(store, Store):
            raise ValidationError(f"{name}: store must be a kvstate Store")
        self.spec, self.num_blocks, self.store = spec, num_blocks, store
        self.bytes_moved = 0  #: payload bytes written to and read from the store

    def _check(self, rank: int, keys: Sequence[str], block_ids: Any = _NO_IDS) -> None:
        """Rank in range; keys a sequence of non-empty str; block ids (unless the op takes
        none) one per key, ints in range and distinct. Raises before anything is touched."""
        name = type(self).__name__
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.spec.tp_size:
            raise ValidationError(f"{name}: rank {rank!r} outside 0..{self.spec.tp_size - 1}")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) \
                or not all(isinstance(k, str) and k for k in keys):
            raise ValidationError(f"{name}: keys must be a sequence of non-empty str, got {keys!r}")
        if block_ids is _NO_IDS:
            return
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise ValidationError(f"{name}: block ids must be a sequence of ints, got {block_ids!r}")
        if len(block_ids) != len(keys):
            raise ValidationError(f"{name}: {len(keys)} keys but {len(block_ids)} block ids")
        for b in block_ids:
            self._check_block(b)
        if len(set(block_ids)) != len(block_ids):
            raise ValidationError(f"{name}: block ids {list(block_ids)} name a block twice")

    def _check_block(self, b: Any) -> None:
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
            raise ValidationError(f"{type(self).__name__}: block {b!r} outside 0..{self.num_blocks - 1}")

    def _check_fill(self, rank: int, kind: str, block_id: int, data: Any) -> None:
        """Checks of ``fill_block``: rank, kind, block id, and data of exactly one block."""
        self._check(rank, ())
        if kind not in self.spec.kinds:
            raise ValidationError(f"{type(self).__name__}.fill_block: kind {kind!r} is not one of {self.spec.kinds}")
        self._check_block(block_id)
        need = self.spec.block_bytes(kind)
        if not isinstance(data, (bytes, bytearray, memoryview)) or memoryview(data).nbytes != need:
            got = memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else type(data).__name__
            raise ValidationError(f"{type(self).__name__}.fill_block: block {block_id} needs {need} bytes, got {got}")

    def _names(self, rank: int, keys: Sequence[str]) -> list[str]:
        return [rank_key(key, kind, rank) for key in keys for kind in self.spec.kinds]

    def _whole(self, ok: Sequence[bool], n: int) -> int:
        """Leading blocks of ``n`` whose every kind's object is ``ok`` (one flag per object)."""
        nk = len(self.spec.kinds)
        return leading(all(ok[i * nk:(i + 1) * nk]) for i in range(n))

    def query(self, rank: int, keys: Sequence[str]) -> int:
        self._check(rank, keys)
        found = self.store.batch_is_exist(self._names(rank, keys))
        return self._whole([f == 1 for f in found], len(keys))


class ReferenceBackend(StoreBackend):
    """Per-rank numpy caches over a :class:`~kvstate.backends.stores.Store`."""

    def __init__(self, spec: CacheSpec, num_blocks: int, store: Store) -> None:
        self._setup(spec, num_blocks, store)
        #: caches[rank][kind] -> list of per-layer arrays [num_blocks, heads, block_size, dim]
        self.caches = [
            {kind: [np.zeros((num_blocks,) + spec.block_shape(kind), spec.kind_dtype(kind))
                    for _ in range(spec.layers)] for kind in spec.kinds}
            for _ in range(spec.tp_size)]

    # -- block access (tests, the demo's fake compute) -----------------------------------------
    def block_bytes(self, rank: int, kind: str, block_id: int) -> bytes:
        """One block of ``kind`` on ``rank``, all layers, in the stored (block-major) layout."""
        self._check(rank, ())
        self._check_block(block_id)
        return b"".join(layer[block_id].tobytes() for layer in self.caches[rank][kind])

    def fill_block(self, rank: int, kind: str, block_id: int, data: bytes) -> None:
        """Overwrite one block of ``kind`` on ``rank`` (block-major bytes, as stored)."""
        self._check_fill(rank, kind, block_id, data)
        layers = self.caches[rank][kind]
        chunk = layers[0][block_id].nbytes
        for i, layer in enumerate(layers):
            layer[block_id] = np.frombuffer(data, layer.dtype, offset=i * chunk,
                                            count=layer[block_id].size).reshape(layer.shape[1:])

    # -- TransferBackend -----------------------------------------------------------------------
    def _host(self, n: int) -> dict[str, np.ndarray]:
        s = self.spec
        return {k: np.empty((n, s.layers) + s.block_shape(k), s.kind_dtype(k)) for k in s.kinds}

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
              guard: Guard | None = None) -> int:
        self._check(rank, keys, block_ids)
        n = len(keys)
        host = self._host(n)
        check_fence(guard, rank, "gather", block_ids)
        slots = list(range(n))
        for kind, buf in host.items():
            swap_cache_layout(self.caches[rank][kind], buf, list(block_ids), slots, "d2h")
        bufs = [as_bytes_view(host[kind][i]) for i in range(n) for kind in self.spec.kinds]
        status = self.store.batch_put_from(self._names(rank, keys), bufs)
        count = self._whole([st == 0 for st in status], n)
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None = None) -> int:
        self._check(rank, keys, block_ids)
        n = len(keys)
        host = self._host(n)
        kinds = self.spec.kinds
        bufs = [as_bytes_view(host[kind][i]) for i in range(n) for kind in kinds]
        got = self.store.batch_get_into(self._names(rank, keys), bufs)
        # a short read is a miss: a block counts only if every kind arrived whole
        count = self._whole([g == b.nbytes for g, b in zip(got, bufs)], n)
        if count:
            check_fence(guard, rank, "scatter into", block_ids[:count])
            for kind, buf in host.items():
                swap_cache_layout(self.caches[rank][kind], buf, list(block_ids[:count]),
                                  list(range(count)), "h2d")
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count
