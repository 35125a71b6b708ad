/* memdiff._fastread: an optional reader of snapshot pickles that keeps trace entries in columns.
 *
 * It decodes the data-only subset of pickle protocols 2-5 that snapshots use (dicts, lists,
 * tuples, strings, bytes, ints, floats, bools, None, memo references). Every other opcode (any
 * global, reduce, build, persistent id...) and every malformed stream makes it decline: read()
 * returns None and memdiff reads the file again with the pure path, which refuses or reads it
 * with the messages it always gave. So nothing in a file runs here, and no error message lives
 * in this file.
 *
 * The entries of root['device_traces'][d] are not built as dicts: each is a row of columns
 * (four int64 values, four ids into a table of distinct objects, a key-order shape), which is
 * what makes a million-event trace cost ~50 bytes an event instead of ~400. A Trace behaves as
 * the read-only list of dicts it stands for; an entry that does not fit the columns (another key,
 * a value of another type, a repeated key) is kept whole as the dict it is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>

#define CHUNK (1 << 20)
#define MAX_ITEM (256 << 20) /* load.MAX_READ: no value of a snapshot is near this */
#define NINT 3
#define NOBJ 5
#define NSLOT (NINT + NOBJ)
#define MAX_SHAPES 255
#define VERBATIM 255
#define KCACHE 16
#define PAGE 4096
#define VCACHE 65536
#define MAX_TRACE_MEMO 16
#define FAST_BYTES 1024 /* an entry longer than this is read opcode by opcode */
#define FAST_PAIRS 16

/* int64 columns first, then columns of ids into the table of distinct values (1, 2 or 4 bytes
 * an id, widened as the table grows: most traces have a handful of actions and streams). */
static const char *slot_names[NSLOT] = {"addr", "size", "time_us",
                                        "action", "frames", "compile_context", "user_metadata", "stream"};
#define ACTION_BIT (1 << NINT)
static PyObject *slot_strs[NSLOT];

/* ---- Trace ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, cap;
    int64_t *ints[NINT];
    void *objs[NOBJ];
    int width[NOBJ];     /* bytes an id in objs[k] */
    uint8_t *shape;
    PyObject *table;     /* list: distinct objects (ids in objs) */
    PyObject *by_value;  /* dict: str or int -> id (immutable: one object stands for all equal ones) */
    PyObject *by_ptr;    /* dict: the address of any other object -> id */
    PyObject *shapes;    /* list of tuples of key strings */
    uint32_t shape_codes[MAX_SHAPES];
    PyObject *verbatim;  /* dict: row -> the entry's dict */
} Trace;

static PyTypeObject TraceType;

static Trace *trace_new(void) {
    Trace *t = PyObject_New(Trace, &TraceType);
    if (!t) return NULL;
    t->n = t->cap = 0;
    for (int k = 0; k < NINT; k++) t->ints[k] = NULL;
    for (int k = 0; k < NOBJ; k++) {
        t->objs[k] = NULL;
        t->width[k] = 1;
    }
    t->shape = NULL;
    t->table = PyList_New(0);
    t->by_value = PyDict_New();
    t->by_ptr = PyDict_New();
    t->shapes = PyList_New(0);
    t->verbatim = PyDict_New();
    if (!t->table || !t->by_value || !t->by_ptr || !t->shapes || !t->verbatim) { Py_DECREF(t); return NULL; }
    return t;
}

static void trace_dealloc(Trace *t) {
    for (int k = 0; k < NINT; k++) PyMem_Free(t->ints[k]);
    for (int k = 0; k < NOBJ; k++) PyMem_Free(t->objs[k]);
    PyMem_Free(t->shape);
    Py_XDECREF(t->table);
    Py_XDECREF(t->by_value);
    Py_XDECREF(t->by_ptr);
    Py_XDECREF(t->shapes);
    Py_XDECREF(t->verbatim);
    PyObject_Free(t);
}

static int trace_grow(Trace *t) {
    Py_ssize_t cap = t->cap ? t->cap + t->cap / 2 : 1024;
    for (int k = 0; k < NINT; k++) {
        void *p = PyMem_Realloc(t->ints[k], (size_t)cap * sizeof(int64_t));
        if (!p) return -1;
        t->ints[k] = p;
    }
    for (int k = 0; k < NOBJ; k++) {
        void *p = PyMem_Realloc(t->objs[k], (size_t)cap * t->width[k]);
        if (!p) return -1;
        t->objs[k] = p;
    }
    void *p = PyMem_Realloc(t->shape, (size_t)cap);
    if (!p) return -1;
    t->shape = p;
    t->cap = cap;
    return 0;
}

/* The columns cut to their rows once the trace is read: growth leaves up to a third unused. */
static void trace_trim(Trace *t) {
    if (!t || t->n == t->cap || t->n == 0) return;
    for (int k = 0; k < NINT; k++) {
        void *p = PyMem_Realloc(t->ints[k], (size_t)t->n * sizeof(int64_t));
        if (p) t->ints[k] = p; else return;
    }
    for (int k = 0; k < NOBJ; k++) {
        void *p = PyMem_Realloc(t->objs[k], (size_t)t->n * t->width[k]);
        if (p) t->objs[k] = p; else return;
    }
    void *p = PyMem_Realloc(t->shape, (size_t)t->n);
    if (p) { t->shape = p; t->cap = t->n; }
}

static Py_ssize_t trace_len(Trace *t) { return t->n; }

static inline uint32_t obj_id(Trace *t, int k, Py_ssize_t i) {
    switch (t->width[k]) {
    case 1: return ((uint8_t *)t->objs[k])[i];
    case 2: return ((uint16_t *)t->objs[k])[i];
    default: return ((uint32_t *)t->objs[k])[i];
    }
}

/* Store id at row i of objs[k], widening the column first when the id needs it. */
static int set_obj_id(Trace *t, int k, Py_ssize_t i, uint32_t id) {
    int w = id <= 0xFF ? 1 : id <= 0xFFFF ? 2 : 4;
    if (w > t->width[k]) {
        int old = t->width[k];
        void *p = PyMem_Realloc(t->objs[k], (size_t)(t->cap ? t->cap : 1) * w);
        if (!p) { PyErr_NoMemory(); return -1; }
        t->objs[k] = p;
        t->width[k] = w;
        for (Py_ssize_t j = t->n - 1; j >= 0; j--) {  /* from the end: wider slots lie further on */
            uint32_t v = old == 1 ? ((uint8_t *)p)[j] : ((uint16_t *)p)[j];
            if (w == 2) ((uint16_t *)p)[j] = (uint16_t)v;
            else ((uint32_t *)p)[j] = v;
        }
    }
    switch (t->width[k]) {
    case 1: ((uint8_t *)t->objs[k])[i] = (uint8_t)id; break;
    case 2: ((uint16_t *)t->objs[k])[i] = (uint16_t)id; break;
    default: ((uint32_t *)t->objs[k])[i] = id;
    }
    return 0;
}

