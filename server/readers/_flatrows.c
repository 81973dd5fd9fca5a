/* The walk of a group of rows of one-level columns, in one call (flat_rows.py).
 *
 * Why: once reads go in groups, walking each row's columns (an offsets pair from a cached
 * page, then the value bytes from a cached page or a range to read) was the largest part
 * of the server's CPU per row, in Python even without objects per column (about 3-4 us a
 * row of two columns). Here a group crosses into C once: walk_rows does what
 * flat_rows.walk_rows_py does, step for step, and returns the same structures, so the
 * Python stays the reference (tests run both on the same rows).
 *
 * walk_rows(columns, page_map, batches, starts, where, indices, flat_row, names)
 *   columns   tuple of (kind, node, offsets, values, width, offset_size, child_node) ints
 *   page_map  {(file, batch, buffer, page): bytes} of cached structural pages
 *   batches   batches[file][batch]: a BatchLayout (rows, buffer_list, node_list)
 *   starts    the first global row of every non-empty batch, ascending
 *   where     (file, batch) of each of those
 *   indices   global rows, each within the table (the caller checks)
 *   flat_row  the FlatRow class, called as flat_row(index, values, 16 * len(columns), names)
 * -> ({file: [(position, item, fetch, batch, row)]}, [positions left to the general walk],
 *     [(position, item)] rows whose values are all in hand)
 * where fetch is [(absolute offset, size, column)] and the item's value there is None.
 *
 * fill_landed(rows, parts, flat_row) -> [(position, item, None)] | None
 *   rows      a file's [(position, item, fetch, batch, row)] as walk_rows gives them
 *   parts     the bytes its ranges read, the rows' fetches one after another
 * Each part put in its item's value and counted in its nbytes (flat_rows.fill for every
 * row, as arrow_ipc's `_landed` does); None, with nothing changed, where a row is not a
 * flat_row, a part is not bytes or is short (a truncated file): the caller's own loop then
 * names it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define PAGE_BYTES (64 << 10)
#define DENSE_BYTES_PER_ROW 16
enum { FIXED = 0, BYTES = 1, LIST = 2 };

typedef struct {
    long long kind, node, offsets, values, width, osize, child_node;
} Column;

static PyObject *s_buffer_list, *s_node_list, *s_rows, *s_values, *s_nbytes;

/* Item i of a list or tuple of two ints. */
static int pair_at(PyObject *seq, Py_ssize_t i, long long *a, long long *b) {
    if (!PyList_Check(seq) || i < 0 || i >= PyList_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_IndexError, "layout index out of range");
        return -1;
    }
    PyObject *t = PyList_GET_ITEM(seq, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
        PyErr_SetString(PyExc_TypeError, "a layout entry is not a pair");
        return -1;
    }
    *a = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 0));
    *b = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 1));
    return PyErr_Occurred() ? -1 : 0;
}

/* The cached page (file, batch, buffer, page), borrowed, or NULL (no error) when absent. */
static PyObject *page_of(PyObject *pages, long long f, long long b, long long buf, long long p) {
    PyObject *key = Py_BuildValue("(LLLL)", f, b, buf, p);
    if (!key) return NULL;
    PyObject *page = PyDict_GetItemWithError(pages, key);
    Py_DECREF(key);
    if (page && !PyBytes_Check(page)) return NULL;
    return page;
}

static long long read_le(const unsigned char *p, long long size) {
    unsigned long long v = 0;
    for (long long i = size - 1; i >= 0; i--) v = (v << 8) | p[i];
    if (size == 4) return (long long)(int32_t)(uint32_t)v;
    return (long long)v;
}

