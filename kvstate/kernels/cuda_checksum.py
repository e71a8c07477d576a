"""SUM64 checksums of stored block objects, taken on the GPU where the caches are.

A block's object of one kind is, in the stored (block-major) layout, its row of each layer of a
span, one after the other. :data:`~kvstate.backends.integrity.SUM64` weighs each 64-bit word of
it by ``2i + 1``, ``i`` its position in the object; so per layer it is the row's words weighted
from ``layer × words`` on, summed mod 2**64 with the other layers'. On the GPU that is, per
layer, a gather of the blocks' rows, a multiply and a row sum (CuPy, uint64 arithmetic wraps):
the caches are read once more from HBM, a few hundred µs a GiB, while the transfer is bound by
PCIe and the store. The result equals :func:`kvstate.backends.integrity.sum64` of the same bytes
on the host, which is what lets either side verify the other's objects.

Sums are taken on CuPy's current stream: callers wait for the copies that wrote the blocks
(a scatter's event, a layer-wise save's gather) before they ask.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["block_sums", "summable"]


def summable(views: Sequence[Any]) -> bool:
    """Whether layers' rows are whole 64-bit words (what :func:`block_sums` reads them as)."""
    return bool(views) and all((v.nbytes // v.shape[0]) % 8 == 0 and v.flags.c_contiguous for v in views)


def block_sums(cp: Any, views: Sequence[Any], ids: Sequence[int], weights: dict[tuple[int, int], Any]) -> np.ndarray:
    """SUM64 of each block's object made of ``views``' layers (per-layer GPU arrays ``[blocks,
    ...]``, in object order): a uint64 array, one per id. ``weights`` caches each layer's
    weights by (words, layer) between calls."""
    ids_d = cp.asarray(np.asarray(ids, np.int64))
    acc = cp.zeros(len(ids), dtype=cp.uint64)
    for li, v in enumerate(views):
        rows = v.reshape(v.shape[0], -1).view(cp.uint64)
        words = rows.shape[1]
        w = weights.get((words, li))
        if w is None:
            w = weights[(words, li)] = cp.arange(li * words, (li + 1) * words, dtype=cp.uint64) * cp.uint64(2) \
                + cp.uint64(1)
        acc += (rows[ids_d] * w).sum(axis=1, dtype=cp.uint64)
    return cp.asnumpy(acc)