static PyObject *row_dict(Trace *t, Py_ssize_t i) {
    uint8_t s = t->shape[i];
    if (s == VERBATIM) {
        PyObject *key = PyLong_FromSsize_t(i);
        if (!key) return NULL;
        PyObject *d = PyDict_GetItemWithError(t->verbatim, key);
        Py_DECREF(key);
        if (!d && !PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "fastread: lost entry");
        Py_XINCREF(d);
        return d;
    }
    uint32_t code = t->shape_codes[s];
    int len = code & 15;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int k = 0; k < len; k++) {
        int slot = (code >> (4 + 3 * k)) & 7;
        PyObject *v;
        if (slot < NINT) {
            v = PyLong_FromLongLong(t->ints[slot][i]);
            if (!v) { Py_DECREF(d); return NULL; }
        } else {
            v = PyList_GET_ITEM(t->table, obj_id(t, slot - NINT, i));
            Py_INCREF(v);
        }
        int r = PyDict_SetItem(d, slot_strs[slot], v);
        Py_DECREF(v);
        if (r < 0) { Py_DECREF(d); return NULL; }
    }
    return d;
}

static PyObject *trace_item(Trace *t, Py_ssize_t i) {
    if (i < 0 || i >= t->n) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return NULL;
    }
    return row_dict(t, i);
}

static PyObject *trace_subscript(Trace *t, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) i += t->n;
        return trace_item(t, i);
    }
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
        Py_ssize_t len = PySlice_AdjustIndices(t->n, &start, &stop, step);
        PyObject *out = PyList_New(len);
        if (!out) return NULL;
        for (Py_ssize_t k = 0, i = start; k < len; k++, i += step) {
            PyObject *d = row_dict(t, i);
            if (!d) { Py_DECREF(out); return NULL; }
            PyList_SET_ITEM(out, k, d);
        }
        return out;
    }
    PyErr_Format(PyExc_TypeError, "list indices must be integers or slices, not %.200s", Py_TYPE(key)->tp_name);
    return NULL;
}

static PyObject *trace_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(a, &TraceType)) Py_RETURN_NOTIMPLEMENTED;
    PyObject *whole = PySequence_List(a);
    if (!whole) return NULL;
    PyObject *other = Py_IS_TYPE(b, &TraceType) ? PySequence_List(b) : (Py_INCREF(b), b);
    if (!other) { Py_DECREF(whole); return NULL; }
    PyObject *r = PyObject_RichCompare(whole, other, op);
    Py_DECREF(whole);
    Py_DECREF(other);
    return r;
}

/* walk(codes, deltas, closed, allocs, unmatched) -> None when a row is not plain (the caller walks
 * the dicts), else (open dict, ooms, annotations, segment events), with deltas and closed (8 bytes
 * an entry each, writable) filled and the alloc and unmatched free indices appended to the two
 * array('q'). `codes` maps an action string to 1 alloc,
 * 2 free_completed, 3 oom, 4 annotate, 5 a segment action: the loop of normalize.walk.Walk. */
/* Append the n indices at buf to the array('q') `to`, a block at a time (no copy of the whole). */
static int flush(PyObject *to, int64_t *buf, Py_ssize_t *n) {
    if (!*n) return 0;
    PyObject *r = PyObject_CallMethod(to, "frombytes", "y#", (const char *)buf, *n * 8);
    *n = 0;
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

#define BLOCK 8192

/* The walk's open allocations: address -> alloc event, in open addressing (a Python dict would make
 * two int objects an event). `since` is the event that last put the address in afresh, so that the
 * dict made at the end lists addresses in the order a dict filled event by event would. */
typedef struct {
    int64_t addr, at, since;
    int used;
} Open;

typedef struct {
    Open *slots;
    Py_ssize_t cap, n;  /* cap a power of two, at most half full */
    int bits;           /* cap == 1 << bits */
    uint64_t mult;      /* odd, drawn per walk: addresses come from the file, which must not choose collisions */
} OpenSet;

/* The top bits of a multiplicative hash. */
static inline Py_ssize_t open_hash(const OpenSet *o, int64_t addr) {
    return (Py_ssize_t)(((uint64_t)addr * o->mult) >> (64 - o->bits));
}

static Open *open_find(OpenSet *o, int64_t addr) {
    Py_ssize_t k = open_hash(o, addr);
    while (o->slots[k].used) {
        if (o->slots[k].addr == addr) return &o->slots[k];
        k = (k + 1) & (o->cap - 1);
    }
    return NULL;
}

static int open_put(OpenSet *o, int64_t addr, int64_t at) {
    if (2 * (o->n + 1) > o->cap) {
        OpenSet grown = {NULL, o->cap ? o->cap * 2 : 1024, o->n, o->cap ? o->bits + 1 : 10, o->mult};
        Py_ssize_t cap = grown.cap;
        Open *slots = PyMem_Calloc(cap, sizeof(Open)), *old = o->slots;
        if (!slots) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < o->cap; k++) {
            if (!old[k].used) continue;
            Py_ssize_t j = open_hash(&grown, old[k].addr);
            while (slots[j].used) j = (j + 1) & (cap - 1);
            slots[j] = old[k];
        }
        PyMem_Free(old);
        grown.slots = slots;
        *o = grown;
    }
    Py_ssize_t k = open_hash(o, addr);
    while (o->slots[k].used && o->slots[k].addr != addr) k = (k + 1) & (o->cap - 1);
    if (o->slots[k].used) {  /* a reused address still open: the older allocation stays open for good */
        o->slots[k].at = at;
        return 0;
    }
    o->slots[k] = (Open){addr, at, at, 1};
    o->n++;
    return 0;
}

/* Remove a found slot, moving later members of its probe run back (no tombstones). */
static void open_remove(OpenSet *o, Open *gone) {
    Py_ssize_t k = gone - o->slots, mask = o->cap - 1;
    Py_ssize_t j = k;
    for (;;) {
        j = (j + 1) & mask;
        if (!o->slots[j].used) break;
        Py_ssize_t home = open_hash(o, o->slots[j].addr);
        /* j's entry may move to k when its home is not within (k, j] cyclically */
        if ((j > k && (home <= k || home > j)) || (j < k && (home <= k && home > j))) {
            o->slots[k] = o->slots[j];
            k = j;
        }
    }
    o->slots[k].used = 0;
    o->n--;
}

static int by_since(const void *a, const void *b) {
    int64_t x = (*(Open *const *)a)->since, y = (*(Open *const *)b)->since;
    return (x > y) - (x < y);
}

/* The open allocations as the dict normalize.walk.Walk fills: address -> event, in its order. */
static PyObject *open_dict(OpenSet *o) {
    Open **all = PyMem_Malloc((o->n ? o->n : 1) * sizeof(Open *));
    if (!all) return PyErr_NoMemory();
    Py_ssize_t m = 0;
    for (Py_ssize_t k = 0; k < o->cap; k++)
        if (o->slots[k].used) all[m++] = &o->slots[k];
    qsort(all, m, sizeof(Open *), by_since);
    PyObject *d = PyDict_New();
    for (Py_ssize_t k = 0; d && k < m; k++) {
        PyObject *addr = PyLong_FromLongLong(all[k]->addr), *at = PyLong_FromLongLong(all[k]->at);
        if (!addr || !at || PyDict_SetItem(d, addr, at) < 0) Py_CLEAR(d);
        Py_XDECREF(addr);
        Py_XDECREF(at);
    }
    PyMem_Free(all);
    return d;
}

