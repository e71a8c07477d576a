"""CUDA C source of the transfer kernels, compiled at run time through CuPy (NVRTC).

The kernels move bytes between *layered* memory (GPU caches: one pointer per layer, block ``b``
of layer ``l`` at ``layer_ptrs[l] + b * chunk``) and *flat* memory (a host buffer or a device
staging area, where entry ``i`` of group ``g`` occupies ``span`` contiguous bytes at
``flat(g) + fid[i] * span``; a span holds ``span / chunk`` layers back to back). ``gather``
copies layered → flat (``d2h``), otherwise flat → layered (``h2d``). Every parameter is
64-bit, so the host passes plain ints.

``kv_chunks`` is the fast path when every chunk is a whole number of aligned 16-byte vectors
(the usual bfloat16/float16 cache): one CTA per (entry, layer) chunk, whose indices are loaded
once, and plain vector copies — no per-unit arithmetic.

``kv_span`` takes any chunk size (105 bytes, fp8 scales): one CTA per piece of at most
``SPAN_PIECE`` bytes of a span, staged through shared memory. The GPU side moves byte by byte,
coalesced across the CTA (every byte is independent, so the loads overlap); the flat side
moves as aligned 16-byte vectors with byte-exact head and tail — so writes into pinned host
memory still leave as full packets, tails are copied exactly, and no thread walks a chain of
dependent byte copies; each thread issues its loads in batches before storing any, so a
CTA has many loads in flight.

``kv_copy_sum`` copies blocks between two layered caches of one shape (a direct pull: the
source is another GPU's, read over the link) as ``kv_chunks`` does, and takes each copied
block's SUM64 (:mod:`kvstate.kernels._cuda_checksum`'s weights, the block's rows of every layer
one object) from the words it moved: each thread weighs what it loaded, a warp adds its
threads' sums and one atomic a warp adds them into the block's. The sums then cost no second
read of the copies: they ride in the registers of a copy bound by the link.

Each kernel comes in two forms. The plain one reads the block ids from device arrays (``gids``,
``fids``); the ``_i`` form takes up to ``INLINE_IDS`` of them inside its parameters (an
``IdList`` passed by value as a ``__grid_constant__``), so a call of that size needs no
upload of its ids before the kernel and no event guarding the upload buffer.
"""
from __future__ import annotations

__all__ = ["KERNEL_SOURCE", "KERNEL_NAMES", "SPAN_PIECE", "INLINE_IDS"]

KERNEL_NAMES = ("kv_chunks", "kv_chunks_i", "kv_span", "kv_span_i", "kv_copy_sum", "kv_copy_sum_i")

#: bytes of a span one ``kv_span`` CTA moves through shared memory (plus 16 for alignment)
SPAN_PIECE = 1024

#: most block ids an ``_i`` kernel takes in its parameters (keeps them under 4 KiB)
INLINE_IDS = 480

KERNEL_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

#define INLINE_IDS 480
struct IdList {            /* block ids passed by value: 8 + 2 * 4 * INLINE_IDS bytes */
    int n, has_f;
    int g[INLINE_IDS];
    int f[INLINE_IDS];
};

struct DevIds {            /* ids in device memory; no fids: entry i goes to flat position i */
    const i64* g; const i64* f;
    __device__ __forceinline__ u64 gid(unsigned int i) const { return (u64)g[i]; }
    __device__ __forceinline__ u64 fid(unsigned int i) const { return f ? (u64)f[i] : (u64)i; }
};

struct InlineIds {         /* ids in the kernel's parameter space */
    const IdList* p;
    __device__ __forceinline__ u64 gid(unsigned int i) const { return (u64)p->g[i]; }
    __device__ __forceinline__ u64 fid(unsigned int i) const { return p->has_f ? (u64)p->f[i] : (u64)i; }
};

