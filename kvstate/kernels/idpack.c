/* Block ids from a Python list or tuple into int64 bytes, at C speed.
 *
 * pack(seq) -> bytes of len(seq) native int64 values. Each item must be an int or an object
 * with __index__ (numpy integers), never a bool: a bool raises TypeError, as do floats,
 * strings and None; an int beyond int64 raises OverflowError. The pure-Python path in
 * kvstate.kernels.plan does the same when this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *pack(PyObject *self, PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "block ids must be a list or tuple");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) { Py_DECREF(fast); return NULL; }
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = items[i];
        long long v;
        if (PyLong_CheckExact(x)) {
            v = PyLong_AsLongLong(x);
        } else if (PyBool_Check(x) || PyFloat_Check(x)) {
            PyErr_Format(PyExc_TypeError, "block id %zd is a %s", i, Py_TYPE(x)->tp_name);
            goto fail;
        } else {
            PyObject *idx = PyNumber_Index(x);  /* numpy integers; refuses floats, str, None */
            if (idx == NULL) goto fail;
            v = PyLong_AsLongLong(idx);
            Py_DECREF(idx);
        }
        if (v == -1 && PyErr_Occurred()) goto fail;
        dst[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O, "pack(seq) -> bytes: block ids as native int64, refusing non-integers and bools."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "idpack", NULL, -1, methods};

PyMODINIT_FUNC PyInit_idpack(void) { return PyModule_Create(&module); }
