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

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_ssize_t stream_from;
    if (!PyArg_ParseTuple(args, "OOn:copy_many", &dsts, &srcs, &stream_from)) return NULL;
    PyObject *d = PySequence_Fast(dsts, "copy_many: dsts must be a sequence");
    if (d == NULL) return NULL;
    PyObject *s = PySequence_Fast(srcs, "copy_many: srcs must be a sequence");
    if (s == NULL) { Py_DECREF(d); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(d), got = 0;
    Py_buffer *bufs = NULL;
    if (n != PySequence_Fast_GET_SIZE(s)) {
        PyErr_Format(PyExc_ValueError, "copy_many: %zd destinations for %zd sources", n, PySequence_Fast_GET_SIZE(s));
        goto fail;
    }
    bufs = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    if (bufs == NULL) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t i = 0; i < n; i++, got += 2) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(d, i), &bufs[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(s, i), &bufs[got + 1], PyBUF_C_CONTIGUOUS) < 0) {
            got += 1;
            goto fail;
        }
        if (bufs[got].len != bufs[got + 1].len) {
            PyErr_Format(PyExc_ValueError, "copy_many: pair %zd: %zd bytes into %zd", i, bufs[got + 1].len,
                         bufs[got].len);
            got += 2;
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < 2 * n; i += 2) {
        if (bufs[i].len >= stream_from) stream_copy((char *)bufs[i].buf, (const char *)bufs[i + 1].buf, (size_t)bufs[i].len);
        else memcpy(bufs[i].buf, bufs[i + 1].buf, (size_t)bufs[i].len);
    }
    Py_END_ALLOW_THREADS
    release_all(bufs, got);
    Py_DECREF(d);
    Py_DECREF(s);
    Py_RETURN_NONE;
fail:
    if (bufs != NULL) release_all(bufs, got);
    Py_DECREF(d);
    Py_DECREF(s);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src): src's bytes into dst (same length), streaming stores."},
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dsts, srcs, stream_from): copy(dst, src) for each pair, the GIL released once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streamcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamcopy(void) { return PyModule_Create(&module); }
