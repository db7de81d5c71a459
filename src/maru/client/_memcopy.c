/* maru.client._memcopy: many memcpy calls for one Python call.
 *
 * A batch of KV pages is hundreds of separate page parts (the K and V halves of every page
 * live apart in SGLang's host pool). Copying them with one ctypes.memmove each costs about a
 * microsecond of interpreter overhead per part on a small VM, which at 64 KiB pages is a
 * fifth of the batch. `copy_many` takes the addresses as int64 arrays and runs the loop in C,
 * without the GIL. maru.client.memcopy falls back to ctypes when this module was not built.
 *
 * Streaming: a page part copied into the pool is read next by another process (from memory),
 * and one copied into SGLang's host pool goes next to the GPU by DMA (from memory): neither
 * needs the destination in this core's cache. Ordinary stores first read every destination
 * line into the cache and then push out whatever was there (the server's and the client's
 * own working set, here); non-temporal stores write whole lines straight to memory
 * (docs/performance-history.md, session 3). The stores are weakly ordered, so the loop ends with a
 * store fence: whatever the caller does next (the REGISTER_KV that publishes the pages) comes
 * after them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING 1
#else
#define HAVE_STREAMING 0
#endif

/* Below this a part is copied with memmove: small copies gain nothing from streaming. */
#define STREAMING_MIN_BYTES 4096

#if HAVE_STREAMING
/* memmove for non-overlapping ranges: non-temporal stores in 64-byte steps from the first
 * 16-byte aligned destination address, memcpy for the edges before and after. */
static void copy_streaming(char *d, const char *s, size_t n)
{
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (n < STREAMING_MIN_BYTES || (d < s + n && s < d + n)) {
        memmove(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
}
#endif

static int get_addresses(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (view->itemsize != 8 || (strcmp(fmt, "q") != 0 && strcmp(fmt, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous array of int64 addresses", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_many(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj;
    Py_ssize_t size;
    int streaming = 1;
    if (!PyArg_ParseTuple(args, "OOn|p:copy_many", &dst_obj, &src_obj, &size, &streaming))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_many: size must not be negative");
        return NULL;
    }
    Py_buffer dst, src;
    if (get_addresses(dst_obj, &dst, "dst") < 0)
        return NULL;
    if (get_addresses(src_obj, &src, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_ssize_t n = dst.len / 8;
    if (src.len / 8 != n) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "copy_many: %zd destinations for %zd sources", n,
                            src.len / 8);
    }
    const int64_t *d = (const int64_t *)dst.buf, *s = (const int64_t *)src.buf;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_STREAMING
    if (streaming) {
        for (Py_ssize_t i = 0; i < n; i++)
            copy_streaming((char *)(intptr_t)d[i], (const char *)(intptr_t)s[i], (size_t)size);
        _mm_sfence();
    } else
#endif
    {
        for (Py_ssize_t i = 0; i < n; i++)
            memmove((void *)(intptr_t)d[i], (const void *)(intptr_t)s[i], (size_t)size);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dst, src, size, streaming=True): memmove(dst[i], src[i], size) for the int64\n"
     "addresses of dst and src, without the GIL; see maru.client.memcopy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "maru.client._memcopy", "Many memcpy calls for one Python call.", -1, methods,
};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