static PyObject *trace_walk_into(Trace *t, PyObject *codes, int64_t *d, int64_t *cl, PyObject *allocs,
                                 PyObject *unmatched) {
    Py_ssize_t n = t->n, nt = PyList_GET_SIZE(t->table);
    int8_t *kind = PyMem_Calloc(nt ? nt : 1, 1);
    if (!kind) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < nt; k++) {
        PyObject *v = PyList_GET_ITEM(t->table, k);
        if (!PyUnicode_CheckExact(v)) { kind[k] = -1; continue; }
        PyObject *c = PyDict_GetItemWithError(codes, v);
        if (!c && PyErr_Occurred()) { PyMem_Free(kind); return NULL; }
        kind[k] = c ? (int8_t)PyLong_AsLong(c) : 0;
    }
    /* Which shapes carry action, addr and size. */
    int has[MAX_SHAPES];
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(t->shapes); s++) {
        uint32_t code = t->shape_codes[s];
        int m = 0;
        for (int k = 0; k < (int)(code & 15); k++) m |= 1 << ((code >> (4 + 3 * k)) & 7);
        has[s] = m;
    }
    Py_ssize_t nal = 0, nun = 0;
    int64_t *al = PyMem_Malloc(BLOCK * 8), *un = PyMem_Malloc(BLOCK * 8);
    /* Seeded by where this walk's buffers and stack lie (randomized per process) and the clock. */
    uint64_t seed = (uint64_t)(uintptr_t)al ^ ((uint64_t)(uintptr_t)&n << 21) ^ (uint64_t)time(NULL) * 0xD6E8FEB86659FD93ull;
    OpenSet open = {NULL, 0, 0, 0, (seed * 0x9E3779B97F4A7C15ull) | 1};
    PyObject *live = NULL, *ooms = PyList_New(0), *notes = PyList_New(0), *segs = PyList_New(0);
    PyObject *result = NULL;
    if (!al || !un || !ooms || !notes || !segs) goto done;
    const int need = ACTION_BIT | (1 << 0) | (1 << 1);  /* action, addr, size */
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = 0;
        cl[i] = n;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t s = t->shape[i];
        if (s == VERBATIM || !(has[s] & ACTION_BIT)) { result = Py_None; goto done; }
        int8_t a = kind[obj_id(t, 0, i)];
        if (a < 0) { result = Py_None; goto done; }
        if ((a == 1 || a == 2) && (has[s] & need) != need) { result = Py_None; goto done; }
        if (a == 1) {
            d[i] = t->ints[1][i];
            if (open_put(&open, t->ints[0][i], i) < 0) goto done;
            al[nal++] = i;
            if (nal == BLOCK && flush(allocs, al, &nal) < 0) goto done;
        } else if (a == 2) {
            Open *j = open.cap ? open_find(&open, t->ints[0][i]) : NULL;
            if (!j) {
                d[i] = -t->ints[1][i];
                un[nun++] = i;
                if (nun == BLOCK && flush(unmatched, un, &nun) < 0) goto done;
            } else {
                cl[j->at] = i;
                d[i] = -d[j->at];
                open_remove(&open, j);
            }
        } else if (a >= 3) {
            PyObject *at = PyLong_FromSsize_t(i);
            int r = at ? PyList_Append(a == 3 ? ooms : a == 4 ? notes : segs, at) : -1;
            Py_XDECREF(at);
            if (r < 0) goto done;
        }
    }
    if (flush(allocs, al, &nal) < 0 || flush(unmatched, un, &nun) < 0 || !(live = open_dict(&open))) goto done;
    result = Py_BuildValue("(OOOO)", live, ooms, notes, segs);
done:
    if (result == Py_None) Py_INCREF(Py_None);
    PyMem_Free(kind);
    PyMem_Free(al);
    PyMem_Free(un);
    PyMem_Free(open.slots);
    Py_XDECREF(live);
    Py_XDECREF(ooms);
    Py_XDECREF(notes);
    Py_XDECREF(segs);
    return result;
}

static PyObject *trace_walk(Trace *t, PyObject *args) {
    PyObject *codes, *allocs, *unmatched;
    Py_buffer db, cb;
    if (!PyArg_ParseTuple(args, "O!w*w*OO", &PyDict_Type, &codes, &db, &cb, &allocs, &unmatched)) return NULL;
    if (db.len != t->n * 8 || cb.len != t->n * 8) {
        PyBuffer_Release(&db);
        PyBuffer_Release(&cb);
        PyErr_SetString(PyExc_ValueError, "walk: deltas and closed need 8 bytes an entry");
        return NULL;
    }
    PyObject *out = trace_walk_into(t, codes, (int64_t *)db.buf, (int64_t *)cb.buf, allocs, unmatched);
    PyBuffer_Release(&db);
    PyBuffer_Release(&cb);
    return out;
}

