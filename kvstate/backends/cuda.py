"""The CUDA backend: the core's write and read commands over real GPU caches.

Each TP rank owns layer-major GPU caches per kind (allocated here, or the engine's own
PyTorch/Paddle/CuPy tensors), a :class:`~kvstate.kernels.cuda.CudaSwapper` (its streams and
kernels) and a pinned staging ring of two slots, bounded by ``staging_bytes`` (64 MiB by
default) whatever the request length. A write gathers piece *k+1* into one slot on the GPU
while the store copies piece *k* out of the other; a read gets piece *k+1* from the store
while piece *k* is scattered to the GPU. Completion is a CUDA event; the calling (driver)
thread waits for it with a timeout, so the engine's thread never blocks on a transfer.

With ``host_blocks``, each rank also owns the host tier's pinned block-major arena: a swap
moves blocks straight between the GPU caches and its slots, one kernel per kind. Blocks'
checksums are taken on the GPU (:mod:`~kvstate.backends.cuda_sums`). Like every backend it
knows nothing of request states: it answers how many *leading* blocks it stored, read or found.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..kernels.cuda import CudaSwapper, DeviceLayers, load_cupy
from ..spec import CacheSpec
from ..validate import check_int
from .base import Guard, Store, check_fence
from .cuda_sums import DeviceSums
from .manifested import Deferred
from .objects import StoreBackend

__all__ = ["CudaBackend"]


class CudaBackend(DeviceSums, StoreBackend):
    """Per-rank GPU caches over a :class:`~kvstate.backends.stores.Store`, through pinned staging.

    ``ranks`` (default: all) are the TP ranks held here: a rank worker holds one. ``caches``,
    when given, is ``caches[rank][kind]`` = a list of per-layer GPU tensors ``[num_blocks,
    heads, block_size, dim]`` (the engine's own cache, or one another process shares through
    CUDA IPC): a list with one entry per TP rank, or a dict of the ranks held; otherwise
    zeroed CuPy arrays are allocated. ``staging_bytes`` is the pinned staging per rank.
    """

    def __init__(self, spec: CacheSpec, num_blocks: int, store: Store, *, caches: Any = None,
                 device: int = 0, staging_bytes: int = 64 << 20, timeout: float = 60.0,
                 host_blocks: int = 0, ranks: Sequence[int] | None = None) -> None:
        self._setup(spec, num_blocks, store, ranks)
        check_int(host_blocks, "CudaBackend: host_blocks", minimum=0)
        self.host_blocks = host_blocks  #: slots of the pinned host tier arena, per rank
        per_block = spec.bytes_per_block_per_rank
        if not isinstance(staging_bytes, int) or staging_bytes < 2 * per_block:
            raise ValidationError(f"CudaBackend: staging_bytes must hold two blocks ({2 * per_block} bytes "
                                  f"for this spec), got {staging_bytes!r}")
        if caches is not None:
            caches = self._caches_by_rank(caches)
        self.cp = load_cupy()
        self.device = device
        self.per_slot = staging_bytes // 2 // per_block  #: blocks per staging slot
        self._sum_weights: dict[tuple[int, int], Any] = {}  # SUM64 weights on the GPU, by (words, layer)
        self._swappers: dict[int, CudaSwapper] = {}
        self._locks = {r: threading.Lock() for r in self.ranks}
        self._closed = False
        try:
            self._layers: dict[int, dict[str, DeviceLayers]] = {}
            self._slots: dict[int, list[dict[str, np.ndarray]]] = {}
            self._host: dict[int, dict[str, np.ndarray]] = {}
            self._groups: dict[int, dict[str, list[DeviceLayers]]] = {r: {} for r in self.ranks}
            for r in self.ranks:
                sw = CudaSwapper(device, timeout=timeout)
                self._swappers[r] = sw
                self._layers[r] = {kind: self._bind(r, kind, sw, None if caches is None else caches[r][kind])
                                   for kind in spec.kinds}
                self._slots[r] = [
                    {k: sw.pinned((self.per_slot, spec.layers) + spec.block_shape(k), spec.kind_dtype(k))
                     for k in spec.kinds} for _ in range(2)]
                if host_blocks:  # the host tier: block-major, slot i at the same place on every rank
                    self._host[r] = {k: sw.pinned((host_blocks, spec.layers) + spec.block_shape(k),
                                                  spec.kind_dtype(k)) for k in spec.kinds}
        except BaseException:
            self.close()
            raise
        #: pinned host memory in all: staging, and the host tier's arena
        self.pinned_bytes = (2 * self.per_slot + host_blocks) * per_block * len(self.ranks)

    def _caches_by_rank(self, caches: Any) -> dict[int, Any]:
        """The engine's caches as ``{rank: {kind: layers}}`` for exactly the ranks held."""
        spec = self.spec
        if isinstance(caches, Sequence) and not isinstance(caches, (str, bytes)):
            if len(caches) != spec.tp_size:
                raise ValidationError(f"CudaBackend: caches must hold one dict per TP rank ({spec.tp_size})")
            caches = {r: caches[r] for r in self.ranks}
        if not isinstance(caches, dict) or set(caches) != set(self.ranks):
            raise ValidationError(f"CudaBackend: caches must be a list per TP rank or a dict of the ranks held "
                                  f"({list(self.ranks)})")
        for r, by_kind in caches.items():
            if not isinstance(by_kind, dict) or set(by_kind) != set(spec.kinds):
                raise ValidationError(f"CudaBackend: caches[{r}] must map exactly the kinds {spec.kinds}")
        return caches

    def _bind(self, r: int, kind: str, sw: CudaSwapper, layers: Any) -> DeviceLayers:
        """Bind rank ``r``'s caches of ``kind`` (zeroed ones allocated when ``layers`` is None),
        and each layer group's, which a layer-wise save gathers alone."""
        spec, cp = self.spec, self.cp
        if layers is None:
            with cp.cuda.Device(self.device):
                layers = [cp.zeros((self.num_blocks,) + spec.block_shape(kind), spec.kind_dtype(kind))
                          for _ in range(spec.layers)]
        bound = sw.bind(list(layers), f"caches[{r}][{kind!r}]")
        want = (self.num_blocks,) + spec.block_shape(kind)
        if bound.shape != want or len(bound) != spec.layers:
            raise ValidationError(f"CudaBackend: caches[{r}][{kind!r}] must be {spec.layers} layers "
                                  f"of {want}, got {len(bound)} of {bound.shape}")
        if spec.layer_groups > 1:
            self._groups[r][kind] = [sw.bind(bound.views[a:b], f"caches[{r}][{kind!r}][{a}:{b}]")
                                     for a, b in map(spec.group_span, range(spec.layer_groups))]
        return bound

    # -- block access (tests, the demo's fake compute) -----------------------------------------
    def caches(self, rank: int, kind: str) -> DeviceLayers:
        """The bound per-layer GPU caches of ``kind`` on ``rank``."""
        return self._layers[rank][kind]

    def block_bytes(self, rank: int, kind: str, block_id: int) -> bytes:
        """One block of ``kind`` on ``rank``, all layers, in the stored (block-major) layout."""
        self._check_open()
        self._check_keys(rank, ())
        self._check_block(block_id)
        return b"".join(v[block_id].get().tobytes() for v in self._layers[rank][kind].views)

    def fill_block(self, rank: int, kind: str, block_id: int, data: bytes) -> None:
        """Overwrite one block of ``kind`` on ``rank`` (block-major bytes, as stored)."""
        self._check_open()
        self._check_fill(rank, kind, block_id, data)
        views = self._layers[rank][kind].views
        chunk = views[0][block_id].nbytes
        for i, v in enumerate(views):
            part = np.frombuffer(data, v.dtype, offset=i * chunk, count=v[block_id].size)
            v[block_id] = self.cp.asarray(part.reshape(v.shape[1:]))

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
        """Staging slot ``slot`` of ``kind`` holding ``m`` blocks: every layer, or (a layer
        group) the same memory read as ``[m, group_layers, ...]``, one object per row."""
        arr = self._slots[rank][slot][kind]
        if group is None:
            return arr[:m]
        spec = self.spec
        shape = (m, spec.group_layers) + spec.block_shape(kind)
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
                 guard: Guard | None, group: int | None = None) -> Any:
        check_fence(guard, rank, "gather" if direction == "d2h" else "scatter into", ids)
        sw, ev = self._swappers[rank], None
        m = len(ids)
        for kind in self.spec.kinds:
            layers = self._layers[rank][kind] if group is None else self._groups[rank][kind][group]
            ev = sw.swap_cache_layout_async(layers, self._slot(rank, slot, kind, m, group),
                                            np.asarray(ids, np.int64), np.arange(m, dtype=np.int64), direction)
        return ev  # one stream: the last event covers every kind

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
              guard: Guard | None = None, layers: Callable[..., Any] | None = None) -> int:
        self._check_open()
        self._check_transfer(rank, keys, block_ids)
        if layers is None:
            count = self._put(rank, keys, block_ids, guard, None)
        elif len(keys) <= self.per_slot * self.spec.layer_groups:  # a group fits a slot: pipelined
            count = self._save_groups(rank, keys, block_ids, guard, layers)
        else:  # group by group, each once its layers are computed; the lock is free between groups
            count = self._by_group(len(keys), layers,
                                   lambda g, m, ready: self._put(rank, keys[:m], block_ids[:m], guard, g, ready))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _pieces(self, group: int | None) -> tuple[int, list[int] | None]:
        """(blocks a staging slot holds, the groups named) for a transfer of every layer
        (``group`` None) or of one layer group."""
        if group is None:
            return self.per_slot, None
        return self.per_slot * self.spec.layer_groups, [group]

    def _save_groups(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None,
                     layers: Callable[..., Any]) -> int:
        """A layer-wise save whose groups each fit a staging slot: group g + 1, when reported
        already, is gathered (after its device event) while group g is stored; otherwise the
        rank's lock is let go while the save waits for it. A group short of a block stores
        later groups only for the blocks it reached; a gate that says no stores nothing."""
        spec, sw, n = self.spec, self._swappers[rank], len(keys)
        count, g = n, 0

        def gather(events: list[Any], g: int, ready: Any) -> None:
            if ready is not True:
                sw.wait_on_device(ready)
            events[g % 2] = self._enqueue(rank, g % 2, block_ids, "d2h", guard, g)

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
                        sums = self._flat(self._device_sums(rank, block_ids[:count], [g]), 0, count)
                        count = min(count, self._put_objects(rank, keys[:count], [g],
                                                             self._piece_views(rank, g % 2, count, g), sums))
                        g += 1
                        if not (ahead and count):
                            break
                finally:  # nothing may still write a slot when we leave
                    self._wait_all(sw, events)
        return count

    def _put(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None,
             group: int | None, ready: Any = True) -> int:
        """Gather the blocks (every layer, or one layer group, after the device event
        ``ready`` if one is given) piece by piece through the two staging slots, storing a
        piece while the next is gathered; leading blocks stored."""
        sw, n = self._swappers[rank], len(keys)
        m, groups = self._pieces(group)
        pieces = [(a, min(n, a + m)) for a in range(0, n, m)]
        count, sums = 0, None
        with self._on(rank):
            events: list[Any] = [None, None]
            if ready is not True:
                sw.wait_on_device(ready)
            if pieces:
                events[0] = self._enqueue(rank, 0, block_ids[:pieces[0][1]], "d2h", guard, group)
            try:
                for k, (a, b) in enumerate(pieces):
                    if k + 1 < len(pieces):  # gather the next piece while this one is stored
                        a2, b2 = pieces[k + 1]
                        events[(k + 1) % 2] = self._enqueue(rank, (k + 1) % 2, block_ids[a2:b2], "d2h", guard, group)
                    sw.wait(events[k % 2])
                    if k == 0:  # the first piece gathered: the layers are computed; every block summed at once
                        sums = self._device_sums(rank, block_ids, groups)
                    done = self._put_objects(rank, keys[a:b], groups, self._piece_views(rank, k % 2, b - a, group),
                                             self._flat(sums, a, b))
                    count += done
                    if done < b - a:
                        break
            finally:  # nothing may still write a slot when we leave
                self._wait_all(sw, events)
        return count

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None = None, arrived: Callable[[int, Any], None] | None = None) -> int:
        self._check_open()
        self._check_transfer(rank, keys, block_ids)
        if arrived is None:
            count = self._get(rank, keys, block_ids, guard, None)
        elif len(keys) <= self.per_slot * self.spec.layer_groups:  # a group fits a slot: pipelined
            count = self._load_groups(rank, keys, block_ids, guard, arrived)
        else:  # group by group, piece by piece; each is in place (synchronised) when it is reported
            count = self._load_by_group(len(keys), arrived,
                                        lambda g, m: (self._get(rank, keys[:m], block_ids[:m], guard, g), None))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _load_groups(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None,
                     arrived: Callable[[int, Any], None]) -> int:
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
                        events[slot] = self._enqueue(rank, slot, block_ids[:m], "h2d", guard, g)

                    done = self._get_objects(rank, keys, [g], self._piece_views(rank, slot, n, g), scatter, deferred)
                    if deferred:  # verified where it landed before it is reported
                        sw.wait(events[slot])
                        sums = self._device_sums(rank, block_ids[:len(deferred)], [g]) or []
                        done = min(done, self._verify_deferred(rank, deferred, sums))
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
            count = min(count, self._get(rank, keys[:count], block_ids[:count], guard, g))
        return count

    def _get(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None,
             group: int | None) -> int:
        """Read the blocks (every layer, or one layer group) piece by piece into the two
        staging slots, scattering a piece while the next is read; leading blocks scattered."""
        sw, n = self._swappers[rank], len(keys)
        m, groups = self._pieces(group)
        deferred: Deferred | None = [] if self.verify else None  # SUM64 blocks: verified where they land, at the end
        count = 0
        with self._on(rank):
            events: list[Any] = [None, None]
            try:
                for k, a in enumerate(range(0, n, m)):
                    b, slot = min(n, a + m), k % 2
                    if events[slot] is not None:  # the slot's previous scatter must have read it
                        sw.wait(events[slot])

                    def scatter(c: int, slot: int = slot, a: int = a) -> None:
                        events[slot] = self._enqueue(rank, slot, block_ids[a:a + c], "h2d", guard, group)

                    # a block counts only if every object arrived whole (and verified)
                    done = self._get_objects(rank, keys[a:b], groups, self._piece_views(rank, slot, b - a, group),
                                             scatter, deferred if count == len(deferred or ()) else None)
                    count += done
                    if done < b - a:
                        break
            finally:  # nor read one
                self._wait_all(sw, events)
            if deferred:
                sums = self._device_sums(rank, block_ids[:len(deferred)], groups) or []
                count = min(count, self._verify_deferred(rank, deferred, sums))
        return count

    def close(self) -> None:
        """Wait for queued transfers, free staging, caches this backend allocated and streams."""
        if self._closed:
            return
        self._closed = True
        for sw in self._swappers.values():
            sw.close()
        self._swappers.clear()
        self._layers = {}
        self._slots = {}
        self._host = {}
        self._sum_weights = {}
        super().close()
