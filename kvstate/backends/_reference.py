"""The numpy reference backend: real KV bytes on the CPU, moved through the transfer ops.

Each TP rank owns layer-major caches per kind (``key``, ``value``, fp8 scales), one array
per layer ``[num_blocks, heads, block_size, dim]``. A write gathers the blocks into a
block-major host buffer with :func:`~kvstate.kernels.swap_cache_layout` (``"d2h"``) and
puts one object per (block, kind, rank); a read gets the objects into the host buffer and
scatters the blocks that arrived whole (``"h2d"``). The backend knows nothing of request
states: it answers how many *leading* blocks it stored, read or found.

With ``host_blocks`` each rank also holds the host tier's block-major arena; a swap moves
blocks between the caches and its slots with the same op. With state groups
(:mod:`kvstate._statepages`), each rank holds ``num_states`` state pages, ``state_pages[rank]``
``[num_states, state bytes]``, stored as :mod:`~kvstate.backends._stateobjects` says; the
blocks are those of the spec's paged layers (``CacheSpec.paged``: ``self.spec``).

Through an :class:`~kvstate.backends._arena.ArenaStore` whose slot is one object (the shared
store of the processes of a host), a write gathers each object straight into the slot the store
claimed for it and a read scatters straight out of the slot it found: the host's memory is
crossed once, on the backend's copy threads. Each object's checksum is taken as it is copied:
SUM64 by the C helper (:mod:`~kvstate.backends._hostcopy`'s ``copy_sum64``, the GIL let go once
a thread), or XXH3 a layer's chunk at a time where the helper was not built or the caches are
not dense; a reader verifies either. A read counts a block only when its slots still held it after
the copy (:meth:`~kvstate.backends._arena.ArenaStore.unchanged`) and its checksums are its
manifest's; a block scattered but not counted is not the caller's to use. A read whose
manifests are of two algorithms, or of SUM64 where the helper was not built, goes through host
rows, as every other store's reads do.

The ``guard`` (see :mod:`kvstate.backends._base`) is asked just before blocks are gathered or
scattered. Only the slow store operation runs between the check and the end of the command;
the check-to-copy window is a local copy, which ``Policy.fence_grace`` covers.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import xxhash

from .._errors import KVStateError, ProtocolError, ValidationError
from .._spec import CacheSpec
from .._tables import page_layers, slot_of_layer
from .._validate import check_int, is_int
from ..kernels._reference import swap_cache_layout
from ._arena import ArenaStore
from ._base import MISSING, Guard, Store, check_caches, check_fence, leading
from ._hostcopy import copy_sum64, stream_copy
from ._integrity import SUM64, XXH3, sum64
from ._lends import LendBoard, fold_sums, leading_matches, local_peer
from ._objects import StoreBackend
from ._shm import SharedCaches, shm_directory
from ._stateobjects import paged_of
from ._stores import PARALLEL_BYTES, default_threads

__all__ = ["ReferenceBackend", "KEEP_STAGING_BYTES"]

#: host rows a transfer thread keeps between its transfers, per kind: memory touched once is
#: reused (a fresh buffer page-faults on every first write, and a read's copy into one ran at
#: a seventh of the speed); a larger transfer gets rows of its own, freed after it
KEEP_STAGING_BYTES = 256 << 20


class ReferenceBackend(StoreBackend):
    """Per-rank numpy caches over a :class:`~kvstate.backends._stores.Store`.

    ``ranks`` (default: all) are the TP ranks held here: a rank worker holds one. ``caches``,
    when given, maps each of them to ``{kind: [per-layer arrays]}`` the engine owns, or is a
    :class:`~kvstate.backends._shm.SharedCaches` (shared memory another process created: a
    puller of a third process can then map it too); otherwise zeroed arrays are allocated. ``lends`` /
    ``pulls``: the direct handoff's board (:mod:`kvstate.backends._lends`), to lend blocks on
    (P) or pull reads from (D), between backends of one process."""

    def __init__(self, spec: CacheSpec, num_blocks: int, store: Store, *, host_blocks: int = 0,
                 ranks: Sequence[int] | None = None,
                 caches: Mapping[int, Mapping[str, Sequence[Any]]] | SharedCaches | None = None,
                 num_states: int = 0, states: Mapping[int, np.ndarray] | None = None,
                 lends: LendBoard | None = None, pulls: LendBoard | None = None) -> None:
        full, spec = spec, paged_of(spec)
        self._setup(spec, num_blocks, store, ranks, host_blocks)
        self._setup_lends(lends, pulls, full)
        self._token = local_peer(self)  # what a D backend of this process finds its caches by
        #: rank -> the shared-memory file its caches live in (``caches`` given as a SharedCaches):
        #: what a puller of another process maps
        self._files: dict[int, str] = {}
        if isinstance(caches, SharedCaches):
            self._files = {r: caches.paths[r] for r in self.ranks if r in caches.paths}
            caches = caches.caches
        self._peers: OrderedDict[str, SharedCaches] = OrderedDict()  # lenders' files mapped here
        self._setup_states(full, num_states, self._gather_state, self._scatter_state)
        #: state_pages[rank] -> [num_states, state bytes] (with state groups): ``states[rank]``
        #: when given (e.g. shared memory, :class:`~kvstate.backends._shm.SharedCaches`), else zeroed
        self.state_pages = {r: np.zeros((num_states, self.state_size), np.uint8) for r in self.ranks} \
            if states is None else {r: self._state_array(states, r) for r in self.ranks}
        if caches is not None:
            check_caches(spec, num_blocks, self.ranks, caches, "ReferenceBackend")
        self._staging = threading.local()  # each transfer thread's kept host rows (_buffers)
        self._in_place: bool | None = None  # whether transfers go straight through an arena's slots
        self._movers: ThreadPoolExecutor | None = None  # their copy threads, started on first use
        self._movers_lock = threading.Lock()
        self.host_blocks = host_blocks  #: slots of the host tier arena, per rank
        #: host[rank][kind] -> block-major arena [host_blocks, layers, heads, block_size, dim]
        self.host = {r: self._host(host_blocks) for r in self.ranks} if host_blocks else {}
        #: caches[rank][kind] -> list of per-layer arrays [num_blocks, heads, block_size, dim]
        #: (with group tables, layers at one slot of a block share an array: :mod:`kvstate._tables`)
        self.caches: dict[int, dict[str, list[np.ndarray]]] = {
            r: ({kind: list(caches[r][kind]) for kind in spec.kinds} if caches is not None else
                {kind: self._layer_arrays(num_blocks, kind) for kind in spec.kinds})
            for r in self.ranks}

    def _layer_arrays(self, num_blocks: int, kind: str) -> list[np.ndarray]:
        """Zeroed caches of ``kind``, one array per layer slot of a block, listed per layer."""
        spec = self.spec
        slots = [np.zeros((num_blocks,) + spec.block_shape(kind), spec.kind_dtype(kind))
                 for _ in range(page_layers(spec))]
        return [slots[i] for i in slot_of_layer(spec)]

    # -- block access (tests, the demo's fake compute) -----------------------------------------
    def _layer_views(self, rank: int, kind: str) -> list[np.ndarray]:
        return self.caches[rank][kind]

    def _gather_state(self, rank: int, page: int, out: np.ndarray) -> None:
        out[:] = self.state_pages[rank][page]

    def _scatter_state(self, rank: int, page: int, data: np.ndarray) -> None:
        self.state_pages[rank][page] = data

    def _arena(self, rank: int, kind: str) -> np.ndarray:
        return self.host[rank][kind]

    # -- TransferBackend -----------------------------------------------------------------------
    def _swap(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int], direction: str,
              guard: Guard | None) -> int:
        self._check_swap(rank, block_ids, host_slots)
        check_fence(guard, rank, "gather" if direction == "d2h" else "scatter into", block_ids)
        if block_ids:
            for kind, arena in self.host[rank].items():
                swap_cache_layout(self.caches[rank][kind], arena, list(block_ids), list(host_slots), direction)
        self.bytes_swapped += len(block_ids) * self.spec.bytes_per_block_per_rank
        return len(block_ids)

    # -- the direct handoff (kvstate.backends._lends): within this process ----------------------
    def lend_peer(self, rank: int) -> dict[str, Any]:
        if rank in self._files:
            return {"kind": "shm", "pid": os.getpid(), "token": self._token, "path": self._files[rank],
                    "num_blocks": self.num_blocks}
        return {"kind": "local", "pid": os.getpid(), "token": self._token}

    def lend_sums(self, rank: int, block_ids: Sequence[int] | np.ndarray) -> list[int]:
        """SUM64 of each block's bytes, every kind and layer."""
        return [fold_sums([sum64(self.block_bytes(rank, k, b)) for k in self.spec.kinds]) for b in block_ids]

    def pull_copy(self, rank: int, peer: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
                  dst_ids: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray, guard: Guard | None) -> int:
        """Copy a lender's blocks into this backend's: another backend of this process, or
        (``shm``) caches in a shared-memory file of this host, mapped here; how many leading
        blocks landed with the lender's ``sums``."""
        theirs = self._lender_caches(peer, rank)
        blocks = len(theirs[self.spec.kinds[0]][0])
        if not len(src_ids) == len(dst_ids) == len(sums):
            raise ProtocolError(f"rank {rank}: a pull needs as many lender's blocks, own blocks and checksums, got "
                                f"{len(src_ids)}, {len(dst_ids)} and {len(sums)}")
        if not all(is_int(b) and 0 <= b < blocks for b in src_ids):
            raise ProtocolError(f"rank {rank}: the lend names blocks {list(src_ids)[:8]} its caches do not hold")
        check_fence(guard, rank, "scatter into", dst_ids)
        ids, into = list(src_ids), list(dst_ids)
        for kind in self.spec.kinds:
            for mine, layer in zip(self.caches[rank][kind], theirs[kind], strict=True):
                mine[into] = layer[ids]
        return leading_matches(self.lend_sums(rank, dst_ids), sums)

    def _lender_caches(self, peer: dict[str, Any], rank: int) -> dict[str, list[np.ndarray]]:
        """The lender's caches of ``rank``: its arrays when it is of this process, else its
        shared-memory file mapped (a file of this host's shared-memory directory only)."""
        kind, pid = peer.get("kind"), peer.get("pid")
        if kind in ("local", "shm") and pid == os.getpid():
            src: ReferenceBackend = local_peer(None, peer.get("token"))
            if rank not in src.caches:
                raise ProtocolError(f"rank {rank}: the lending backend does not hold this rank")
            return src.caches[rank]
        path, blocks = peer.get("path"), peer.get("num_blocks")
        if kind != "shm" or not isinstance(path, str) or not is_int(blocks) or \
                Path(path).parent != shm_directory() or not Path(path).name.startswith("kvstate-"):
            raise ProtocolError(f"a reference backend pulls from its own process or from kvstate's shared-memory "
                                f"caches in {shm_directory()}, not {peer!r:.160}")
        if path not in self._peers:
            try:
                self._peers[path] = SharedCaches.attach(self.spec, blocks, {rank: path})
            except KVStateError as e:
                raise ProtocolError(f"the lender's caches {path}: {e}") from None
            while len(self._peers) > 8:
                self._peers.popitem(last=False)[1].close()
        self._peers.move_to_end(path)
        return self._peers[path].caches[rank]

    def _state_array(self, states: Mapping[int, np.ndarray], rank: int) -> np.ndarray:
        """Rank ``rank``'s given state pages, checked: a writable ``[num_states, state bytes]`` uint8 array."""
        a = states.get(rank) if isinstance(states, Mapping) else None
        shape = (self.num_states, self.state_size)
        if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != np.uint8 or not a.flags.c_contiguous \
                or not a.flags.writeable:
            raise ValidationError(f"ReferenceBackend: state pages of rank {rank} must be a writable contiguous "
                                  f"uint8 array of shape {shape}")
        return a

    def close(self) -> None:
        """Let go of every thread's kept host rows and lenders' mapped files, then the store's side."""
        self._staging = threading.local()
        with self._movers_lock:
            movers, self._movers = self._movers, None
        if movers is not None:
            movers.shutdown(wait=True)
        while getattr(self, "_peers", None):
            self._peers.popitem()[1].close()
        super().close()

    def _host(self, n: int) -> dict[str, np.ndarray]:
        """The host tier's arena: whole blocks of the rank, every head."""
        spec = self.spec
        return {k: np.zeros((n, spec.layers) + spec.block_shape(k), spec.kind_dtype(k)) for k in spec.kinds}

    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
              guard: Guard | None = None, layers: Callable[..., Any] | None = None,
              tables: Sequence[Sequence[int]] = (), window_from: int = 0) -> int:
        self._check_transfer(rank, keys, block_ids, tables, window_from)
        if not self.spec.writes(rank):  # a replica: the first rank holding these heads stores them
            return len(keys)
        if tables:  # group tables: each group from its own blocks
            ids = self._group_ids(block_ids, tables)
            count = self._each_part(rank, len(keys), lambda part, m, _: self._write_groups(
                keys[:m], ids, window_from, lambda g, ks, b: self._put_layers(rank, part, ks, b, guard, g, len(ks))))
        else:
            count = self._each_part(rank, len(keys), lambda part, m, _: self._write_part(
                rank, part, keys, block_ids, guard, layers, m))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _write_part(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                    guard: Guard | None, layers: Callable[..., Any] | None, m: int) -> int:
        """Store the first ``m`` blocks of one head group, layer-wise when ``layers`` is given."""
        put = partial(self._put_layers, rank, part, keys, block_ids, guard)
        return put(None, m) if layers is None else self._by_group(m, layers, lambda grp, k, _: put(grp, k))

    def _buffers(self, m: int, group: int | None) -> tuple[dict[str, np.ndarray], slice]:
        """Block-major host rows for ``m`` blocks of every layer (``group`` None) or of one layer
        group, and the slice of layers they hold: this thread's own, kept and reused up to
        :data:`KEEP_STAGING_BYTES` a kind (each transfer thread has its own: they run at once)."""
        spec = self.spec
        a, b = (0, spec.layers) if group is None else spec.group_span(group)
        kept = self._staging.__dict__.setdefault("rows", {})
        out = {}
        for k in spec.kinds:
            shape, dtype = (m, b - a) + spec.object_shape(k), np.dtype(spec.kind_dtype(k))
            need = int(np.prod(shape))
            if need * dtype.itemsize > KEEP_STAGING_BYTES:
                out[k] = np.empty(shape, dtype)
                continue
            rows = kept.get(k)
            if rows is None or rows.size < need:
                rows = kept[k] = np.empty(need, dtype)
                rows.view(np.uint8).fill(0)  # touched now, once
            out[k] = rows[:need].reshape(shape)
        return out, slice(a, b)

    def _part_layers(self, rank: int, kind: str, span: slice) -> list[np.ndarray]:
        """The rank's layers at positions ``span`` of the stored order, of ``kind``, seen by part
        (see :mod:`~kvstate.backends._objects`)."""
        layers = self.caches[rank][kind]
        return [self._part_view(layers[i], kind) for i in self.spec.storage_order[span]]

    def _put_layers(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                    guard: Guard | None, group: int | None, m: int) -> int:
        """Gather and store the first ``m`` blocks of head group ``part`` (its place on the rank,
        its index): every layer, or layer group ``group``."""
        if self._zero_copy():
            return self._arena_put(rank, part, keys[:m], block_ids[:m], guard, group)
        host, span = self._buffers(m, group)
        check_fence(guard, rank, "gather", block_ids[:m])
        ids = self._part_ids(block_ids[:m], part[0])
        for kind, buf in host.items():
            swap_cache_layout(self._part_layers(rank, kind, span), buf, ids, list(range(m)), "d2h")
        return self.objects.put(part[1], keys[:m], None if group is None else [group],
                                self._group_views(host, m, group))

    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
             guard: Guard | None = None, arrived: Callable[[int, Any], None] | None = None,
             window_from: int = 0, tables: Sequence[Sequence[int]] = ()) -> int:
        self._check_transfer(rank, keys, block_ids, tables)
        check_int(window_from, "ReferenceBackend.read: window_from", minimum=0, maximum=len(keys))
        if (window_from and self.spec.splits_groups) or tables:  # group by group
            return self._each_part(rank, len(keys), lambda part, m, _: self._read_window(
                part, keys, self._group_ids(block_ids, tables), m, window_from,
                lambda g, ks, ids: self._get_layers(rank, part, ks, ids, guard, g, len(ks))))
        count = self._each_part(rank, len(keys), lambda part, m, whole: self._read_part(
            rank, part, keys, block_ids, guard, arrived if whole else None, m))
        self.bytes_moved += count * self.spec.bytes_per_block_per_rank
        return count

    def _read_part(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, arrived: Callable[[int, Any], None] | None, m: int) -> int:
        """Read the first ``m`` blocks of one head group, reporting layers when ``arrived`` is given."""
        get = partial(self._get_layers, rank, part, keys, block_ids, guard)
        return get(None, m) if arrived is None else self._load_by_group(m, arrived, lambda grp, k: (get(grp, k), None))

    def _get_layers(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                    guard: Guard | None, group: int | None, m: int) -> int:
        """Read the first ``m`` blocks of head group ``part`` (every layer, or layer group
        ``group``) and scatter the leading ones that arrived whole (a short read is a miss)."""
        if self._zero_copy():
            count = self._arena_settled(part, keys[:m], group, lambda s: self._arena_get(
                rank, part, keys[s:m], block_ids[s:m], guard, group))
            if count is not None:
                return count
        host, span = self._buffers(m, group)
        count = self.objects.get(part[1], keys[:m], None if group is None else [group],
                                 self._group_views(host, m, group))
        if count:
            check_fence(guard, rank, "scatter into", block_ids[:count])
            ids = self._part_ids(block_ids[:count], part[0])
            for kind, buf in host.items():
                swap_cache_layout(self._part_layers(rank, kind, span), buf, ids, list(range(count)), "h2d")
        return count

    # -- zero copy: an arena store's slots are the host rows -----------------------------------
    def _zero_copy(self) -> bool:
        if self._in_place is None:
            self._in_place = self._arena_fits()
        return self._in_place

    def _arena_put(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, group: int | None) -> int:
        """Gather the blocks straight into slots the arena claimed, each object's checksum
        taken as it copies, then publish the objects and their manifests in one step: leading
        blocks stored.
        Claims not published are let go, whatever stops the write."""
        store, groups = cast(ArenaStore, self.store), None if group is None else [group]
        per, names = self.objects.per(groups), self.objects.names(part[1], keys, groups)
        mnames: list[str] = []
        count = 0
        try:
            slots = store.claim(names)
            n = leading(all(s >= 0 for s in slots[i * per:(i + 1) * per]) for i in range(len(keys)))
            check_fence(guard, rank, "gather", block_ids[:n])
            algorithm = SUM64 if self._summable(rank) else XXH3
            sums = self._move_objects(self._slot_objects(rank, part, block_ids[:n], slots, groups), True, algorithm)
            mnames, blobs = self.objects.manifests(part[1], keys[:n], groups, [store.big.size] * len(sums), sums,
                                                   algorithm)
            n = leading(st == 0 for st in store.stage(mnames, blobs))
            status = store.publish(names[:n * per] + mnames[:n])
            count = self.objects.leading_blocks(keys[:n], groups, [st == 0 for st in status])
            return count
        finally:
            store.release(names[count * per:] + mnames[count:])

    def _arena_get(self, rank: int, part: tuple[int, int], keys: Sequence[str], block_ids: Sequence[int],
                   guard: Guard | None, group: int | None) -> int | None:
        """Scatter the blocks straight out of the slots the arena holds them in, each object's
        checksum taken as it copies; the leading blocks whose slots held them throughout and whose
        checksums are their manifests' (the first broken one evicted). None: their manifests
        are of two algorithms, or of SUM64 where the C helper cannot take it: for the host rows'
        path to read."""
        store, groups = cast(ArenaStore, self.store), None if group is None else [group]
        per, gs = self.objects.per(groups), self.objects.groups_of(groups)
        places = store.locate(self.objects.names(part[1], keys, groups))
        read, vouched = self.objects.read_manifests(part[1], keys, groups)
        got = [p.length if p.slot >= 0 else MISSING for p in places]
        whole = self.objects.arrived(keys, gs, got, vouched)
        algorithms = {alg for alg, _ in vouched[:whole * len(gs)]} or {XXH3}
        if len(algorithms) > 1 or algorithms == {SUM64} and not self._summable(rank):
            return None
        check_fence(guard, rank, "scatter into", block_ids[:whole])
        sums = self._move_objects(self._slot_objects(rank, part, block_ids[:whole], [p.slot for p in places],
                                                     groups), False, algorithms.pop())
        still = store.unchanged(places[:whole * per])
        w = leading(all(still[i * per:(i + 1) * per]) for i in range(whole))
        want = [(keys[i], self.objects.expected(i, gs, vouched)) for i in range(w)]
        done = self.objects.verify_deferred(part[1], want, [sums[i * per:(i + 1) * per] for i in range(w)])
        if done == whole:
            self.objects.evict_if_broken(part[1], keys, groups, got, read, whole)
        return done

    def _slot_objects(self, rank: int, part: tuple[int, int], block_ids: Sequence[int], slots: Sequence[int],
                      groups: Sequence[int] | None) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """Each object of the blocks (names' order: block, kind, layer group), as its slot's
        bytes and the block's chunk of each layer it holds, in the stored order."""
        spec, rows = self.spec, cast(ArenaStore, self.store).slots()
        spans = [slice(0, spec.layers) if g is None else slice(*spec.group_span(g))
                 for g in self.objects.groups_of(groups)]
        layers = {(k, i): self._part_layers(rank, k, span) for k in spec.kinds for i, span in enumerate(spans)}
        ids = self._part_ids(block_ids, part[0])
        return [(rows[slots[j]], [layer[b] for layer in layers[k, i]])
                for j, (b, k, i) in enumerate((b, k, i) for b in ids for k in spec.kinds for i in range(len(spans)))]

    def _summable(self, rank: int) -> bool:
        """Whether the rank's chunks can be copied with their SUM64 taken by the C helper: it is
        built, and every layer is C-contiguous with chunks of whole 64-bit words."""
        return copy_sum64 is not None and all(layer.flags.c_contiguous and layer[0].nbytes % 8 == 0
                                              for layers in self.caches[rank].values() for layer in layers)

    def _move_objects(self, objects: list[tuple[np.ndarray, list[np.ndarray]]], gather: bool,
                      algorithm: int) -> list[int]:
        """Move each object between its slot and its chunks (``gather``: into the slot), on
        the copy threads when the batch is large; each object's checksum under ``algorithm``
        (SUM64 by the C helper, one call a thread; XXH3 chunk by chunk), in order. Returns
        only when every copy has ended, whatever failed."""
        sums = [0] * len(objects)

        def run(idx: range) -> None:
            if algorithm == SUM64:
                sums[idx.start:idx.stop] = _copy_summed([objects[i] for i in idx], gather)
            else:
                for i in idx:
                    sums[i] = _move_object(*objects[i], gather)

        threads = default_threads()
        if threads < 2 or len(objects) < 2 or sum(r.nbytes for r, _ in objects) < PARALLEL_BYTES:
            run(range(len(objects)))
            return sums
        with self._movers_lock:
            if self._movers is None:
                self._movers = ThreadPoolExecutor(threads, "kvstate-move")
            step = -(-len(objects) // threads)
            futures = [self._movers.submit(run, range(a, min(a + step, len(objects))))
                       for a in range(0, len(objects), step)]
        wait(futures)
        for f in futures:
            f.result()
        return sums


def _copy_summed(objects: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]], gather: bool) -> list[int]:
    """Move the objects with the C helper (one call, the GIL let go once); their SUM64."""
    dsts: list[np.ndarray] = []
    srcs: list[np.ndarray] = []
    starts = []
    for row, chunks in objects:
        starts.append(len(dsts))
        at = 0
        for c in chunks:
            piece, flat = row[at:at + c.nbytes], c.reshape(-1).view(np.uint8)
            at += c.nbytes
            dsts.append(piece if gather else flat)
            srcs.append(flat if gather else piece)
    return cast(Callable[..., list[int]], copy_sum64)(dsts, srcs, starts)  # there: _summable said so


def _move_object(row: np.ndarray, chunks: Sequence[np.ndarray], gather: bool) -> int:
    """Copy ``chunks`` into the slot bytes ``row`` one after another (``gather``), or back out
    of it; the XXH3 of the bytes moved. Each chunk is hashed where it is read from, then copied
    while it is still in cache, with streaming stores where the helper is built (the copy's
    destination is not read again soon, so it need not be read into the cache first)."""
    h, at = xxhash.xxh3_64(), 0
    for c in chunks:
        piece = row[at:at + c.nbytes]
        at += c.nbytes
        if stream_copy is not None and c.flags.c_contiguous:
            flat = c.reshape(-1).view(np.uint8)
            src, dst = (flat, piece) if gather else (piece, flat)
            h.update(src.data)
            stream_copy(dst, src)
        elif gather:
            np.copyto(piece.view(c.dtype).reshape(c.shape), c)
            h.update(piece.data)
        else:
            h.update(piece.data)
            np.copyto(c, piece.view(c.dtype).reshape(c.shape))
    return h.intdigest()
