/* Large host copies with streaming (non-temporal) stores, the GIL released.
 *
 * copy(dst, src) copies the bytes of the C-contiguous buffer `src` into the writable
 * C-contiguous buffer `dst` of the same length; ValueError if the lengths differ, TypeError
 * (from the buffer protocol) if either is not such a buffer. It returns None.
 *
 * copy_many(dsts, srcs, stream_from) does the same for each pair of two sequences, the GIL
 * released once for all of them: a store's copy thread moves its share of a batch's objects
 * in one call instead of one call (and one hold of the GIL between them) per object. Pairs
 * of `stream_from` bytes or more use streaming stores, smaller ones memcpy. Every buffer is
 * checked before any byte moves.
 *
 * Why: an embedded store's put copies a block from the staging buffer into the store's array,
 * and a get copies it back into staging; neither destination is read again soon (the GPU's DMA
 * reads the staging, a later get reads the array). With ordinary stores the CPU first reads
 * every destination line into its cache (read-for-ownership), then writes it back: three
 * passes over memory for two. Streaming stores write around the cache: two passes. glibc's
 * memcpy streams only above `glibc.cpu.x86_non_temporal_threshold` (3/4 of the shared cache;
 * 151 MiB on a 300 MiB-L3 host), far above a block's few MiB.
 *
 * copy_sum64(dsts, srcs, starts) copies pairs as copy_many does and answers, for each object
 * (the pairs from starts[j] up to starts[j + 1], the last up to the end), the SUM64 of its
 * bytes (kvstate.backends._integrity.sum64: sum of w_i * (2i + 1) mod 2**64 over its
 * little-endian 64-bit words, counted across its pairs), taken from the very loads that copy
 * the bytes: the source is read from memory once, with additions only. Every
 * pair's length must be a multiple of 8. The numpy backend moves a block's layers between its
 * caches and an arena's slots with it, one call a copy thread.
 *
 * The destination is written through 16-byte SSE2 streaming stores from its first 64-byte
 * boundary on (memcpy for the unaligned head and the tail), then fenced. Where SSE2 is not
 * there (not x86-64), it is memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void stream_copy(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
#endif
    memcpy(dst, src, n);
}

static PyObject *copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src)) return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: %zd bytes into %zd", src.len, dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static void release_all(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

/* How far ahead of its loads sum64_copy asks for the source: the hardware's prefetchers stop at
 * each 4 KiB page, and an arena's shared memory is mapped in 4 KiB pages. On the 16-core H200
 * host, reads out of an arena ran at 0.72-0.73x of memcpy without it, 0.89-0.90x at 1 KiB and
 * 0.90-1.04x at 4 KiB ahead (docs/benchmarks.md). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

/* SUM64 of `words` little-endian 64-bit words at `p`, the first at position `first` of its
 * object: sum of w_i * (2i + 1) mod 2**64. Eight lanes (lane l takes the words 8m + l) keep a
 * running sum P and a sum of the running sums A, additions only (SSE2 where there): for a lane
 * of M words, S = P and sum_m m * w_m = M * S - A, so the lane adds (2(first + l) + 1) S +
 * 16 (M S - A), all mod 2**64. With `dst`, each group of eight words is also stored there, by
 * streaming stores when dst is 16-byte aligned (then fenced), else memcpy: one read of the
 * source for the copy and the sum. */
