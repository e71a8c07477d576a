"""Recurrent states as store objects: how a backend with state pages (:mod:`kvstate.statepages`)
puts and gets them.

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
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import ValidationError
from ..keys import rank_key
from ..spec import CacheSpec
from ..validate import is_int
from .base import Guard, Store, check_fence, leading
from .integrity import FORMAT_VERSION

__all__ = ["StateObjects", "STATE_KIND", "state_geometry", "paged_of"]

STATE_KIND = "state"  #: the kind name of a state object (``rank_key(key, "state", rank)``)
_TRAILER = struct.Struct("<4sxxxxQQ")  # magic, geometry id, XXH3-64 of the page's bytes
_MAGIC = b"KVST"


def state_geometry(spec: CacheSpec) -> int:
    """A 64-bit id of what one rank's state object holds: the same for a P and a D that
    :func:`~kvstate.spec.check_pair` accepts."""
    groups = ";".join(f"{len(g.layers)}x{g.state_bytes}@{g.checkpoint}" for g in spec.groups if g.kind == "state")
    return xxhash.xxh3_64_intdigest(f"kvstate/state/{FORMAT_VERSION}/tp {spec.tp_size}/{groups}".encode())


def paged_of(spec: Any) -> Any:
    """The paged part of ``spec`` (:meth:`~kvstate.spec.CacheSpec.paged`), which a backend's
    blocks hold (anything else passes through, for the backend's own checks to refuse)."""
    return spec.paged() if isinstance(spec, CacheSpec) else spec


class StateObjects(ABC):
    """The state half of a backend: pages per rank, and their objects in the store. The host
    class gives the store, its ranks and ``_gather_state`` / ``_scatter_state`` (a page to and
    from a host buffer)."""

    store: Store
    ranks: tuple[int, ...]
    verify: bool
    bytes_moved: int

    def _setup_states(self, spec: CacheSpec, num_states: int) -> None:
        name = type(self).__name__
        if not is_int(num_states) or num_states < 0:
            raise ValidationError(f"{name}: num_states must be an int >= 0, got {num_states!r}")
        spec.check_num_states(name, num_states, ValidationError)
        self.state_size = spec.state_bytes_per_rank  #: bytes of one page on one rank
        self.num_states = num_states  #: state pages per rank
        self.broken_states = 0  #: state objects a read found broken (and evicted)
        self._state_geometry = state_geometry(spec)

    def _check_states(self, rank: int, keys: Sequence[str], pages: Sequence[int]) -> None:
        name = type(self).__name__
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

    @abstractmethod
    def _gather_state(self, rank: int, page: int, out: np.ndarray) -> None:
        """Copy the rank's state page ``page`` into ``out`` (the backend's device)."""

    @abstractmethod
    def _scatter_state(self, rank: int, page: int, data: np.ndarray) -> None:
        """Copy ``data`` into the rank's state page ``page`` (the backend's device)."""

    def state_bytes(self, rank: int, page: int) -> bytes:
        """One state page's bytes on ``rank`` (tests, an engine's checks)."""
        self._check_states(rank, ["page"], [page])
        out = np.empty(self.state_size, np.uint8)
        self._gather_state(rank, page, out)
        return out.tobytes()

    def fill_state(self, rank: int, page: int, data: bytes) -> None:
        """Overwrite one state page on ``rank`` (tests, an engine's fake compute)."""
        self._check_states(rank, ["page"], [page])
        if not isinstance(data, bytes) or len(data) != self.state_size:
            raise ValidationError(f"{type(self).__name__}.fill_state: expected {self.state_size} bytes")
        self._scatter_state(rank, page, np.frombuffer(data, np.uint8))

    # -- TransferBackend ---------------------------------------------------------------------------
    def write_states(self, rank: int, keys: Sequence[str], pages: Sequence[int], guard: Guard | None = None) -> int:
        """Store page ``pages[i]`` as the state after ``keys[i]``; how many leading states were stored."""
        self._check_states(rank, keys, pages)
        if not keys:
            return 0
        size = self.state_size
        bufs = np.empty((len(keys), size + _TRAILER.size), np.uint8)
        check_fence(guard, rank, "gather state pages", pages)
        for i, p in enumerate(pages):
            self._gather_state(rank, p, bufs[i, :size])
            digest = xxhash.xxh3_64_intdigest(bufs[i, :size].data) if self.verify else 0
            bufs[i, size:] = np.frombuffer(_TRAILER.pack(_MAGIC, self._state_geometry, digest), np.uint8)
        status = self.store.batch_put_from([rank_key(k, STATE_KIND, rank) for k in keys], list(bufs))
        n = leading(st == 0 for st in status)
        self.bytes_moved += n * size
        return n

    def read_state(self, rank: int, key: str, page: int, guard: Guard | None = None) -> bool:
        """Load the state stored after ``key`` into ``page``; whether it arrived whole and verified."""
        self._check_states(rank, [key], [page])
        size = self.state_size
        buf = np.empty(size + _TRAILER.size, np.uint8)
        name = rank_key(key, STATE_KIND, rank)
        got = self.store.batch_get_into([name], [buf])[0]
        if got < 0:
            return False  # a miss (or the store failed): says nothing of the object
        if not self._intact(buf, got):
            self.broken_states += 1
            self.store.evict([name])
            return False
        check_fence(guard, rank, "scatter into state pages", [page])
        self._scatter_state(rank, page, buf[:size])
        self.bytes_moved += size
        return True

    def _intact(self, buf: Any, got: int) -> bool:
        size = self.state_size
        if got != size + _TRAILER.size:
            return False
        magic, geometry, digest = _TRAILER.unpack_from(buf, size)
        if magic != _MAGIC or geometry != self._state_geometry:
            return False
        return not self.verify or xxhash.xxh3_64_intdigest(buf[:size].data) == digest