static PyObject *walk_rows(PyObject *self, PyObject *args) {
    PyObject *cols_obj, *pages, *batches, *starts, *where, *indices_obj, *flat_row, *names;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OOO!", &PyTuple_Type, &cols_obj, &PyDict_Type, &pages, &PyList_Type,
                          &batches, &PyList_Type, &starts, &PyList_Type, &where, &indices_obj, &flat_row,
                          &PyTuple_Type, &names))
        return NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(cols_obj);
    if (ncols > 64) {  /* flat_rows.NATIVE_MAX_COLUMNS: wider selections walk in Python */
        PyErr_SetString(PyExc_ValueError, "more than 64 columns");
        return NULL;
    }
    Column cols[64];
    for (Py_ssize_t c = 0; c < ncols; c++) {
        PyObject *t = PyTuple_GET_ITEM(cols_obj, c);
        if (!PyArg_ParseTuple(t, "LLLLLLL", &cols[c].kind, &cols[c].node, &cols[c].offsets, &cols[c].values,
                              &cols[c].width, &cols[c].osize, &cols[c].child_node))
            return NULL;
    }
    PyObject *indices = PySequence_Fast(indices_obj, "indices must be a sequence");
    if (!indices) return NULL;
    PyObject *per_file = PyDict_New(), *slow = PyList_New(0), *ready = PyList_New(0);
    PyObject *per_row = PyLong_FromLongLong(16 * (long long)ncols);
    PyObject *layout = NULL, *bufs = NULL, *nodes = NULL, *rows_obj = NULL, *values = NULL, *fetch = NULL;
    if (!per_file || !slow || !ready || !per_row) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(indices), nstarts = PyList_GET_SIZE(starts);
    for (Py_ssize_t pos = 0; pos < n; pos++) {
        long long index = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(indices, pos));
        if (index == -1 && PyErr_Occurred()) goto fail;
        /* bisect_right(starts, index) - 1 */
        Py_ssize_t lo_i = 0, hi_i = nstarts;
        while (lo_i < hi_i) {
            Py_ssize_t mid = (lo_i + hi_i) / 2;
            long long v = PyLong_AsLongLong(PyList_GET_ITEM(starts, mid));
            if (v == -1 && PyErr_Occurred()) goto fail;
            if (index < v) hi_i = mid; else lo_i = mid + 1;
        }
        Py_ssize_t k = lo_i - 1;
        if (k < 0) { PyErr_Format(PyExc_IndexError, "row %lld is before the table's first", index); goto fail; }
        long long f, b;
        if (pair_at(where, k, &f, &b) < 0) goto fail;
        long long r = index - PyLong_AsLongLong(PyList_GET_ITEM(starts, k));
        PyObject *file_batches = PyList_GetItem(batches, (Py_ssize_t)f);
        if (!file_batches) goto fail;
        PyObject *lay = PySequence_GetItem(file_batches, (Py_ssize_t)b);
        if (!lay) goto fail;
        Py_XSETREF(layout, lay);
        Py_XSETREF(bufs, PyObject_GetAttr(layout, s_buffer_list));
        Py_XSETREF(nodes, PyObject_GetAttr(layout, s_node_list));
        Py_XSETREF(rows_obj, PyObject_GetAttr(layout, s_rows));
        if (!bufs || !nodes || !rows_obj) goto fail;
        long long dense = DENSE_BYTES_PER_ROW * PyLong_AsLongLong(rows_obj);
        if (PyErr_Occurred()) goto fail;
        Py_XSETREF(values, PyList_New(ncols));
        Py_XSETREF(fetch, PyList_New(0));
        if (!values || !fetch) goto fail;
        int flat = 1;
        for (Py_ssize_t c = 0; c < ncols && flat; c++) {
            Column *col = &cols[c];
            long long length, nulls, lo, hi;
            if (pair_at(nodes, col->node, &length, &nulls) < 0) goto fail;
            if (nulls || r >= length) { flat = 0; break; }
            if (col->kind == FIXED) {
                lo = r * col->width;
                hi = lo + col->width;
            } else {
                long long size = col->osize, at = r * size, ostart, olen;
                if (pair_at(bufs, col->offsets, &ostart, &olen) < 0) goto fail;
                if (at + 2 * size > olen || at / PAGE_BYTES != (at + 2 * size - 1) / PAGE_BYTES) { flat = 0; break; }
                PyObject *page = page_of(pages, f, b, col->offsets, at / PAGE_BYTES);
                if (!page) { if (PyErr_Occurred()) goto fail; flat = 0; break; }
                long long in = at % PAGE_BYTES;
                if (in + 2 * size > PyBytes_GET_SIZE(page)) { flat = 0; break; }
                const unsigned char *raw = (const unsigned char *)PyBytes_AS_STRING(page) + in;
                lo = read_le(raw, size);
                hi = read_le(raw + size, size);
                if (col->kind == LIST) {
                    long long child_len, child_nulls;
                    if (pair_at(nodes, col->child_node, &child_len, &child_nulls) < 0) goto fail;
                    if (child_nulls || !(0 <= lo && lo <= hi && hi <= child_len)) { flat = 0; break; }
                } else if (!(0 <= lo && lo <= hi)) {
                    flat = 0;
                    break;
                }
                lo *= col->width;
                hi *= col->width;
            }
            long long vstart, vlen;
            if (pair_at(bufs, col->values, &vstart, &vlen) < 0) goto fail;
            if (hi > vlen) { flat = 0; break; }
            PyObject *value;
            if (hi == lo) {
                value = PyBytes_FromStringAndSize(NULL, 0);
            } else if (vlen <= dense) {
                long long first = lo / PAGE_BYTES;
                if (first != (hi - 1) / PAGE_BYTES) { flat = 0; break; }
                PyObject *page = page_of(pages, f, b, col->values, first);
                if (!page) { if (PyErr_Occurred()) goto fail; flat = 0; break; }
                long long base = first * PAGE_BYTES;
                if (hi - base > PyBytes_GET_SIZE(page)) { flat = 0; break; }
                value = PyBytes_FromStringAndSize(PyBytes_AS_STRING(page) + (lo - base), (Py_ssize_t)(hi - lo));
            } else {
                PyObject *entry = Py_BuildValue("(LLn)", vstart + lo, hi - lo, c);
                if (!entry || PyList_Append(fetch, entry) < 0) { Py_XDECREF(entry); goto fail; }
                Py_DECREF(entry);
                value = Py_NewRef(Py_None);
            }
            if (!value) goto fail;
            PyList_SET_ITEM(values, c, value);
        }
        if (!flat) {
            PyObject *p = PyLong_FromSsize_t(pos);
            if (!p || PyList_Append(slow, p) < 0) { Py_XDECREF(p); goto fail; }
            Py_DECREF(p);
            continue;
        }
        PyObject *item = PyObject_CallFunction(flat_row, "LOOO", index, values, per_row, names);
        if (!item) goto fail;
        PyObject *entry;
        if (PyList_GET_SIZE(fetch) == 0) {
            entry = Py_BuildValue("(nN)", pos, item);
            if (!entry || PyList_Append(ready, entry) < 0) { Py_XDECREF(entry); goto fail; }
            Py_DECREF(entry);
            continue;
        }
        PyObject *fkey = PyLong_FromLongLong(f);
        if (!fkey) { Py_DECREF(item); goto fail; }
        PyObject *group = PyDict_GetItemWithError(per_file, fkey);
        if (!group) {
            if (PyErr_Occurred()) { Py_DECREF(fkey); Py_DECREF(item); goto fail; }
            group = PyList_New(0);
            if (!group || PyDict_SetItem(per_file, fkey, group) < 0) { Py_XDECREF(group); Py_DECREF(fkey); Py_DECREF(item); goto fail; }
            Py_DECREF(group);  /* the dict holds it */
        }
        Py_DECREF(fkey);
        entry = Py_BuildValue("(nNOLL)", pos, item, fetch, b, r);
        if (!entry || PyList_Append(group, entry) < 0) { Py_XDECREF(entry); goto fail; }
        Py_DECREF(entry);
    }
    Py_XDECREF(layout); Py_XDECREF(bufs); Py_XDECREF(nodes); Py_XDECREF(rows_obj);
    Py_XDECREF(values); Py_XDECREF(fetch);
    Py_DECREF(per_row);
    Py_DECREF(indices);
    return Py_BuildValue("(NNN)", per_file, slow, ready);
