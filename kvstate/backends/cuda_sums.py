"""The CUDA backend's checksums, taken on the GPU (:mod:`kvstate.kernels.cuda_checksum`).

A write launches its blocks' SUM64 once their layers are gathered (so they are computed) and
fetches them once its last piece is stored, so the GPU sums while the host copies; their
manifests then go in one batch. A read gets every manifest in one batch first, scatters the
blocks that arrived whole and asks for the SUM64 of what landed, comparing them with the
manifests before the blocks count. Layers whose rows are
not whole 64-bit words fall back to host checksums (XXH3), as does a trusted store (none).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..kernels.cuda_checksum import block_sums, summable

__all__ = ["DeviceSums"]


class DeviceSums:
    """Mixed into :class:`~kvstate.backends.cuda.CudaBackend`: SUM64 of blocks on the GPU."""

    cp: Any
    spec: Any
    verify: bool
    _parts: dict[int, dict[str, Any]]
    _groups: dict[int, dict[str, list[Any]]]
    _sum_cache: dict[Any, Any]
    _groups_of: Callable[[Sequence[int] | None], list[int | None]]  # the backend's (Manifested's)
    _part_ids: Callable[[Sequence[int], int], list[int]]  # the backend's (StoreBackend's)

    def _device_sums(self, rank: int, g: int, ids: Sequence[int],
                     groups: Sequence[int] | None) -> list[list[int]] | None:
        """Per block of ``ids``, its ``g``-th head group's objects' SUM64 in object order (kind,
        then layer group), taken from the GPU caches; None when the store is trusted or the rows
        are not whole words."""
        pending = self._launch_sums(rank, g, ids, groups)
        return None if pending is None else pending()

    def _launch_sums(self, rank: int, g: int, ids: Sequence[int],
                     groups: Sequence[int] | None) -> Callable[[], list[list[int]]] | None:
        """As :meth:`_device_sums`, without waiting for them: the kernels are launched and the
        answer is what the returned function gives (a write fetches them once its objects are
        stored, so the GPU sums while the host copies)."""
        if not self.verify or not ids:
            return None
        gs = self._groups_of(groups)
        objects = [self._parts[rank][kind] if lg is None else self._groups[rank][kind][lg]
                   for kind in self.spec.kinds for lg in gs]  # object order within a block
        if not all(self._summable(layers.views) for layers in objects):
            return None
        cp = self.cp
        rows = cp.asarray(np.asarray(self._part_ids(ids, g), np.int64))
        out = cp.zeros((len(objects), len(ids)), dtype=cp.uint64)
        for j, layers in enumerate(objects):
            block_sums(cp, layers.views, rows, self._sum_cache, fetch=False, out=out[j])
        return lambda: cp.asnumpy(out).T.tolist()  # one copy back; per block, its objects' sums

    def _summable(self, views: Sequence[Any]) -> bool:
        """:func:`summable`, asked once per list of layers (they are fixed)."""
        key = ("summable", id(views))
        if key not in self._sum_cache:
            self._sum_cache[key] = (summable(views), views)
        return bool(self._sum_cache[key][0])

    @staticmethod
    def _flat(sums: list[list[int]] | None, a: int, b: int) -> list[int] | None:
        """The checksums of blocks ``a..b`` as one list in object order (what a put takes)."""
        return None if sums is None else [s for block in sums[a:b] for s in block]
