/* The rings' per-frame hot paths in C: IngressCore.write() and IngressCore.read_into() for the ingress ring,
 * EgressCore.read_chunk() for the egress ring's consumer (the media side's one read per 20 ms frame).
 *
 * Why this exists: benchmarks/ring_ipc.py measured the pure-Python write at ~2-4 us and read at ~2 us per 20 ms
 * frame on our CI VM (interpreter overhead: attribute loads, memoryview casts and slices, each a few hundred ns),
 * which made a shared-memory hand-off only ~4x cheaper than base64 JSON over a WebSocket. The same protocol in C
 * is one call of a few hundred ns. engine_bridge/ring.py stays the reference: it defines the layout, creates and
 * checks the segment, and keeps a pure-Python path that is used when this module is not built (no compiler) and
 * that the tests run against the same cases.
 *
 * Layout (see ring.py): a 512-byte header of little-endian u64 words, then `capacity` data bytes (a power of
 * two). Word 8 (byte 64) is the write cursor, word 16 (byte 128) the read cursor, word 24 (byte 192) the egress
 * epoch, word 33 (byte 264) the overrun counter, word 34 (byte 272) the egress stale-chunk counter. An egress chunk
 * is a 16-byte tag (epoch, turn_id, seq, nsamples: little-endian u32) followed by its PCM16, wrapping like any
 * bytes. Cursors are monotonic byte counts. The producer copies data and then publishes the write cursor with
 * release ordering; the consumer loads it with acquire ordering, copies, then publishes the read cursor with
 * release ordering; the producer loads the read cursor with acquire ordering before it reuses space.
 *
 * The core holds a buffer export of the segment's memoryview; IngressCore.release() must be called before the
 * segment is closed (ring.py does it in close()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 512
#define W_WRITE 8
#define W_READ 16
#define W_EPOCH 24
#define W_OVERRUNS 33
#define W_STALE 34
#define CHUNK_HEADER_BYTES 16

typedef struct {
    PyObject_HEAD
    Py_buffer view;        /* the whole segment, writable */
    int has_view;
    uint64_t *words;       /* header as u64 words */
    unsigned char *data;   /* data[capacity] */
    uint64_t capacity;     /* bytes, a power of two */
    PyObject *name;        /* segment name, for error messages */
    PyObject *ring_error;  /* the RingError class of ring.py */
    PyObject *tag_type;    /* EgressCore: ring.py's ChunkInfo, a tuple subclass built here without Python code */
} RingCore;

static int
core_check_open(RingCore *self)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "ring is closed");
        return -1;
    }
    return 0;
}

/* Get PCM16 as a 1-D C-contiguous buffer: audio to write may be int16 ('h') or bytes ('B', 'b', 'c') of even
 * length; a destination to read into must be int16 (writable), as ring.py's Python path requires. */
static int
get_pcm_buffer(PyObject *obj, Py_buffer *buf, int writable, const char *ring)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, buf, flags) < 0) {
        return -1;
    }
    const char *f = buf->format ? buf->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    int is_int16 = (f[0] == 'h' && f[1] == '\0' && buf->itemsize == 2);
    int is_bytes = ((f[0] == 'B' || f[0] == 'b' || f[0] == 'c') && f[1] == '\0' && buf->itemsize == 1);
    if (buf->ndim > 1 || !(is_int16 || (is_bytes && !writable))) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_TypeError, writable ? "%s audio must be read into a 1-D int16 array"
                                               : "%s audio must be 1-D int16 PCM (an int16 array or bytes)",
                     ring);
        return -1;
    }
    if (buf->len & 1) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_ValueError, "%s audio must be whole int16 samples (an even byte count)", ring);
        return -1;
    }
    return 0;
}

