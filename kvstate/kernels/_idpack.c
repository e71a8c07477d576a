/* The transfer ops' host path at C speed: block ids packed and checked, identity keys.
 *
 * pack(seq) -> bytes of len(seq) native int64 values. Each item must be an int or an object
 * with __index__ (numpy integers), never a bool: a bool raises TypeError, as do floats,
 * strings and None; an int beyond int64 raises OverflowError.
 *
 * valid(ids, limit, unique) -> True when every id of the C-contiguous int64 buffer `ids` lies
 * in 0..limit-1 and, if `unique`, no id repeats; False otherwise (the caller then finds and
 * names the offending id); None when `ids` is not such a buffer. Uniqueness uses an open
 * addressing table of about 2n slots: O(n) in the ids, never in `limit`.
 *
 * pack_valid(seq, limit, unique) -> pack(seq) when its ids pass valid(), else None.
 *
 * pack_pair(a, b, limit_a, limit_b, unique_a, unique_b) -> pack(a) + pack(b), one bytes
 * object, when both pass valid() with their own limits and len(a) == len(b), else None: a
 * transfer's GPU and host ids in one call.
 *
 * narrow(src, start, count, dst) copies the int64 values start..start+count-1 of the buffer
 * `src` into the writable buffer `dst`, read as int32 (the caller knows they fit: ids checked
 * below 2**31), raising ValueError if either buffer is too short for them.
 *
 * identity(seq) -> bytes of the items' addresses (their id()s): a key naming exactly these
 * objects, built without allocating an int per item.
 *
 * kvstate.kernels._plan and kvstate.kernels._cuda do the same in Python where this module was
 * not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* An exact int's value when it is small (one digit, as every block id is), without a call;
 * 0 when it is not small (the caller then takes the general path). */
static inline int small_int(PyObject *x, long long *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)x)) return 0;
    *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)x);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(x);
    if (size < -1 || size > 1) return 0;
    *v = size * (long long)((PyLongObject *)x)->ob_digit[0];
    return 1;
#endif
}

/* Pack the items of `fast` (a PySequence_Fast result) into dst, room for all of them: 0, or
 * -1 with an exception set. */
static int pack_into(PyObject *fast, int64_t *dst) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = items[i];
        long long v;
        if (PyLong_CheckExact(x)) {
            if (small_int(x, &v)) {
                dst[i] = (int64_t)v;
                continue;
            }
            v = PyLong_AsLongLong(x);
        } else if (PyBool_Check(x) || PyFloat_Check(x)) {
            PyErr_Format(PyExc_TypeError, "block id %zd is a %s", i, Py_TYPE(x)->tp_name);
            return -1;
        } else {
            PyObject *idx = PyNumber_Index(x);  /* numpy integers; refuses floats, str, None */
            if (idx == NULL) return -1;
            v = PyLong_AsLongLong(idx);
            Py_DECREF(idx);
        }
        if (v == -1 && PyErr_Occurred()) return -1;
        dst[i] = (int64_t)v;
    }
    return 0;
}

static PyObject *pack(PyObject *Py_UNUSED(self), PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "block ids must be a list or tuple");
    if (fast == NULL) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, PySequence_Fast_GET_SIZE(fast) * (Py_ssize_t)sizeof(int64_t));
    if (out != NULL && pack_into(fast, (int64_t *)PyBytes_AS_STRING(out)) < 0) Py_CLEAR(out);
    Py_DECREF(fast);
    return out;
}

/* Whether n ids (all already in range, so non-negative) are distinct. */
static int distinct(const int64_t *ids, Py_ssize_t n) {
    Py_ssize_t k = 1;
    while (k < n && ids[k] > ids[k - 1]) k++;
    if (k == n) return 1;  /* increasing (a run of host slots, say): distinct, no table needed */
    enum { STACK_SLOTS = 2048 };
    uint64_t stack[STACK_SLOTS];
    size_t slots = 4;
    unsigned bits = 2;
    while (slots < (size_t)n * 2) { slots <<= 1; bits++; }
    uint64_t *table = slots <= STACK_SLOTS ? stack : malloc(slots * sizeof(uint64_t));
    if (table == NULL) return -1;
    memset(table, 0, slots * sizeof(uint64_t));
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        uint64_t key = (uint64_t)ids[i] + 1;  /* 0 marks an empty slot */
        size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (table[h] != 0) {
            if (table[h] == key) { ok = 0; break; }
            h = (h + 1) & (slots - 1);
        }
        table[h] = key;
    }
    if (table != stack) free(table);
    return ok;
}

