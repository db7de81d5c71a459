/* A `freed` notice (packed int64 triples: region id, offset, length; one a page) read in one C
 * pass: `maru.client.chunks.ChunkBook` applies every eviction of a full instance from such a
 * notice, mostly one or two whole runs of the chunks its writes took. In numpy and Python the
 * parse, the split by region and the search for runs cost 60-90 us a notice on a writer whose
 * caches the copy just emptied (a dozen numpy calls on a few hundred entries), once for every
 * one or two writes (benchmarks/results/history.md, 2026-12-05). Here they are one call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t region, start;
} Page;

static int page_order(const void *a, const void *b)
{
    const Page *x = a, *y = b;
    if (x->region != y->region)
        return x->region < y->region ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* freed_runs(freed, chunk) -> list of (region id, first chunk, step, count): the pages' first
 * chunks (offset // chunk), sorted by region then chunk, each given once, as arithmetic runs:
 * first, first + step, ..., `count` of them (a run of one has step 0). */
static PyObject *freed_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "freed_runs(freed: bytes, chunk: int)");
        return NULL;
    }
    int64_t chunk = PyLong_AsLongLong(args[1]);
    if (chunk == -1 && PyErr_Occurred())
        return NULL;
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "freed_runs: chunk must be positive");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    if (size % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "freed_runs: expected packed int64 triples");
        return NULL;
    }
    Py_ssize_t n = size / (3 * (Py_ssize_t)sizeof(int64_t));
    PyObject *out = PyList_New(0);
    if (out == NULL || n == 0)
        return out;
    Page *pages = PyMem_Malloc((size_t)n * sizeof(Page));
    if (pages == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    const char *raw = PyBytes_AS_STRING(args[0]);
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t triple[3];
        memcpy(triple, raw + i * (Py_ssize_t)sizeof(triple), sizeof(triple)); /* (unaligned) */
        int64_t q = triple[1] / chunk;
        pages[i].region = triple[0];
        pages[i].start = q - (q * chunk > triple[1]); /* (floor, as Python's //) */
        if (i && page_order(&pages[i - 1], &pages[i]) > 0)
            sorted = 0;
    }
    if (!sorted) /* (the usual notice is in order already: one run evicted oldest first) */
        qsort(pages, (size_t)n, sizeof(Page), page_order);
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t j = i + 1; /* the next page not yet placed in a run */
        int64_t step = 0, count = 1, last = pages[i].start;
        while (j < n && pages[j].region == pages[i].region) {
            /* (sorted: the gap is >= 0; unsigned, so that no notice can overflow it) */
            int64_t gap = (int64_t)((uint64_t)pages[j].start - (uint64_t)last);
            if (gap == 0) { /* (a page given twice) */
                j++;
                continue;
            }
            if (count > 1 && gap != step)
                break;
            step = gap;
            last = pages[j].start;
            count++;
            j++;
        }
        PyObject *run = Py_BuildValue("(LLLL)", (long long)pages[i].region,
                                      (long long)pages[i].start, (long long)step,
                                      (long long)count);
        if (run == NULL || PyList_Append(out, run) < 0) {
            Py_XDECREF(run);
            Py_DECREF(out);
            PyMem_Free(pages);
            return NULL;
        }
        Py_DECREF(run);
        i = j;
    }
    PyMem_Free(pages);
    return out;
}

static PyMethodDef methods[] = {
    {"freed_runs", (PyCFunction)(void (*)(void))freed_runs, METH_FASTCALL,
     "freed_runs(freed, chunk) -> [(region id, first chunk, step, count), ...]: a `freed`\n"
     "notice's pages as arithmetic runs of first chunks, by region then chunk, each once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "maru.common._freed",
    "A reply's `freed` notice as runs of chunks, in one C pass.", -1, methods,
};

PyMODINIT_FUNC PyInit__freed(void)
{
    return PyModule_Create(&module);
}
