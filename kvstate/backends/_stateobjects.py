"""Recurrent states as store objects: how a backend with state pages (:mod:`kvstate._statepages`)
puts and gets them, through the :class:`StateObjects` part it holds.

Rules:

- One object per (state, rank): the rank's state page (every state layer of the rank's share,
  ``CacheSpec.state_bytes_per_rank`` bytes) after a cache's leading blocks, named
  ``rank_key(key, "state", rank)`` for the key of the last of those blocks.
- The page's bytes are followed by a trailer: a magic, the state geometry's id (the state
  groups' layers, sizes and checkpoints, the TP degree, the format version) and the XXH3-64 of
  the bytes (0 on a trusted store, ``store.verify`` off, which skips the check).
- A get counts only an object of the page's length plus the trailer, of this geometry, whose
  bytes hash to the trailer's checksum. One that arrived but fails is evicted and counted
  (``broken_states``), so the next write of the prompt stores it again; a miss evicts nothing.
- A write of several states stores them in order and answers how many leading ones were stored;
  a page is gathered (and a got state scattered into its page) only while the guard allows.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from .._errors import ValidationError
from .._keys import rank_key
from .._spec import CacheSpec
from .._validate import is_int
from ._base import Guard, Store, check_fence, leading
from ._integrity import FORMAT_VERSION

__all__ = ["StateObjects", "PageCopy", "STATE_KIND", "state_geometry", "paged_of"]

STATE_KIND = "state"  #: the kind name of a state object (``rank_key(key, "state", rank)``)
_TRAILER = struct.Struct("<4sxxxxQQ")  # magic, geometry id, XXH3-64 of the page's bytes
_MAGIC = b"KVST"


def state_geometry(spec: CacheSpec) -> int:
    """A 64-bit id of what one rank's state object holds: the same for a P and a D that
    :func:`~kvstate._spec.check_pair` accepts."""
    groups = ";".join(f"{len(g.layers)}x{g.state_bytes}@{g.checkpoint}" for g in spec.groups if g.kind == "state")
    return xxhash.xxh3_64_intdigest(f"kvstate/state/{FORMAT_VERSION}/tp {spec.tp_size}/{groups}".encode())


def paged_of(spec: Any) -> Any:
    """The paged part of ``spec`` (:meth:`~kvstate._spec.CacheSpec.paged`), which a backend's
    blocks hold (anything else passes through, for the backend's own checks to refuse)."""
    return spec.paged() if isinstance(spec, CacheSpec) else spec


#: ``gather(rank, page, out)`` copies a page into a host buffer; ``scatter(rank, page, data)``
#: copies one back (the device's side: numpy arrays, or the GPU's pages)
PageCopy = Callable[[int, int, np.ndarray], None]


class StateObjects:
    """The states of a backend with state pages, as objects in its store: a part the backend
    holds, handed the device's page copies (``gather`` and ``scatter``)."""

    def __init__(self, owner: str, spec: CacheSpec, num_states: int, store: Store, ranks: tuple[int, ...],
                 gather: PageCopy, scatter: PageCopy) -> None:
        if not is_int(num_states) or num_states < 0:
            raise ValidationError(f"{owner}: num_states must be an int >= 0, got {num_states!r}")
        spec.check_num_states(owner, num_states, ValidationError)
        self.owner, self.store, self.ranks = owner, store, ranks
        self.verify = bool(getattr(store, "verify", True))
        self.size = spec.state_bytes_per_rank  #: bytes of one page on one rank
        self.num_states = num_states  #: state pages per rank
        self.broken = 0  #: state objects a read found broken (and evicted)
        self._geometry = state_geometry(spec)
        self._gather, self._scatter = gather, scatter

    def check(self, rank: int, keys: Sequence[str], pages: Sequence[int]) -> None:
        """A rank held here, one non-empty str key per page, pages in range (and pages to hold)."""
        name = self.owner
        if not self.num_states:
            raise ValidationError(f"{name} holds no state pages (its spec has no state group)")
        if rank not in self.ranks:
            raise ValidationError(f"{name}: rank {rank!r} is not held here (ranks {self.ranks})")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or \
                not all(isinstance(k, str) and k for k in keys) or len(keys) != len(pages):
            raise ValidationError(f"{name}: states need one non-empty str key per page, got {keys!r} for {pages!r}")
        for p in pages:
            if not is_int(p) or not 0 <= p < self.num_states:
                raise ValidationError(f"{name}: state page {p!r} outside 0..{self.num_states - 1}")

    def page_bytes(self, rank: int, page: int) -> bytes:
        """One state page's bytes on ``rank`` (tests, an engine's checks)."""
        self.check(rank, ["page"], [page])
        out = np.empty(self.size, np.uint8)
        self._gather(rank, page, out)
        return out.tobytes()

    def fill(self, rank: int, page: int, data: bytes) -> None:
        """Overwrite one state page on ``rank`` (tests, an engine's fake compute)."""
        self.check(rank, ["page"], [page])
        if not isinstance(data, bytes) or len(data) != self.size:
            raise ValidationError(f"{self.owner}.fill_state: expected {self.size} bytes")
        self._scatter(rank, page, np.frombuffer(data, np.uint8))

    def write(self, rank: int, keys: Sequence[str], pages: Sequence[int], guard: Guard | None = None) -> int:
        """Store page ``pages[i]`` as the state after ``keys[i]``; how many leading states were stored."""
        self.check(rank, keys, pages)
        if not keys:
            return 0
        size = self.size
        bufs = np.empty((len(keys), size + _TRAILER.size), np.uint8)
        check_fence(guard, rank, "gather state pages", pages)
        for i, p in enumerate(pages):
            self._gather(rank, p, bufs[i, :size])
            digest = xxhash.xxh3_64_intdigest(bufs[i, :size].data) if self.verify else 0
            bufs[i, size:] = np.frombuffer(_TRAILER.pack(_MAGIC, self._geometry, digest), np.uint8)
        status = self.store.batch_put_from([rank_key(k, STATE_KIND, rank) for k in keys], list(bufs))
        return leading(st == 0 for st in status)

    def read(self, rank: int, key: str, page: int, guard: Guard | None = None) -> bool:
        """Load the state stored after ``key`` into ``page``; whether it arrived whole and verified."""
        self.check(rank, [key], [page])
        size = self.size
        buf = np.empty(size + _TRAILER.size, np.uint8)
        name = rank_key(key, STATE_KIND, rank)
        got = self.store.batch_get_into([name], [buf])[0]
        if got < 0:
            return False  # a miss (or the store failed): says nothing of the object
        if not self._intact(buf, got):
            self.broken += 1
            self.store.evict([name])
            return False
        check_fence(guard, rank, "scatter into state pages", [page])
        self._scatter(rank, page, buf[:size])
        return True

    def _intact(self, buf: Any, got: int) -> bool:
        size = self.size
        if got != size + _TRAILER.size:
            return False
        magic, geometry, digest = _TRAILER.unpack_from(buf, size)
        if magic != _MAGIC or geometry != self._geometry:
            return False
        return not self.verify or xxhash.xxh3_64_intdigest(buf[:size].data) == digest