/* 1 when all n ids lie in 0..limit-1 (and are distinct, if unique), 0 if not, -1 on no memory. */
static int fits(const int64_t *ids, Py_ssize_t n, long long limit, int unique) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((uint64_t)ids[i] >= (uint64_t)limit) return 0;  /* negatives wrap high */
    }
    return unique && n > 1 ? distinct(ids, n) : 1;
}

static PyObject *pack_valid(PyObject *self, PyObject *args) {
    PyObject *seq;
    long long limit;
    int unique;
    if (!PyArg_ParseTuple(args, "OLp", &seq, &limit, &unique)) return NULL;
    PyObject *out = pack(self, seq);
    if (out == NULL) return NULL;
    int ok = fits((const int64_t *)PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out) / 8, limit, unique);
    if (ok == 1) return out;
    Py_DECREF(out);
    if (ok < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *pack_pair(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *a, *b;
    long long lim_a, lim_b;
    int uniq_a, uniq_b;
    if (!PyArg_ParseTuple(args, "OOLLpp", &a, &b, &lim_a, &lim_b, &uniq_a, &uniq_b)) return NULL;
    PyObject *fa = PySequence_Fast(a, "block ids must be a list or tuple");
    if (fa == NULL) return NULL;
    PyObject *fb = PySequence_Fast(b, "block ids must be a list or tuple");
    if (fb == NULL) { Py_DECREF(fa); return NULL; }
    Py_ssize_t na = PySequence_Fast_GET_SIZE(fa), nb = PySequence_Fast_GET_SIZE(fb);
    PyObject *out = NULL;
    int ok = 0;
    if (na == nb) {  /* both packed in place, one after the other, then checked */
        out = PyBytes_FromStringAndSize(NULL, (na + nb) * (Py_ssize_t)sizeof(int64_t));
        int64_t *ia = out == NULL ? NULL : (int64_t *)PyBytes_AS_STRING(out);
        if (out == NULL || pack_into(fa, ia) < 0 || pack_into(fb, ia + na) < 0) {
            Py_XDECREF(out);
            Py_DECREF(fa);
            Py_DECREF(fb);
            return NULL;
        }
        ok = fits(ia, na, lim_a, uniq_a);
        if (ok == 1) ok = fits(ia + na, nb, lim_b, uniq_b);
    }
    Py_DECREF(fa);
    Py_DECREF(fb);
    if (ok == 1) return out;
    Py_XDECREF(out);
    if (ok < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Whether a buffer format names native int64 ("l" or "q", optionally "@", "=", or "<" where
 * this machine is little-endian). */
static int int64_format(const char *f) {
    if (f == NULL) return 0;
    if (f[0] == '@' || f[0] == '=' || (f[0] == '<' && PY_LITTLE_ENDIAN)) f++;
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
}

static PyObject *valid(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *obj;
    long long limit;
    int unique;
    if (!PyArg_ParseTuple(args, "OLp", &obj, &limit, &unique)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (view.itemsize != 8 || !int64_format(view.format)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    int ok = fits((const int64_t *)view.buf, view.len / 8, limit, unique);
    PyBuffer_Release(&view);
    if (ok < 0) return PyErr_NoMemory();
    return PyBool_FromLong(ok);
}

static PyObject *narrow(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "y*nnw*", &src, &start, &count, &dst)) return NULL;
    int ok = start >= 0 && count >= 0 && (start + count) * 8 <= src.len && count * 4 <= dst.len;
    if (ok) {
        const int64_t *from = (const int64_t *)src.buf + start;
        int32_t *to = (int32_t *)dst.buf;
        for (Py_ssize_t i = 0; i < count; i++) to[i] = (int32_t)from[i];
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "narrow: a buffer is too short for the ids asked");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *identity(PyObject *Py_UNUSED(self), PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "identity() needs a list or tuple");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(void *));
    if (out != NULL) memcpy(PyBytes_AS_STRING(out), items, n * sizeof(void *));
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O, "pack(seq) -> bytes: block ids as native int64, refusing non-integers and bools."},
    {"valid", valid, METH_VARARGS, "valid(ids, limit, unique) -> bool or None: ids in range (and distinct)."},
    {"pack_valid", pack_valid, METH_VARARGS, "pack_valid(seq, limit, unique) -> bytes or None: pack, then valid."},
    {"pack_pair", pack_pair, METH_VARARGS, "pack_pair(a, b, limit_a, limit_b, unique_a, unique_b) -> bytes or None."},
    {"narrow", narrow, METH_VARARGS, "narrow(src, start, count, dst): int64 ids of src into the int32 buffer dst."},
    {"identity", identity, METH_O, "identity(seq) -> bytes: the items' addresses, a key for exactly these objects."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_idpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__idpack(void) { return PyModule_Create(&module); }