/* values(key) -> the list of e.get(key) over the entries, without building them. */
static PyObject *trace_values(Trace *t, PyObject *key) {
    int slot = -1;
    for (int k = 0; k < NSLOT; k++)
        if (PyUnicode_Check(key) && PyUnicode_Compare(key, slot_strs[k]) == 0) slot = k;
    PyObject *out = PyList_New(t->n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        uint8_t s = t->shape[i];
        PyObject *v = NULL;
        if (s == VERBATIM || slot < 0) {
            PyObject *d = row_dict(t, i);
            if (!d) { Py_DECREF(out); return NULL; }
            v = PyDict_GetItemWithError(d, key);
            if (!v && PyErr_Occurred()) { Py_DECREF(d); Py_DECREF(out); return NULL; }
            v = v ? v : Py_None;
            Py_INCREF(v);
            Py_DECREF(d);
        } else {
            uint32_t code = t->shape_codes[s];
            int present = 0;
            for (int k = 0; k < (int)(code & 15); k++) present |= ((code >> (4 + 3 * k)) & 7) == (uint32_t)slot;
            if (!present) {
                v = Py_None;
                Py_INCREF(v);
            } else if (slot < NINT) {
                v = PyLong_FromLongLong(t->ints[slot][i]);
                if (!v) { Py_DECREF(out); return NULL; }
            } else {
                v = PyList_GET_ITEM(t->table, obj_id(t, slot - NINT, i));
                Py_INCREF(v);
            }
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* codes(key, events) -> bytes of int64: for each event index (a buffer of int64), the id of its
 * value of `key` in table() when the columns hold it, -1 when the row does not (a row kept whole,
 * or one without that key: e.get(key) says). Ids are by identity but for strings and ints (one
 * object stands for all equal ones), so equal ids mean equal values. */
static PyObject *trace_codes(Trace *t, PyObject *args) {
    PyObject *key;
    Py_buffer events;
    if (!PyArg_ParseTuple(args, "Uy*", &key, &events)) return NULL;
    int slot = -1;
    for (int k = NINT; k < NSLOT; k++)
        if (PyUnicode_Compare(key, slot_strs[k]) == 0) slot = k;
    Py_ssize_t n = events.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!out) { PyBuffer_Release(&events); return NULL; }
    const int64_t *at = (const int64_t *)events.buf;
    int64_t *codes = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t i = at[j];
        codes[j] = -1;
        if (i < 0 || i >= t->n || slot < 0 || t->shape[i] == VERBATIM) continue;
        uint32_t code = t->shape_codes[t->shape[i]];
        for (int k = 0; k < (int)(code & 15); k++)
            if (((code >> (4 + 3 * k)) & 7) == (uint32_t)slot) codes[j] = obj_id(t, slot - NINT, i);
    }
    PyBuffer_Release(&events);
    return out;
}

static PyObject *trace_table(Trace *t, PyObject *unused) {
    Py_INCREF(t->table);
    return t->table;
}

static PyObject *trace_nbytes(Trace *t, PyObject *unused) {
    Py_ssize_t per = NINT * 8 + 1;
    for (int k = 0; k < NOBJ; k++) per += t->width[k];
    return PyLong_FromSsize_t(t->cap * per);
}

static PyMethodDef trace_methods[] = {
    {"walk", (PyCFunction)trace_walk, METH_VARARGS, "normalize.walk.Walk's loop over the columns; None when it cannot"},
    {"values", (PyCFunction)trace_values, METH_O, "[e.get(key) for e in trace], built from the columns"},
    {"nbytes", (PyCFunction)trace_nbytes, METH_NOARGS, "bytes held by the columns"},
    {"codes", (PyCFunction)trace_codes, METH_VARARGS, "ids into table() of a key's values at events (-1: ask the row)"},
    {"table", (PyCFunction)trace_table, METH_NOARGS, "the distinct values the columns' ids point at"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods trace_as_sequence = {.sq_length = (lenfunc)trace_len, .sq_item = (ssizeargfunc)trace_item};
static PyMappingMethods trace_as_mapping = {.mp_length = (lenfunc)trace_len,
                                            .mp_subscript = (binaryfunc)trace_subscript};

static PyTypeObject TraceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "memdiff._fastread.Trace",
    .tp_basicsize = sizeof(Trace),
    .tp_dealloc = (destructor)trace_dealloc,
    .tp_as_sequence = &trace_as_sequence,
    .tp_as_mapping = &trace_as_mapping,
    .tp_richcompare = trace_richcompare,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One device's trace entries in columns, read as a read-only list of dicts.",
    .tp_methods = trace_methods,
};

/* ---- the reader ------------------------------------------------------------------------- */

typedef struct {
    PyObject *read;           /* stream.read */
    char *buf;
    Py_ssize_t len, pos, cap;
    long long consumed;       /* bytes of the stream taken so far: bounds the memo */
    int eof;
    PyObject **stack;
    Py_ssize_t sp, scap;
    Py_ssize_t *marks;
    Py_ssize_t mp, mcap;
    PyObject ***memo;         /* pages */
    uint32_t **memo_ids;      /* beside each page: 1 + the object's id in the open trace's table, 0 unknown */
    Py_ssize_t memo_len, memo_cap;
    /* The trace being filled: its builder's stack position and the row of the open entry. */
    Trace *trace;
    Py_ssize_t trace_pos, entry_pos, row;
    uint32_t row_code;        /* the open row's key order: count, then 3 bits a slot */
    PyObject *row_dict;       /* the open row when it is kept whole */
    Py_ssize_t traces_made, traces_pos;
    /* Memo indices where a Trace was put (a get of one declines), so that the entry fast path
     * knows without reading the object: a frames list's header would be a cache miss an event. */
    Py_ssize_t trace_memo[MAX_TRACE_MEMO];
    int ntrace_memo;
    int stream_error;         /* the stream raised (a bomb, a file growing): not the data's fault */
    /* Entry keys and values repeat as the same (memo) objects: pointer caches, each holding a
     * reference so that no address is reused while cached. */
    PyObject *kkey[KCACHE];
    int kslot[KCACHE], nk;
    PyObject *vkey[VCACHE];
    uint32_t vid[VCACHE];
} Reader;

static int64_t le(const unsigned char *p, int n);

static PyObject ENTRY_MARK_OBJ;  /* never used as an object: its address tags a stack slot */
#define ENTRY (&ENTRY_MARK_OBJ)

/* Make n contiguous bytes available at buf+pos: 0, or 1 when the stream ends first, -1 on error. */
static int need(Reader *r, Py_ssize_t n) {
    if (r->len - r->pos >= n) return 0;
    if (n > MAX_ITEM) return 1;
    if (r->pos) {
        r->consumed += r->pos;
        memmove(r->buf, r->buf + r->pos, r->len - r->pos);
        r->len -= r->pos;
        r->pos = 0;
    }
    if (n > r->cap || r->cap < CHUNK) {
        Py_ssize_t cap = n > CHUNK ? n : CHUNK;
        char *p = PyMem_Realloc(r->buf, cap);
        if (!p) { PyErr_NoMemory(); return -1; }
        r->buf = p;
        r->cap = cap;
    }
    while (r->len < n) {
        if (r->eof) return 1;
        Py_ssize_t want = r->cap - r->len;
        PyObject *b = PyObject_CallFunction(r->read, "n", want);
        if (!b) { r->stream_error = 1; return -1; }
        if (!PyBytes_Check(b)) { Py_DECREF(b); return 1; }
        Py_ssize_t got = PyBytes_GET_SIZE(b);
        if (got == 0) r->eof = 1;
        memcpy(r->buf + r->len, PyBytes_AS_STRING(b), got);
        r->len += got;
        Py_DECREF(b);
    }
    return 0;
}

static int push(Reader *r, PyObject *o) {  /* steals o */
    if (!o) return -1;
    if (r->sp == r->scap) {
        Py_ssize_t cap = r->scap ? r->scap * 2 : 256;
        PyObject **p = PyMem_Realloc(r->stack, cap * sizeof(PyObject *));
        if (!p) { if (o != ENTRY) Py_DECREF(o); PyErr_NoMemory(); return -1; }
        r->stack = p;
        r->scap = cap;
    }
    r->stack[r->sp++] = o;
    return 0;
}

static void drop(PyObject *o) {
    if (o != ENTRY) Py_XDECREF(o);
}

/* The memo in pages of PAGE slots, a page allocated only when something gettable is stored in
 * it: a trace's entries are memoized one by one and can never be got back (ENTRY), so pages of
 * them cost nothing (a pointer a slot would be 8 bytes an event). */
static PyObject *memo_at(Reader *r, Py_ssize_t idx) {
    PyObject **page = r->memo[idx / PAGE];
    return page ? page[idx % PAGE] : NULL;
}

static int memo_put(Reader *r, Py_ssize_t idx) {
    if (r->sp == 0 || idx < 0 || idx > r->consumed + r->pos) return 1;
    Py_ssize_t pages = idx / PAGE + 1;
    if (pages > r->memo_cap) {
        Py_ssize_t cap = r->memo_cap ? r->memo_cap : 64;
        while (cap < pages) cap *= 2;
        PyObject ***p = PyMem_Realloc(r->memo, cap * sizeof(PyObject **));
        if (!p) { PyErr_NoMemory(); return -1; }
        r->memo = p;
        uint32_t **q = PyMem_Realloc(r->memo_ids, cap * sizeof(uint32_t *));
        if (!q) { PyErr_NoMemory(); return -1; }
        r->memo_ids = q;
        for (Py_ssize_t k = r->memo_cap; k < cap; k++) {
            p[k] = NULL;
            q[k] = NULL;
        }
        r->memo_cap = cap;
    }
    PyObject *o = r->stack[r->sp - 1];
    PyObject **page = r->memo[idx / PAGE];
    if (!page) {
        if (o == ENTRY) {
            if (idx >= r->memo_len) r->memo_len = idx + 1;
            return 0;
        }
        r->memo_ids[idx / PAGE] = PyMem_Calloc(PAGE, sizeof(uint32_t));
        if (!r->memo_ids[idx / PAGE]) { PyErr_NoMemory(); return -1; }
        page = r->memo[idx / PAGE] = PyMem_Calloc(PAGE, sizeof(PyObject *));
        if (!page) { PyErr_NoMemory(); return -1; }
    }
    if (o != ENTRY) {
        if (Py_IS_TYPE(o, &TraceType)) {
            if (r->ntrace_memo == MAX_TRACE_MEMO) return 1;
            r->trace_memo[r->ntrace_memo++] = idx;
        }
        Py_INCREF(o);
    }
    drop(page[idx % PAGE]);
    page[idx % PAGE] = o == ENTRY ? NULL : o;
    r->memo_ids[idx / PAGE][idx % PAGE] = 0;
    if (idx >= r->memo_len) r->memo_len = idx + 1;
    return 0;
}

static int memo_get(Reader *r, Py_ssize_t idx) {
    if (idx < 0 || idx >= r->memo_len) return 1;
    PyObject *o = memo_at(r, idx);
    /* An entry (never stored) or a trace got twice would be one object in two places. */
    if (!o || Py_IS_TYPE(o, &TraceType)) return 1;
    Py_INCREF(o);
    return push(r, o);
}

static Py_ssize_t top_mark(Reader *r) { return r->mp ? r->marks[r->mp - 1] : -1; }

/* Is a list pushed now a device's trace? The stack holds, ignoring marks, the root dict at the
 * bottom, then its key/value pairs, then 'device_traces', a plain list, and the traces before
 * this one. */
static int trace_context(Reader *r) {
    Py_ssize_t k = r->sp - 1;
    while (k >= 0 && Py_IS_TYPE(r->stack[k], &TraceType)) k--;
    if (k < 2 || !PyList_CheckExact(r->stack[k])) return 0;
    PyObject *name = r->stack[k - 1];
    if (!PyUnicode_CheckExact(name) || PyUnicode_CompareWithASCIIString(name, "device_traces") != 0) return 0;
    /* The marks: one under the root's pairs, at most one under the traces. */
    if (r->mp < 1 || r->mp > 2 || r->marks[0] != 1 || !PyDict_CheckExact(r->stack[0])) return 0;
    if (r->mp == 2 && r->marks[1] != k + 1) return 0;
    if (r->traces_made && r->traces_pos != k) return 0;
    r->traces_pos = k;
    return 1;
}

static int finish_row(Reader *r) {
    if (r->row < 0) return 0;
    Trace *t = r->trace;
    if (r->row_dict) {
        t->shape[r->row] = VERBATIM;
        PyObject *key = PyLong_FromSsize_t(r->row);
        int ok = key ? PyDict_SetItem(t->verbatim, key, r->row_dict) : -1;
        Py_XDECREF(key);
        Py_CLEAR(r->row_dict);
        r->row = -1;
        return ok;
    }
    Py_ssize_t ns = PyList_GET_SIZE(t->shapes), s;
    for (s = 0; s < ns; s++)
        if (t->shape_codes[s] == r->row_code) break;
    if (s == ns) {
        if (ns == MAX_SHAPES) return 1;
        int len = r->row_code & 15;
        PyObject *keys = PyTuple_New(len);
        if (!keys) return -1;
        for (int k = 0; k < len; k++) {
            PyObject *name = slot_strs[(r->row_code >> (4 + 3 * k)) & 7];
            Py_INCREF(name);
            PyTuple_SET_ITEM(keys, k, name);
        }
        int ok = PyList_Append(t->shapes, keys);
        Py_DECREF(keys);
        if (ok < 0) return -1;
        t->shape_codes[s] = r->row_code;
    }
    t->shape[r->row] = (uint8_t)s;
    r->row = -1;
    return 0;
}

static int table_id(Trace *t, PyObject *v, uint32_t *out) {
    int by_value = PyUnicode_CheckExact(v) || PyLong_CheckExact(v);
    PyObject *key = by_value ? (Py_INCREF(v), v) : PyLong_FromVoidPtr(v);
    if (!key) return -1;
    PyObject *ids = by_value ? t->by_value : t->by_ptr;
    PyObject *id = PyDict_GetItemWithError(ids, key);
    if (id) {
        *out = (uint32_t)PyLong_AsUnsignedLong(id);
        Py_DECREF(key);
        return 0;
    }
    if (PyErr_Occurred()) { Py_DECREF(key); return -1; }
    Py_ssize_t n = PyList_GET_SIZE(t->table);
    if (n >= 0xFFFFFFF0) { Py_DECREF(key); return 1; }
    PyObject *num = PyLong_FromSsize_t(n);
    int ok = (num && PyDict_SetItem(ids, key, num) == 0 && PyList_Append(t->table, v) == 0) ? 0 : -1;
    Py_XDECREF(num);
    Py_DECREF(key);
    *out = (uint32_t)n;
    return ok;
}

/* The open row as the dict it stands for, from then on kept whole. */
static int row_to_dict(Reader *r) {
    Trace *t = r->trace;
    PyObject *d = PyDict_New();
    if (!d) return -1;
    int len = r->row_code & 15;
    for (int k = 0; k < len; k++) {
        int slot = (r->row_code >> (4 + 3 * k)) & 7;
        PyObject *v = slot < NINT ? PyLong_FromLongLong(t->ints[slot][r->row])
                                  : (Py_INCREF(PyList_GET_ITEM(t->table, obj_id(t, slot - NINT, r->row))),
                                     PyList_GET_ITEM(t->table, obj_id(t, slot - NINT, r->row)));
        if (!v || PyDict_SetItem(d, slot_strs[slot], v) < 0) { Py_XDECREF(v); Py_DECREF(d); return -1; }
        Py_DECREF(v);
    }
    r->row_dict = d;
    return 0;
}

static int key_slot(Reader *r, PyObject *key) {
    for (int k = 0; k < r->nk; k++)
        if (r->kkey[k] == key) return r->kslot[k];
    int slot = -1;
    if (PyUnicode_CheckExact(key))
        for (int k = 0; k < NSLOT; k++)
            if (PyUnicode_Compare(key, slot_strs[k]) == 0) { slot = k; break; }
    if (r->nk < KCACHE) {
        Py_INCREF(key);
        r->kkey[r->nk] = key;
        r->kslot[r->nk++] = slot;
    }
    return slot;
}

static void vcache_clear(Reader *r) {
    for (int k = 0; k < VCACHE; k++) Py_CLEAR(r->vkey[k]);
    for (Py_ssize_t k = 0; k < r->memo_cap; k++)
        if (r->memo_ids[k]) memset(r->memo_ids[k], 0, PAGE * sizeof(uint32_t));
}

/* The id of an object in the open trace's table, through a cache by address: 0, 1 when the table
 * is full, -1 error. */
static int value_id(Reader *r, PyObject *value, uint32_t *id) {
    size_t h = ((uintptr_t)value >> 4) & (VCACHE - 1);
    if (r->vkey[h] == value) {
        *id = r->vid[h];
        return 0;
    }
    int ok = table_id(r->trace, value, id);
    if (ok == 0) {
        Py_INCREF(value);
        Py_XSETREF(r->vkey[h], value);
        r->vid[h] = *id;
    }
    return ok;
}

/* The column of `key` for the open row: -1 when it is no column's or the row holds it already. */
static int free_slot(Reader *r, PyObject *key) {
    int slot = key_slot(r, key), len = r->row_code & 15;
    for (int k = 0; k < len && slot >= 0; k++)
        if ((int)((r->row_code >> (4 + 3 * k)) & 7) == slot) slot = -1;  /* a repeated key */
    return slot;
}

/* The open row holds `slot` next, in its key order. */
static void row_add(Reader *r, int slot) {
    int len = r->row_code & 15;
    r->row_code = ((r->row_code & ~15u) | (uint32_t)(slot << (4 + 3 * len))) | (uint32_t)(len + 1);
}

static int set_entry(Reader *r, PyObject *key, PyObject *value) {
    if (r->row_dict) return PyDict_SetItem(r->row_dict, key, value);
    int slot = free_slot(r, key);
    Trace *t = r->trace;
    if (slot >= 0 && slot < NINT) {
        if (!PyLong_CheckExact(value)) slot = -1;
        else {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); slot = -1; }
            else t->ints[slot][r->row] = v;
        }
    } else if (slot >= NINT) {
        uint32_t id;
        int ok = value_id(r, value, &id);
        if (ok < 0) return -1;
        if (ok > 0) slot = -1;
        else if (set_obj_id(t, slot - NINT, r->row, id) < 0) return -1;
    }
    if (slot < 0) {
        if (row_to_dict(r) < 0) return -1;
        return PyDict_SetItem(r->row_dict, key, value);
    }
    row_add(r, slot);
    return 0;
}

