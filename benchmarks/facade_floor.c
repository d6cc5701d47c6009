/*
 * The glue of a one-step load in C, for benchmarks/facade_floor.py: what a native facade
 * of the engine's small-copy path would cost around the manager's own (Python) calls.
 * Not the engine's code: no counters, no histograms, no Transfer handle, no interrupt
 * undo; see the script's docstring.
 *
 * load_step(prepare_load, touch, complete_load, create_future, result_type, keys, ctx,
 *           nbytes, call_blocks, copy_address, tables, direction, kv_ids)
 *   -> a future already resolved with result_type(len(keys), nbytes, 0.0)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *call2(PyObject *fn, PyObject *a, PyObject *b) {
    return PyObject_CallFunctionObjArgs(fn, a, b, NULL);
}

static PyObject *load_step(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (n != 13) {
        PyErr_SetString(PyExc_TypeError, "load_step takes 13 arguments");
        return NULL;
    }
    PyObject *keys = a[5], *ctx = a[6];
    PyObject *spec = call2(a[0], keys, ctx);
    if (spec == NULL) return NULL;
    PyObject *slots = PyObject_GetAttrString(spec, "block_ids");
    Py_DECREF(spec);
    if (slots == NULL) return NULL;
    PyObject *rc = PyObject_CallFunctionObjArgs(a[8], a[9], a[10], a[11], a[12], slots, NULL);
    Py_DECREF(slots);
    if (rc == NULL) return NULL;
    Py_DECREF(rc);
    PyObject *r = call2(a[1], keys, ctx);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    r = call2(a[2], keys, ctx);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    PyObject *fut = PyObject_CallNoArgs(a[3]);
    if (fut == NULL) return NULL;
    PyObject *res = PyObject_CallFunction(a[4], "nOd", PyObject_Length(keys), a[7], 0.0);
    if (res == NULL) {
        Py_DECREF(fut);
        return NULL;
    }
    PyObject *name = PyUnicode_FromString("set_result");
    r = name == NULL ? NULL : PyObject_CallMethodOneArg(fut, name, res);
    Py_XDECREF(name);
    Py_DECREF(res);
    if (r == NULL) {
        Py_DECREF(fut);
        return NULL;
    }
    Py_DECREF(r);
    return fut;
}

static PyMethodDef methods[] = {
    {"load_step", (PyCFunction)(void (*)(void))load_step, METH_FASTCALL, "a one-step load"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "facade_floor", NULL, -1, methods};

PyMODINIT_FUNC PyInit_facade_floor(void) { return PyModule_Create(&module); }