fail:
    Py_XDECREF(layout); Py_XDECREF(bufs); Py_XDECREF(nodes); Py_XDECREF(rows_obj);
    Py_XDECREF(values); Py_XDECREF(fetch);
    Py_XDECREF(per_file); Py_XDECREF(slow); Py_XDECREF(ready); Py_XDECREF(per_row);
    Py_DECREF(indices);
    return NULL;
}

/* Row i of `rows` as (item, fetch), borrowed; 0 where it is not a (pos, item, fetch, b, r)
 * of a flat_row with a list fetch. */
static int landed_row(PyObject *rows, Py_ssize_t i, PyObject *flat_row, PyObject **item, PyObject **fetch) {
    PyObject *t = PyList_GET_ITEM(rows, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) return 0;
    *item = PyTuple_GET_ITEM(t, 1);
    *fetch = PyTuple_GET_ITEM(t, 2);
    return Py_TYPE(*item) == (PyTypeObject *)flat_row && PyList_Check(*fetch);
}

static PyObject *fill_landed(PyObject *self, PyObject *args) {
    PyObject *rows, *parts, *flat_row;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &rows, &PyList_Type, &parts, &flat_row)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows), at = 0, nparts = PyList_GET_SIZE(parts);
    /* First every check, so that a group the caller's loop must take is left untouched. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item, *fetch;
        if (!landed_row(rows, i, flat_row, &item, &fetch)) Py_RETURN_NONE;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fetch); j++, at++) {
            PyObject *f = PyList_GET_ITEM(fetch, j);
            if (at >= nparts || !PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 3) Py_RETURN_NONE;
            PyObject *part = PyList_GET_ITEM(parts, at);
            long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(f, 1));
            if (size == -1 && PyErr_Occurred()) return NULL;
            if (!PyBytes_CheckExact(part) || PyBytes_GET_SIZE(part) != size) Py_RETURN_NONE;
        }
    }
    if (at != nparts) Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item, *fetch;
        landed_row(rows, i, flat_row, &item, &fetch);
        PyObject *values = PyObject_GetAttr(item, s_values), *nbytes = PyObject_GetAttr(item, s_nbytes);
        long long total = nbytes ? PyLong_AsLongLong(nbytes) : -1;
        Py_XDECREF(nbytes);
        if (!values || !PyList_Check(values) || (total == -1 && PyErr_Occurred())) {
            if (values && !PyList_Check(values)) PyErr_SetString(PyExc_TypeError, "a FlatRow's values is not a list");
            Py_XDECREF(values);
            Py_DECREF(out);
            return NULL;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fetch); j++, at++) {
            PyObject *f = PyList_GET_ITEM(fetch, j), *part = PyList_GET_ITEM(parts, at);
            Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(f, 2));
            if (k < 0 || k >= PyList_GET_SIZE(values)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a fetch's column is out of range");
                Py_DECREF(values);
                Py_DECREF(out);
                return NULL;
            }
            PyList_SetItem(values, k, Py_NewRef(part));
            total += PyBytes_GET_SIZE(part);
        }
        Py_DECREF(values);
        PyObject *t = PyList_GET_ITEM(rows, i), *now = PyLong_FromLongLong(total), *entry = NULL;
        if (!now || PyObject_SetAttr(item, s_nbytes, now) < 0
            || !(entry = PyTuple_Pack(3, PyTuple_GET_ITEM(t, 0), item, Py_None))) {
            Py_XDECREF(now);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(now);
        PyList_SET_ITEM(out, i, entry);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"walk_rows", walk_rows, METH_VARARGS, "walk_rows(columns, page_map, batches, starts, where, indices, flat_row, names)"},
    {"fill_landed", fill_landed, METH_VARARGS,
     "fill_landed(rows, parts, flat_row) -> [(position, item, None)] | None: a file's landed parts into its flat rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_flatrows", "A group of flat rows walked in one call.", -1, methods};

PyMODINIT_FUNC PyInit__flatrows(void) {
    s_buffer_list = PyUnicode_InternFromString("buffer_list");
    s_node_list = PyUnicode_InternFromString("node_list");
    s_rows = PyUnicode_InternFromString("rows");
    s_values = PyUnicode_InternFromString("values");
    s_nbytes = PyUnicode_InternFromString("nbytes");
    if (!s_buffer_list || !s_node_list || !s_rows || !s_values || !s_nbytes) return NULL;
    return PyModule_Create(&module);
}