template <class Ids>
__device__ __forceinline__ void chunks_body(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const Ids ids, u64 span, u64 chunk, u64 lps64, i64 gather)
{
    const unsigned int layers_per_span = (unsigned int)lps64;
    const unsigned int i = blockIdx.x;
    const unsigned int gl = blockIdx.y;
    const unsigned int g = gl / layers_per_span;
    const unsigned int l = gl - g * layers_per_span;
    const u64 fb = ids.fid(i);
    const u64 gbase = flat_ptrs ? flat_ptrs[g] : flat_base + (u64)g * group_stride;
    uint4* f = (uint4*)(gbase + fb * span + (u64)l * chunk);
    uint4* p = (uint4*)(layer_ptrs[gl] + ids.gid(i) * chunk);
    const u64 units = chunk >> 4;
    if (gather) {
        for (u64 j = threadIdx.x; j < units; j += blockDim.x) f[j] = p[j];
    } else {
        for (u64 j = threadIdx.x; j < units; j += blockDim.x) p[j] = f[j];
    }
}

#define SUM_BATCH 4

__device__ __forceinline__ u64 weighed(uint4 v, u64 w) {   /* two words, weights w and w + 2 */
    const u64 lo = (u64)v.x | ((u64)v.y << 32), hi = (u64)v.z | ((u64)v.w << 32);
    return lo * w + hi * (w + 2ull);
}

template <class Ids>
__device__ __forceinline__ void copy_sum_body(
    const u64* __restrict__ src_ptrs, const u64* __restrict__ dst_ptrs, const Ids ids, u64 chunk,
    u64* __restrict__ sums)
{
    const unsigned int i = blockIdx.x, l = blockIdx.y;
    const uint4* p = (const uint4*)(src_ptrs[l] + ids.gid(i) * chunk);
    uint4* f = (uint4*)(dst_ptrs[l] + ids.fid(i) * chunk);
    const u64 units = chunk >> 4, w0 = 2ull * ((u64)l * (chunk >> 3)) + 1ull;  /* word 2u weighs w0 + 4u */
    const unsigned int step = blockDim.x;
    u64 acc = 0, j = threadIdx.x;
    for (; j + (SUM_BATCH - 1) * step < units; j += SUM_BATCH * step) {
        uint4 v[SUM_BATCH];
        #pragma unroll
        for (int k = 0; k < SUM_BATCH; ++k) v[k] = p[j + k * step];   /* every load in flight first */
        #pragma unroll
        for (int k = 0; k < SUM_BATCH; ++k) {
            const u64 u = j + k * step;
            f[u] = v[k];
            acc += weighed(v[k], w0 + 4ull * u);
        }
    }
    for (; j < units; j += step) {
        const uint4 v = p[j];
        f[j] = v;
        acc += weighed(v, w0 + 4ull * j);
    }
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(sums + i, acc);
}

#define SPAN_BATCH 8

