"""The interfaces at the core's edge: a storage pool (:class:`Store`) and what a driver asks of a
backend (:class:`TransferBackend`), with the checks and names every implementation shares.

- A :class:`Store` is a batch key/object interface shaped like Mooncake's store API:
  ``batch_put_from`` writes whole objects from buffers, ``batch_get_into`` reads objects into
  buffers and returns the bytes read per key (negative: missing or failed), ``batch_is_exist``
  answers 1 / 0 per key, ``evict`` removes objects a read found broken. Implementations:
  :mod:`~kvstate.backends._stores` (memory, files),
  :mod:`~kvstate.backends._mooncake`.
- A :class:`TransferBackend` answers, per TP rank, how many *leading* keys are stored
  (``query``), and writes or reads blocks to or from them, answering how many leading blocks
  it moved whole. It knows nothing of request states.
- A ``guard`` (the drivers build it from a command's fence) is asked right before blocks are
  gathered or scattered; once it says no, the transfer raises
  :class:`~kvstate._errors.FenceError` and touches no block, since the lifecycle may already
  have recycled them.
- :class:`~kvstate.backends._objects.StoreBackend` is what backends keeping one object per
  (block, kind, rank, layer group) in a Store share.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from .._errors import FenceError, ValidationError
from .._spec import CacheSpec
from .._validate import all_ints, is_int

__all__ = ["Store", "TransferBackend", "Guard", "check_fence", "check_batch", "leading", "check_caches",
           "check_keys", "check_verify", "as_bytes_view", "MISSING", "TOO_LARGE", "MAX_KEY_LEN"]

MISSING = -1  #: ``batch_get_into`` / ``batch_put_from`` code for a missing key or a failed operation
#: ``batch_get_into`` code for an object larger than the buffer given for it: stored, but not
#: of the size asked for (a reader that knows the size evicts it as broken)
TOO_LARGE = -2
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


def check_backend(backend: Any, who: str) -> None:
    """A transfer backend (``query``, ``write`` and ``read``, as :class:`TransferBackend` has)."""
    if not all(callable(getattr(backend, m, None)) for m in ("query", "write", "read")):
        raise ValidationError(f"{who}: backend must be a transfer backend (query, write, read), got {backend!r}")


def check_fence(guard: Guard | None, rank: int, what: str, block_ids: Sequence[int] | np.ndarray) -> None:
    """Raise :class:`FenceError` when ``guard`` says the blocks may no longer be touched."""
    if guard is not None and not callable(guard):
        raise ValidationError(f"check_fence: guard must be callable or None, got {guard!r}")
    if not is_int(rank) or not 0 <= rank < 1 << 20 or not isinstance(what, str) or \
            not isinstance(block_ids, (Sequence, np.ndarray)) or isinstance(block_ids, (str, bytes)) or \
            not all_ints(block_ids):
        raise ValidationError(f"check_fence: rank must be an int >= 0, what a str and block_ids a sequence of "
                              f"ints; got {rank!r}, {what!r}, {block_ids!r}")
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


def check_verify(verify: Any, who: str) -> bool:
    """A store's ``verify`` setting: a bool."""
    if not isinstance(verify, bool):
        raise ValidationError(f"{who}: verify must be True or False, got {verify!r}")
    return verify


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

    def batch_put_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        """:meth:`batch_put_from`, and each buffer's XXH3-64 (:mod:`kvstate.backends._integrity`).
        A store that copies the bytes itself hashes them in the same pass, while they are in
        cache (the embedded stores); this default hashes them after the put."""
        status = self.batch_put_from(keys, buffers)
        return status, [xxhash.xxh3_64_intdigest(v) for v in check_batch(keys, "batch_put_hashed", buffers)]

    def batch_get_hashed(self, keys: Sequence[str], buffers: Sequence[Any]) -> tuple[list[int], list[int]]:
        """:meth:`batch_get_into`, and the XXH3-64 of the bytes each buffer received (0 for a
        miss); the same pass as the copy where the store can."""
        got = self.batch_get_into(keys, buffers)
        views = check_batch(keys, "batch_get_hashed", buffers)
        return got, [xxhash.xxh3_64_intdigest(v[:n]) if n >= 0 else 0 for n, v in zip(got, views)]

    #: whether blocks stored here carry checksummed manifests (:mod:`kvstate.backends._integrity`):
    #: on by default; a trusted pool may turn it off, on every client of the pool alike
    verify: bool = True

    def evict(self, keys: Sequence[str]) -> int:
        """Remove these objects now (a read found them broken); how many were there. A store
        that cannot remove anything answers 0, and cannot heal a broken object."""
        return 0

    def register_memory(self, buffer: Any) -> bool:
        """Offer host memory its caller puts from and gets into again and again (a backend's
        staging). A store whose transport moves bytes straight from registered memory (Mooncake's
        transfer engine) registers it, so a batch whose buffers all lie in it skips the store's
        own staging copy, and answers True; the caller then calls :meth:`unregister_memory`
        before it frees the memory. Other stores copy anyway and answer False."""
        return False

    def unregister_memory(self, buffer: Any) -> None:  # noqa: B027 - a default: nothing was registered
        """Forget memory :meth:`register_memory` took (before its owner frees it)."""

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
    stored; asked before a write, to skip them), ``write`` and ``read`` of blocks (and, with
    state groups, ``write_states`` and ``read_state``). Each asks ``guard`` right before it
    gathers or scatters blocks or pages."""

    spec: CacheSpec

    @abstractmethod
    def query(self, rank: int, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored whole for ``rank``."""

    @abstractmethod
    def write(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
              layers: Callable[..., Any] | None = None, tables: Sequence[Sequence[int]] = (),
              window_from: int = 0) -> int:
        """Store block ``block_ids[i]`` under ``keys[i]``; how many leading blocks were stored.
        With group tables (:mod:`kvstate._tables`; passed only then) ``block_ids`` are the first
        layer group's blocks and ``tables`` the others', aligned with them, and the window
        groups are stored only from ``window_from`` on (:class:`~kvstate.commands.WriteBlocks`).

        ``layers`` (a layer-wise save, a :meth:`~kvstate.backends._gate.LayerGate.ready`):
        store layer group by group, each only once ``layers(end)`` says its layers ``[0,
        end)`` are computed: True, or a device event the group's copies must wait for (a
        backend without a device has none to wait on); if it says False, they never will
        be: stop (blocks missing a group are not stored whole)."""

    @abstractmethod
    def read(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Guard | None = None,
             arrived: Callable[[int, Any], None] | None = None, window_from: int = 0,
             tables: Sequence[Sequence[int]] = ()) -> int:
        """Read ``keys[i]`` into block ``block_ids[i]`` (and ``tables``, as in :meth:`write`);
        how many leading blocks arrived whole.

        ``arrived`` (a layer-wise load): read layer group by group, calling ``arrived(end,
        event)`` once layers ``[0, end)`` of every block are scattered (``event``: a device
        event marking it, or None when they are already in place); stop at a group that
        does not arrive whole. ``window_from`` (:class:`~kvstate.commands.ReadBlocks`; passed
        only when not 0): the window layer groups are needed from that key on; a backend that
        reads every block whole (always right) need not take it."""

    #: the lend boards (:mod:`kvstate.backends._lends`) blocks are lent on (P) and reads pulled
    #: from (D); None: none
    lends: Any = None
    pulls: Any = None

    def lend(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], until: Callable[[], bool],
             guard: Guard | None = None, stores: bool = False) -> int:
        """Lend blocks to a D on this host (a :class:`~kvstate.commands.LendBlocks`) until it
        pulled them or ``until()`` turns False; how many it pulled whole. Backends without a
        lend board raise."""
        raise ValidationError(f"{type(self).__name__} has no lend board: build it with lends=LendBoard(...)")

    def pull(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], until: Callable[[], bool],
             guard: Guard | None = None) -> int | None:
        """Pull ``keys`` into ``block_ids`` from a P on this host that lends them: how many
        leading blocks arrived and matched; None when no P lends them; -1 when the pull failed
        and that P writes them to the store too (read them there)."""
        return None

    def arm_pull(self, rank: int, keys: Sequence[str], block_ids: Sequence[int], timeout: float = 60.0) -> bool:
        """Prepare, at reservation, the pull of ``keys`` into ``block_ids`` that will follow
        P's lend, so that the pull starts without launching anything; whether this backend
        armed it (backends that cannot answer False: their pull runs as it always does)."""
        return False

    def disarm_pull(self, rank: int, keys: Sequence[str]) -> bool:
        """Let go of the pull armed for ``keys``; whether one was."""
        return False

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

    def write_states(self, rank: int, keys: Sequence[str], pages: Sequence[int], guard: Guard | None = None) -> int:
        """Store state page ``pages[i]`` as the state after block ``keys[i]``
        (:mod:`kvstate._statepages`); how many leading states were stored. Backends without
        state pages raise."""
        raise ValidationError(f"{type(self).__name__} moves no state pages (state layer groups)")

    def read_state(self, rank: int, key: str, page: int, guard: Guard | None = None) -> bool:
        """Load the state stored after block ``key`` into state page ``page``; whether it
        arrived whole and verified."""
        raise ValidationError(f"{type(self).__name__} moves no state pages (state layer groups)")

    def close(self) -> None:  # noqa: B027 - a default, not an abstract method: the reference backend holds nothing
        """Release buffers and devices (idempotent)."""