static uint64_t sum64_copy(char *dst, const char *p, size_t words, uint64_t first) {
    size_t groups = words / 8;
    uint64_t S[8] = {0}, A[8] = {0}, s = 0;
#if defined(__SSE2__)
    int stream = dst != NULL && ((uintptr_t)dst & 15) == 0;
    __m128i P0 = _mm_setzero_si128(), P1 = P0, P2 = P0, P3 = P0, A0 = P0, A1 = P0, A2 = P0, A3 = P0;
    for (size_t m = 0; m < groups; m++) {
        const char *q = p + 64 * m;
        _mm_prefetch(q + PREFETCH_AHEAD, _MM_HINT_T0);
        __m128i a = _mm_loadu_si128((const __m128i *)q), b = _mm_loadu_si128((const __m128i *)(q + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(q + 32)), d = _mm_loadu_si128((const __m128i *)(q + 48));
        P0 = _mm_add_epi64(P0, a), P1 = _mm_add_epi64(P1, b), P2 = _mm_add_epi64(P2, c), P3 = _mm_add_epi64(P3, d);
        A0 = _mm_add_epi64(A0, P0), A1 = _mm_add_epi64(A1, P1), A2 = _mm_add_epi64(A2, P2), A3 = _mm_add_epi64(A3, P3);
        if (stream) {
            char *o = dst + 64 * m;
            _mm_stream_si128((__m128i *)o, a), _mm_stream_si128((__m128i *)(o + 16), b);
            _mm_stream_si128((__m128i *)(o + 32), c), _mm_stream_si128((__m128i *)(o + 48), d);
        }
    }
    if (stream) _mm_sfence();
    else if (dst != NULL) memcpy(dst, p, 64 * groups);
    _mm_storeu_si128((__m128i *)&S[0], P0), _mm_storeu_si128((__m128i *)&S[2], P1);
    _mm_storeu_si128((__m128i *)&S[4], P2), _mm_storeu_si128((__m128i *)&S[6], P3);
    _mm_storeu_si128((__m128i *)&A[0], A0), _mm_storeu_si128((__m128i *)&A[2], A1);
    _mm_storeu_si128((__m128i *)&A[4], A2), _mm_storeu_si128((__m128i *)&A[6], A3);
#else
    for (size_t m = 0; m < groups; m++)
        for (int l = 0; l < 8; l++) {
            uint64_t w;
            memcpy(&w, p + 64 * m + 8 * l, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            w = __builtin_bswap64(w);
#endif
            S[l] += w, A[l] += S[l];
        }
    if (dst != NULL) memcpy(dst, p, 64 * groups);
#endif
    for (int l = 0; l < 8; l++) s += (2 * (first + (uint64_t)l) + 1) * S[l] + 16 * ((uint64_t)groups * S[l] - A[l]);
    for (size_t i = 8 * groups; i < words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        s += w * (2 * (first + i) + 1);
    }
    if (dst != NULL) memcpy(dst + 64 * groups, p + 64 * groups, 8 * (words - 8 * groups));
    return s;
}

/* Buffers of the `n` pairs of `d` and `s`, every one checked (writable destinations,
 * C-contiguous, lengths equal and, with `words`, multiples of 8), or NULL with the error set
 * (`name` names the caller). The number acquired goes to *got either way: release them all. */
static Py_buffer *pair_buffers(const char *name, PyObject *d, PyObject *s, Py_ssize_t n, int words, Py_ssize_t *got) {
    Py_buffer *bufs = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    *got = 0;
    if (bufs == NULL) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++, *got += 2) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(d, i), &bufs[*got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(s, i), &bufs[*got + 1], PyBUF_C_CONTIGUOUS) < 0) {
            *got += 1;
            goto fail;
        }
        if (bufs[*got].len != bufs[*got + 1].len) {
            PyErr_Format(PyExc_ValueError, "%s: pair %zd: %zd bytes into %zd", name, i, bufs[*got + 1].len,
                         bufs[*got].len);
            *got += 2;
            goto fail;
        }
        if (words && bufs[*got].len % 8) {
            PyErr_Format(PyExc_ValueError, "%s: pair %zd: %zd bytes, not whole 64-bit words", name, i, bufs[*got].len);
            *got += 2;
            goto fail;
        }
    }
    return bufs;
fail:
    release_all(bufs, *got);
    *got = 0;
    return NULL;
}

/* The two sequences of a call, as fast sequences of one length; 0, or -1 with the error set. */
static int pair_sequences(const char *name, PyObject *dsts, PyObject *srcs, PyObject **d, PyObject **s) {
    *d = PySequence_Fast(dsts, "dsts must be a sequence");
    if (*d == NULL) return -1;
    *s = PySequence_Fast(srcs, "srcs must be a sequence");
    if (*s == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(*d) != PySequence_Fast_GET_SIZE(*s)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd destinations for %zd sources", name, PySequence_Fast_GET_SIZE(*d),
                     PySequence_Fast_GET_SIZE(*s));
        return -1;
    }
    return 0;
}

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs, *d = NULL, *s = NULL, *out = NULL;
    Py_ssize_t stream_from, got = 0;
    if (!PyArg_ParseTuple(args, "OOn:copy_many", &dsts, &srcs, &stream_from)) return NULL;
    if (pair_sequences("copy_many", dsts, srcs, &d, &s) < 0) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(d);
    Py_buffer *bufs = pair_buffers("copy_many", d, s, n, 0, &got);
    if (bufs == NULL) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < 2 * n; i += 2) {
        if (bufs[i].len >= stream_from) stream_copy((char *)bufs[i].buf, (const char *)bufs[i + 1].buf, (size_t)bufs[i].len);
        else memcpy(bufs[i].buf, bufs[i + 1].buf, (size_t)bufs[i].len);
    }
    Py_END_ALLOW_THREADS
    release_all(bufs, got);
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(d);
    Py_XDECREF(s);
    return out;
}

