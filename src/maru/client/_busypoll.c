/* maru.client._busypoll: wait for a reply on a non-blocking socket by spinning, without the GIL.
 *
 * A thread that sleeps in poll() for a reply must be woken by the kernel when it comes; on a
 * virtual machine that wake-up costs about as much again as the whole round trip. Retrying a
 * non-blocking recv() for a few hundred microseconds avoids it. Done in Python, the spinning
 * thread would hold the GIL between retries and delay the caller's other threads (SGLang's
 * scheduler); here the whole spin runs with the GIL released, and yields the CPU between
 * retries.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *recv_spin(PyObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t size;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "inL:recv_spin", &fd, &size, &spin_ns))
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "recv_spin: size must be positive");
        return NULL;
    }
    PyObject *buf = PyBytes_FromStringAndSize(NULL, size);
    if (buf == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(buf);
    ssize_t n;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    long long until = now_ns() + spin_ns;
    for (;;) {
        n = recv(fd, p, (size_t)size, MSG_DONTWAIT);
        if (n >= 0)
            break;
        err = errno;
        if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
            break;
        if (now_ns() >= until)
            break;
        /* Let any other runnable thread have this CPU: where more threads spin than there
         * are idle cores, one of them may be the server that owes us the reply (measured in
         * docs/operations.md, busy polling). */
        sched_yield();
    }
    Py_END_ALLOW_THREADS
    if (n < 0) {
        Py_DECREF(buf);
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)
            Py_RETURN_NONE; /* nothing within the spin */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (_PyBytes_Resize(&buf, n) < 0)
        return NULL;
    return buf;
}

static PyMethodDef methods[] = {
    {"recv_spin", recv_spin, METH_VARARGS,
     "recv_spin(fd, size, spin_ns): retry a non-blocking recv of up to `size` bytes for up to "
     "`spin_ns` nanoseconds with the GIL released, yielding the CPU between tries. Returns "
     "the bytes (b\"\" if the peer closed), or None if nothing came; raises OSError on a "
     "socket error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "maru.client._busypoll", "Spin-wait for socket data without the GIL.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__busypoll(void) { return PyModule_Create(&module); }
