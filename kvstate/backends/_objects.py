"""Blocks as objects in a :class:`~kvstate.backends._base.Store`: what the reference and CUDA
backends share.

One object per (block, kind, head group, layer group), named by :func:`~kvstate._keys.rank_key`
with the head group's index (the rank's own, by default: :mod:`kvstate._spec` gives the
rank-neutral layout's rules), and, unless the store is trusted (``store.verify`` off), a
checksummed manifest per (block, head group, layer group) beside them
(:mod:`~kvstate.backends._integrity`: its rules). Every put and get of objects goes through
:meth:`BlockObjects.put` and :meth:`BlockObjects.get` (``StoreBackend.objects``), so every backend
writes manifests and verifies reads the same way. A block counts as stored, or as read, only
when every one of its objects (and its manifest) is; a read that finds a block broken evicts it.

A rank holding several head groups (a D at a lower TP degree than its P) moves each group as a
*part*: its caches seen as ``[num_blocks * head_groups, object_heads, block_size, dim]``, in
which block ``b``'s group ``g`` is row ``b * head_groups + g`` (:meth:`StoreBackend._part_ids`),
so one gather or scatter op per part moves contiguous chunks. A rank replicating another's heads
writes nothing: the first replica stores them.

A read straight out of an arena's slots that stops at a block whose objects are stored once it
stopped lost a race, not the block: another put of the same key (keys name their content, so
its bytes are equal) replaced the slot it copied from while it copied, and the read could not
count it. It is read again from there, at most
:data:`~kvstate.backends._arena.ARENA_REREADS` times
(:meth:`StoreBackend._arena_settled`); a block evicted or found broken is gone by then, and
stays a miss.
"""
from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, cast

import numpy as np

from .._blocks import table_kinds
from .._errors import ConfigError, ValidationError
from .._pool import FREED
from .._spec import CacheSpec
from .._tables import check_layout, per_block, table_of_layer
from .._validate import MAX_BLOCKS, all_ints, check_int, is_int
from ..kernels._ids import checked_ids
from ._arena import ARENA_REREADS, ArenaStore
from ._base import Guard, Store, TransferBackend, as_bytes_view, leading
from ._integrity import Hasher
from ._lends import LendBoard, PeerOps, lend_blocks, pull_blocks
from ._manifested import MANIFEST_KIND, BlockObjects
from ._stateobjects import PageCopy, StateObjects
from ._stores import default_threads

__all__ = ["StoreBackend", "MANIFEST_KIND"]