/* Each object's first pair from `starts` into first[0..objects) (first[objects] = n): they
 * rise strictly from 0, each below n. 0, or -1 with the error set. */
static int object_starts(PyObject *st, Py_ssize_t objects, Py_ssize_t n, Py_ssize_t *first) {
    for (Py_ssize_t j = 0; j < objects; j++) {
        first[j] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(st, j));
        if (first[j] == -1 && PyErr_Occurred()) return -1;
        if (first[j] >= n || (j == 0 ? first[j] != 0 : first[j] <= first[j - 1])) {
            PyErr_Format(PyExc_ValueError, "copy_sum64: starts must rise from 0, each below the %zd pairs", n);
            return -1;
        }
    }
    if (objects == 0 && n) {
        PyErr_SetString(PyExc_ValueError, "copy_sum64: pairs without an object (no starts)");
        return -1;
    }
    first[objects] = n;
    return 0;
}

static void copy_and_sum(Py_buffer *bufs, const Py_ssize_t *first, Py_ssize_t objects, uint64_t *sums) {
    for (Py_ssize_t j = 0; j < objects; j++) {
        uint64_t sum = 0, word = 0;
        for (Py_ssize_t i = first[j]; i < first[j + 1]; i++) {
            char *dst = (char *)bufs[2 * i].buf;
            const char *src = (const char *)bufs[2 * i + 1].buf;
            size_t len = (size_t)bufs[2 * i].len;
            sum += sum64_copy(dst, src, len / 8, word);
            word += len / 8;
        }
        sums[j] = sum;
    }
}

static PyObject *copy_sum64(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs, *starts, *d = NULL, *s = NULL, *st = NULL, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOO:copy_sum64", &dsts, &srcs, &starts)) return NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t got = 0, n, objects;
    Py_ssize_t *first = NULL;
    uint64_t *sums = NULL;
    if (pair_sequences("copy_sum64", dsts, srcs, &d, &s) < 0) goto done;
    if ((st = PySequence_Fast(starts, "copy_sum64: starts must be a sequence")) == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(d), objects = PySequence_Fast_GET_SIZE(st);
    first = PyMem_Calloc((size_t)objects + 1, sizeof(Py_ssize_t));
    sums = PyMem_Calloc((size_t)objects + 1, sizeof(uint64_t));
    if (first == NULL || sums == NULL) { PyErr_NoMemory(); goto done; }
    if (object_starts(st, objects, n, first) < 0) goto done;
    if ((bufs = pair_buffers("copy_sum64", d, s, n, 1, &got)) == NULL) goto done;
    Py_BEGIN_ALLOW_THREADS
    copy_and_sum(bufs, first, objects, sums);
    Py_END_ALLOW_THREADS
    if ((out = PyList_New(objects)) == NULL) goto done;
    for (Py_ssize_t j = 0; j < objects; j++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[j]);
        if (v == NULL) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, j, v);
    }
done:
    if (bufs != NULL) release_all(bufs, got);
    PyMem_Free(first);
    PyMem_Free(sums);
    Py_XDECREF(d);
    Py_XDECREF(s);
    Py_XDECREF(st);
    return out;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src): src's bytes into dst (same length), streaming stores."},
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dsts, srcs, stream_from): copy(dst, src) for each pair, the GIL released once."},
    {"copy_sum64", copy_sum64, METH_VARARGS,
     "copy_sum64(dsts, srcs, starts): copy each pair, streaming, and answer each object's SUM64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streamcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamcopy(void) { return PyModule_Create(&module); }
