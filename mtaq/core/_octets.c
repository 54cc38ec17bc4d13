/* mtaq.core._octets: the byte passes over a message's text that the relay makes at every 250 and every delivery
   (issue 36.5: at 100 KiB they were about a fifth of the relay's CPU), in C. Each is the pure-Python definition in
   mtaq/core/octets.py, byte for byte (tests/test_octets.py checks the two agree on random and crafted input):

   crlf_only(data)  True when every CR and every LF of data is part of a CRLF (RFC 5321 §2.3.8)
   unstuff(data)    data.replace(b"\r\n.", b"\r\n"): a dot after each CRLF taken away (§4.5.2, receiving)
   stuff(data)      data.replace(b"\n.", b"\n.."): a dot after each LF doubled (§4.5.2, sending)

   data must be a bytes object (TypeError otherwise); unstuff and stuff give data itself when nothing changes.
   Neither pattern can overlap itself, so "every dot after a CRLF / LF of the input" is what replace finds. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Every LF has a CR just before it, and there are as many CRs as LFs: then the CR of each LF is a different
   one (their positions differ), so every CR is that of some LF, that is, followed by it. Branch-free, so the
   compiler can use vector instructions: byte-wide sums over blocks of 255 bytes (they cannot overflow),
   added up after each block. */
static int crlf_only_impl(const unsigned char *p, Py_ssize_t n) {
    if (n == 0) return 1;
    if (p[0] == '\n') return 0;
    size_t cr_total = p[0] == '\r', lf_total = 0, bad_total = 0;
    Py_ssize_t i = 1;
    while (i < n) {
        Py_ssize_t end = n - i > 255 ? i + 255 : n;
        unsigned char cr = 0, lf = 0, bad = 0;
        for (Py_ssize_t j = i; j < end; j++) {
            unsigned char c = p[j], is_lf = c == '\n';
            cr += c == '\r';
            lf += is_lf;
            bad += is_lf & (p[j - 1] != '\r');
        }
        cr_total += cr;
        lf_total += lf;
        bad_total += bad;
        i = end;
    }
    return bad_total == 0 && cr_total == lf_total;
}

static int bytes_arg(PyObject *arg) {
    if (!PyBytes_CheckExact(arg)) {
        PyErr_Format(PyExc_TypeError, "expected bytes, got %.100s", Py_TYPE(arg)->tp_name);
        return 0;
    }
    return 1;
}

static PyObject *crlf_only(PyObject *self, PyObject *arg) {
    if (!bytes_arg(arg)) return NULL;
    return PyBool_FromLong(crlf_only_impl((const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg)));
}

/* The next dot of p[0:n] at or after `from` that follows an LF (with `crlf`: a CRLF), or -1. Found by its LF
   with memchr: a line end is rarer than a dot in most text. */
static Py_ssize_t next_dot(const char *p, Py_ssize_t n, Py_ssize_t from, int crlf) {
    Py_ssize_t lf = from - 1; /* the LF before the dot; with crlf not before 1 (p[lf - 1] is read) */
    if (lf < crlf) lf = crlf;
    while (lf + 1 < n) {
        const char *d = memchr(p + lf, '\n', (size_t)(n - 1 - lf));
        if (d == NULL) return -1;
        lf = d - p;
        if (p[lf + 1] == '.' && (!crlf || p[lf - 1] == '\r')) return lf + 1;
        lf++;
    }
    return -1;
}

/* unstuff (crlf): the dots after a CRLF taken away; stuff: the dots after an LF doubled. */
static PyObject *redot(PyObject *arg, int crlf) {
    if (!bytes_arg(arg)) return NULL;
    const char *p = PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg), count = 0;
    if (memchr(p, '.', (size_t)n) != NULL) /* no dot at all (base64, most bodies of generated mail): done */
        for (Py_ssize_t i = next_dot(p, n, 0, crlf); i >= 0; i = next_dot(p, n, i + 1, crlf)) count++;
    if (count == 0) {
        Py_INCREF(arg);
        return arg;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, crlf ? n - count : n + count);
    if (out == NULL) return NULL;
    char *o = PyBytes_AS_STRING(out);
    Py_ssize_t from = 0;
    for (Py_ssize_t i = next_dot(p, n, 0, crlf); i >= 0; i = next_dot(p, n, i + 1, crlf)) {
        memcpy(o, p + from, (size_t)(i - from)); /* up to the dot */
        o += i - from;
        if (!crlf) *o++ = '.';
        from = crlf ? i + 1 : i; /* the dot itself: skipped, or copied with what follows */
    }
    memcpy(o, p + from, (size_t)(n - from));
    return out;
}

static PyObject *unstuff(PyObject *self, PyObject *arg) { return redot(arg, 1); }

static PyObject *stuff(PyObject *self, PyObject *arg) { return redot(arg, 0); }

static PyMethodDef methods[] = {
    {"crlf_only", crlf_only, METH_O, "True when every CR and LF of the bytes is part of a CRLF."},
    {"unstuff", unstuff, METH_O, "data.replace(b'\\r\\n.', b'\\r\\n')"},
    {"stuff", stuff, METH_O, "data.replace(b'\\n.', b'\\n..')"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mtaq.core._octets",
                                    "The byte passes over a message's text in C (mtaq/core/octets.py).", -1, methods};

PyMODINIT_FUNC PyInit__octets(void) { return PyModule_Create(&module); }