/* Take the segment view both cores hold (they differ only in their methods); -1 with an exception set on error. */
static int
ring_core_attach(RingCore *self, PyObject *segment, PyObject *name, PyObject *ring_error)
{
    if (!PyType_Check(ring_error) || !PyType_IsSubtype((PyTypeObject *)ring_error, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "ring_error must be an exception class");
        return -1;
    }
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "the ring core is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(segment, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    self->has_view = 1;
    if (self->view.len < HEADER_BYTES || ((uintptr_t)self->view.buf & 7u)) {
        PyErr_SetString(PyExc_ValueError, "segment too small or not 8-byte aligned");
        return -1;
    }
    self->words = (uint64_t *)self->view.buf;
    self->data = (unsigned char *)self->view.buf + HEADER_BYTES;
    /* The static header (byte 16: capacity u64) was validated by ring.py; check the bits this code relies on. */
    uint64_t cap;
    memcpy(&cap, (unsigned char *)self->view.buf + 16, sizeof cap);
    if (cap == 0 || (cap & (cap - 1)) || cap > (uint64_t)(self->view.len - HEADER_BYTES)) {
        PyErr_SetString(PyExc_ValueError, "segment has a bad capacity");
        return -1;
    }
    self->capacity = cap;
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    Py_INCREF(ring_error);
    Py_XSETREF(self->ring_error, ring_error);
    return 0;
}

static int
RingCore_init(RingCore *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"segment", "name", "ring_error", NULL};
    PyObject *segment, *name, *ring_error;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", kwlist, &segment, &name, &ring_error)) {
        return -1;
    }
    return ring_core_attach(self, segment, name, ring_error);
}

static void
core_release_view(RingCore *self)
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        self->words = NULL;
        self->data = NULL;
    }
}