/* set_entry of an inline number, stored without making an int object when its key is a number's. */
static int set_entry_int(Reader *r, PyObject *key, long long v) {
    if (!r->row_dict) {
        int slot = free_slot(r, key);
        if (slot >= 0 && slot < NINT) {
            r->trace->ints[slot][r->row] = v;
            row_add(r, slot);
            return 0;
        }
    }
    PyObject *o = PyLong_FromLongLong(v);
    if (!o) return -1;
    int ok = set_entry(r, key, o);
    Py_DECREF(o);
    return ok;
}

/* set_entry of an object got from memo slot idx, whose id in the table is cached beside the slot. */
static int set_entry_memo(Reader *r, PyObject *key, PyObject *value, Py_ssize_t idx) {
    if (!r->row_dict) {
        int slot = free_slot(r, key);
        if (slot >= NINT) {
            uint32_t *cached = &r->memo_ids[idx / PAGE][idx % PAGE], id;
            if (*cached) id = *cached - 1;
            else {
                int ok = value_id(r, value, &id);
                if (ok < 0) return -1;
                if (ok > 0) return set_entry(r, key, value);
                *cached = id + 1;  /* ids stay below 0xFFFFFFF0 (table_id) */
            }
            if (set_obj_id(r->trace, slot - NINT, r->row, id) < 0) return -1;
            row_add(r, slot);
            return 0;
        }
    }
    return set_entry(r, key, value);
}

