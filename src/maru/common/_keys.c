/* Key batches in one C pass each: the fast paths of `maru.common.protocol.all_keys_valid` and
 * `maru.common.protocol.joined`. A write of 256 pages joins and checks 256 keys before its copy
 * can start; in Python those two passes cost tens of microseconds on the writer's critical
 * path (a step per key). Each function answers only the usual batch and says so (False, None)
 * for anything else, which the Python caller then takes key by key, as before. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* fit(keys, max_chars) -> bool: every key exactly str or bytes, not empty, at most `max_chars`
 * long. False means "look closer" (`check_key` per key), not "bad". */
static PyObject *fit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fit(keys, max_chars)");
        return NULL;
    }
    Py_ssize_t most = PyLong_AsSsize_t(args[1]);
    if (most == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "fit: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *key = items[i];
        Py_ssize_t len;
        if (PyUnicode_CheckExact(key))
            len = PyUnicode_GET_LENGTH(key);
        else if (PyBytes_CheckExact(key))
            len = PyBytes_GET_SIZE(key);
        else
            len = 0;
        ok = len > 0 && len <= most;
    }
    Py_DECREF(seq);
    return PyBool_FromLong(ok);
}

/* join(prefix, keys) -> list or None: `prefix + key` for each key, when the prefix and every
 * key are exactly str, or exactly bytes; None otherwise (the caller joins in Python, where a
 * mix raises the TypeError it always did). */
static PyObject *join(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "join(prefix, keys)");
        return NULL;
    }
    PyObject *prefix = args[0];
    int is_str = PyUnicode_CheckExact(prefix);
    if (!is_str && !PyBytes_CheckExact(prefix))
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(args[1], "join: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (is_str ? !PyUnicode_CheckExact(items[i]) : !PyBytes_CheckExact(items[i])) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t pn = is_str ? 0 : PyBytes_GET_SIZE(prefix);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *joined;
        if (is_str)
            joined = PyUnicode_Concat(prefix, items[i]);
        else {
            Py_ssize_t kn = PyBytes_GET_SIZE(items[i]);
            joined = PyBytes_FromStringAndSize(NULL, pn + kn);
            if (joined != NULL) {
                memcpy(PyBytes_AS_STRING(joined), PyBytes_AS_STRING(prefix), (size_t)pn);
                memcpy(PyBytes_AS_STRING(joined) + pn, PyBytes_AS_STRING(items[i]), (size_t)kn);
            }
        }
        if (joined == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(out, i, joined);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"fit", (PyCFunction)(void (*)(void))fit, METH_FASTCALL,
     "fit(keys, max_chars) -> bool: every key exactly str or bytes, not empty, at most\n"
     "max_chars long (False: check them one by one)."},
    {"join", (PyCFunction)(void (*)(void))join, METH_FASTCALL,
     "join(prefix, keys) -> list or None: prefix + key per key when the prefix and every key\n"
     "are exactly str or exactly bytes; None otherwise (join them in Python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "maru.common._keys",
    "Key batches in one C pass: the usual batch's check and prefix join.", -1, methods,
};

PyMODINIT_FUNC PyInit__keys(void)
{
    return PyModule_Create(&module);
}