static void
RingCore_dealloc(RingCore *self)
{
    core_release_view(self);
    Py_XDECREF(self->name);
    Py_XDECREF(self->ring_error);
    Py_XDECREF(self->tag_type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The byte copies with wraparound, shared by write and read_into: `pos` is a monotonic cursor, `n` <= capacity. */
static inline void
ring_copy_in(RingCore *self, uint64_t pos, const unsigned char *src, uint64_t n)
{
    uint64_t start = pos & (self->capacity - 1);
    uint64_t first = self->capacity - start < n ? self->capacity - start : n;
    memcpy(self->data + start, src, first);
    memcpy(self->data, src + first, n - first);
}

static inline void
ring_copy_out(RingCore *self, uint64_t pos, unsigned char *dst, uint64_t n)
{
    uint64_t start = pos & (self->capacity - 1);
    uint64_t first = self->capacity - start < n ? self->capacity - start : n;
    memcpy(dst, self->data + start, first);
    memcpy(dst + first, self->data, n - first);
}

/* Bytes written and not yet read, or -1 (RingError set) when the cursors contradict each other. */
static inline int64_t
ring_used(RingCore *self, uint64_t w, uint64_t r)
{
    if (r > w || w - r > self->capacity) {
        PyErr_Format(self->ring_error, "ring %S invariant broken: write=%llu read=%llu capacity=%llu",
                     self->name, (unsigned long long)w, (unsigned long long)r,
                     (unsigned long long)self->capacity);
        return -1;
    }
    return (int64_t)(w - r);
}

PyDoc_STRVAR(write_doc,
"write(pcm) -> bool\n\n"
"Append PCM16 (an int16 array or bytes of even length). Returns False and counts an overrun when the consumer\n"
"has not made room; the ring is never overwritten.");

static PyObject *
IngressCore_write(RingCore *self, PyObject *pcm)
{
    if (core_check_open(self) < 0) {
        return NULL;
    }
    Py_buffer src;
    if (get_pcm_buffer(pcm, &src, 0, "ingress") < 0) {
        return NULL;
    }
    uint64_t n = (uint64_t)src.len;
    uint64_t *words = self->words;
    uint64_t w = __atomic_load_n(&words[W_WRITE], __ATOMIC_RELAXED); /* only we write it */
    int64_t used = ring_used(self, w, __atomic_load_n(&words[W_READ], __ATOMIC_ACQUIRE));
    if (used < 0 || self->capacity - (uint64_t)used < n) {
        PyBuffer_Release(&src);
        if (used < 0) {
            return NULL;
        }
        if (n > self->capacity) {
            PyErr_Format(PyExc_ValueError, "frame of %llu bytes is larger than the ring (%llu bytes)",
                         (unsigned long long)n, (unsigned long long)self->capacity);
            return NULL;
        }
        __atomic_store_n(&words[W_OVERRUNS], words[W_OVERRUNS] + 1, __ATOMIC_RELAXED);
        Py_RETURN_FALSE;
    }
    ring_copy_in(self, w, (const unsigned char *)src.buf, n);
    PyBuffer_Release(&src);
    __atomic_store_n(&words[W_WRITE], w + n, __ATOMIC_RELEASE); /* publish after the copy */
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(read_into_doc,
"read_into(out) -> int\n\n"
"Copy up to len(out) samples into out (a writable 1-D int16 array); returns how many were copied.");

static PyObject *
IngressCore_read_into(RingCore *self, PyObject *out)
{
    if (core_check_open(self) < 0) {
        return NULL;
    }
    Py_buffer dst;
    if (get_pcm_buffer(out, &dst, 1, "ingress") < 0) {
        return NULL;
    }
    uint64_t *words = self->words;
    uint64_t r = __atomic_load_n(&words[W_READ], __ATOMIC_RELAXED); /* only we write it */
    int64_t used = ring_used(self, __atomic_load_n(&words[W_WRITE], __ATOMIC_ACQUIRE), r);
    if (used < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    uint64_t n = (uint64_t)used < (uint64_t)dst.len ? (uint64_t)used : (uint64_t)dst.len;
    n &= ~(uint64_t)1;
    if (n) {
        ring_copy_out(self, r, (unsigned char *)dst.buf, n);
        __atomic_store_n(&words[W_READ], r + n, __ATOMIC_RELEASE); /* publish after the copy */
    }
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLongLong(n / 2);
}

static PyObject *
RingCore_release(RingCore *self, PyObject *Py_UNUSED(ignored))
{
    core_release_view(self);
    Py_RETURN_NONE;
}

static PyMethodDef IngressCore_methods[] = {
    {"write", (PyCFunction)IngressCore_write, METH_O, write_doc},
    {"read_into", (PyCFunction)IngressCore_read_into, METH_O, read_into_doc},
    {"release", (PyCFunction)RingCore_release, METH_NOARGS,
     "Drop the buffer export of the segment (before the segment is closed). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IngressCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engine_bridge._ringcore.IngressCore",
    .tp_doc = "The ingress ring's write/read_into over a segment laid out by engine_bridge.ring.",
    .tp_basicsize = sizeof(RingCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RingCore_init,
    .tp_dealloc = (destructor)RingCore_dealloc,
    .tp_methods = IngressCore_methods,
};

PyDoc_STRVAR(read_chunk_doc,
"read_chunk(out) -> (epoch, turn_id, seq, nsamples) | None\n\n"
"Copy the next current-epoch chunk into out (a writable 1-D int16 array large enough for any chunk). Chunks of an\n"
"older epoch than the header's are skipped and counted as stale. None when nothing current is pending.");

static PyObject *
EgressCore_read_chunk(RingCore *self, PyObject *out)
{
    if (core_check_open(self) < 0) {
        return NULL;
    }
    Py_buffer dst;
    if (get_pcm_buffer(out, &dst, 1, "egress") < 0) {
        return NULL;
    }
    uint64_t *words = self->words;
    uint64_t epoch_now = __atomic_load_n(&words[W_EPOCH], __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t r = __atomic_load_n(&words[W_READ], __ATOMIC_RELAXED); /* only we write it */
        uint64_t w = __atomic_load_n(&words[W_WRITE], __ATOMIC_ACQUIRE);
        int64_t used = ring_used(self, w, r);
        if (used < 0) {
            PyBuffer_Release(&dst);
            return NULL;
        }
        if (used < CHUNK_HEADER_BYTES) {
            PyBuffer_Release(&dst);
            Py_RETURN_NONE;
        }
        unsigned char hdr[CHUNK_HEADER_BYTES];
        ring_copy_out(self, r, hdr, CHUNK_HEADER_BYTES);
        uint32_t tag[4];
        for (int i = 0; i < 4; i++) { /* little-endian on any host */
            tag[i] = (uint32_t)hdr[4 * i] | (uint32_t)hdr[4 * i + 1] << 8 | (uint32_t)hdr[4 * i + 2] << 16 |
                     (uint32_t)hdr[4 * i + 3] << 24;
        }
        uint64_t nbytes = 2 * (uint64_t)tag[3];
        uint64_t end = r + CHUNK_HEADER_BYTES + nbytes;
        if (end > w) {
            PyBuffer_Release(&dst);
            PyErr_Format(self->ring_error, "egress ring %S: chunk runs past the write cursor", self->name);
            return NULL;
        }
        if (tag[0] < epoch_now) {
            __atomic_store_n(&words[W_STALE], words[W_STALE] + 1, __ATOMIC_RELAXED);
            __atomic_store_n(&words[W_READ], end, __ATOMIC_RELEASE);
            continue;
        }
        if (nbytes > (uint64_t)dst.len) {
            PyBuffer_Release(&dst);
            PyErr_Format(PyExc_ValueError, "output buffer holds %zd samples, chunk has %u", dst.len / 2,
                         (unsigned)tag[3]);
            return NULL;
        }
        ring_copy_out(self, r + CHUNK_HEADER_BYTES, (unsigned char *)dst.buf, nbytes);
        PyBuffer_Release(&dst);
        __atomic_store_n(&words[W_READ], end, __ATOMIC_RELEASE); /* publish after the copy */
        PyTypeObject *tag_type = (PyTypeObject *)self->tag_type;
        PyObject *info = tag_type->tp_alloc(tag_type, 4);
        if (info == NULL) {
            return NULL;
        }
        for (int i = 0; i < 4; i++) {
            PyObject *v = PyLong_FromUnsignedLong(tag[i]);
            if (v == NULL) {
                Py_DECREF(info);
                return NULL;
            }
            PyTuple_SET_ITEM(info, i, v);
        }
        return info;
    }
}

static int
EgressCore_init(RingCore *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"segment", "name", "ring_error", "tag_type", NULL};
    PyObject *segment, *name, *ring_error, *tag_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO", kwlist, &segment, &name, &ring_error, &tag_type)) {
        return -1;
    }
    if (!PyType_Check(tag_type) || !PyType_IsSubtype((PyTypeObject *)tag_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "tag_type must be a tuple subclass (a NamedTuple)");
        return -1;
    }
    if (ring_core_attach(self, segment, name, ring_error) < 0) {
        return -1;
    }
    Py_INCREF(tag_type);
    Py_XSETREF(self->tag_type, tag_type);
    return 0;
}

static PyMethodDef EgressCore_methods[] = {
    {"read_chunk", (PyCFunction)EgressCore_read_chunk, METH_O, read_chunk_doc},
    {"release", (PyCFunction)RingCore_release, METH_NOARGS,
     "Drop the buffer export of the segment (before the segment is closed). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EgressCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engine_bridge._ringcore.EgressCore",
    .tp_doc = "The egress ring's consumer read_chunk over a segment laid out by engine_bridge.ring.",
    .tp_basicsize = sizeof(RingCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EgressCore_init,
    .tp_dealloc = (destructor)RingCore_dealloc,
    .tp_methods = EgressCore_methods,
};

static struct PyModuleDef ringcore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "engine_bridge._ringcore",
    .m_doc = "C hot paths of engine_bridge.ring's rings (optional; ring.py falls back to Python).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__ringcore(void)
{
    PyObject *m = PyModule_Create(&ringcore_module);
    if (m == NULL) {
        return NULL;
    }
    /* PyModule_AddType readies the type and adds it under its short name ("IngressCore", "EgressCore"). */
    if (PyModule_AddType(m, &IngressCoreType) < 0 || PyModule_AddType(m, &EgressCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
