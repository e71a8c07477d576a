"""The interfaces at the core's edge: a storage pool (:class:`Store`) and what a driver asks of a
backend (:class:`TransferBackend`), with the checks and names every implementation shares.

- A :class:`Store` is a batch key/object interface shaped like Mooncake's store API:
  ``batch_put_from`` writes whole objects from buffers, ``batch_get_into`` reads objects into
  buffers and returns the bytes read per key (negative: missing or failed), ``batch_is_exist``
  answers 1 / 0 per key. Implementations: :mod:`~kvstate.backends.stores` (memory, files),
  :mod:`~kvstate.backends.mooncake`.
- A :class:`TransferBackend` answers, per TP rank, how many *leading* keys are stored
  (``query``), and writes or reads blocks to or from them, answering how many leading blocks
  it moved whole. It knows nothing of request states.
- A ``guard`` (the drivers build it from a command's fence) is asked right before blocks are
  gathered or scattered; once it says no, the transfer raises
  :class:`~kvstate.errors.FenceError` and touches no block, since the lifecycle may already
  have recycled them.
- :class:`StoreBackend` is what backends keeping one object per (block, kind, rank, layer
  group) in a Store share: argument checks, object names and views, the existence query,
  counting whole blocks. A block counts as stored only when every one of its objects is.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import FenceError, ValidationError
from ..keys import rank_key
from ..spec import CacheSpec
from ..validate import is_int

__all__ = ["Store", "TransferBackend", "StoreBackend", "Guard", "check_fence", "check_batch", "leading", "check_caches",
           "check_keys", "as_bytes_view", "MISSING", "MAX_KEY_LEN"]

MISSING = -1  #: ``batch_get_into`` / ``batch_put_from`` code for a missing key or a failed operation
MAX_KEY_LEN = 512

#: asked just before a transfer touches blocks: True while the command's fence has not passed
Guard = Callable[[], bool]


def leading(flags: Iterable[bool]) -> int:
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


def check_caches(spec: CacheSpec, num_blocks: int, ranks: Sequence[int], caches: Any, who: str) -> None:
    """Host caches an engine hands a backend: ``caches[rank][kind]`` for exactly ``ranks`` and
    ``spec.kinds``, each a list of ``spec.layers`` C-contiguous numpy arrays of one layer's
    blocks ``[num_blocks, heads, block_size, dim]`` in the kind's dtype."""
    if not isinstance(caches, Mapping) or set(caches) != set(ranks):
        raise ValidationError(f"{who}: caches must map exactly the ranks held ({list(ranks)}) to their caches")
    for r in ranks:
        by_kind = caches[r]
        if not isinstance(by_kind, Mapping) or set(by_kind) != set(spec.kinds):
            raise ValidationError(f"{who}: caches[{r}] must map exactly the kinds {spec.kinds}")
        for kind in spec.kinds:
            layers, want = by_kind[kind], (num_blocks,) + spec.block_shape(kind)
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or len(layers) != spec.layers:
                raise ValidationError(f"{who}: caches[{r}][{kind!r}] must be a list of {spec.layers} layers")
            for i, a in enumerate(layers):
                if not isinstance(a, np.ndarray) or a.shape != want or a.dtype != spec.kind_dtype(kind) \
                        or not a.flags.c_contiguous or not a.flags.writeable:
                    got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                    raise ValidationError(f"{who}: caches[{r}][{kind!r}][{i}] must be a writable C-contiguous "
                                          f"{np.dtype(spec.kind_dtype(kind))}{list(want)} array, got {got}")


def as_bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (what the stores read and write)."""
    return a.data.cast("B")


def check_keys(keys: Sequence[str], op: str) -> None:
    """A store operation's keys: a sequence of non-empty str of at most :data:`MAX_KEY_LEN`."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValidationError(f"{op}: keys must be a sequence of str")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValidationError(f"{op}: key {k!r} is not a non-empty str")
        if len(k) > MAX_KEY_LEN:
            raise ValidationError(f"{op}: key {k[:40]!r}... is {len(k)} chars, over {MAX_KEY_LEN}")