class StoreBackend(TransferBackend):
    """One object per (block, kind, rank, layer group) in a :class:`Store`: checks, views,
    query, whole blocks, a logical block's bytes. Its parts: ``objects`` (the objects and
    their manifests, :class:`~kvstate.backends._manifested.BlockObjects`) and ``states`` (state
    pages as objects, :class:`~kvstate.backends._stateobjects.StateObjects`); the subclass is
    the device (numpy or CUDA) they are copied from and into."""

    def _setup(self, spec: CacheSpec, num_blocks: int, store: Store, ranks: Sequence[int] | None = None,
               host_blocks: int = 0) -> None:
        name = type(self).__name__
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"{name}: spec must be a CacheSpec")
        spec.check_moved(name)
        check_int(host_blocks, f"{name}: host_blocks", minimum=0, maximum=MAX_BLOCKS)
        check_layout(spec, False, host_blocks, name)
        if not is_int(num_blocks) or not 0 < num_blocks <= MAX_BLOCKS:
            raise ValidationError(f"{name}: num_blocks must be an int in 1..{MAX_BLOCKS}, got {num_blocks!r}")
        if not isinstance(store, Store):
            raise ValidationError(f"{name}: store must be a kvstate Store")
        self.spec, self.num_blocks, self.store = spec, num_blocks, store
        #: the TP ranks whose caches this backend holds: all of them, or (a rank worker's) a few
        self.ranks = self._check_ranks(ranks)
        self.bytes_moved = 0  #: payload bytes written to and read from the store
        self.bytes_swapped = 0  #: payload bytes copied to and from the host tier
        self.objects = BlockObjects(spec, store)  #: the blocks' objects and manifests in the store
        #: manifests written and reads verified (the store's setting: a trusted pool turns it off)
        self.verify = self.objects.verify
        self._hash = Hasher(default_threads())  # a transfer's host checksums on a thread a core, up to 8
        self._slot_sums: dict[tuple[int, int], list[int]] = {}  # (rank, host slot) -> checksum per kind
        self.broken_slots = 0  #: host tier slots whose bytes no longer matched their checksums

    def _setup_lends(self, lends: Any, pulls: Any, full: CacheSpec) -> None:
        """The lend boards, checked: ``lends`` (P: lend blocks there) and ``pulls`` (D: pull its
        reads from P's lends there first; P's own prefix reads must not wait for lends). The
        direct handoff moves a cache's paged blocks whole, so it serves specs without state
        layers or group tables."""
        name = type(self).__name__
        for what, board in (("lends", lends), ("pulls", pulls)):
            if board is not None and not isinstance(board, LendBoard):
                raise ConfigError(f"{name}: {what} must be a LendBoard or None, got {type(board).__name__}")
            if board is not None and (full.state_bytes_per_rank or per_block(self.spec) != 1):
                raise ConfigError(f"{name}: the direct handoff ({what}=) moves paged caches without state layers "
                                  "or per-group block tables")
        self.lends, self.pulls = lends, pulls
        #: lends posted and how they ended; pulls and how they ended (``no_lend``: the store was read)
        self.lend_counts = dict.fromkeys(("lent", "pulled", "unpulled", "pulls", "pull_failed", "no_lend"), 0)
        self._counting = threading.Lock()  # lends and pulls end on several threads at once

    def lend(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], until: Callable[[], bool],
             guard: Guard | None = None, stores: bool = False) -> int:
        if self.lends is None:
            return super().lend(rank, keys, block_ids, until, guard, stores)
        self._check_transfer(rank, keys, block_ids)
        n = lend_blocks(self.lends, cast(PeerOps, self), rank, keys, block_ids, until, guard, stores)
        with self._counting:
            self.lend_counts["lent"] += 1
            self.lend_counts["pulled" if n else "unpulled"] += 1
        return n

    def pull(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], until: Callable[[], bool],
             guard: Guard | None = None) -> int | None:
        if self.pulls is None:
            return None
        packed = self._check_transfer(rank, keys, block_ids)  # the ids as an array, for the copy's upload
        n = pull_blocks(self.pulls, cast(PeerOps, self), rank, keys, block_ids if packed is None else packed, until,
                        guard)
        self._count_pull(len(keys), n)
        return n

    def _count_pull(self, wanted: int, n: int | None) -> None:
        """A pull of ``wanted`` blocks answered ``n`` (:func:`~kvstate.backends._lends.pull_blocks`)."""
        key = "no_lend" if n is None else "pulls" if n == wanted else "pull_failed"
        with self._counting:
            self.lend_counts[key] += 1
            if n is not None and n == wanted:
                self.bytes_moved += n * self.spec.bytes_per_block_per_rank

    def _arena_fits(self) -> bool:
        """Whether transfers can go straight between the caches and the store's slots: an
        :class:`~kvstate.backends._arena.ArenaStore` with manifests on, whose big slot is exactly
        one object (one kind of a block, every layer or one layer group's), one head group a
        rank and no window groups (whose objects differ in size)."""
        spec, store = self.spec, self.store
        return isinstance(store, ArenaStore) and store.verify and spec.head_groups == 1 and \
            not spec.splits_groups and all(spec.group_layers * int(np.prod(spec.block_shape(k))) *
                                           np.dtype(spec.kind_dtype(k)).itemsize == store.big.size
                                           for k in spec.kinds)

    def _arena_settled(self, part: tuple[int, int], keys: Sequence[str], group: int | None,
                       get: Callable[[int], int | None]) -> int | None:
        """``get(start)``: an arena read of ``keys[start:]``, answering its leading blocks read
        whole (None: not readable in place); read again from a block that stopped it while its
        objects are stored (see the module's docstring)."""
        count = get(0)
        for _ in range(ARENA_REREADS):
            if count is None or count >= len(keys) or not self._arena_holds(part, keys[count], group):
                break
            more = get(count)
            if more is None:
                break
            count += more
        return count

    def _arena_holds(self, part: tuple[int, int], key: str, group: int | None) -> bool:
        """Whether every object of ``key``'s block (one head group, one or every layer group)
        is in the arena now."""
        return all(self.store.batch_is_exist(self.objects.names(part[1], [key], None if group is None else [group])))

    def lend_geometry(self) -> str:
        """The backend's kind (its kvstate class, whatever subclasses it) and every field of its
        spec: equal on both sides exactly when a block of one is a block of the other."""
        spec, known = self.spec, self.__dict__.get("_geometry")
        if known is None or known[0] is not spec:  # asked on every pull; the spec is frozen
            kind = next(c.__name__ for c in type(self).__mro__ if c.__module__.startswith("kvstate."))
            text = f"{kind}|" + "|".join(f"{f.name}={getattr(spec, f.name)}" for f in fields(spec))
            known = self.__dict__["_geometry"] = (spec, text)
        return known[1]

    def _setup_states(self, spec: CacheSpec, num_states: int, gather: PageCopy, scatter: PageCopy) -> None:
        """The state pages' part (``spec``: the whole cache's, state groups and all), over the
        device's page copies."""
        self.states = StateObjects(type(self).__name__, spec, num_states, self.store, self.ranks, gather, scatter)

    @property
    def broken_blocks(self) -> int:
        """Blocks a read found broken (and evicted from the store)."""
        return self.objects.broken_blocks

    @property
    def broken_states(self) -> int:
        """State objects a read found broken (and evicted from the store)."""
        return self.states.broken

    @property
    def num_states(self) -> int:
        """State pages per rank (0 without state groups)."""
        return self.states.num_states

    @property
    def state_size(self) -> int:
        """Bytes of one state page on one rank."""
        return self.states.size

    def _check_ranks(self, ranks: Sequence[int] | None) -> tuple[int, ...]:
        tp = self.spec.tp_size
        if ranks is None:
            return tuple(range(tp))
        name = type(self).__name__
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            raise ValidationError(f"{name}: ranks must be a non-empty sequence of ints, got {ranks!r}")
        for r in ranks:
            if not is_int(r) or not 0 <= r < tp:
                raise ValidationError(f"{name}: rank {r!r} outside 0..{tp - 1}")
        if len(set(ranks)) != len(ranks):
            raise ValidationError(f"{name}: ranks {list(ranks)} name a rank twice")
        return tuple(sorted(ranks))

    def _check_keys(self, rank: int, keys: Sequence[str]) -> None:
        """Rank served here; keys a sequence of non-empty str. Raises before anything is touched."""
        name = type(self).__name__
        if not is_int(rank) or not 0 <= rank < self.spec.tp_size:
            raise ValidationError(f"{name}: rank {rank!r} outside 0..{self.spec.tp_size - 1}")
        if rank not in self.ranks:
            raise ValidationError(f"{name}: rank {rank} is not held here (this backend holds ranks {self.ranks})")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) \
                or not (set(map(type, keys)) <= {str} and all(keys) or all(isinstance(k, str) and k for k in keys)):
            raise ValidationError(f"{name}: keys must be a sequence of non-empty str, got {keys!r}")

    def _check_transfer(self, rank: int, keys: Sequence[str], block_ids: Sequence[int],
                        tables: Sequence[Sequence[int]] = (), window_from: int = 0) -> np.ndarray | None:
        """As :meth:`_check_keys`, and block ids one per key, ints in range and distinct, in
        group 0's table and, with group tables (:mod:`kvstate._tables`), each other group's
        (a window group's may be ``FREED`` before ``window_from``: not moved). A single table
        of plain ints is checked in one compiled pass, and answered packed as int64 (None
        otherwise): a pull's hundreds of ids are on the path of a first token."""
        self._check_keys(rank, keys)
        name = type(self).__name__
        want = per_block(self.spec) - 1
        if not want and not tables and block_ids.__class__ is list and len(block_ids) == len(keys) and \
                set(map(type, block_ids)) <= {int}:
            packed = checked_ids(block_ids, self.num_blocks)
            if packed is not None:
                return packed  # else the checks below find and name the id
        if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence) or len(tables) != want:
            raise ValidationError(f"{name}: {want} other block tables expected (one per layer group past the "
                                  f"first, kvstate._tables), got {tables!r}")
        windows = tuple(t for t, k in enumerate(table_kinds(self.spec)) if k.frees_behind_window) if tables else ()
        every: list[int] = []
        for t, ids in enumerate((block_ids, *tables)):
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValidationError(f"{name}: block ids must be a sequence of ints, got {ids!r}")
            if len(ids) != len(keys):
                raise ValidationError(f"{name}: {len(keys)} keys but {len(ids)} block ids")
            lo = window_from if t in windows else 0
            if FREED in ids[:lo]:
                ids = [b for b in ids[:lo] if b != FREED] + list(ids[lo:])
            self._check_blocks(ids)
            every += ids
        if len(set(every)) != len(every):
            raise ValidationError(f"{name}: block ids {every} name a block twice")
        return None

    def _group_ids(self, block_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """Each stored group's block ids: its own table's with group tables, else ``block_ids``."""
        return [block_ids, *tables] if tables else [block_ids] * self.spec.object_groups

    def _write_groups(self, keys: Sequence[str], group_ids: Sequence[Sequence[int]], window_from: int,
                      put: Callable[[int, Sequence[str], Sequence[int]], int]) -> int:
        """Store one head group's blocks group by group, each by ``put(group, keys, block_ids)``
        from its own table (``group_ids``): the full groups' every block, the window groups'
        from ``window_from`` on; the leading blocks every group holding them stored."""
        count = m = len(keys)
        for g, group in enumerate(self.spec.stored_groups):
            lo = min(window_from, m) if group.kind == "window" else 0
            if m > lo:
                count = min(count, lo + put(g, keys[lo:m], group_ids[g][lo:m]))
        return count

    def _check_swap(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int]) -> None:
        """A swap's rank, block ids (as a transfer's) and host slots: one per block, in range, distinct."""
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise ValidationError(f"{type(self).__name__}: block ids must be a sequence of ints, got {block_ids!r}")
        self._check_transfer(rank, [f"block{b}" for b in range(len(block_ids))], block_ids)
        self._check_slots(host_slots, len(block_ids))

    def _check_slots(self, host_slots: Sequence[int], n: int) -> None:
        """``n`` host tier slots: ints in the arena's range, distinct (and a tier to hold them)."""
        name = type(self).__name__
        host_blocks = getattr(self, "host_blocks", 0)
        if not host_blocks:
            raise ValidationError(f"{name} has no host tier: build it with host_blocks > 0")
        if isinstance(host_slots, (str, bytes)) or not isinstance(host_slots, Sequence) or len(host_slots) != n:
            raise ValidationError(f"{name}: host slots must be a sequence of one int per block ({n})")
        for h in host_slots:
            if not is_int(h) or not 0 <= h < host_blocks:
                raise ValidationError(f"{name}: host slot {h!r} outside 0..{host_blocks - 1}")
        if len(set(host_slots)) != len(host_slots):
            raise ValidationError(f"{name}: host slots {list(host_slots)} name a slot twice")

    def _arena(self, rank: int, kind: str) -> Any:
        """The host tier's block-major array of ``kind`` on ``rank`` (backends with a tier)."""
        raise ValidationError(f"{type(self).__name__} has no host tier")

    def _swap(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int], direction: str,
              guard: Guard | None) -> int:
        """Copy blocks between the caches and the arena's slots (``d2h``: into the slots)."""
        raise ValidationError(f"{type(self).__name__} has no host tier: build it with host_blocks > 0")

    def swap_out(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int],
                 guard: Guard | None = None) -> int:
        """Copy the blocks into the slots, then note each slot's checksums (what a swap-in
        or a write-back from host memory checks the slot against)."""
        n = self._swap(rank, block_ids, host_slots, "d2h", guard)
        for slot, sums in zip(host_slots[:n], self._slot_hashes(rank, host_slots[:n])):
            self._slot_sums[(rank, slot)] = sums
        return n

    def _slot_hashes(self, rank: int, host_slots: Sequence[int]) -> list[list[int]]:
        """Each slot's checksums, one per kind: the slots of a transfer hashed in one call, so
        its threads share them all (a slot at a time left most of them idle)."""
        arenas = [self._arena(rank, kind) for kind in self.spec.kinds]
        sums = self._hash([as_bytes_view(a[slot]) for slot in host_slots for a in arenas])
        k = len(arenas)
        return [sums[i * k:(i + 1) * k] for i in range(len(host_slots))]

    def swap_in(self, rank: int, host_slots: Sequence[int], block_ids: Sequence[int],
                guard: Guard | None = None) -> int:
        """Copy the leading slots whose bytes still match their checksums; a slot that does
        not ends the copy (a short answer: the lifecycle recomputes or reads the rest)."""
        self._check_swap(rank, block_ids, host_slots)
        k = self._verified_slots(rank, host_slots)
        return self._swap(rank, block_ids[:k], host_slots[:k], "h2d", guard) if k else 0

    def _verified_slots(self, rank: int, host_slots: Sequence[int]) -> int:
        """Leading slots whose bytes match the checksums their swap-out noted."""
        known = [slot for slot in host_slots if (rank, slot) in self._slot_sums]
        return self._matching_slots(rank, host_slots, dict(zip(known, self._slot_hashes(rank, known))))

    def _matching_slots(self, rank: int, host_slots: Sequence[int], got: dict[int, list[int]]) -> int:
        """Leading slots whose checksums taken now (``got``) are those their swap-out noted; the
        first that differs is counted broken and forgotten."""
        for i, slot in enumerate(host_slots):
            want = self._slot_sums.get((rank, slot))
            if want is None or got.get(slot) != want:
                self.broken_slots += want is not None
                self._slot_sums.pop((rank, slot), None)
                return i
        return len(host_slots)

    def host_slot_bytes(self, rank: int, kind: str, slot: int) -> bytes:
        """One host tier slot of ``kind`` on ``rank``, in the stored (block-major) layout."""
        self._check_swap(rank, [0], [slot])
        if kind not in self.spec.kinds:
            raise ValidationError(f"{type(self).__name__}: kind {kind!r} is not one of {self.spec.kinds}")
        return bytes(as_bytes_view(self._arena(rank, kind)[slot]))

    def flush_host(self, rank: int, keys: Sequence[str], host_slots: Sequence[int]) -> int:
        """Skip the leading keys already stored, put the rest from their slots (zero-copy views
        of the arena); how many leading keys are stored."""
        self._check_keys(rank, keys)
        self._check_slots(host_slots, len(keys))
        n = self.query(rank, keys)
        if n == len(keys) or not self.spec.writes(rank):
            return len(keys) if not self.spec.writes(rank) else n
        slots = host_slots[n:n + self._verified_slots(rank, host_slots[n:])]  # a broken slot is not stored
        arenas = {kind: self._arena(rank, kind) for kind in self.spec.kinds}
        done, spec = len(slots), self.spec
        for g, part in enumerate(spec.parts(rank)):
            if spec.head_groups == 1 and not spec.splits_groups:  # zero-copy views of the arena's rows
                views = self._object_views(arenas, slots)
            else:  # a head group strided in a row, or layers stored group by group: copied out in order
                a, b, order = g * spec.object_heads, (g + 1) * spec.object_heads, list(spec.storage_order)
                views = self._object_views({k: np.ascontiguousarray(arr[list(slots[:done])][:, order, a:b])
                                            for k, arr in arenas.items()}, range(done))
            done = self.objects.put(part, keys[n:n + done], None, views[:done * self.objects.per(None)])
        self.bytes_moved += done * self.spec.bytes_per_block_per_rank
        return n + done

    def _check_blocks(self, ids: Sequence[Any]) -> None:
        """:meth:`_check_block` of each id; many plain ints at once through numpy (a pull's
        hundreds of ids are on the path of a first token)."""
        if len(ids) >= 64 and all_ints(ids):
            try:
                a = np.array(ids, np.int64)
            except OverflowError:
                a = None
            if a is not None and a.min() >= 0 and a.max() < self.num_blocks:
                return
        for b in ids:
            self._check_block(b)

    def _check_block(self, b: Any) -> None:
        if not is_int(b) or not 0 <= b < self.num_blocks:
            raise ValidationError(f"{type(self).__name__}: block {b!r} outside 0..{self.num_blocks - 1}")

    def _check_fill(self, rank: int, kind: str, block_id: int, data: Any) -> None:
        """Checks of ``fill_block``: rank, kind, block id, and data of exactly one block."""
        self._check_keys(rank, ())
        if kind not in self.spec.kinds:
            raise ValidationError(f"{type(self).__name__}.fill_block: kind {kind!r} is not one of {self.spec.kinds}")
        self._check_block(block_id)
        need = self.spec.block_bytes(kind)
        if not isinstance(data, (bytes, bytearray, memoryview)) or memoryview(data).nbytes != need:
            got = memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else type(data).__name__
            raise ValidationError(f"{type(self).__name__}.fill_block: block {block_id} needs {need} bytes, got {got}")

    def _each_part(self, rank: int, n: int, move: Callable[[tuple[int, int], int, bool], int]) -> int:
        """Run ``move(part, m, whole)`` for each of the rank's head groups (``part``: its place on
        the rank, its index) over the first ``m`` blocks every earlier group reached; leading
        blocks every group moved. ``whole`` is true for the last group when all blocks reached
        it: only then may a layer-wise read report layers (they are in place for every head)."""
        count, parts = n, list(enumerate(self.spec.parts(rank)))
        for g, part in parts:
            if not count:
                break
            count = move((g, part), count, g == len(parts) - 1 and count == n)
        return count

    def _part_ids(self, block_ids: Sequence[int], g: int) -> list[int]:
        """Rows of the rank's ``g``-th head group of ``block_ids`` in the caches seen by part."""
        n = self.spec.head_groups
        return list(block_ids) if n == 1 else [b * n + g for b in block_ids]

    def _part_view(self, layer: Any, kind: str) -> Any:
        """One layer's cache of ``kind`` seen by part (a view: numpy and CuPy reshape alike)."""
        spec = self.spec
        if spec.head_groups == 1:
            return layer
        return layer.reshape((self.num_blocks * spec.head_groups,) + spec.object_shape(kind))

    def _object_views(self, host: dict[str, Any], rows: Sequence[int],
                      groups: Sequence[int] | None = None) -> list[memoryview]:
        """Byte views of the objects held in block-major ``host[kind][row]`` (layers first), in
        :meth:`BlockObjects.names`' order: each group's layers are contiguous within a row."""
        spec, kinds = self.spec, self.spec.kinds
        if spec.object_groups == 1 and groups is None:
            return [as_bytes_view(host[kind][i]) for i in rows for kind in kinds]
        spans = [spec.group_span(g) for g in (range(spec.object_groups) if groups is None else groups)]
        return [as_bytes_view(host[kind][i][a:b]) for i in rows for kind in kinds for a, b in spans]

    def _group_views(self, host: dict[str, Any], m: int, group: int | None) -> list[memoryview]:
        """Byte views of the objects of ``m`` blocks held in rows of ``host[kind]``, in
        :meth:`BlockObjects.names`' order: rows of every layer hold every group's objects (``group``
        None); rows of one group's layers hold one object each."""
        if group is None:
            return self._object_views(host, range(m))
        return [as_bytes_view(host[kind][i]) for i in range(m) for kind in self.spec.kinds]

    def _by_group(self, n: int, layers: Callable[..., Any], put: Callable[[int, int, Any], int]) -> int:
        """A layer-wise write of ``n`` blocks: ``put(group, m, ready)`` stores one group of the
        first ``m`` blocks once its layers are computed (``ready``: the gate's True or device
        event) and answers how many leading ones it stored."""
        self._check_layerwise()
        count = n
        for g in range(self.spec.object_groups):
            ready = layers(self.spec.group_span(g)[1])
            if not ready:
                return 0
            count = min(count, put(g, count, ready))
            if not count:
                break
        return count

    def _load_by_group(self, n: int, arrived: Callable[[int, Any], None],
                       get: Callable[[int, int], tuple[int, Any]]) -> int:
        """A layer-wise read of ``n`` blocks: ``get(group, m)`` reads and scatters one group of
        the first ``m`` blocks, answering (leading blocks scattered, device event or None)."""
        self._check_layerwise()
        count = n
        for g in range(self.spec.object_groups):
            got, event = get(g, count)  # later groups only for blocks every earlier one reached
            count = min(count, got)
            if count == n:  # a group short of a block is never reported: the load will not be whole
                arrived(self.spec.group_span(g)[1], event)
            if not count:
                break
        return count

    def _read_window(self, part: tuple[int, int], keys: Sequence[str], group_ids: Sequence[Sequence[int]], m: int,
                     window_from: int, get: Callable[[int | None, Sequence[str], Sequence[int]], int]) -> int:
        """Read the first ``m`` blocks of one head group: the full groups' every block, the
        window groups' from ``window_from`` on, each group by ``get(group, keys, block_ids)``
        into its blocks (``group_ids``: :meth:`_group_ids`), answering the leading blocks it
        scattered; the leading blocks the cache can be continued from
        (:meth:`~kvstate._spec.CacheSpec.resume_blocks`)."""
        spec, whole, window_end = self.spec, m, m
        per_layer = sum(spec.chunk_bytes(k) for k in spec.kinds) // spec.head_groups
        for g, group in enumerate(spec.stored_groups):
            lo = min(window_from, m) if group.kind == "window" else 0
            named = g if spec.object_groups > 1 else None  # one group (every layer a window layer): plain names
            got = get(named, keys[lo:m], group_ids[g][lo:m]) if m > lo else 0
            self.bytes_moved += got * len(group.layers) * per_layer
            if group.kind == "window":
                window_end = min(window_end, lo + got)
            else:
                whole = min(whole, got)
        return spec.resume_blocks(whole, window_end, window_from, m)

    def _check_layerwise(self) -> None:
        """Layer-wise transfers go by layers ``[0, end)``; window groups are stored by group."""
        if self.spec.splits_groups:
            raise ValidationError(f"{type(self).__name__}: a spec with window groups moves no layer-wise transfer")

    def _whole(self, ok: Sequence[bool], n: int, groups: int | None = None) -> int:
        """Leading blocks of ``n`` whose every object is ``ok`` (one flag per object, as in
        :meth:`BlockObjects.names`; ``groups``: layer groups per block and kind, all by default)."""
        nk = len(self.spec.kinds) * (self.spec.object_groups if groups is None else groups)
        return leading(all(ok[i * nk:(i + 1) * nk]) for i in range(n))

    def write_states(self, rank: int, keys: Sequence[str], pages: Sequence[int], guard: Guard | None = None) -> int:
        """Store page ``pages[i]`` as the state after ``keys[i]``; how many leading states were stored."""
        n = self.states.write(rank, keys, pages, guard)
        self.bytes_moved += n * self.states.size
        return n

    def read_state(self, rank: int, key: str, page: int, guard: Guard | None = None) -> bool:
        """Load the state stored after ``key`` into ``page``; whether it arrived whole and verified."""
        ok = self.states.read(rank, key, page, guard)
        self.bytes_moved += self.states.size if ok else 0
        return ok

    def state_bytes(self, rank: int, page: int) -> bytes:
        """One state page's bytes on ``rank`` (tests, an engine's checks)."""
        return self.states.page_bytes(rank, page)

    def fill_state(self, rank: int, page: int, data: bytes) -> None:
        """Overwrite one state page on ``rank`` (tests, an engine's fake compute)."""
        self.states.fill(rank, page, data)

    # -- a logical block's bytes (tests, the demo's fake compute; never the transfers' path) -----
    @abstractmethod
    def _layer_views(self, rank: int, kind: str) -> Sequence[Any]:
        """The rank's caches of ``kind``, one array a layer (numpy or CuPy
        ``[num_blocks, heads, block_size, dim]``: the device's)."""

    def _chunk_bytes(self, chunk: Any) -> bytes:
        """One (layer, block) chunk's bytes (a device array is copied to the host first)."""
        return bytes((chunk.get() if hasattr(chunk, "get") else chunk).tobytes())

    def _set_chunk(self, layer: Any, block: int, data: np.ndarray) -> None:
        layer[block] = data

    def block_bytes(self, rank: int, kind: str, block_id: Any) -> bytes:
        """One logical block of ``kind`` on ``rank``, all layers, in the stored layout: a block
        id, or with group tables (:mod:`kvstate._tables`) a tuple of one block per table; a layer
        whose block is ``FREED`` (behind the window) reads as zeros."""
        self._check_keys(rank, ())
        self.spec.block_shape(kind)  # a kind of this cache
        layers = self._layer_views(rank, kind)
        return b"".join(bytes(layer[0].nbytes) if b == FREED else self._chunk_bytes(layer[b])
                        for layer, b in zip(layers, self._layer_rows(block_id), strict=True))

    def fill_block(self, rank: int, kind: str, block_id: Any, data: bytes) -> None:
        """Overwrite one logical block of ``kind`` on ``rank`` (block-major bytes, as stored; a
        ``FREED`` layer is never written)."""
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

    def query(self, rank: int, keys: Sequence[str]) -> int:
        """Leading keys whose every object, and manifest, is stored (in each of the rank's head groups)."""
        self._check_keys(rank, keys)
        count = len(keys)
        for part in self.spec.parts(rank):
            if count > 1 and not self._stored(part, keys[:1]):  # a new prompt: its first block answers
                return 0
            count = self._stored(part, keys[:count])
        return count

    def _stored(self, part: int, keys: Sequence[str]) -> int:
        """Leading keys whose objects (and manifests) head group ``part`` holds in the store."""
        names = self.objects.names(part, keys)
        if not self.verify:
            return self._whole([f == 1 for f in self.store.batch_is_exist(names)], len(keys))
        found = self.store.batch_is_exist(names + self.objects.manifest_names(part, keys, None))
        return self.objects.leading_blocks(keys, None, [f == 1 for f in found])

    def close(self) -> None:
        self._hash.close()