template <class Ids>
__device__ __forceinline__ void span_body(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const Ids ids, u64 span64, u64 chunk64, u64 lps64, u64 piece64, i64 gather)
{
    /* 64-bit parameters (the host passes plain ints); spans are < 2^31 here */
    const unsigned int span = (unsigned int)span64, chunk = (unsigned int)chunk64;
    const unsigned int layers_per_span = (unsigned int)lps64, piece = (unsigned int)piece64;
    extern __shared__ uint4 smem4[];
    unsigned char* sm = (unsigned char*)smem4;
    const unsigned int i = blockIdx.x, g = blockIdx.y;
    const unsigned int s0 = blockIdx.z * piece;
    if (s0 >= span) return;
    const unsigned int len = span - s0 < piece ? span - s0 : piece;
    const u64 fb = ids.fid(i);
    const u64 gbase = flat_ptrs ? flat_ptrs[g] : flat_base + (u64)g * group_stride;
    unsigned char* f = (unsigned char*)(gbase + fb * (u64)span + s0);  /* this piece, flat side */
    const unsigned int a0 = (unsigned int)((u64)f & 15);               /* sm[a0 + t] <-> f[t] */
    const unsigned int head = a0 ? (16 - a0 < len ? 16 - a0 : len) : 0;
    const unsigned int nvec = (len - head) >> 4;
    const unsigned int vend = head + (nvec << 4);                      /* f + head is aligned */
    const u64* lp = layer_ptrs + (u64)g * layers_per_span;
    const u64 gofs = ids.gid(i) * (u64)chunk;
    const unsigned int step = blockDim.x * SPAN_BATCH;
    if (gather) {
        for (unsigned int t0 = threadIdx.x; t0 < len; t0 += step) {
            unsigned char v[SPAN_BATCH];
            #pragma unroll
            for (int k = 0; k < SPAN_BATCH; ++k) {   /* every load of the batch in flight at once */
                const unsigned int t = t0 + k * blockDim.x;
                if (t < len) {
                    const unsigned int u = s0 + t, l = u / chunk;
                    v[k] = __ldg((const unsigned char*)lp[l] + gofs + (u - l * chunk));
                }
            }
            #pragma unroll
            for (int k = 0; k < SPAN_BATCH; ++k) {
                const unsigned int t = t0 + k * blockDim.x;
                if (t < len) sm[a0 + t] = v[k];
            }
        }
        __syncthreads();
        for (unsigned int v = threadIdx.x; v < nvec; v += blockDim.x)
            ((uint4*)(f + head))[v] = smem4[(a0 + head) / 16 + v];
        for (unsigned int t = threadIdx.x; t < head; t += blockDim.x) f[t] = sm[a0 + t];
        for (unsigned int t = vend + threadIdx.x; t < len; t += blockDim.x) f[t] = sm[a0 + t];
    } else {
        for (unsigned int v = threadIdx.x; v < nvec; v += blockDim.x)
            smem4[(a0 + head) / 16 + v] = ((const uint4*)(f + head))[v];
        for (unsigned int t = threadIdx.x; t < head; t += blockDim.x) sm[a0 + t] = f[t];
        for (unsigned int t = vend + threadIdx.x; t < len; t += blockDim.x) sm[a0 + t] = f[t];
        __syncthreads();
        for (unsigned int t = threadIdx.x; t < len; t += blockDim.x) {
            const unsigned int u = s0 + t, l = u / chunk;
            *((unsigned char*)lp[l] + gofs + (u - l * chunk)) = sm[a0 + t];
        }
    }
}

extern "C" __global__ void kv_chunks(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const i64* __restrict__ gids, const i64* __restrict__ fids,
    u64 span, u64 chunk, u64 lps64, i64 gather)
{
    DevIds ids = {gids, fids};
    chunks_body(layer_ptrs, flat_ptrs, flat_base, group_stride, ids, span, chunk, lps64, gather);
}

extern "C" __global__ void kv_chunks_i(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, u64 span, u64 chunk, u64 lps64, i64 gather, const __grid_constant__ IdList idl)
{
    InlineIds ids = {&idl};
    chunks_body(layer_ptrs, flat_ptrs, flat_base, group_stride, ids, span, chunk, lps64, gather);
}

extern "C" __global__ void kv_copy_sum(
    const u64* __restrict__ src_ptrs, const u64* __restrict__ dst_ptrs, const i64* __restrict__ gids,
    const i64* __restrict__ fids, u64 chunk, u64* __restrict__ sums)
{
    DevIds ids = {gids, fids};
    copy_sum_body(src_ptrs, dst_ptrs, ids, chunk, sums);
}

extern "C" __global__ void kv_copy_sum_i(
    const u64* __restrict__ src_ptrs, const u64* __restrict__ dst_ptrs, u64 chunk, u64* __restrict__ sums,
    const __grid_constant__ IdList idl)
{
    InlineIds ids = {&idl};
    copy_sum_body(src_ptrs, dst_ptrs, ids, chunk, sums);
}

extern "C" __global__ void kv_span(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const i64* __restrict__ gids, const i64* __restrict__ fids,
    u64 span64, u64 chunk64, u64 lps64, u64 piece64, i64 gather)
{
    DevIds ids = {gids, fids};
    span_body(layer_ptrs, flat_ptrs, flat_base, group_stride, ids, span64, chunk64, lps64, piece64, gather);
}

extern "C" __global__ void kv_span_i(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, u64 span64, u64 chunk64, u64 lps64, u64 piece64, i64 gather,
    const __grid_constant__ IdList idl)
{
    InlineIds ids = {&idl};
    span_body(layer_ptrs, flat_ptrs, flat_base, group_stride, ids, span64, chunk64, lps64, piece64, gather);
}
"""