/* A memo reference at p (BINGET or LONG_BINGET) as a borrowed object: NULL when p holds none, the
 * slot is empty or holds a Trace (memo_get declines those). *p moves past it. */
static PyObject *memo_ref(Reader *r, const unsigned char **p, const unsigned char *end, Py_ssize_t *at) {
    Py_ssize_t idx;
    if (**p == 'h' && end - *p >= 2) { idx = (*p)[1]; *p += 2; }
    else if (**p == 'j' && end - *p >= 5) { idx = (Py_ssize_t)(uint32_t)le(*p + 1, 4); *p += 5; }
    else return NULL;
    if (idx >= r->memo_len) return NULL;
    for (int k = 0; k < r->ntrace_memo; k++)
        if (r->trace_memo[k] == idx) return NULL;
    *at = idx;
    return memo_at(r, idx);
}

/* The usual trace entry in one go, right after its EMPTY_DICT: its memo put, MARK, pairs whose keys
 * and objects are memo references and whose numbers are inline, SETITEMS. The entry is parsed
 * whole first and applied only when it has that form: 0 applied, 1 not this form (nothing taken:
 * it is read opcode by opcode, with the same result), -1 error. The objects are borrowed from the
 * memo, which nothing changes while they are used (the entry's own put must find its slot empty):
 * no reference count is touched, so no frames list is read, which is what makes it fast. */
static int fast_entry(Reader *r) {
    if (r->len - r->pos < FAST_BYTES && need(r, FAST_BYTES) < 0) return -1;  /* 1: the stream's end */
    const unsigned char *p = (const unsigned char *)r->buf + r->pos, *end = (const unsigned char *)r->buf + r->len;
    PyObject *keys[FAST_PAIRS], *objs[FAST_PAIRS];
    Py_ssize_t slots[FAST_PAIRS], unused;
    long long ints[FAST_PAIRS];
    int n = 0;
    Py_ssize_t put;
#define SKIP_FRAMES() while (p < end && *p == 0x95) { if (end - p < 9) return 1; p += 9; }
    SKIP_FRAMES();
    if (p == end) return 1;
    if (*p == 0x94) { put = r->memo_len; p += 1; }
    else if (*p == 'q' && end - p >= 2) { put = p[1]; p += 2; }
    else if (*p == 'r' && end - p >= 5) { put = (Py_ssize_t)(uint32_t)le(p + 1, 4); p += 5; }
    else return 1;
    if (put < r->memo_len && memo_at(r, put)) return 1;  /* a put over an object: opcode by opcode */
    Py_ssize_t after_put = (const char *)p - r->buf;
    SKIP_FRAMES();
    if (p == end || *p != '(') return 1;
    p++;
    for (;;) {
        SKIP_FRAMES();
        if (p == end) return 1;
        if (*p == 'u') { p++; break; }
        if (n == FAST_PAIRS || !(keys[n] = memo_ref(r, &p, end, &unused))) return 1;
        SKIP_FRAMES();
        if (p == end) return 1;
        objs[n] = NULL;
        switch (*p) {
        case 'K': if (end - p < 2) return 1; ints[n] = p[1]; p += 2; break;
        case 'M': if (end - p < 3) return 1; ints[n] = le(p + 1, 2); p += 3; break;
        case 'J': if (end - p < 5) return 1; ints[n] = (int32_t)(uint32_t)le(p + 1, 4); p += 5; break;
        case 0x8a: {
            if (end - p < 2 || p[1] > 8 || end - p < 2 + p[1]) return 1;
            int m = p[1];
            uint64_t v = m ? (uint64_t)le(p + 2, m) : 0;
            if (m && m < 8 && (p[1 + m] & 0x80)) v |= ~(uint64_t)0 << (8 * m);
            ints[n] = (int64_t)v;
            p += 2 + m;
            break;
        }
        case 'h': case 'j':
            if (!(objs[n] = memo_ref(r, &p, end, &slots[n]))) return 1;
            break;
        default:
            return 1;
        }
        n++;
    }
    /* Applied as the opcodes would be: the entry's put, then SETITEMS onto it. */
    Py_ssize_t at = r->pos;
    r->pos = after_put;  /* where the put's own opcode leaves the stream: memo_put bounds by it */
    int ok = memo_put(r, put);
    if (ok) {
        r->pos = at;
        return ok;
    }
    for (int k = 0; k < n; k++) {
        ok = objs[k] ? set_entry_memo(r, keys[k], objs[k], slots[k]) : set_entry_int(r, keys[k], ints[k]);
        if (ok < 0) return -1;
    }
    r->pos = (const char *)p - r->buf;
    return 0;
#undef SKIP_FRAMES
}

