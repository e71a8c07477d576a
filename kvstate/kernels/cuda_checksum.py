"""SUM64 checksums of stored block objects, taken on the GPU where the caches are.

A block's object of one kind is, in the stored (block-major) layout, its row of each layer of a
span, one after the other. :data:`~kvstate.backends.integrity.SUM64` weighs each 64-bit word of
it by ``2i + 1``, ``i`` its position in the object; so per layer it is the row's words weighted
from ``layer × words`` on, summed mod 2**64 with the other layers'. On the GPU that is one
kernel: a thread block per (block, layer) row reads the row where it lies, weighs its words and
adds the row's sum into the block's (uint64 arithmetic wraps; addition commutes, so the order
of the atomic adds changes nothing). The caches are read once more from HBM, about a quarter of
a millisecond a GiB, while the transfer is bound by PCIe and the store. The result equals
:func:`kvstate.backends.integrity.sum64` of the same bytes on the host, which is what lets
either side verify the other's objects.

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


_SOURCE = r"""
extern "C" __global__ void sum64_rows(const unsigned long long* const* layers, const long long* ids,
                                      long long words, unsigned long long* out) {
    const long long i = blockIdx.x, layer = blockIdx.y;
    const unsigned long long* row = layers[layer] + ids[i] * words;
    const unsigned long long base = (unsigned long long)layer * words;
    unsigned long long acc = 0;
    for (long long j = threadIdx.x; j < words; j += blockDim.x)
        acc += row[j] * (2ull * (base + j) + 1ull);
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(out + i, acc);
}
"""
_THREADS = 256


def block_sums(cp: Any, views: Sequence[Any], ids: Sequence[int], cache: dict[Any, Any]) -> np.ndarray:
    """SUM64 of each block's object made of ``views``' layers (per-layer GPU arrays ``[blocks,
    ...]`` of one shape, in object order): a uint64 array, one per id. ``cache`` keeps the
    compiled kernel and each set of layers' device pointer array between calls."""
    kernel = cache.get("kernel")
    if kernel is None:
        kernel = cache["kernel"] = cp.RawKernel(_SOURCE, "sum64_rows")
    ptrs = tuple(int(v.data.ptr) for v in views)
    table = cache.get(ptrs)
    if table is None:
        table = cache[ptrs] = cp.asarray(np.asarray(ptrs, np.uint64))
    words = views[0].nbytes // views[0].shape[0] // 8
    ids_d = cp.asarray(np.asarray(ids, np.int64))
    out = cp.zeros(len(ids), dtype=cp.uint64)
    kernel((len(ids), len(views)), (_THREADS,), (table, ids_d, np.int64(words), out))
    return cp.asnumpy(out)
