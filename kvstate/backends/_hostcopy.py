"""Large host-to-host copies for the embedded stores, streaming past the CPU's caches.

Rules:

- :func:`copy_into` copies ``src``'s bytes into ``dst`` (numpy byte arrays of one length) and
  releases the GIL while it copies, so several copy threads run at once.
- ``copy_sum64`` (the C helper's alone) copies many pairs with streaming stores and takes each
  object's SUM64 (:func:`~kvstate.backends._integrity.sum64`) a cache-sized piece before it
  copies it: a checksummed copy that reads its source from memory once.
- :func:`copy_all` copies many pairs (any flat byte buffers) in one call: with the C helper,
  the GIL is released once for the whole batch, so a thread moving many small objects does
  not queue for the GIL between them.
- From :data:`STREAM_BYTES` up, and where ``pip install`` built the C helper
  :mod:`kvstate.backends._streamcopy` (:data:`STREAMING`), it writes with streaming
  (non-temporal) stores: a store's put and get write a destination nothing reads again soon,
  and an ordinary store would first read every destination line into the cache. Smaller copies,
  and every copy where the helper was not built, are numpy's (same bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["copy_into", "copy_all", "stream_copy", "copy_sum64", "STREAMING", "STREAM_BYTES"]


def _compiled() -> tuple[Callable[[Any, Any], None] | None, Callable[[Any, Any, int], None] | None,
                         Callable[[Any, Any, Any], list[int]] | None]:
    try:
        from ._streamcopy import copy, copy_many, copy_sum64
    except ImportError:  # pragma: no cover - where no C compiler was found at install
        return None, None, None
    return copy, copy_many, copy_sum64


#: the C helper's ``copy(dst, src)`` (streaming stores), ``copy_many(dsts, srcs, stream_from)``
#: and ``copy_sum64(dsts, srcs, starts)`` (each object's SUM64 taken as it is copied: see
#: ``_streamcopy.c``); None where it was not built
stream_copy, stream_copy_many, copy_sum64 = _compiled()

#: whether copies from :data:`STREAM_BYTES` up use streaming stores
STREAMING: bool = stream_copy is not None
#: the smallest copy worth streaming: below it the destination may as well stay in cache
STREAM_BYTES = 256 << 10


def copy_into(dst: np.ndarray, src: np.ndarray, stream: Any = stream_copy) -> None:
    """Copy ``src``'s bytes into ``dst`` (``stream``: the streaming copy, None for numpy's)."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy_into: {src.nbytes} bytes into {dst.nbytes}")
    if stream is not None and dst.nbytes >= STREAM_BYTES:
        stream(dst, src)
    else:
        np.copyto(dst, src)


def copy_all(dsts: Sequence[Any], srcs: Sequence[Any], many: Any = stream_copy_many) -> None:
    """Copy each ``srcs[i]``'s bytes into ``dsts[i]`` (flat byte buffers, pairwise of one length;
    ``many``: the C helper's batch copy, None for numpy's, one pair at a time)."""
    if many is not None:
        many(dsts, srcs, STREAM_BYTES)
        return
    for d, s in zip(dsts, srcs, strict=True):
        copy_into(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8), None)
