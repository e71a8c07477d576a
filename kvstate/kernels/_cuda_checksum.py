"""SUM64 checksums of stored block objects, taken on the GPU where the caches are.

A block's object of one kind is, in the stored (block-major) layout, its row of each layer of a
span, one after the other. :data:`~kvstate.backends._integrity.SUM64` weighs each 64-bit word of
it by ``2i + 1``, ``i`` its position in the object; so per layer it is the row's words weighted
from ``layer × words`` on, summed mod 2**64 with the other layers'. On the GPU that is one
kernel: a thread block per (block, layer) row reads the row where it lies, weighs its words and
adds the row's sum into the block's (uint64 arithmetic wraps; addition commutes, so the order
of the atomic adds changes nothing). The caches are read once more from HBM, about a quarter of
a millisecond a GiB, while the transfer is bound by PCIe and the store. The result equals
:func:`kvstate.backends._integrity.sum64` of the same bytes on the host, which is what lets
either side verify the other's objects.

Sums are taken on CuPy's current stream: callers wait for the copies that wrote the blocks
(a scatter's event, a layer-wise save's gather) before they ask, or make the stream wait.
:func:`to_host` lands them in pinned host memory with a kernel's stores rather than a copy:
a copy from the device queues on a copy engine behind the DMAs a save has in flight, so a
write that fetched its sums that way would wait for its own gather before it could write its
manifests.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["block_sums", "summable", "to_host", "fold_match", "load_fold_match", "load_sums"]


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

_TO_HOST = r"""
extern "C" __global__ void u64_to_host(const unsigned long long* src, unsigned long long* dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        dst[i] = src[i];
}
"""


_FOLD_MATCH = r"""
extern "C" __global__ void fold_match(const unsigned long long* sums, long long kinds, long long n,
                                      const unsigned long long* expect, long long* host_out) {
    __shared__ long long best[32];
    long long mine = n;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned long long h = 0xCBF29CE484222325ull;
        for (long long j = 0; j < kinds; ++j)
            h = (h ^ sums[j * n + i]) * 0x100000001B3ull;
        if (h != expect[i]) {  /* a thread's indices rise: its first miss is its least */
            mine = i;
            break;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const long long other = __shfl_down_sync(0xffffffffu, mine, o);
        mine = other < mine ? other : mine;
    }
    if ((threadIdx.x & 31) == 0)
        best[threadIdx.x >> 5] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long least = n;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w)
            least = best[w] < least ? best[w] : least;
        *host_out = least;
    }
}
"""


#: the kernels, by their name in a caller's cache: source and entry point
_KERNELS = {"kernel": (_SOURCE, "sum64_rows"), "to_host": (_TO_HOST, "u64_to_host"),
            "fold_match": (_FOLD_MATCH, "fold_match")}


def _kernel(cp: Any, cache: dict[Any, Any], name: str, load: bool = False) -> Any:
    """The kernel ``name`` of ``_KERNELS``, made once and kept in ``cache``; with ``load``,
    compiled and loaded on the current device now, rather than at its first launch."""
    kernel = cache.get(name)
    if kernel is None:
        kernel = cache[name] = cp.RawKernel(*_KERNELS[name])
    if load:
        kernel.compile()
    return kernel


def load_fold_match(cp: Any, cache: dict[Any, Any]) -> Any:
    """:func:`fold_match`'s kernel, compiled and loaded now and kept in ``cache``: a module
    load waits for every stream of the context, so a caller about to queue work that waits
    on the host (an armed pull) loads it first."""
    return _kernel(cp, cache, "fold_match", load=True)


def load_sums(cp: Any, cache: dict[Any, Any]) -> None:
    """:func:`block_sums`' and :func:`to_host`'s kernels, compiled and loaded now on the current
    device and kept in ``cache``: a backend about to queue a wait on the host (an armed pull)
    loads every kernel its reads and writes may launch meanwhile (see :func:`load_fold_match`)."""
    for name in ("kernel", "to_host"):
        _kernel(cp, cache, name, load=True)


def fold_match(cp: Any, sums: Any, expect: Any, host_ptr: int, cache: dict[Any, Any]) -> None:
    """On CuPy's current stream: fold each block's objects' sums (``sums``: ``[objects,
    blocks]`` uint64 on the device, :func:`~kvstate.backends._lends.fold_sums`' FNV fold),
    compare with ``expect`` (uint64 on the device, one a block) and store how many leading
    blocks match (an int64) at ``host_ptr`` (the device's address of pinned host memory).
    One CTA: a pull's blocks are hundreds to thousands, and the host reads one number."""
    kernel = cache.get("fold_match") or load_fold_match(cp, cache)  # loaded once, then a lookup
    kinds, n = sums.shape
    kernel((1,), (1024,), (sums, np.int64(kinds), np.int64(n), expect, np.uint64(host_ptr)))


def block_sums(cp: Any, views: Sequence[Any], ids: Any, cache: dict[Any, Any], fetch: bool = True,
               out: Any = None) -> Any:
    """SUM64 of each block's object made of ``views``' layers (per-layer GPU arrays ``[blocks,
    ...]`` of one shape, in object order): a uint64 array, one per id (``ids``: a sequence, or
    an int64 device array already uploaded). With ``fetch`` off, the device array, still being
    summed (a caller with other work fetches it later rather than wait for the kernel now);
    with ``out`` (a zeroed uint64 device array, one per id), the sums land there. ``cache``
    keeps the compiled kernel and, per list of layers, its device pointer table: a backend's
    layers are fixed, so a call reads none of their attributes again."""
    kernel = _kernel(cp, cache, "kernel")
    table, words = _table(cp, views, cache)
    ids_d = ids if isinstance(ids, cp.ndarray) else cp.asarray(np.asarray(ids, np.int64))
    if out is None:
        out = cp.zeros(len(ids_d), dtype=cp.uint64)
    kernel((len(ids_d), len(views)), (_THREADS,), (table, ids_d, np.int64(words), out))
    return cp.asnumpy(out) if fetch else out


def _table(cp: Any, views: Sequence[Any], cache: dict[Any, Any]) -> tuple[Any, int]:
    """The layers' device pointer table and words per row, made once per list of layers (kept
    in ``cache`` with the list, so its id is not reused while the entry lives)."""
    entry = cache.get(("layers", id(views)))
    if entry is None or entry[0] is not views:
        ptrs = np.asarray([int(v.data.ptr) for v in views], np.uint64)
        entry = cache[("layers", id(views))] = (views, cp.asarray(ptrs), views[0].nbytes // views[0].shape[0] // 8)
    return entry[1], entry[2]


def to_host(cp: Any, sums: Any, cache: dict[Any, Any], host: Any = None, host_ptr: int | None = None) -> Any:
    """A pinned host array of ``sums``' shape, filled by a kernel on CuPy's current stream
    (its stores cross PCIe as mapped writes, never through a copy engine); read it once an
    event recorded after this call has passed. The memory comes from CuPy's pinned pool and
    returns there when the array is dropped: the caller keeps it until that event passed.
    ``host``: a pinned uint64 array of that shape to fill instead (a caller's, reused), and
    ``host_ptr`` the device's address for it if the caller knows it."""
    import cupyx

    kernel = _kernel(cp, cache, "to_host")
    if host is None:
        host = cupyx.empty_pinned(sums.shape, np.uint64)
    n = int(sums.size)
    if n:
        # pinned memory is mapped under unified addressing; the device's address for it, asked
        dst = host_ptr if host_ptr is not None else \
            int(cp.cuda.runtime.pointerGetAttributes(int(host.ctypes.data)).devicePointer)
        kernel((-(-n // _THREADS),), (_THREADS,), (cp.ascontiguousarray(sums), np.uint64(dst), np.int64(n)))
    return host