/* SETITEMS onto stack[target] of the pairs stack[from:sp]. 0 ok, 1 decline, -1 error. */
static int set_items(Reader *r, Py_ssize_t target, Py_ssize_t from) {
    if (target < 0 || (r->sp - from) % 2) return 1;
    PyObject *d = r->stack[target];
    if (d == ENTRY) {
        if (target != r->entry_pos || r->row < 0) return 1;
        for (Py_ssize_t k = from; k < r->sp; k += 2) {
            if (r->stack[k] == ENTRY || r->stack[k + 1] == ENTRY) return 1;
            if (set_entry(r, r->stack[k], r->stack[k + 1]) < 0) return -1;
        }
    } else {
        if (!PyDict_CheckExact(d)) return 1;
        for (Py_ssize_t k = from; k < r->sp; k += 2) {
            if (r->stack[k] == ENTRY || r->stack[k + 1] == ENTRY) return 1;
            if (Py_IS_TYPE(r->stack[k], &TraceType) || Py_IS_TYPE(r->stack[k + 1], &TraceType))
                return 1;
            if (PyDict_SetItem(d, r->stack[k], r->stack[k + 1]) < 0) {
                if (PyErr_ExceptionMatches(PyExc_TypeError)) { PyErr_Clear(); return 1; }
                return -1;
            }
        }
    }
    while (r->sp > from) drop(r->stack[--r->sp]);
    return 0;
}

/* APPENDS onto stack[target] of stack[from:sp]. */
static int append_items(Reader *r, Py_ssize_t target, Py_ssize_t from) {
    if (target < 0) return 1;
    PyObject *l = r->stack[target];
    if (Py_IS_TYPE(l, &TraceType)) {
        if ((Trace *)l != r->trace || target != r->trace_pos) return 1;
        for (Py_ssize_t k = from; k < r->sp; k++)
            if (r->stack[k] != ENTRY) return 1;
        int ok = finish_row(r);
        if (ok) return ok;
        r->entry_pos = -1;
        r->sp = from;
        return 0;
    }
    if (!PyList_CheckExact(l)) return 1;
    for (Py_ssize_t k = from; k < r->sp; k++) {
        if (r->stack[k] == ENTRY) return 1;
        if (Py_IS_TYPE(r->stack[k], &TraceType) && (!r->traces_made || target != r->traces_pos)) return 1;
    }
    /* In one piece, as the C unpickler extends a list: a batch is up to 1,000 items. */
    Py_ssize_t at = PyList_GET_SIZE(l), m = r->sp - from;
    PyObject *batch = PyList_New(m);
    if (!batch) return -1;
    for (Py_ssize_t k = 0; k < m; k++) PyList_SET_ITEM(batch, k, r->stack[from + k]);  /* steals */
    r->sp = from;
    int ok = PyList_SetSlice(l, at, at, batch);
    Py_DECREF(batch);
    return ok < 0 ? -1 : 0;
}

static PyObject *tuple_from(Reader *r, Py_ssize_t from) {
    Py_ssize_t n = r->sp - from;
    for (Py_ssize_t k = from; k < r->sp; k++)
        if (r->stack[k] == ENTRY || Py_IS_TYPE(r->stack[k], &TraceType)) return NULL;
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) PyTuple_SET_ITEM(t, k, r->stack[from + k]);
    r->sp = from;
    return t;
}

static int64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; k--) v = (v << 8) | p[k];
    return (int64_t)v;
}

#define NEED(n) do { int _e = need(r, (n)); if (_e) return _e; } while (0)
#define TAKE(n) (r->pos += (n), (const unsigned char *)(r->buf + r->pos - (n)))
#define PUSH(o) do { PyObject *_o = (o); if (!_o) return -1; if (push(r, _o) < 0) return -1; } while (0)

