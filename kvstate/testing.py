"""Helpers for tests and integrators: deterministic stand-in KV bytes, written and checked.

A block's stand-in bytes are fixed by (storage key, heads, kind), so whoever reads a block back
(D after the handoff, a reload after preemption, a request sharing a stored prefix) can check
every byte against what the writer put there. The helpers work on any backend with
``fill_block(rank, kind, block_id, data)`` and ``block_bytes(rank, kind, block_id)`` (the
reference and CUDA backends). Ranks holding the same heads (replicas: a latent cache, or
fewer KV heads than ranks) hold the same bytes.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["fake_block", "fill_blocks", "fill_layers", "mismatched_blocks", "mismatched_needed"]


@functools.lru_cache(maxsize=1024)  # a block is written once and checked several times
def fake_block(key: str, rank: int, kind: str, nbytes: int) -> bytes:
    """``nbytes`` stand-in bytes of one block: a pattern fixed by (key, heads, kind); ``rank`` is
    the first rank holding those heads (``rank // spec.replicas``)."""
    seed = int.from_bytes(hashlib.sha256(f"{key}|{rank}|{kind}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def fill_blocks(backend: Any, keys: Sequence[str], block_ids: Sequence[int], start: int = 0) -> None:
    """Write block ``block_ids[i]``'s stand-in bytes for ``keys[i]``, ``i >= start``, on every
    rank and kind: what "computing" those blocks means in a test."""
    spec = backend.spec
    for i in range(start, len(keys)):
        for r in range(spec.tp_size):
            for kind in spec.kinds:
                backend.fill_block(r, kind, block_ids[i],
                                   fake_block(keys[i], r // spec.replicas, kind, spec.block_bytes(kind)))


def fill_layers(backend: Any, keys: Sequence[str], block_ids: Sequence[int], layers: tuple[int, int],
                start: int = 0) -> None:
    """As :func:`fill_blocks`, but only layers ``[a, b)`` of each block get their stand-in
    bytes (the others keep theirs): what computing those layers means in a layer-wise test."""
    spec, (a, b) = backend.spec, layers
    for i in range(start, len(keys)):
        for r in range(spec.tp_size):
            for kind in spec.kinds:
                chunk = spec.chunk_bytes(kind)
                want = fake_block(keys[i], r // spec.replicas, kind, spec.block_bytes(kind))
                have = backend.block_bytes(r, kind, block_ids[i])
                mixed = have[:a * chunk] + want[a * chunk:b * chunk] + have[b * chunk:]
                backend.fill_block(r, kind, block_ids[i], mixed)


def mismatched_blocks(backend: Any, keys: Sequence[str], block_ids: Sequence[int],
                      upto: int | None = None, layers: Sequence[int] | None = None) -> list[tuple[int, int, str]]:
    """``(i, rank, kind)`` of every block among the first ``upto`` (default all) whose bytes,
    in every layer or only in ``layers``, differ from ``keys[i]``'s stand-in: empty when they
    all hold what was written."""
    spec, bad = backend.spec, []
    for i in range(len(keys) if upto is None else upto):
        for r in range(spec.tp_size):
            for kind in spec.kinds:
                want = fake_block(keys[i], r // spec.replicas, kind, spec.block_bytes(kind))
                have = backend.block_bytes(r, kind, block_ids[i])
                if layers is not None:
                    c = spec.chunk_bytes(kind)
                    want, have = (b"".join(x[j * c:(j + 1) * c] for j in layers) for x in (want, have))
                if have != want:
                    bad.append((i, r, kind))
    return bad


def mismatched_needed(backend: Any, keys: Sequence[str], block_ids: Sequence[int],
                      num_tokens: int) -> list[tuple[int, int, str]]:
    """As :func:`mismatched_blocks`, over what continuing a cache of ``num_tokens`` tokens
    needs: every layer from the block its last window starts in, and before it the layers of
    groups other than window ones (a window-first read brings no other)."""
    spec = backend.spec
    first = min(spec.window_first_block(num_tokens), len(keys))
    full = [i for g in spec.groups if g.kind != "window" for i in g.layers]
    early = mismatched_blocks(backend, keys[:first], block_ids, layers=full) if full else []  # window-only: none
    return early + [(first + i, r, k) for i, r, k in mismatched_blocks(backend, keys[first:], block_ids[first:])]
