/* A JPEG's header walked in C: images.py's `_jpeg_problem`, step for step, for the server's
 * image path, which checks every file it reads before sending it.
 *
 * Why: the walk visits about ten header segments per file, each a few Python operations;
 * on page-cached images it was the largest single cost of the event loop's work per image
 * (bench/results/cpu_per_sample.md's profile: about a third of the loop's time per image).
 * In C it is a loop over bytes. The messages are images.py's, word for word; its Python
 * walk stays the reference and the fallback where this is not built (tests compare both on
 * every truncation of real files and on corrupted ones).
 *
 * jpeg_problem(data) -> str | None     data: any object with the buffer protocol
 * sound_jpegs(landed) -> list[bool]      landed: [(position, data, error), ...] as a read
 *                                        group hands them over; True where `error` is None
 *                                        and `data` is bytes of a JPEG whose header walks
 *                                        clean (one call a group, not three a file)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int is_sof(unsigned m) { return m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC; }
static int is_standalone(unsigned m) { return m == 0x01 || (m >= 0xD0 && m <= 0xD8); }
static unsigned u16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* The last b"\xff\xd9" at or after `from` (as bytes.rfind), -1 where there is none. */
static Py_ssize_t rfind_eoi(const unsigned char *d, Py_ssize_t n, Py_ssize_t from) {
    for (Py_ssize_t j = n - 2; j >= from; j--)
        if (d[j] == 0xFF && d[j + 1] == 0xD9) return j;
    return -1;
}

static PyObject *walk(const unsigned char *d, Py_ssize_t n) {
    Py_ssize_t i = 2;
    int sized = 0;
    for (int step = 0; step < 4096; step++) {
        if (i + 4 > n) return PyUnicode_FromString("the file ends inside its header (truncated?)");
        unsigned ff = d[i], marker = d[i + 1], length = u16(d + i + 2);
        if (ff != 0xFF) return PyUnicode_FromFormat("no segment marker at byte %zd of its header (corrupt)", i);
        if (marker == 0xFF) { i += 1; continue; }  /* fill byte before a marker */
        if (is_standalone(marker)) { i += 2; continue; }
        if (marker == 0xD9) return PyUnicode_FromString("it ends (end-of-image marker) before any image data");
        if (length < 2 || i + 2 + (Py_ssize_t)length > n)
            return PyUnicode_FromFormat("the header segment at byte %zd runs past the end of the file (truncated?)", i);
        if (marker == 0xDA) {  /* start of scan: entropy-coded data, then EOI */
            if (!sized) return PyUnicode_FromString("image data starts before any frame header (SOF)");
            if (rfind_eoi(d, n, i + 2 + (Py_ssize_t)length) < 0)
                return PyUnicode_FromString("no end-of-image marker after its image data (truncated or overwritten?)");
            Py_RETURN_NONE;
        }
        if (is_sof(marker)) {
            if (length < 8 || !u16(d + i + 5) || !u16(d + i + 7))  /* inside the segment: length >= 8 */
                return PyUnicode_FromString("its frame header declares a zero width or height");
            sized = 1;
        }
        i += 2 + (Py_ssize_t)length;
    }
    return PyUnicode_FromString("its header has too many segments (corrupt)");
}

static PyObject *jpeg_problem(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = walk((const unsigned char *)view.buf, view.len);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *sound_jpegs(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "landed must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; out && k < n; k++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, k), *data;
        int ok = 0;
        if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3 && PyTuple_GET_ITEM(t, 2) == Py_None
            && PyBytes_Check(data = PyTuple_GET_ITEM(t, 1))) {
            const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
            Py_ssize_t len = PyBytes_GET_SIZE(data);
            if (len >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) {
                PyObject *problem = walk(d, len);
                if (!problem) { Py_CLEAR(out); break; }
                ok = problem == Py_None;
                Py_DECREF(problem);
            }
        }
        PyList_SET_ITEM(out, k, Py_NewRef(ok ? Py_True : Py_False));
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"jpeg_problem", jpeg_problem, METH_O, "What is structurally wrong with a JPEG's header (None: nothing seen)."},
    {"sound_jpegs", sound_jpegs, METH_O,
     "sound_jpegs(landed) -> [bool]: for each (position, data, error), error None and data a JPEG whose header walks clean."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_imagecheck", NULL, -1, methods};

PyMODINIT_FUNC PyInit__imagecheck(void) { return PyModule_Create(&module); }
