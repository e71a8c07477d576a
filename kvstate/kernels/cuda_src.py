"""CUDA C source of the transfer kernels, compiled at run time through CuPy (NVRTC).

One kernel, ``kv_copy``, moves bytes between *layered* memory (GPU caches: one pointer per
layer, a block ``b`` of layer ``l`` at ``layer_ptrs[l] + b * chunk``) and *flat* memory (a host
buffer or a device staging area, where entry ``i`` of group ``g`` occupies ``span``
contiguous bytes at ``flat(g) + fid[i] * span``; a span holds ``span / chunk`` layers back to
back). ``gather`` copies layered → flat (``d2h``), otherwise flat → layered (``h2d``).

Work is split into 16-byte *units aligned in flat memory*, each CTA taking one contiguous
range of them: every flat access is one 16-byte
load or store, so writes into pinned host memory leave the GPU as full, coalesced PCIe
packets whatever the chunk size. A unit whose GPU side is also aligned and inside one chunk
moves with one vector access; otherwise its bytes are assembled one by one (odd chunk sizes,
such as 105 bytes), and a unit cut by a span's edge touches only its own bytes — tails are
copied exactly. Two variants: 32-bit index arithmetic when every index fits, 64-bit otherwise.

``kv_chunks`` is the fast path when every chunk is a whole number of aligned 16-byte vectors
(the usual bfloat16/float16 cache): one CTA per (entry, layer) chunk, whose indices are loaded
once, and plain vector copies — no per-unit arithmetic.

``kv_span`` is the path for chunk sizes that are not whole vectors (105 bytes, fp8 scales):
one CTA per piece of at most ``SPAN_PIECE`` bytes of a span, staged through shared memory.
The GPU side moves byte by byte, coalesced across the CTA (every byte is independent, so
the loads overlap); the flat side moves as aligned 16-byte vectors with byte-exact head and
tail — so writes into pinned host memory still leave as full packets, and no thread walks a
chain of dependent byte copies.
"""
from __future__ import annotations

__all__ = ["KERNEL_SOURCE", "KERNEL_NAMES"]

KERNEL_NAMES = ("kv_copy32", "kv_copy64", "kv_chunks", "kv_span")

#: bytes of a span one ``kv_span`` CTA moves through shared memory (plus 16 for alignment)
SPAN_PIECE = 16384

KERNEL_SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;

template <typename I>
__device__ __forceinline__ void kv_copy_body(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const i64* __restrict__ gids, const i64* __restrict__ fids,
    I n, I groups, I span, I chunk, I layers_per_span, I units, int gather)
{
    /* each CTA walks one contiguous range of units, so the writes in flight at any moment
       fall in few pages (scattered writes into pinned memory thrash the IOMMU's TLB) */
    const I total = n * groups * units;
    const I per = (total + (I)gridDim.x - 1) / (I)gridDim.x;
    const I first = (I)blockIdx.x * per;
    const I last = first + per < total ? first + per : total;
    for (I u = first + (I)threadIdx.x; u < last; u += (I)blockDim.x) {
        const I e = u / units;
        const I k = u - e * units;
        const I g = e / n;
        const I i = e - g * n;
        const u64 fb = fids ? (u64)fids[i] : (u64)i;
        const u64 gbase = flat_ptrs ? flat_ptrs[g] : flat_base + (u64)g * group_stride;
        unsigned char* span0 = (unsigned char*)(gbase + fb * (u64)span);
        const u64 a = ((u64)span0 & ~(u64)15) + (u64)16 * (u64)k;   /* aligned unit address */
        const i64 lo = (i64)(a - (u64)span0);                     /* may be < 0 for unit 0 */
        const i64 s = lo < 0 ? 0 : lo;
        const i64 t = lo + 16 > (i64)span ? (i64)span : lo + 16;
        if (s >= t) continue;
        const u64 gid = (u64)gids[i];
        I l = (I)s / chunk;
        I off = (I)s - l * chunk;
        const u64* lp = layer_ptrs + g * layers_per_span;
        unsigned char* gp = (unsigned char*)lp[l] + gid * (u64)chunk + off;
        if (s == lo && t == lo + 16) {
            uint4* fp = (uint4*)a;
            if (off + 16 <= chunk && (((u64)gp) & 15) == 0) {
                if (gather) *fp = *(const uint4*)gp; else *(uint4*)gp = *fp;
                continue;
            }
            uint4 v;
            unsigned char* vb = (unsigned char*)&v;
            if (!gather) v = *fp;
            for (int j = 0; j < 16; ++j) {
                if (gather) vb[j] = *gp; else *gp = vb[j];
                if (++off == chunk) { off = 0; ++l; if (j < 15) gp = (unsigned char*)lp[l] + gid * (u64)chunk; }
                else ++gp;
            }
            if (gather) *fp = v;
            continue;
        }
        /* a unit cut by the span's edge: only this span's bytes */
        unsigned char* fp = span0 + s;
        for (i64 j = s; j < t; ++j) {
            if (gather) *fp = *gp; else *gp = *fp;
            ++fp;
            if (++off == chunk) { off = 0; ++l; if (j + 1 < t) gp = (unsigned char*)lp[l] + gid * (u64)chunk; }
            else ++gp;
        }
    }
}

