/* int64_buffer: the one check of maru's C extensions (`_memcopy.c`, `_shmindex.c`) that an
 * argument holding pointers or sizes is a C-contiguous array of int64 (numpy's "q" or "l"):
 * copying to or from addresses read from anything else would write anywhere. Each extension
 * compiles its own copy of this static function. */
#ifndef MARU_INT64_BUFFER_H
#define MARU_INT64_BUFFER_H

#include <Python.h>
#include <string.h>

/* `obj`'s buffer in `view` (release it), or -1 with a TypeError naming `name`. */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (view->itemsize != 8 || (strcmp(fmt, "q") != 0 && strcmp(fmt, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous array of int64s", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#endif
