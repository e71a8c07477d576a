"""Reading and writing one logical block's bytes directly: what tests, the demo's stand-in
compute and :mod:`kvstate.testing` do with a backend (never the transfers' path).

A logical block is a block id, or with group tables (:mod:`kvstate.tables`) a tuple of its
blocks, one per block table (:func:`kvstate.tables.rows`): layer ``l`` lives in the block of
its group's table. Its bytes are block-major, every layer in order, as a stored object holds
them; a layer whose block is ``FREED`` (behind the window) reads as zeros and is never written.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..pool import FREED
from ..spec import CacheSpec
from ..tables import per_block, table_of_layer

__all__ = ["BlockAccess"]


class BlockAccess(ABC):
    """``block_bytes`` and ``fill_block`` over the host class's per-layer caches
    (``_layer_views``: numpy or CuPy arrays ``[num_blocks, heads, block_size, dim]``)."""

    spec: CacheSpec
    # the host class's checks (annotations only: nothing here shadows them)
    _check_keys: Callable[[int, Sequence[str]], None]
    _check_block: Callable[[Any], None]
    _check_fill: Callable[[int, str, int, Any], None]

    @abstractmethod
    def _layer_views(self, rank: int, kind: str) -> Sequence[Any]:
        """The rank's caches of ``kind``, one array a layer (the backend's)."""

    def _chunk_bytes(self, chunk: Any) -> bytes:
        """One (layer, block) chunk's bytes (a device array is copied to the host first)."""
        return bytes((chunk.get() if hasattr(chunk, "get") else chunk).tobytes())

    def _set_chunk(self, layer: Any, block: int, data: np.ndarray) -> None:
        layer[block] = data

    def block_bytes(self, rank: int, kind: str, block_id: Any) -> bytes:
        """One logical block of ``kind`` on ``rank``, all layers, in the stored layout."""
        self._check_keys(rank, ())
        self.spec.block_shape(kind)  # a kind of this cache
        layers = self._layer_views(rank, kind)
        return b"".join(bytes(layer[0].nbytes) if b == FREED else self._chunk_bytes(layer[b])
                        for layer, b in zip(layers, self._layer_rows(block_id), strict=True))

    def fill_block(self, rank: int, kind: str, block_id: Any, data: bytes) -> None:
        """Overwrite one logical block of ``kind`` on ``rank`` (block-major bytes, as stored)."""
        rows = self._layer_rows(block_id)
        self._check_fill(rank, kind, next((b for b in rows if b != FREED), 0), data)
        layers = self._layer_views(rank, kind)
        chunk = layers[0][0].nbytes
        for i, (layer, b) in enumerate(zip(layers, rows, strict=True)):
            if b != FREED:
                part = np.frombuffer(data, layer.dtype, offset=i * chunk, count=layer[b].size)
                self._set_chunk(layer, b, part.reshape(layer.shape[1:]))

    def _layer_rows(self, block: Any) -> list[int]:
        """The block holding each layer of logical block ``block`` (checked)."""
        if not isinstance(block, tuple):
            self._check_block(block)
            return [block] * self.spec.layers
        want = per_block(self.spec)
        if len(block) != want:
            raise ValidationError(f"{type(self).__name__}: logical block {block!r} must name {want} blocks, "
                                  "one per block table")
        for b in block:
            if b != FREED:
                self._check_block(b)
        return [block[t] for t in table_of_layer(self.spec)]