/* One opcode. 0 go on, 2 STOP, 1 decline, -1 error. */
static int step(Reader *r) {
    NEED(1);
    unsigned char op = *TAKE(1);
    const unsigned char *p;
    Py_ssize_t n, m;
    switch (op) {
    case 0x80: NEED(1); p = TAKE(1); return (p[0] >= 2 && p[0] <= 5) ? 0 : 1;  /* PROTO */
    case 0x95: NEED(8); TAKE(8); return 0;  /* FRAME: a hint only */
    case '.': return 2;
    case '(':
        if (r->mp == r->mcap) {
            Py_ssize_t cap = r->mcap ? r->mcap * 2 : 64;
            Py_ssize_t *q = PyMem_Realloc(r->marks, cap * sizeof(Py_ssize_t));
            if (!q) { PyErr_NoMemory(); return -1; }
            r->marks = q;
            r->mcap = cap;
        }
        r->marks[r->mp++] = r->sp;
        return 0;
    case '}':
        if (r->trace && r->trace_pos < r->sp && r->stack[r->trace_pos] == (PyObject *)r->trace &&
            top_mark(r) <= r->trace_pos + 1 &&
            (r->stack[r->sp - 1] == ENTRY || r->sp - 1 == r->trace_pos)) {
            if (r->stack[r->sp - 1] == ENTRY && r->entry_pos != r->sp - 1) return 1;
            int ok = finish_row(r);
            if (ok) return ok;
            Trace *t = r->trace;
            if (t->n == t->cap && trace_grow(t) < 0) return -1;
            r->row = t->n++;
            r->row_code = 0;
            if (push(r, ENTRY) < 0) return -1;
            r->entry_pos = r->sp - 1;
            ok = fast_entry(r);
            return ok > 0 ? 0 : ok;
        }
        PUSH(PyDict_New());
        return 0;
    case ']':
        if (trace_context(r)) {
            if (r->trace) {
                int ok = finish_row(r);
                if (ok) return ok;
                trace_trim(r->trace);
            }
            Trace *t = trace_new();
            if (!t) return -1;
            vcache_clear(r);
            if (push(r, (PyObject *)t) < 0) return -1;
            r->trace = t;
            r->trace_pos = r->sp - 1;
            r->entry_pos = -1;
            r->traces_made++;
            return 0;
        }
        PUSH(PyList_New(0));
        return 0;
    case ')': PUSH(PyTuple_New(0)); return 0;
    case 'N': Py_INCREF(Py_None); PUSH(Py_None); return 0;
    case 0x88: Py_INCREF(Py_True); PUSH(Py_True); return 0;
    case 0x89: Py_INCREF(Py_False); PUSH(Py_False); return 0;
    case 'J': NEED(4); p = TAKE(4); PUSH(PyLong_FromLong((int32_t)(uint32_t)le(p, 4))); return 0;
    case 'K': NEED(1); p = TAKE(1); PUSH(PyLong_FromLong(p[0])); return 0;
    case 'M': NEED(2); p = TAKE(2); PUSH(PyLong_FromLong((long)le(p, 2))); return 0;
    case 0x8a:  /* LONG1 */
        NEED(1); n = *TAKE(1);
        if (n > 8) return 1;
        NEED(n); p = TAKE(n);
        if (n == 0) { PUSH(PyLong_FromLong(0)); return 0; }
        {
            uint64_t v = (uint64_t)le(p, (int)n);
            if (n < 8 && (p[n - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * n);
            PUSH(PyLong_FromLongLong((int64_t)v));
        }
        return 0;
    case 'G': {
        NEED(8); p = TAKE(8);
        uint64_t v = 0;
        for (int k = 0; k < 8; k++) v = (v << 8) | p[k];
        double x;
        memcpy(&x, &v, 8);
        PUSH(PyFloat_FromDouble(x));
        return 0;
    }
    case 0x8c: NEED(1); n = *TAKE(1); goto unicode;
    case 'X': NEED(4); n = (Py_ssize_t)(uint32_t)le(TAKE(4), 4); goto unicode;
    case 0x8d: NEED(8); { uint64_t v = (uint64_t)le(TAKE(8), 8); if (v > MAX_ITEM) return 1; n = (Py_ssize_t)v; } goto unicode;
    unicode:
        NEED(n); p = TAKE(n);
        {
            PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "surrogatepass");
            if (!s) { PyErr_Clear(); return 1; }
            PUSH(s);
        }
        return 0;
    case 'C': NEED(1); n = *TAKE(1); goto bytes;
    case 'B': NEED(4); n = (Py_ssize_t)(uint32_t)le(TAKE(4), 4); goto bytes;
    case 0x8e: NEED(8); { uint64_t v = (uint64_t)le(TAKE(8), 8); if (v > MAX_ITEM) return 1; n = (Py_ssize_t)v; } goto bytes;
    bytes:
        NEED(n); p = TAKE(n);
        PUSH(PyBytes_FromStringAndSize((const char *)p, n));
        return 0;
    case 0x94: return memo_put(r, r->memo_len);
    case 'q': NEED(1); return memo_put(r, *TAKE(1));
    case 'r': NEED(4); return memo_put(r, (Py_ssize_t)(uint32_t)le(TAKE(4), 4));
    case 'h': NEED(1); return memo_get(r, *TAKE(1));
    case 'j': NEED(4); return memo_get(r, (Py_ssize_t)(uint32_t)le(TAKE(4), 4));
    case 0x85: case 0x86: case 0x87: {
        m = op - 0x84;
        if (r->sp - m < (r->mp ? top_mark(r) : 0)) return 1;
        PyObject *t = tuple_from(r, r->sp - m);
        if (!t) return PyErr_Occurred() ? -1 : 1;
        PUSH(t);
        return 0;
    }
    case 't': {
        if (!r->mp) return 1;
        PyObject *t = tuple_from(r, r->marks[--r->mp]);
        if (!t) return PyErr_Occurred() ? -1 : 1;
        PUSH(t);
        return 0;
    }
    case 'a':
        if (r->sp - 2 < (r->mp ? top_mark(r) : 0)) return 1;
        return append_items(r, r->sp - 2, r->sp - 1);
    case 'e':
        if (!r->mp) return 1;
        m = r->marks[--r->mp];
        return append_items(r, m - 1, m);
    case 's':
        if (r->sp - 3 < (r->mp ? top_mark(r) : 0)) return 1;
        return set_items(r, r->sp - 3, r->sp - 2);
    case 'u':
        if (!r->mp) return 1;
        m = r->marks[--r->mp];
        return set_items(r, m - 1, m);
    default:
        return 1;
    }
}

static void reader_clear(Reader *r) {
    vcache_clear(r);
    for (int k = 0; k < r->nk; k++) Py_CLEAR(r->kkey[k]);
    while (r->sp) drop(r->stack[--r->sp]);
    for (Py_ssize_t k = 0; k < r->memo_cap; k++) {
        PyMem_Free(r->memo_ids[k]);
        if (!r->memo[k]) continue;
        for (Py_ssize_t j = 0; j < PAGE; j++) Py_XDECREF(r->memo[k][j]);
        PyMem_Free(r->memo[k]);
    }
    PyMem_Free(r->stack);
    PyMem_Free(r->marks);
    PyMem_Free(r->memo);
    PyMem_Free(r->memo_ids);
    PyMem_Free(r->buf);
    Py_XDECREF(r->row_dict);
    Py_XDECREF(r->read);
}

/* The number of Trace objects among root['device_traces']: each made must sit there. */
static Py_ssize_t traces_in_place(PyObject *root) {
    if (!PyDict_CheckExact(root)) return -1;
    PyObject *traces = PyDict_GetItemString(root, "device_traces");
    if (!traces || !PyList_CheckExact(traces)) return -1;
    Py_ssize_t found = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(traces); k++)
        found += PyObject_TypeCheck(PyList_GET_ITEM(traces, k), &TraceType);
    return found;
}

/* read(stream) -> (root object, bytes read) or None when the accelerator declines the file. */
static PyObject *fastread_read(PyObject *self, PyObject *stream) {
    Reader r;
    memset(&r, 0, sizeof r);
    r.trace_pos = r.entry_pos = r.row = -1;
    r.read = PyObject_GetAttrString(stream, "read");
    if (!r.read) return NULL;
    int rc = 0;
    while ((rc = step(&r)) == 0) {
    }
    PyObject *result = NULL;
    if (rc == 2 && r.sp == 1 && r.mp == 0 && r.stack[0] != ENTRY && finish_row(&r) == 0) {
        PyObject *root = r.stack[0];
        if (r.traces_made == 0 || traces_in_place(root) == r.traces_made) {
            trace_trim(r.trace);
            /* The pure path reads the stream to its end too (nothing may follow STOP unread). */
            result = Py_BuildValue("(OL)", root, r.consumed + r.pos);
        }
    }
    if (rc == -1 && !result) {
        if (r.stream_error) {
            reader_clear(&r);
            return NULL;  /* the stream's own InputError (a bomb, a file growing), as the pure path meets it */
        }
        PyErr_Clear();  /* what the data made fail (an unhashable key, memory): the pure path says why */
    }
    reader_clear(&r);
    if (!result) Py_RETURN_NONE;
    return result;
}

/* identities(list) -> bytes: the addresses of the list's items, in order. Two lists give equal
   bytes exactly when they hold the same objects, so a key for "this sequence of objects" costs one
   copy of the item array, not an int object per item (a hostile file repeats a 20,000-frame list
   as thousands of lists of the same memoized frames). */
static PyObject *fastread_identities(PyObject *self, PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "identities() takes a list");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)((PyListObject *)list)->ob_item,
                                     PyList_GET_SIZE(list) * (Py_ssize_t)sizeof(PyObject *));
}

static PyMethodDef module_methods[] = {
    {"read", fastread_read, METH_O, "(root, bytes taken) of a snapshot pickle stream, or None to decline"},
    {"identities", fastread_identities, METH_O, "bytes naming the objects a list holds, in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "memdiff._fastread",
                                    "Columnar reader of snapshot pickles (optional accelerator).", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__fastread(void) {
    if (PyType_Ready(&TraceType) < 0) return NULL;
    for (int k = 0; k < NSLOT; k++) {
        slot_strs[k] = PyUnicode_InternFromString(slot_names[k]);
        if (!slot_strs[k]) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TraceType);
    if (PyModule_AddObject(m, "Trace", (PyObject *)&TraceType) < 0) return NULL;
    return m;
}
