"""Large host-to-host copies for the embedded stores, streaming past the CPU's caches.

Rules:

- :func:`copy_into` copies ``src``'s bytes into ``dst`` (numpy byte arrays of one length) and
  releases the GIL while it copies, so several copy threads run at once.
- From :data:`STREAM_BYTES` up, and where ``pip install`` built the C helper
  :mod:`kvstate.backends.streamcopy` (:data:`STREAMING`), it writes with streaming
  (non-temporal) stores: a store's put and get write a destination nothing reads again soon,
  and an ordinary store would first read every destination line into the cache. Smaller copies,
  and every copy where the helper was not built, are numpy's (same bytes).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["copy_into", "stream_copy", "STREAMING", "STREAM_BYTES"]


def _compiled() -> Callable[[Any, Any], None] | None:
    try:
        from .streamcopy import copy
    except ImportError:  # pragma: no cover - where no C compiler was found at install
        return None
    return copy


#: the C helper's ``copy(dst, src)`` (streaming stores); None where it was not built
stream_copy = _compiled()

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
