"""The CUDA backend's checksums, taken on the GPU (:mod:`kvstate.kernels._cuda_checksum`).

A write launches its blocks' SUM64 once their layers are gathered (so they are computed) and
fetches them once its last piece is stored, so the GPU sums while the host copies; their
manifests then go in one batch. A read gets every manifest in one batch first, scatters the
blocks that arrived whole and asks for the SUM64 of what landed, comparing them with the
manifests before the blocks count. A zero-copy transfer (an arena store's slots) launches a
write's sums once its gathers are queued and a read's sums right behind each piece's scatter,
on the device. Sums always land in pinned host memory by a kernel's stores: a copy would queue
behind the DMAs a write has in flight. Layers whose rows are not whole 64-bit words fall back
to host checksums (XXH3), as does a trusted store (none).

The host tier's slot checks are taken on the GPU too: a swap-out notes the SUM64 of the blocks
it copied, a swap-in copies the slots in and compares the SUM64 of what landed, the count
stopping at the first block that differs (its bytes, and those after it, do not count: the
lifecycle reads or recomputes them). A write-back from host memory checks its slots on the host
against the same sums before it stores them. A trusted store does not turn these off: the host
tier's memory is this process's own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..kernels._cuda_checksum import block_sums, summable, to_host
from ..kernels._cuda_launch import event_ptr, transfer_stream
from ._base import Guard
from ._integrity import sum64

__all__ = ["DeviceSums"]


class DeviceSums:
    """Mixed into :class:`~kvstate.backends._cuda.CudaBackend`: SUM64 of blocks on the GPU."""

    cp: Any
    spec: Any
    verify: bool
    _parts: dict[int, dict[str, Any]]
    _groups: dict[int, dict[str, list[Any]]]
    _sum_cache: dict[Any, Any]
    objects: Any  # the backend's BlockObjects (its groups_of)
    _part_ids: Callable[[Sequence[int], int], list[int]]  # the backend's (StoreBackend's)
    _slot_sums: dict[tuple[int, int], list[int]]
    _matching_slots: Callable[[int, Sequence[int], dict[int, list[int]]], int]  # the backend's (StoreBackend's)
    _on: Callable[[int], Any]  # the backend's: its rank's lock, its device current
    _swappers: dict[int, Any]  # the backend's: a CudaSwapper a rank (its timeout)
    _swap: Callable[..., int]
    _arena: Callable[[int, str], Any]
    _check_swap: Callable[[int, Sequence[int], Sequence[int]], None]

    def _device_sums(self, rank: int, g: int, ids: Sequence[int],
                     groups: Sequence[int] | None) -> list[list[int]] | None:
        """Per block of ``ids``, its ``g``-th head group's objects' SUM64 in object order (kind,
        then layer group), taken from the GPU caches; None when the store is trusted or the rows
        are not whole words."""
        pending = self._launch_sums(rank, g, ids, groups)
        return None if pending is None else pending()

    def _launch_sums(self, rank: int, g: int, ids: Sequence[int], groups: Sequence[int] | None,
                     always: bool = False, after: Any = None) -> Callable[[], list[list[int]]] | None:
        """As :meth:`_device_sums`, without waiting for them: the kernels are launched and the
        answer is what the returned function gives (a write fetches them once its gather is
        under way, so the GPU sums while the host copies). ``always``: even for a trusted
        store. ``after``: a device event the sums wait for (a scatter's: the host goes on).
        The sums land in pinned host memory by a kernel's stores, never behind a copy engine's
        queue (:func:`~kvstate.kernels._cuda_checksum.to_host`)."""
        if not (self.verify or always) or not ids:
            return None
        objects = self._object_layers(rank, groups)
        if not all(self._summable(layers.views) for layers in objects):
            return None
        cp, stream = self.cp, self._side_stream(rank)
        with stream:
            if after is not None:  # a CuPy or a PyTorch event
                cp.cuda.runtime.streamWaitEvent(stream.ptr, event_ptr(after), 0)
            rows = cp.asarray(np.asarray(self._part_ids(ids, g), np.int64))
            out = cp.zeros((len(objects), len(ids)), dtype=cp.uint64)
            for j, layers in enumerate(objects):
                block_sums(cp, layers.views, rows, self._sum_cache, fetch=False, out=out[j])
            host = to_host(cp, out, self._sum_cache)
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(stream)
        self._keep_until(rank, done, host)

        def fetch() -> list[list[int]]:  # per block, its objects' sums
            self._swappers[rank].wait(done)
            return host.T.tolist()
        return fetch

    def _keep_until(self, rank: int, event: Any, host: Any) -> None:
        """Hold ``host`` (pinned memory a kernel writes) until ``event`` passed, whatever the
        caller does with it: returned to CuPy's pool earlier, it could be handed out again
        while the kernel still writes it. Entries whose events passed are let go here."""
        held = self._sum_cache.setdefault(("held", rank), [])
        held[:] = [(ev, h) for ev, h in held if not ev.done]
        held.append((event, host))

    def _side_stream(self, rank: int) -> Any:
        """The rank's stream for checksums and state pages, its own, non-blocking and at the
        device's highest priority (``transfer_stream``). Every
        caller has waited on the host for the transfer whose blocks it sums, or hands its event
        over (``after``), so the sums need no other order with the transfer streams; on CUDA's
        legacy default stream they would queue behind
        whatever an engine computes there, and behind every other rank's work. Kept in the sum
        cache, which the backend drops when it closes."""
        key = ("stream", rank)
        if key not in self._sum_cache:
            self._sum_cache[key] = transfer_stream(self.cp)  # on the rank's device: callers hold it current
        return self._sum_cache[key]

    def _side_wait(self, rank: int) -> None:
        """Wait, within the rank's swapper's timeout, for the work queued on its side stream."""
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self._side_stream(rank))
        self._swappers[rank].wait(ev)

    def _object_layers(self, rank: int, groups: Sequence[int] | None) -> list[Any]:
        """The layer lists of a block's objects on ``rank``, in object order (kind, then layer group)."""
        return [self._parts[rank][kind] if lg is None else self._groups[rank][kind][lg]
                for kind in self.spec.kinds for lg in self.objects.groups_of(groups)]

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

    # -- the host tier's slot checks ---------------------------------------------------------
    def _slots_on_gpu(self, rank: int) -> bool:
        """Whether the rank's slot checks are SUM64 taken on the GPU (rows of whole words)."""
        return all(self._summable(layers.views) for layers in self._object_layers(rank, None))

    def _gpu_block_sums(self, rank: int, ids: Sequence[int]) -> list[list[int]]:
        """Per block of ``ids``, the SUM64 of its objects, head group by head group."""
        with self._on(rank):
            pending = [self._launch_sums(rank, g, ids, None, always=True) for g in range(self.spec.head_groups)]
            got = [p() for p in pending if p is not None]
        return [[s for sums in got for s in sums[i]] for i in range(len(ids))]

    def swap_out(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int],
                 guard: Guard | None = None) -> int:
        """Copy the blocks into the slots, noting each slot's SUM64 taken from its block on the GPU."""
        if not self._slots_on_gpu(rank):
            return super().swap_out(rank, block_ids, host_slots, guard)  # type: ignore[misc]
        n = self._swap(rank, block_ids, host_slots, "d2h", guard)
        for slot, sums in zip(host_slots[:n], self._gpu_block_sums(rank, block_ids[:n]) if n else []):
            self._slot_sums[(rank, slot)] = sums
        return n

    def swap_in(self, rank: int, host_slots: Sequence[int], block_ids: Sequence[int],
                guard: Guard | None = None) -> int:
        """Copy the leading slots with noted sums into the blocks, then count those whose SUM64 on
        the GPU is their slot's: a broken slot ends the count, and is forgotten."""
        if not self._slots_on_gpu(rank):
            return super().swap_in(rank, host_slots, block_ids, guard)  # type: ignore[misc]
        self._check_swap(rank, block_ids, host_slots)
        k = next((i for i, s in enumerate(host_slots) if (rank, s) not in self._slot_sums), len(host_slots))
        n = self._swap(rank, block_ids[:k], host_slots[:k], "h2d", guard) if k else 0
        got = dict(zip(host_slots[:n], self._gpu_block_sums(rank, block_ids[:n]) if n else []))
        return self._matching_slots(rank, host_slots[:n], got)

    def _slot_hashes(self, rank: int, host_slots: Sequence[int]) -> list[list[int]]:
        """Slots' sums as a swap-out notes them, taken on the host (a write-back from host memory
        checks its slots with them): SUM64 of each object cut from the slot's row."""
        if not self._slots_on_gpu(rank):
            return super()._slot_hashes(rank, host_slots)  # type: ignore[misc]
        return [[sum64(obj) for obj in self._slot_objects(rank, slot)] for slot in host_slots]

    def _slot_objects(self, rank: int, slot: int) -> list[np.ndarray]:
        """Slot ``slot``'s bytes as the block's objects, in :meth:`_gpu_block_sums`' order (a
        slot's row holds the layers in their own order and every head of the rank)."""
        spec, heads, out = self.spec, self.spec.object_heads, []
        for g in range(spec.head_groups):
            for kind in spec.kinds:
                row = self._arena(rank, kind)[slot]
                for lg in self.objects.groups_of(None):
                    a, b = (0, spec.layers) if lg is None else spec.group_span(lg)
                    layers = list(spec.storage_order[a:b])
                    out.append(np.ascontiguousarray(row[layers, g * heads:(g + 1) * heads]))
        return out