extern "C" __global__ void kv_chunks(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const i64* __restrict__ gids, const i64* __restrict__ fids,
    u64 span, u64 chunk, u64 lps64, i64 gather)
{
    const unsigned int layers_per_span = (unsigned int)lps64;
    const unsigned int i = blockIdx.x;
    const unsigned int gl = blockIdx.y;
    const unsigned int g = gl / layers_per_span;
    const unsigned int l = gl - g * layers_per_span;
    const u64 fb = fids ? (u64)fids[i] : (u64)i;
    const u64 gbase = flat_ptrs ? flat_ptrs[g] : flat_base + (u64)g * group_stride;
    uint4* f = (uint4*)(gbase + fb * span + (u64)l * chunk);
    uint4* p = (uint4*)(layer_ptrs[gl] + (u64)gids[i] * chunk);
    const u64 units = chunk >> 4;
    if (gather) {
        for (u64 j = threadIdx.x; j < units; j += blockDim.x) f[j] = p[j];
    } else {
        for (u64 j = threadIdx.x; j < units; j += blockDim.x) p[j] = f[j];
    }
}

extern "C" __global__ void kv_span(
    const u64* __restrict__ layer_ptrs, const u64* __restrict__ flat_ptrs, u64 flat_base,
    u64 group_stride, const i64* __restrict__ gids, const i64* __restrict__ fids,
    u64 span64, u64 chunk64, u64 lps64, u64 piece64, i64 gather)
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
    const u64 fb = fids ? (u64)fids[i] : (u64)i;
    const u64 gbase = flat_ptrs ? flat_ptrs[g] : flat_base + (u64)g * group_stride;
    unsigned char* f = (unsigned char*)(gbase + fb * (u64)span + s0);  /* this piece, flat side */
    const unsigned int a0 = (unsigned int)((u64)f & 15);               /* sm[a0 + t] <-> f[t] */
    const unsigned int head = a0 ? (16 - a0 < len ? 16 - a0 : len) : 0;
    const unsigned int nvec = (len - head) >> 4;
    const unsigned int vend = head + (nvec << 4);                      /* f + head is aligned */
    const u64* lp = layer_ptrs + (u64)g * layers_per_span;
    const u64 gofs = (u64)gids[i] * (u64)chunk;
    if (gather) {
        for (unsigned int t = threadIdx.x; t < len; t += blockDim.x) {
            const unsigned int u = s0 + t, l = u / chunk;
            sm[a0 + t] = *((const unsigned char*)lp[l] + gofs + (u - l * chunk));
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

extern "C" __global__ void kv_copy32(
    const u64* layer_ptrs, const u64* flat_ptrs, u64 flat_base, u64 group_stride,
    const i64* gids, const i64* fids, unsigned int n, unsigned int groups, unsigned int span,
    unsigned int chunk, unsigned int layers_per_span, unsigned int units, int gather)
{
    kv_copy_body<unsigned int>(layer_ptrs, flat_ptrs, flat_base, group_stride, gids, fids,
                               n, groups, span, chunk, layers_per_span, units, gather);
}

extern "C" __global__ void kv_copy64(
    const u64* layer_ptrs, const u64* flat_ptrs, u64 flat_base, u64 group_stride,
    const i64* gids, const i64* fids, u64 n, u64 groups, u64 span,
    u64 chunk, u64 layers_per_span, u64 units, int gather)
{
    kv_copy_body<u64>(layer_ptrs, flat_ptrs, flat_base, group_stride, gids, fids,
                      n, groups, span, chunk, layers_per_span, units, gather);
}
"""