def check_batch(keys: Sequence[str], op: str, buffers: Sequence[Any]) -> list[memoryview]:
    """A store operation's keys, and one contiguous buffer per key: the buffers as flat byte views."""
    check_keys(keys, op)
    if isinstance(buffers, (str, bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
        raise ValidationError(f"{op}: buffers must be a sequence (one per key), got {type(buffers).__name__}")
    if len(buffers) != len(keys):
        raise ValidationError(f"{op}: {len(keys)} keys but {len(buffers)} buffers")
    views = []
    for k, b in zip(keys, buffers):
        try:
            v = memoryview(b)
        except TypeError:
            raise ValidationError(f"{op}: buffer for key {k!r} does not expose the buffer protocol") from None
        if not v.contiguous:
            raise ValidationError(f"{op}: buffer for key {k!r} is not contiguous")
        views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return views


class Store(ABC):
    """A KV storage pool. Implementations must be safe to call from several threads."""

    @abstractmethod
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Store each buffer's bytes under its key; per key 0 on success, negative on failure."""

    @abstractmethod
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Fill each buffer with its key's object; per key the bytes read, negative if missing."""

    @abstractmethod
    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 if stored, 0 if not."""

    def close(self) -> None:  # noqa: B027 - a default, not an abstract method: most stores hold nothing
        """Release the store's resources (idempotent)."""

    def check(self) -> bool:
        """Whether the pool answers now; a store with a remote pool probes it (and re-joins a
        pool whose server came back). Stores in this process or on a file system answer True."""
        return True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransferBackend(ABC):
    """What a driver needs from a backend, per rank: ``query`` (how many leading keys are
    stored; asked before a write, to skip them), ``write`` and ``read`` of blocks. ``write`` and
    ``read`` ask ``guard`` right before they gather or scatter blocks."""

    spec: CacheSpec

    @abstractmethod
    def query(self, rank: int, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored whole for ``rank``."""

    @abstractmethod
    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
              layers: Callable[..., Any] | None = None) -> int:
        """Store block ``block_ids[i]`` under ``keys[i]``; how many leading blocks were stored.

        ``layers`` (a layer-wise save, a :meth:`~kvstate.backends.gate.LayerGate.ready`):
        store layer group by group, each only once ``layers(end)`` says its layers ``[0,
        end)`` are computed: True, or a device event the group's copies must wait for (a
        backend without a device has none to wait on); if it says False, they never will
        be: stop (blocks missing a group are not stored whole)."""

    @abstractmethod
    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
             arrived: Callable[[int, Any], None] | None = None) -> int:
        """Read ``keys[i]`` into block ``block_ids[i]``; how many leading blocks arrived whole.

        ``arrived`` (a layer-wise load): read layer group by group, calling ``arrived(end,
        event)`` once layers ``[0, end)`` of every block are scattered (``event``: a device
        event marking it, or None when they are already in place); stop at a group that
        does not arrive whole."""

    def swap_out(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int],
                 guard: Guard | None = None) -> int:
        """Copy GPU block ``block_ids[i]`` into host tier slot ``host_slots[i]``; how many
        leading blocks were copied. Backends without a host tier raise."""
        raise ValidationError(f"{type(self).__name__} has no host tier: build it with host_blocks > 0")

    def swap_in(self, rank: int, host_slots: Sequence[int], block_ids: Sequence[int],
                guard: Guard | None = None) -> int:
        """Copy host tier slot ``host_slots[i]`` into GPU block ``block_ids[i]``; how many
        leading blocks were copied."""
        raise ValidationError(f"{type(self).__name__} has no host tier: build it with host_blocks > 0")

    def flush_host(self, rank: int, keys: Sequence[str], host_slots: Sequence[int]) -> int:
        """Store host tier slot ``host_slots[i]`` under ``keys[i]`` (a write-back from host
        memory); how many leading keys are stored afterwards."""
        raise ValidationError(f"{type(self).__name__} has no host tier: build it with host_blocks > 0")

    def close(self) -> None:  # noqa: B027 - a default, not an abstract method: the reference backend holds nothing
        """Release buffers and devices (idempotent)."""


class StoreBackend(TransferBackend):
    """One object per (block, kind, rank, layer group) in a :class:`Store`: checks, names,
    views, query, whole blocks."""

    def _setup(self, spec: CacheSpec, num_blocks: int, store: Store, ranks: Sequence[int] | None = None) -> None:
        name = type(self).__name__
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"{name}: spec must be a CacheSpec")
        if not is_int(num_blocks) or num_blocks <= 0:
            raise ValidationError(f"{name}: num_blocks must be an int > 0, got {num_blocks!r}")
        if not isinstance(store, Store):
            raise ValidationError(f"{name}: store must be a kvstate Store")
        self.spec, self.num_blocks, self.store = spec, num_blocks, store
        #: the TP ranks whose caches this backend holds: all of them, or (a rank worker's) a few
        self.ranks = self._check_ranks(ranks)
        self.bytes_moved = 0  #: payload bytes written to and read from the store
        self.bytes_swapped = 0  #: payload bytes copied to and from the host tier

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
                or not all(isinstance(k, str) and k for k in keys):
            raise ValidationError(f"{name}: keys must be a sequence of non-empty str, got {keys!r}")

    def _check_transfer(self, rank: int, keys: Sequence[str], block_ids: Sequence[int]) -> None:
        """As :meth:`_check_keys`, and block ids one per key, ints in range and distinct."""
        self._check_keys(rank, keys)
        name = type(self).__name__
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise ValidationError(f"{name}: block ids must be a sequence of ints, got {block_ids!r}")
        if len(block_ids) != len(keys):
            raise ValidationError(f"{name}: {len(keys)} keys but {len(block_ids)} block ids")
        for b in block_ids:
            self._check_block(b)
        if len(set(block_ids)) != len(block_ids):
            raise ValidationError(f"{name}: block ids {list(block_ids)} name a block twice")

    def _check_swap(self, rank: int, block_ids: Sequence[int], host_slots: Sequence[int]) -> None:
        """A swap's rank, block ids (as a transfer's) and host slots: one per block, in range, distinct."""
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
        return self._swap(rank, block_ids, host_slots, "d2h", guard)

    def swap_in(self, rank: int, host_slots: Sequence[int], block_ids: Sequence[int],
                guard: Guard | None = None) -> int:
        return self._swap(rank, block_ids, host_slots, "h2d", guard)

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
        if n == len(keys):
            return n
        arenas = {kind: self._arena(rank, kind) for kind in self.spec.kinds}
        views = self._object_views(arenas, host_slots[n:])
        status = self.store.batch_put_from(self._names(rank, keys[n:]), views)
        done = self._whole([st == 0 for st in status], len(keys) - n)
        self.bytes_moved += done * self.spec.bytes_per_block_per_rank
        return n + done

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

    def _names(self, rank: int, keys: Sequence[str], groups: Sequence[int] | None = None) -> list[str]:
        """Object names of ``keys``' blocks, block by block, then kind, then layer group (all
        groups, or only ``groups``)."""
        kinds, spec = self.spec.kinds, self.spec
        if spec.layer_groups == 1 and groups is None:
            return [rank_key(key, kind, rank) for key in keys for kind in kinds]
        gs = range(spec.layer_groups) if groups is None else groups
        return [rank_key(key, kind, rank, g) for key in keys for kind in kinds for g in gs]

    def _object_views(self, host: dict[str, Any], rows: Sequence[int],
                      groups: Sequence[int] | None = None) -> list[memoryview]:
        """Byte views of the objects held in block-major ``host[kind][row]`` (layers first), in
        :meth:`_names`' order: each group's layers are contiguous within a row."""
        spec, kinds = self.spec, self.spec.kinds
        if spec.layer_groups == 1 and groups is None:
            return [as_bytes_view(host[kind][i]) for i in rows for kind in kinds]
        spans = [spec.group_span(g) for g in (range(spec.layer_groups) if groups is None else groups)]
        return [as_bytes_view(host[kind][i][a:b]) for i in rows for kind in kinds for a, b in spans]

    def _group_views(self, host: dict[str, Any], m: int, group: int | None) -> list[memoryview]:
        """Byte views of the objects of ``m`` blocks held in rows of ``host[kind]``, in
        :meth:`_names`' order: rows of every layer hold every group's objects (``group``
        None); rows of one group's layers hold one object each."""
        if group is None:
            return self._object_views(host, range(m))
        return [as_bytes_view(host[kind][i]) for i in range(m) for kind in self.spec.kinds]

    def _by_group(self, n: int, layers: Callable[..., Any], put: Callable[[int, int, Any], int]) -> int:
        """A layer-wise write of ``n`` blocks: ``put(group, m, ready)`` stores one group of the
        first ``m`` blocks once its layers are computed (``ready``: the gate's True or device
        event) and answers how many leading ones it stored."""
        count = n
        for g in range(self.spec.layer_groups):
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
        count = n
        for g in range(self.spec.layer_groups):
            got, event = get(g, count)  # later groups only for blocks every earlier one reached
            count = min(count, got)
            if count == n:  # a group short of a block is never reported: the load will not be whole
                arrived(self.spec.group_span(g)[1], event)
            if not count:
                break
        return count

    def _whole(self, ok: Sequence[bool], n: int, groups: int | None = None) -> int:
        """Leading blocks of ``n`` whose every object is ``ok`` (one flag per object, as in
        :meth:`_names`; ``groups``: layer groups per block and kind, all by default)."""
        nk = len(self.spec.kinds) * (self.spec.layer_groups if groups is None else groups)
        return leading(all(ok[i * nk:(i + 1) * nk]) for i in range(n))

    def query(self, rank: int, keys: Sequence[str]) -> int:
        self._check_keys(rank, keys)
        found = self.store.batch_is_exist(self._names(rank, keys))
        return self._whole([f == 1 for f in found], len(keys))
