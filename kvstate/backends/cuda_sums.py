"""The CUDA backend's checksums, taken on the GPU (:mod:`kvstate.kernels.cuda_checksum`).

A write asks for its blocks' SUM64 once their layers are gathered (so they are computed), and
puts them in the manifests; a read scatters the blocks that arrived whole and asks for the SUM64
of what landed, comparing them with the manifests before the blocks count. Layers whose rows are
not whole 64-bit words fall back to host checksums (XXH3), as does a trusted store (none).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
        if not self.verify or not ids:
            return None
        gs, rows = self._groups_of(groups), self._part_ids(ids, g)
        sums = {}
        for kind in self.spec.kinds:
            for lg in gs:
                layers = self._parts[rank][kind] if lg is None else self._groups[rank][kind][lg]
                if not summable(layers.views):
                    return None
                sums[(kind, lg)] = block_sums(self.cp, layers.views, rows, self._sum_cache)
        return [[int(sums[(kind, lg)][i]) for kind in self.spec.kinds for lg in gs] for i in range(len(ids))]

    @staticmethod
    def _flat(sums: list[list[int]] | None, a: int, b: int) -> list[int] | None:
        """The checksums of blocks ``a..b`` as one list in object order (what a put takes)."""
        return None if sums is None else [s for block in sums[a:b] for s in block]
