/* Large host copies with streaming (non-temporal) stores, the GIL released.
 *
 * copy(dst, src) copies the bytes of the C-contiguous buffer `src` into the writable
 * C-contiguous buffer `dst` of the same length; ValueError if the lengths differ, TypeError
 * (from the buffer protocol) if either is not such a buffer. It returns None.
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

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src): src's bytes into dst (same length), streaming stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "streamcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit_streamcopy(void) { return PyModule_Create(&module); }
