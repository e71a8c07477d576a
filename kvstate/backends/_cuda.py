"""The CUDA backend: the core's write and read commands over real GPU caches.

Each TP rank owns layer-major GPU caches per kind (allocated here, or the engine's own
PyTorch/Paddle/CuPy tensors), a :class:`~kvstate.kernels._cuda.CudaSwapper` (its streams and
kernels) and a pinned staging ring of two slots, bounded by ``staging_bytes`` (64 MiB by
default) whatever the request length. A write gathers piece *k+1* into one slot on the GPU
while the store copies piece *k* out of the other; a read gets piece *k+1* from the store
while piece *k* is scattered to the GPU. Completion is a CUDA event; the calling (driver)
thread waits for it with a timeout, so the engine's thread never blocks on a transfer.

With ``host_blocks``, each rank also owns the host tier's pinned block-major arena: a swap
moves blocks straight between the GPU caches and its slots, one kernel per kind. Blocks'
checksums are taken on the GPU (:mod:`~kvstate.backends._cuda_sums`). Like every backend it
knows nothing of request states: it answers how many *leading* blocks it stored, read or found.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from .._errors import ProtocolError, ValidationError
from .._spec import CacheSpec
from .._validate import check_int
from ..kernels._cuda import CudaSwapper, DeviceLayers, load_cupy
from ..kernels._cuda_checksum import load_sums
from ..kernels._cuda_launch import register_host, unregister_host
from ._arena import ArenaStore
from ._base import MISSING, Guard, Store, check_fence, leading
from ._cuda_armed import Armed, ArmedPulls
from ._cuda_caches import bind_rank, caches_by_rank
from ._cuda_peers import CudaPeers
from ._cuda_states import DevicePages
from ._cuda_sums import DeviceSums
from ._integrity import SUM64
from ._lends import LendBoard, fold_rows, leading_matches, pull_blocks
from ._manifested import Deferred, manifest_slice
from ._objects import StoreBackend
from ._stateobjects import paged_of

__all__ = ["CudaBackend"]


class CudaBackend(DeviceSums, StoreBackend):
    """Per-rank GPU caches over a :class:`~kvstate.backends._stores.Store`, through pinned staging.

    ``ranks`` (default: all) are the TP ranks held here. ``caches``, when given, is
    ``caches[rank][kind]`` = per-layer GPU tensors ``[num_blocks, heads, block_size, dim]`` (the
    engine's, or shared through CUDA IPC): a list with one entry per TP rank, or a dict of the
    ranks held; otherwise zeroed CuPy arrays are allocated. ``staging_bytes`` is the pinned
    staging per rank. ``num_states``, ``states``: state pages (:mod:`~kvstate.backends._cuda_states`).
    ``lends`` / ``pulls``: the direct handoff's board (:mod:`~kvstate.backends._lends`), to lend
    blocks on (P) or pull reads from (D): another process's caches through CUDA IPC, or another
    backend's of this process, on this GPU or one joined to it (:mod:`~kvstate.backends._cuda_peers`);
    ``shared``: the CUDA IPC description ``caches`` were opened from, which a lender passes on."""

    _armed: ArmedPulls | None = None  # D's pulls armed before P lends (made at the first arm)
    _firing: dict[int, Armed]  # an armed pull being fired, by the pulling thread (made with _armed)

    def __init__(self, spec: CacheSpec, num_blocks: int, store: Store, *, caches: Any = None,
                 device: int = 0, staging_bytes: int = 64 << 20, timeout: float = 60.0,
                 host_blocks: int = 0, ranks: Sequence[int] | None = None, num_states: int = 0,
                 states: Any = None, lends: LendBoard | None = None, pulls: LendBoard | None = None,
                 shared: dict[str, Any] | None = None) -> None:
        full, spec = spec, paged_of(spec)
        self._setup(spec, num_blocks, store, ranks, host_blocks)
        self._setup_lends(lends, pulls, full)
        self.host_blocks = host_blocks  #: slots of the pinned host tier arena, per rank
        per_block = spec.bytes_per_block_per_rank
        if not isinstance(staging_bytes, int) or staging_bytes < 2 * per_block:
            raise ValidationError(f"CudaBackend: staging_bytes must hold two blocks ({2 * per_block} bytes "
                                  f"for this spec), got {staging_bytes!r}")
        caches = None if caches is None else caches_by_rank(spec, self.ranks, caches)
        self.cp = load_cupy()
        self.device = device
        self.per_slot = staging_bytes // 2 // per_block  #: blocks per staging slot
        self._sum_cache: dict[Any, Any] = {}  # SUM64 kernel, layer pointer tables, sum streams
        self._swappers: dict[int, CudaSwapper] = {}
        self._locks = {r: threading.Lock() for r in self.ranks}
        self._closed = False
        self._arena_views: dict[str, np.ndarray] | None = None  # the arena's slots, by kind (zero copy)
        self._registered: int | None = None  # the arena's address, registered as pinned here
        self._pages = DevicePages(self.cp, self.ranks, self._on, self._side_stream, self._side_wait)
        self._peers = CudaPeers(self.cp, spec, device, self, shared=shared)  # the direct handoff's mappings
        self.state_pages = self._pages.pages  #: state_pages[rank]: the rank's state pages on the GPU
        try:
            self._layers: dict[int, dict[str, DeviceLayers]] = {}
            self._slots: dict[int, list[dict[str, np.ndarray]]] = {}
            self._host: dict[int, dict[str, np.ndarray]] = {}
            self._parts: dict[int, dict[str, DeviceLayers]] = {}  # the caches as head groups see them
            self._groups: dict[int, dict[str, list[DeviceLayers]]] = {}  # ... and by layer group
            for r in self.ranks:
                sw = CudaSwapper(device, timeout=timeout)
                self._swappers[r] = sw
                bound = {kind: bind_rank(self.cp, sw, spec, num_blocks, device, r, kind,
                                         None if caches is None else caches[r][kind]) for kind in spec.kinds}
                self._layers[r] = {kind: b[0] for kind, b in bound.items()}
                self._parts[r] = {kind: b[1] for kind, b in bound.items()}
                self._groups[r] = {kind: b[2] for kind, b in bound.items()}
                self._slots[r] = [
                    {k: sw.pinned((self.per_slot, spec.layers) + spec.block_shape(k), spec.kind_dtype(k))
                     for k in spec.kinds} for _ in range(2)]
                if host_blocks:  # the host tier: block-major, slot i at the same place on every rank
                    self._host[r] = {k: sw.pinned((host_blocks, spec.layers) + spec.block_shape(k),
                                                  spec.kind_dtype(k)) for k in spec.kinds}
            # a store that moves bytes straight from registered memory (Mooncake) takes the staging
            # and the host tier: their puts and gets then skip the store's own copy
            self._offered = [a for a in [*(a for r in self.ranks for slot in self._slots[r] for a in slot.values()),
                                         *(a for r in self._host for a in self._host[r].values())]
                             if store.register_memory(a)]
            self._setup_states(full, num_states, self._pages.gather, self._pages.scatter)
            self._pages.bind("CudaBackend", (num_states, self.state_size), states, device)
            if lends is not None:
                self._warm_lends()
        except BaseException:
            self.close()
            raise
        #: pinned host memory in all: staging, and the host tier's arena
        self.pinned_bytes = (2 * self.per_slot + host_blocks) * per_block * len(self.ranks)

    # -- block access (tests, the demo's fake compute) -----------------------------------------
    def caches(self, rank: int, kind: str) -> DeviceLayers:
        """The bound per-layer GPU caches of ``kind`` on ``rank``."""
        return self._layers[rank][kind]

    def _layer_views(self, rank: int, kind: str) -> Any:
        self._check_open()
        return self._layers[rank][kind].views

    def _set_chunk(self, layer: Any, block: int, data: np.ndarray) -> None:
        """Write one chunk and wait for it: the copy is a kernel on the calling thread's stream,
        and a rank worker of another process may read the block as soon as this returns."""
        with self.cp.cuda.Device(self.device):
            layer[block] = self.cp.asarray(data)
            self.cp.cuda.get_current_stream().synchronize()

    def _arena(self, rank: int, kind: str) -> np.ndarray:
        self._check_open()
        return self._host[rank][kind]

    # -- TransferBackend -----------------------------------------------------------------------
    def _swap(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int], direction: str,
              guard: Guard | None) -> int:
        """One kernel per kind straight between the GPU caches and the arena's slots (no staging)."""
        self._check_open()
        self._check_swap(rank, block_ids, host_slots)
        if not block_ids:
            return 0
        ids, slots = np.asarray(block_ids, np.int64), np.asarray(host_slots, np.int64)
        sw, ev = self._swappers[rank], None
        with self._on(rank):
            check_fence(guard, rank, "gather" if direction == "d2h" else "scatter into", block_ids)
            for kind in self.spec.kinds:
                ev = sw.swap_cache_layout_async(self._layers[rank][kind], self._host[rank][kind], ids, slots,
                                                direction)
            sw.wait(ev)
        self.bytes_swapped += len(block_ids) * self.spec.bytes_per_block_per_rank
        return len(block_ids)

    @contextlib.contextmanager
    def _on(self, rank: int) -> Iterator[None]:
        """Hold rank ``rank``'s lock with this backend's device current in the calling thread
        (a driver's worker thread has no current device until one is set)."""
        self._swappers[rank].bind_thread()
        with self._locks[rank], self.cp.cuda.Device(self.device):
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise ValidationError("CudaBackend is closed")

    def _slot(self, rank: int, slot: int, kind: str, m: int, group: int | None) -> np.ndarray:
        """Staging slot ``slot`` of ``kind`` holding ``m`` blocks of a head group: every layer,
        or (a layer group, or fewer heads than the rank's) the same memory read as ``[m,
        layers, object_heads, ...]``, one object per row."""
        arr, spec = self._slots[rank][slot][kind], self.spec
        if group is None and spec.head_groups == 1:
            return arr[:m]
        a, b = (0, spec.layers) if group is None else spec.group_span(group)
        shape = (m, b - a) + spec.object_shape(kind)
        return arr.reshape(-1)[:int(np.prod(shape))].reshape(shape)

    def _piece_views(self, rank: int, slot: int, m: int, group: int | None) -> list[memoryview]:
        """Byte views of the objects of ``m`` blocks in staging slot ``slot``, in the order of
        their names: every group's, or one layer group's."""
        return self._group_views({kind: self._slot(rank, slot, kind, m, group) for kind in self.spec.kinds}, m, group)

    @staticmethod
    def _wait_all(sw: CudaSwapper, events: list[Any]) -> None:
        """Wait for every transfer still enqueued on the staging slots."""
        for ev in events:
            if ev is not None:
                sw.wait(ev)

    def _enqueue(self, rank: int, slot: int, ids: Sequence[int], direction: str,
                 guard: Guard | None, group: int | None = None, g: int = 0) -> Any:
        """Gather (``d2h``) or scatter blocks ``ids`` of the rank's ``g``-th head group through
        staging slot ``slot``: every layer, or layer group ``group``."""
        check_fence(guard, rank, "gather" if direction == "d2h" else "scatter into", ids)
        sw, ev = self._swappers[rank], None
        m, rows = len(ids), np.asarray(self._part_ids(ids, g), np.int64)
        for kind in self.spec.kinds:
            layers = self._parts[rank][kind] if group is None else self._groups[rank][kind][group]
            ev = sw.swap_cache_layout_async(layers, self._slot(rank, slot, kind, m, group),
                                            rows, np.arange(m, dtype=np.int64), direction)
        return ev  # one stream: the last event covers every kind

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
              layers: Callable[..., Any] | None = None, tables: Sequence[Sequence[int]] = (),
              window_from: int = 0) -> int:
        self._check_open()
        self._check_transfer(rank, keys, block_ids, tables, window_from)
        if not self.spec.writes(rank):  # a replica: the first rank holding these heads stores them
            return len(keys)
        if tables:  # group tables: each group from its own blocks
            ids = self._group_ids(block_ids, tables)
            count = self._each_part(rank, len(keys), lambda part, m, _: self._write_groups(
                keys[:m], ids, window_from, lambda g, ks, b: self._put(rank, part, ks, b, guard, g)))
        else:
            count = self._each_part(rank, len(keys), lambda part, m, _: self._write_part(
                rank, part, keys[:m], block_ids[:m], guard, layers))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _write_part(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                    guard: Guard | None, layers: Callable[..., Any] | None) -> int:
        """Store one head group of the blocks: at once (straight into an arena's slots where
        the store is one), or layer group by layer group."""
        if self._zero_copy():  # straight into the arena's slots, each object once its layers are computed
            if self.spec.object_groups == 1:
                ready = True if layers is None else layers(self.spec.layers)
                return self._arena_put(rank, part, keys, block_ids, guard, None, ready) if ready else 0
            return self._by_group(len(keys), layers or _computed, lambda g, m, ready: self._arena_put(
                rank, part, keys[:m], block_ids[:m], guard, g, ready))
        if layers is None:
            return self._put(rank, part, keys, block_ids, guard, None)
        if len(keys) <= self._pieces(0)[0]:  # a layer group fits a slot: pipelined
            return self._save_groups(rank, part, keys, block_ids, guard, layers)
        # group by group, each once its layers are computed; the lock is free between groups
        return self._by_group(len(keys), layers,
                              lambda g, m, ready: self._put(rank, part, keys[:m], block_ids[:m], guard, g, ready))

    def _pieces(self, group: int | None) -> tuple[int, list[int] | None]:
        """(blocks of a head group a staging slot holds, the layer groups named) for a transfer
        of every layer (``group`` None) or of one layer group."""
        m = self.per_slot * self.spec.head_groups
        return (m, None) if group is None else (m * self.spec.layer_groups, [group])

    def _save_groups(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                     guard: Guard | None, layers: Callable[..., Any]) -> int:
        """A layer-wise save whose groups each fit a staging slot: group g + 1, when reported
        already, is gathered (after its device event) while group g is stored; otherwise the
        rank's lock is let go while the save waits for it. A group short of a block stores
        later groups only for the blocks it reached; a gate that says no stores nothing."""
        spec, sw, n = self.spec, self._swappers[rank], len(keys)
        count, g = n, 0

        def gather(events: list[Any], g: int, ready: Any) -> None:
            if ready is not True:
                sw.wait_on_device(ready)
            events[g % 2] = self._enqueue(rank, g % 2, block_ids, "d2h", guard, g, part[0])

        while g < spec.layer_groups and count:
            ready = layers(spec.group_span(g)[1])  # waited for with the rank's lock free
            if not ready:
                return 0
            with self._on(rank):
                events: list[Any] = [None, None]  # the gathers in flight, by slot
                try:
                    gather(events, g, ready)
                    while True:  # under the lock as long as the next group is reported already
                        ahead = g + 1 < spec.layer_groups and layers(spec.group_span(g + 1)[1], False)
                        if ahead:
                            gather(events, g + 1, ahead)
                        sw.wait(events[g % 2])  # gathered: its layers are computed, and summed on the GPU
                        sums = self._flat(self._device_sums(rank, part[0], block_ids[:count], [g]), 0, count)
                        count = min(count, self.objects.put(part[1], keys[:count], [g],
                                                            self._piece_views(rank, g % 2, count, g), sums))
                        g += 1
                        if not (ahead and count):
                            break
                finally:  # nothing may still write a slot when we leave
                    self._wait_all(sw, events)
        return count

    def _put(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None, group: int | None, ready: Any = True) -> int:
        """Gather the blocks (every layer, or one layer group, after the device event
        ``ready`` if one is given) piece by piece through the two staging slots, storing a
        piece while the next is gathered; leading blocks stored."""
        sw, n = self._swappers[rank], len(keys)
        m, groups = self._pieces(group)
        pieces = [(a, min(n, a + m)) for a in range(0, n, m)]
        count, pending, sizes = 0, None, list[int]()
        with self._on(rank):
            events: list[Any] = [None, None]
            if ready is not True:
                sw.wait_on_device(ready)
            if pieces:
                events[0] = self._enqueue(rank, 0, block_ids[:pieces[0][1]], "d2h", guard, group, part[0])
            try:
                for k, (a, b) in enumerate(pieces):
                    if k + 1 < len(pieces):  # gather the next piece while this one is stored
                        a2, b2 = pieces[k + 1]
                        events[(k + 1) % 2] = self._enqueue(rank, (k + 1) % 2, block_ids[a2:b2], "d2h", guard, group,
                                                            part[0])
                    sw.wait(events[k % 2])
                    if k == 0:  # the first piece gathered: the layers are computed; every block summed at once
                        pending = self._launch_sums(rank, part[0], block_ids, groups)
                    views = self._piece_views(rank, k % 2, b - a, group)
                    done = self.objects.put_piece(part[1], keys[a:b], groups, views,
                                                  None if pending is None else sizes)  # SUM64: manifests at the end
                    count += done
                    if done < b - a:
                        break
                if pending is not None and count:
                    count = self.objects.put_manifests(part[1], keys[:count], groups, sizes,
                                                       self._flat(pending(), 0, count) or [], SUM64)
            finally:  # nothing may still write a slot when we leave
                self._wait_all(sw, events)
        return count

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
             arrived: Callable[[int, Any], None] | None = None, window_from: int = 0,
             tables: Sequence[Sequence[int]] = ()) -> int:
        self._check_open()
        self._check_transfer(rank, keys, block_ids, tables)
        check_int(window_from, "CudaBackend.read: window_from", minimum=0, maximum=len(keys))
        if (window_from and self.spec.splits_groups) or tables:  # group by group (window ones from window_from)
            return self._each_part(rank, len(keys), lambda part, m, _: self._read_window(
                part, keys, self._group_ids(block_ids, tables), m, window_from,
                lambda g, ks, ids: self._get(rank, part, ks, ids, guard, g)))
        count = self._each_part(rank, len(keys), lambda part, m, whole: self._read_part(
            rank, part, keys[:m], block_ids[:m], guard, arrived if whole else None))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _read_part(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, arrived: Callable[[int, Any], None] | None) -> int:
        """Read one head group of the blocks: at once, or layer group by layer group, reporting each."""
        if self._zero_copy():  # straight out of the arena's slots, each object in place when reported
            if self.spec.object_groups == 1:
                count = cast(int, self._arena_settled(part, keys, None, lambda s: self._arena_get(
                    rank, part, keys[s:], block_ids[s:], guard)))
                if arrived is not None and count == len(keys):
                    arrived(self.spec.layers, None)
                return count
            return self._load_by_group(len(keys), arrived or _ignore, lambda g, m: (
                cast(int, self._arena_settled(part, keys[:m], g, lambda s: self._arena_get(
                    rank, part, keys[s:m], block_ids[s:m], guard, g))), None))
        if arrived is None:
            return self._get(rank, part, keys, block_ids, guard, None)
        if len(keys) <= self._pieces(0)[0]:  # a layer group fits a slot: pipelined
            return self._load_groups(rank, part, keys, block_ids, guard, arrived)
        # group by group, piece by piece; each is in place (synchronised) when it is reported
        return self._load_by_group(len(keys), arrived, lambda g, m: (
            self._get(rank, part, keys[:m], block_ids[:m], guard, g), None))

    def _load_groups(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                     guard: Guard | None, arrived: Callable[[int, Any], None]) -> int:
        """A layer-wise read whose groups each fit a staging slot: group g + 1 is read while
        group g is scattered, and each group is reported with its scatter's event. A group
        short of a block ends the pipeline; later groups are then read only for the blocks it
        reached (so the count is of blocks with every layer in place)."""
        spec, sw, n = self.spec, self._swappers[rank], len(keys)
        short = None
        with self._on(rank):
            events: list[Any] = [None, None]
            try:
                for g in range(spec.layer_groups):
                    slot = g % 2
                    if events[slot] is not None:  # the slot's previous scatter must have read it
                        sw.wait(events[slot])
                    deferred: Deferred = []

                    def scatter(m: int, slot: int = slot, g: int = g) -> None:
                        events[slot] = self._enqueue(rank, slot, block_ids[:m], "h2d", guard, g, part[0])

                    done = self.objects.get(part[1], keys, [g], self._piece_views(rank, slot, n, g), scatter,
                                            deferred)
                    if deferred:  # verified where it landed before it is reported
                        sw.wait(events[slot])
                        sums = self._device_sums(rank, part[0], block_ids[:len(deferred)], [g]) or []
                        done = min(done, self.objects.verify_deferred(part[1], deferred, sums))
                    if done < n:
                        short = (g, done)
                        break
                    arrived(spec.group_span(g)[1], events[slot])
            finally:  # nor read one
                self._wait_all(sw, events)
        if short is None:
            return n
        count = short[1]
        for g in range(short[0] + 1, spec.layer_groups):
            if not count:
                break
            count = min(count, self._get(rank, part, keys[:count], block_ids[:count], guard, g))
        return count

    def _get(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None, group: int | None) -> int:
        """Read the blocks (every layer, or one layer group) piece by piece into the two
        staging slots, scattering a piece while the next is read; leading blocks scattered."""
        sw, n = self._swappers[rank], len(keys)
        m, groups = self._pieces(group)
        deferred: Deferred | None = [] if self.verify else None  # SUM64 blocks: verified where they land, at the end
        count, per = 0, len(self.objects.groups_of(groups))
        with self._on(rank):
            events: list[Any] = [None, None]
            try:
                manifests = self.objects.read_manifests(part[1], keys, groups) if self.verify else None  # all at once
                for k, a in enumerate(range(0, n, m)):
                    b, slot = min(n, a + m), k % 2
                    if events[slot] is not None:  # the slot's previous scatter must have read it
                        sw.wait(events[slot])

                    def scatter(c: int, slot: int = slot, a: int = a) -> None:
                        events[slot] = self._enqueue(rank, slot, block_ids[a:a + c], "h2d", guard, group, part[0])

                    # a block counts only if every object arrived whole (and verified)
                    views = self._piece_views(rank, slot, b - a, group)
                    done = self.objects.get(part[1], keys[a:b], groups, views, scatter,
                                            deferred if count == len(deferred or ()) else None,
                                            None if manifests is None else manifest_slice(manifests, a, b, per))
                    count += done
                    if done < b - a:
                        break
            finally:  # nor read one
                self._wait_all(sw, events)
            if deferred:
                sums = self._device_sums(rank, part[0], block_ids[:len(deferred)], groups) or []
                count = min(count, self.objects.verify_deferred(part[1], deferred, sums))
        return count

    # -- zero copy: an arena store's slots are the host buffer ---------------------------------
    def _zero_copy(self) -> bool:
        """Whether transfers go straight between the caches and the store's slots (an arena
        whose slot is one object, :meth:`_arena_fits`, and the caches' sums on the GPU). The
        slots are registered as pinned memory on first use."""
        if self._arena_views is not None:
            return bool(self._arena_views)
        spec, store, per = self.spec, self.store, self.spec.group_layers  # layers an object holds
        fits = self._arena_fits() and all(self._slots_on_gpu(r) for r in self.ranks)
        self._arena_views = {}
        if fits:
            slots = store.slots()  # type: ignore[attr-defined]
            ptr = int(slots.__array_interface__["data"][0])
            with self.cp.cuda.Device(self.device):
                register_host(self.cp, ptr, slots.nbytes)
            self._registered = ptr
            self._arena_views = {k: slots.view(spec.kind_dtype(k)).reshape((len(slots), per) +
                                                                         spec.block_shape(k)) for k in spec.kinds}
        return bool(self._arena_views)

    def _arena_move(self, rank: int, ids: Sequence[int], slots: Sequence[int], direction: str,
                    guard: Guard | None, group: int | None = None) -> Any:
        """Enqueue the gather (``d2h``) of blocks ``ids`` (every layer, or layer group ``group``)
        into the arena's ``slots`` (block by block, then kind), or their scatter back; returns
        the event after it."""
        nk, sw, ev = len(self.spec.kinds), self._swappers[rank], None
        check_fence(guard, rank, "gather" if direction == "d2h" else "scatter into", ids)
        rows = np.asarray(ids, np.int64)
        # objects of a MiB or more: the DMA engines move them, one call a run of slots
        strategy = "staged" if cast(ArenaStore, self.store).big.size >= 1 << 20 else None
        for k, kind in enumerate(self.spec.kinds):
            layers = self._parts[rank][kind] if group is None else self._groups[rank][kind][group]
            ev = sw.swap_cache_layout_async(layers, self._arena_views[kind], rows,  # type: ignore[index]
                                            np.asarray(slots[k::nk], np.int64), direction, strategy=strategy)
        return ev

    def _arena_put(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, group: int | None = None, ready: Any = True) -> int:
        """Gather the blocks straight into slots the arena store claimed, in runs (:func:`_pieces`:
        each run claimed while the one before it moves, and given its own event), take their
        SUM64 on the GPU meanwhile and stage their manifests, then publish each run, objects
        and manifests in one step, as soon as its copy has landed: only the first run's claim
        comes before the copy and only the last run's publish after it. Leading blocks stored.
        Claims are let go only once nothing can write their slots (a stuck device keeps them
        claimed). ``group``: one layer group's objects, gathered after the device event ``ready``."""
        store, nk, groups = cast(ArenaStore, self.store), len(self.spec.kinds), None if group is None else [group]
        names = self.objects.names(part[1], keys, groups)
        claimed: list[str] = []
        mnames: list[str] = []
        events: list[Any] = []
        runs: list[tuple[int, int]] = []  # the runs moving, each with its event
        count = 0
        with self._on(rank):
            if ready is not True:
                self._swappers[rank].wait_on_device(ready)
            try:  # every run enqueued before any is published: a fence that passes stores none
                for a, b in _pieces(len(keys)):
                    run = names[a * nk:b * nk]
                    claimed += run
                    by_kind = store.claim([run[i * nk + k] for k in range(nk) for i in range(b - a)])  # kinds in runs
                    slots = [by_kind[k * (b - a) + i] for i in range(b - a) for k in range(nk)]
                    m = leading(all(s >= 0 for s in slots[i * nk:(i + 1) * nk]) for i in range(b - a))
                    if m:
                        events.append(self._arena_move(rank, block_ids[a:a + m], slots[:m * nk], "d2h", guard, group))
                        runs.append((a, a + m))
                    if m < b - a:
                        break
                n = runs[-1][1] if runs else 0
                pending = self._launch_sums(rank, part[0], block_ids[:n], groups,  # once the layers are computed
                                            after=None if ready is True else ready) if n else None
                sums = pending() if pending is not None else []
                mnames, blobs = self.objects.manifests(part[1], keys[:n], groups, [store.big.size] * (n * nk),
                                                       self._flat(sums, 0, n) or [], SUM64)
                staged = store.stage(mnames, blobs)
                count = self._publish_runs(rank, keys, names, mnames, runs, events, leading(st == 0 for st in staged),
                                           groups)
                return count
            finally:
                self._wait_all(self._swappers[rank], events)  # a stuck device raises: its claims stay
                store.release(claimed[count * nk:] + mnames[count:])  # the blocks counted were published

    def _publish_runs(self, rank: int, keys: Sequence[str], names: Sequence[str], mnames: Sequence[str],
                      runs: Sequence[tuple[int, int]], events: Sequence[Any], n: int,
                      groups: Sequence[int] | None) -> int:
        """Publish the first ``n`` blocks' objects and manifests run by run, each once its
        gather's event passed; the leading blocks stored (a run short of its end stops it)."""
        store, nk, sw, count = cast(ArenaStore, self.store), len(self.spec.kinds), self._swappers[rank], 0
        for (a, b), ev in zip(runs, events):
            b = min(b, n)
            if a >= b:
                break
            sw.wait(ev)
            status = store.publish(list(names[a * nk:b * nk]) + list(mnames[a:b]))
            done = self.objects.leading_blocks(keys[a:b], groups, [st == 0 for st in status])
            count += done
            if done < b - a:
                break
        return count

    def _arena_get(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, group: int | None = None) -> int:
        """Scatter the blocks straight out of the arena's slots in pieces (:func:`_pieces`), as a
        pipeline: a piece's slots are found and its scatter queued before the manifests of the
        piece before it are read (a block they do not vouch for moved in vain and never counts),
        so the host's work on a piece runs while the next one moves, and only finding the first,
        small piece's slots comes before the copy. Each piece's SUM64 is taken on the GPU where
        it landed as soon as it has (the host does not wait for it); then the leading blocks
        whose slots held them throughout and whose sums are their manifests' count, the first
        broken one evicted. Manifests of host checksums (a writer without a GPU) are read by the
        staged path. ``group``: one layer group's objects."""
        store, nk, sw = cast(ArenaStore, self.store), len(self.spec.kinds), self._swappers[rank]
        groups = None if group is None else [group]
        n, names = len(keys), self.objects.names(part[1], keys, groups)
        moved: list[tuple[int, int, Any, Any]] = []  # per piece vouched: first block, blocks moved, places, reads
        events: list[Any] = []  # per piece moved, in order: moved[i] is events[i]'s
        staged: list[int] = []  # the first block of a piece whose manifests are not SUM64
        count, last = 0, None  # last: the piece moving whose manifests are still unread
        with self._on(rank):
            try:
                for a, b in _pieces(n):
                    places = store.locate(names[a * nk:b * nk])
                    here = leading(all(p.slot >= 0 for p in places[i * nk:(i + 1) * nk]) for i in range(b - a))
                    ev = self._arena_move(rank, block_ids[a:a + here], [p.slot for p in places[:here * nk]],
                                          "h2d", guard, group) if here else None
                    events.append(ev)
                    sums = self._launch_sums(rank, part[0], block_ids[a:a + here], groups, after=ev) if here else None
                    if last is not None and not self._vouch(part, keys, groups, last, moved, staged):
                        last = None  # the piece before ends the read: this one moved in vain
                        break
                    last = (a, b, here, places, sums)
                    if here < b - a:
                        break
                if last is not None:
                    self._vouch(part, keys, groups, last, moved, staged)
                for (a, whole, places, (read, vouched, got, size, sums)), ev in zip(moved, events):
                    if ev is not None:
                        sw.wait(ev)
                    done = self._arena_verified(part, keys[a:a + size], whole, places, vouched, sums, group)
                    if done == whole:
                        self.objects.evict_if_broken(part[1], keys[a:a + size], groups, got, read, whole)
                    count += done
                    if done < size:
                        return count
            finally:
                self._wait_all(sw, events)  # nothing scatters into the blocks once we return
        if not staged or count < staged[0]:
            return count
        return count + self._get(rank, part, keys[count:], block_ids[count:], guard, group)

    def _vouch(self, part: tuple[int, int], keys: Sequence[str], groups: list[int] | None,
               piece: tuple[int, int, int, Any, Any], moved: list[Any], staged: list[int]) -> bool:
        """Read the manifests of a piece queued to move (``piece``: its first and end block,
        blocks moving, their places and sums) and note what they vouch for in ``moved``; False
        when the read ends with it (a block short or missing, or manifests of host checksums,
        whose first block goes to ``staged``)."""
        a, b, here, places, sums = piece
        read, vouched = self.objects.read_manifests(part[1], keys[a:b], groups)
        got = [p.length if p.slot >= 0 else MISSING for p in places]
        whole = min(here, self.objects.arrived(keys[a:b], [None if groups is None else groups[0]], got, vouched))
        if any(alg != SUM64 for alg, _ in vouched[:whole]):
            staged.append(a)
            return False
        moved.append((a, whole, places, (read, vouched, got, b - a, sums)))
        return whole == b - a

    def _arena_verified(self, part: tuple[int, int], keys: Sequence[str], whole: int, places: Sequence[Any],
                        vouched: Any, sums: Callable[[], list[list[int]]] | None, group: int | None) -> int:
        """Of ``whole`` blocks scattered from the arena, the leading ones whose slots still
        hold them and whose SUM64 where they landed (``sums``, launched after the scatter) are
        their manifests' (the first that differs is evicted)."""
        nk = len(self.spec.kinds)
        still = cast(ArenaStore, self.store).unchanged(places[:whole * nk])
        w = leading(all(still[i * nk:(i + 1) * nk]) for i in range(whole))
        got = sums()[:w] if sums is not None and w else []
        want = [(keys[i], self.objects.expected(i, [group], vouched)) for i in range(w)]
        return self.objects.verify_deferred(part[1], want, got)

    # -- the direct handoff (kvstate.backends._lends): CUDA IPC, a kernel reading the lender's GPU --
    def _warm_lends(self) -> None:
        """Build the SUM64 kernel and describe each rank's caches (CUDA IPC handles) before the
        first lend: done at that lend, they came before its post while D's pull waited for it
        (``pull_wait``, half a second by default), and took 290–480 ms on an H200 whose kernel
        cache was cold, so D's first pulls could find nothing and fail their requests."""
        if not self.num_blocks:
            return
        for rank in self.ranks:
            self.lend_peer(rank)
            self.lend_sums(rank, [0])

    def lend_peer(self, rank: int) -> dict[str, Any]:
        self._check_open()
        return self._peers.describe(rank, self._layers[rank], self.num_blocks)

    def lend_sums(self, rank: int, block_ids: Sequence[int]) -> list[int]:
        """SUM64 of each block, every kind and head group, folded into one: taken on the GPU."""
        self._check_open()
        with self._on(rank):
            fetches = [self._launch_sums(rank, g, list(block_ids), None, always=True)
                       for g in range(self.spec.head_groups)]
        return self._folded(fetches)

    # -- pulls armed at reservation (kvstate.backends._cuda_armed) --------------------------------
    def arm_pull(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], timeout: float = 60.0) -> bool:
        """Arm the pull of ``keys`` into ``block_ids`` (D's blocks, reserved) before P lends
        them, for at most ``timeout`` seconds: the pull of those keys into those blocks then
        raises a flag instead of launching its copy. Whether it was armed: not on a backend
        without a lend board to pull from, or whose blocks are not one object a kind of whole
        16-byte vectors, or with every slot of the rank armed (the pull then runs unarmed).
        Checked as a pull is, before anything is queued."""
        self._check_open()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValidationError(f"arm_pull: timeout must be seconds > 0, got {timeout!r}")
        packed = self._check_transfer(rank, keys, block_ids)
        spec = self.spec
        if self.pulls is None or spec.head_groups != 1 or spec.object_groups != 1 or spec.splits_groups:
            return False
        sw, ours = self._swappers[rank], [self._layers[rank][k] for k in spec.kinds]
        if not all(sw.copies_with_sums(o, o) for o in ours):
            return False
        dst = packed if packed is not None else np.asarray(block_ids, np.int64)
        with self._on(rank):
            load_sums(self.cp, self._sum_cache)  # a store read or write while armed must load nothing
            if self._armed is None:
                self._armed, self._firing = ArmedPulls(self.cp), {}
            return self._armed.arm(rank, sw, ours, tuple(keys), dst, time.monotonic() + timeout, block_ids,
                                   self.pulls.prepare(rank, keys))

    def armed_counts(self) -> dict[str, int]:
        """Pulls armed, fired and disarmed unfired since the start, and armed ``now``."""
        armed = self._armed
        if armed is None:
            return {"armed": 0, "fired": 0, "disarmed": 0, "now": 0}
        return {**armed.counts, "now": len(armed)}

    def disarm_pull(self, rank: int, keys: Sequence[str]) -> bool:
        """Let go of the pull armed for ``keys`` (its request ended before its read); whether
        one was armed."""
        return self._armed is not None and self._armed.disarm_keys(rank, keys)

    def pull(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], until: Callable[[], bool],
             guard: Guard | None = None) -> int | None:
        """As every backend's pull; a pull armed for these keys and blocks is fired (its ids
        were checked when it was armed), else disarmed, and the pull runs unarmed."""
        slot = self._armed.take(rank, keys, block_ids) if self._armed is not None and self.pulls is not None else None
        if slot is None:
            return super().pull(rank, keys, block_ids, until, guard)
        me = threading.get_ident()
        self._firing[me] = slot
        try:
            n = pull_blocks(self.pulls, self, rank, slot.keys, slot.dst, until, guard, slot.prepared)
        finally:
            if self._firing.pop(me, None) is not None and self._armed is not None:
                self._armed.disarm(slot)  # no lend came, or it was refused: the queued work runs harmlessly
        self._count_pull(len(keys), n)
        return n

    def _fire(self, rank: int, slot: Armed, peer: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
              sums: Sequence[int] | np.ndarray, guard: Guard | None) -> int:
        """An armed pull's lend taken: P's caches mapped, the fence checked, the flag raised."""
        armed = cast(ArmedPulls, self._armed)
        try:
            theirs = self._peers.mapped(peer, rank)  # a lender met before: no device call, no lock
            if theirs is not None:
                check_fence(guard, rank, "scatter into", slot.dst)
        except BaseException:
            armed.disarm(slot)
            raise
        if theirs is None:  # mapping it may wait for the device, this slot's wait with it: unarmed
            armed.disarm(slot)
            return self._pull_copy(rank, peer, src_ids, slot.dst, sums, guard)
        return armed.fire(slot, [theirs[k] for k in self.spec.kinds], src_ids, sums)()

    def _open_peer(self, rank: int, peer: dict[str, Any]) -> dict[str, Any]:
        """The lender's caches bound here; mapping one not met before lets every armed pull go
        first and arms none meanwhile (it may wait for the whole device:
        :mod:`kvstate.backends._cuda_armed`). Called with the rank's device current."""
        theirs = self._peers.mapped(peer, rank)
        if theirs is not None:
            return theirs
        with self._armed.quiet() if self._armed is not None else contextlib.nullcontext():
            return self._peers.open(peer, rank, self._swappers[rank].bind)

    def pull_copy(self, rank: int, peer: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
                  dst_ids: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray, guard: Guard | None) -> int:
        """Copy a lender's blocks into this rank's (one kernel a kind, on this GPU, reading the
        lender's over the link), sum what landed and compare with the lender's ``sums``: how
        many leading blocks match. Where a block is one object a kind of rows of whole 16-byte
        vectors, the copy's own kernel sums the words it moves and another compares on the
        device, so the host reads one number; otherwise the sums follow the copy, in up to
        four pieces, each piece's sums (local memory) running beside the next piece's copy."""
        slot = self._firing.pop(threading.get_ident(), None) if self._armed is not None and self._firing else None
        if slot is not None:
            return self._fire(rank, slot, peer, src_ids, sums, guard)
        return self._pull_copy(rank, peer, src_ids, dst_ids, sums, guard)

    def _pull_copy(self, rank: int, peer: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
                   dst_ids: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray, guard: Guard | None) -> int:
        """:meth:`pull_copy` unarmed: the copy launched now."""
        self._check_open()
        if not len(src_ids) == len(dst_ids) == len(sums):
            raise ProtocolError(f"rank {rank}: a pull needs as many lender's blocks, own blocks and checksums, got "
                                f"{len(src_ids)}, {len(dst_ids)} and {len(sums)}")
        sw = self._swappers[rank]
        fetch: Callable[[], int]
        with self._on(rank):
            theirs = self._open_peer(rank, peer)
            check_fence(guard, rank, "scatter into", dst_ids)
            ours = self._layers[rank]
            spec = self.spec
            if spec.head_groups == 1 and spec.object_groups == 1 and not spec.splits_groups and \
                    all(sw.copies_with_sums(theirs[k], ours[k]) for k in spec.kinds):
                fetch = self._peers.pull(rank, sw, [(theirs[k], ours[k]) for k in spec.kinds], src_ids, dst_ids,
                                         sums, self._keep_until)
            else:
                pieces = self._pull_pieces(rank, theirs, src_ids, dst_ids)
                fetch = lambda: leading_matches([s for f in pieces for s in self._folded(f)], sums)  # noqa: E731
        return fetch()  # the rank's lock let go: the host only waits for the GPU now

    def _pull_pieces(self, rank: int, theirs: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
                     dst_ids: Sequence[int] | np.ndarray) -> list[list[Any]]:
        """Copies queued in up to four pieces, then each piece's sums launched behind its copy."""
        sw, n = self._swappers[rank], len(dst_ids)
        step = max(16, -(-n // 4))
        copied = []
        for a in range(0, n, step):
            src, dst = np.asarray(src_ids[a:a + step]).tolist(), np.asarray(dst_ids[a:a + step]).tolist()
            ev = sw.copy_blocks([(theirs[k], self._layers[rank][k]) for k in self.spec.kinds], src, dst)
            copied.append((dst, ev))
        return [[self._launch_sums(rank, g, dst, None, always=True, after=ev)
                 for g in range(self.spec.head_groups)] for dst, ev in copied]

    @staticmethod
    def _folded(fetches: list[Any]) -> list[int]:
        if any(f is None for f in fetches):
            raise ProtocolError("the direct handoff on CUDA sums rows of whole 64-bit words; these are not")
        return fold_rows(np.concatenate([np.asarray(f(), dtype=np.uint64) for f in fetches], axis=1))

    def close(self) -> None:
        """Wait for queued transfers, free staging, caches this backend allocated and streams,
        with the backend's device current (callable from any thread, on any device)."""
        if self._closed:
            return
        self._closed = True
        for a in getattr(self, "_offered", ()):  # the store lets go before the memory is freed
            self.store.unregister_memory(a)
        with self.cp.cuda.Device(self.device):  # from any thread, whatever its current device
            for rank in self._swappers:  # checksums may still land in pinned memory kept for them
                if ("held", rank) in self._sum_cache:
                    self._side_wait(rank)
            armed = getattr(self, "_armed", None)
            if armed is not None:
                armed.close()  # no stream left waiting on a flag
            if hasattr(self, "_peers"):
                self._peers.close()
            for sw in self._swappers.values():
                sw.close()
            self._swappers.clear()
            if self._registered is not None:
                unregister_host(self.cp, self._registered)
                self._registered, self._arena_views = None, {}
            self._layers, self._parts, self._groups, self._slots, self._host, self._sum_cache = {}, {}, {}, {}, {}, {}
            self.state_pages.clear()
            super().close()


def _pieces(n: int) -> list[tuple[int, int]]:
    """A zero-copy transfer of ``n`` blocks in pieces: from 32 blocks on, a sixteenth, then
    pieces each twice the one before, then the rest but a last sixteenth, then that sixteenth.
    A piece's bookkeeping (about a quarter of its copy's time, a claim or a manifest read)
    hides behind the copy of the piece before it; only the first piece's comes before the
    copy, and only the last, small piece's publish or check after it."""
    if n < 32:
        return [(0, n)] if n else []
    last = n // 16
    out, a, size = [], 0, last
    while n - last - a > 2 * size:
        out.append((a, a + size))
        a, size = a + size, 2 * size
    return out + [(a, n - last), (n - last, n)]


def _computed(layers: int, block: bool = True) -> bool:
    """A whole transfer's layers: computed already."""
    return True


def _ignore(layers: int, event: Any) -> None:
    """A whole load's groups: nobody waits for them."""
