/* The rings' per-frame hot paths in C: IngressCore.write() and IngressCore.read_into() for the ingress ring,
 * EgressCore.read_chunk() for the egress ring's consumer (the media side's one read per 20 ms frame), and
 * EgressCore.play(): the consumer's whole steady-state frame (see PlayCursor below).
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
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 512
#define W_WRITE 8
#define W_READ 16
#define W_EPOCH 24
#define W_ATTENUATION 25
#define W_OVERRUNS 33
#define W_STALE 34
#define W_PLAYED_TURN 40
#define W_PLAYED_SAMPLES 41
#define W_PLAYED_EPOCH 42
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

/* The tag of the chunk at cursor r (the caller checked 16 bytes are there). */
static inline void
egress_peek_tag(RingCore *self, uint64_t r, uint32_t tag[4])
{
    unsigned char hdr[CHUNK_HEADER_BYTES];
    ring_copy_out(self, r, hdr, CHUNK_HEADER_BYTES);
    for (int i = 0; i < 4; i++) { /* little-endian on any host */
        tag[i] = (uint32_t)hdr[4 * i] | (uint32_t)hdr[4 * i + 1] << 8 | (uint32_t)hdr[4 * i + 2] << 16 |
                 (uint32_t)hdr[4 * i + 3] << 24;
    }
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
        uint32_t tag[4];
        egress_peek_tag(self, r, tag);
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


/* ---- PlayCursor and EgressCore.play: the media side's steady-state frame in one call ----------------------------
 *
 * media/egress.py's EgressPlayer produces one 20 ms frame per call: it reads the gain and epoch words, fills the
 * frame from the chunk it holds and then from the ring, counts what played against the turn that played it and
 * reports that playout to the engine. Almost every frame of a call is the same case: unity gain, the same epoch as
 * the previous frame, and only more audio of the turn that played last (or nothing). benchmarks/plugin_paths.py
 * measured that frame at ~25 us of interpreter time per call on the CI VM (cold caches between 20 ms wake-ups),
 * where the work is two memcpys. play() does exactly that case in C and declines (-1, nothing changed) anything
 * else, which the Python player then does itself: an epoch change, a gain other than unity (or the ramp after
 * one), a new turn, a stale chunk, a corrupt chunk, a chunk buffer too small. So the Python player stays the one
 * reference for every decision, and this path is a shortcut through its commonest one.
 *
 * PlayCursor holds the consumer's position: the held chunk (its buffer, read position, length, epoch and turn),
 * the epoch the player last saw, the gain the previous frame ended at, and the turn that played last:
 * its (epoch, turn_id) and its record, whose `played` attribute play() advances. Its fields are plain attributes
 * the Python player reads and writes on its own path (ring.py has an identical pure-Python class for builds
 * without this module, where play() always declines).
 */
typedef struct {
    PyObject_HEAD
    PyObject *chunk;          /* int16 array the held chunk was copied into */
    long long pos;            /* samples of the held chunk already played */
    long long len;            /* samples in the held chunk */
    long long chunk_epoch;
    long long chunk_turn;
    long long epoch_seen;     /* the epoch word at the previous frame (-1 before the first) */
    double gain;              /* gain applied at the end of the previous frame (a ramp starts from it) */
    long long last_epoch;     /* the turn that played last ... */
    long long last_turn;
    PyObject *last;           /* ... and its record (None when there is none): `played` is advanced here */
} PlayCursor;

static PyMemberDef PlayCursor_members[] = {
    {"chunk", T_OBJECT_EX, offsetof(PlayCursor, chunk), 0, "int16 buffer holding the current chunk"},
    {"pos", T_LONGLONG, offsetof(PlayCursor, pos), 0, "samples of the held chunk already played"},
    {"len", T_LONGLONG, offsetof(PlayCursor, len), 0, "samples in the held chunk"},
    {"chunk_epoch", T_LONGLONG, offsetof(PlayCursor, chunk_epoch), 0, "epoch of the held chunk"},
    {"chunk_turn", T_LONGLONG, offsetof(PlayCursor, chunk_turn), 0, "turn of the held chunk"},
    {"epoch_seen", T_LONGLONG, offsetof(PlayCursor, epoch_seen), 0, "epoch word at the previous frame"},
    {"gain", T_DOUBLE, offsetof(PlayCursor, gain), 0, "gain applied at the end of the previous frame"},
    {"last_epoch", T_LONGLONG, offsetof(PlayCursor, last_epoch), 0, "epoch of the turn that played last"},
    {"last_turn", T_LONGLONG, offsetof(PlayCursor, last_turn), 0, "turn_id of the turn that played last"},
    {"last", T_OBJECT_EX, offsetof(PlayCursor, last), 0, "record of the turn that played last, or None"},
    {NULL, 0, 0, 0, NULL},
};

static int
PlayCursor_init(PlayCursor *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"chunk", NULL};
    PyObject *chunk;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &chunk)) {
        return -1;
    }
    Py_INCREF(chunk);
    Py_XSETREF(self->chunk, chunk);
    Py_INCREF(Py_None);
    Py_XSETREF(self->last, Py_None);
    self->pos = self->len = self->chunk_epoch = self->chunk_turn = 0;
    self->epoch_seen = -1;
    self->gain = 1.0;
    self->last_epoch = self->last_turn = 0;
    return 0;
}

static void
PlayCursor_dealloc(PlayCursor *self)
{
    Py_XDECREF(self->chunk);
    Py_XDECREF(self->last);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject PlayCursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engine_bridge._ringcore.PlayCursor",
    .tp_doc = "The egress consumer's position: held chunk, epoch seen, gain state and the turn that played last.",
    .tp_basicsize = sizeof(PlayCursor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PlayCursor_init,
    .tp_dealloc = (destructor)PlayCursor_dealloc,
    .tp_members = PlayCursor_members,
};

PyDoc_STRVAR(play_doc,
"play(work, cursor) -> int\n\n"
"Fill work (a writable 1-D int16 array: one frame at the ring's rate) for the steady state: unity gain, the epoch\n"
"the cursor saw, and only audio of the turn that played last. Returns the samples of model audio written (the rest\n"
"is zeroed), advances the cursor, the turn record's `played` and the playout words. Returns -1 and changes nothing\n"
"when the frame is anything else; the caller then produces it on its general path.");

static PyObject *
EgressCore_play(RingCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *played_name = NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "play(work, cursor) takes 2 arguments");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[1], &PlayCursorType)) {
        PyErr_SetString(PyExc_TypeError, "play() needs a PlayCursor");
        return NULL;
    }
    PlayCursor *cur = (PlayCursor *)args[1];
    uint64_t *words = self->words;
    /* The gain before the epoch, as the Python player reads them (media/egress.py explains the order). */
    if (cur->chunk == NULL || cur->last == NULL) { /* deleted attributes */
        PyErr_SetString(PyExc_AttributeError, "PlayCursor.chunk and PlayCursor.last must be set");
        return NULL;
    }
    if (!self->has_view || cur->gain != 1.0 || cur->last == Py_None ||
        __atomic_load_n(&words[W_ATTENUATION], __ATOMIC_ACQUIRE) != 0) {
        return PyLong_FromLong(-1);
    }
    uint64_t epoch_now = __atomic_load_n(&words[W_EPOCH], __ATOMIC_ACQUIRE);
    if ((long long)epoch_now != cur->epoch_seen) {
        return PyLong_FromLong(-1);
    }
    if (played_name == NULL && (played_name = PyUnicode_InternFromString("played")) == NULL) {
        return NULL;
    }
    Py_buffer work, chunk;
    if (get_pcm_buffer(args[0], &work, 1, "egress") < 0) {
        return NULL;
    }
    if (get_pcm_buffer(cur->chunk, &chunk, 1, "egress") < 0) {
        PyBuffer_Release(&work);
        return NULL;
    }
    int16_t *out = (int16_t *)work.buf;
    int16_t *held = (int16_t *)chunk.buf;
    uint64_t need = (uint64_t)work.len / 2, room = (uint64_t)chunk.len / 2;
    uint64_t r0 = __atomic_load_n(&words[W_READ], __ATOMIC_RELAXED); /* only we write it */
    uint64_t w = __atomic_load_n(&words[W_WRITE], __ATOMIC_ACQUIRE);
    long long result = -1;
    PyObject *played = NULL;

    /* Plan without consuming: every sample the frame takes must be the last-played turn's. */
    uint64_t have = cur->pos < cur->len ? (uint64_t)(cur->len - cur->pos) : 0;
    if (have && (cur->chunk_epoch != cur->last_epoch || cur->chunk_turn != cur->last_turn)) {
        goto done;
    }
    if (r0 > w || w - r0 > self->capacity) {
        goto done; /* broken cursors: the Python path raises the RingError */
    }
    uint64_t r = r0;
    while (have < need && w - r >= CHUNK_HEADER_BYTES) {
        uint32_t tag[4];
        egress_peek_tag(self, r, tag);
        uint64_t end = r + CHUNK_HEADER_BYTES + 2 * (uint64_t)tag[3];
        if (end > w || tag[3] > room || tag[0] < epoch_now || (long long)tag[0] != cur->last_epoch ||
            (long long)tag[1] != cur->last_turn) {
            goto done; /* corrupt, too large, stale or another turn: the general path's business */
        }
        have += tag[3];
        r = end;
    }
    /* A barge-in between the checks and here must not let this frame play what it made stale. */
    if (__atomic_load_n(&words[W_EPOCH], __ATOMIC_ACQUIRE) != epoch_now) {
        goto done;
    }
    played = PyObject_GetAttr(cur->last, played_name);
    if (played == NULL) {
        result = -2;
        goto done;
    }
    long long played_before = PyLong_AsLongLong(played);
    Py_DECREF(played);
    if (played_before == -1 && PyErr_Occurred()) {
        result = -2;
        goto done;
    }

    /* Commit: the held remainder, then the planned chunks, each copied whole into the chunk buffer as the Python
     * path does (a chunk's tail stays held for the next frame). */
    uint64_t filled = 0;
    r = r0;
    for (;;) {
        if (cur->pos < cur->len) {
            uint64_t take = (uint64_t)(cur->len - cur->pos);
            if (take > need - filled) {
                take = need - filled;
            }
            memcpy(out + filled, held + cur->pos, take * 2);
            cur->pos += (long long)take;
            filled += take;
        }
        if (filled >= need || w - r < CHUNK_HEADER_BYTES) {
            break;
        }
        uint32_t tag[4];
        egress_peek_tag(self, r, tag);
        uint64_t nbytes = 2 * (uint64_t)tag[3];
        ring_copy_out(self, r + CHUNK_HEADER_BYTES, (unsigned char *)held, nbytes);
        r += CHUNK_HEADER_BYTES + nbytes;
        __atomic_store_n(&words[W_READ], r, __ATOMIC_RELEASE); /* publish after the copy */
        cur->pos = 0;
        cur->len = tag[3];
        cur->chunk_epoch = tag[0];
        cur->chunk_turn = tag[1];
    }
    if (filled < need) {
        memset(out + filled, 0, (need - filled) * 2);
    }
    if (filled) {
        long long total = played_before + (long long)filled;
        PyObject *v = PyLong_FromLongLong(total);
        if (v == NULL || PyObject_SetAttr(cur->last, played_name, v) < 0) {
            Py_XDECREF(v);
            result = -2;
            goto done;
        }
        Py_DECREF(v);
        __atomic_store_n(&words[W_PLAYED_EPOCH], (uint64_t)cur->last_epoch, __ATOMIC_RELAXED);
        __atomic_store_n(&words[W_PLAYED_TURN], (uint64_t)cur->last_turn, __ATOMIC_RELAXED);
        __atomic_store_n(&words[W_PLAYED_SAMPLES], (uint64_t)total, __ATOMIC_RELEASE);
    }
    result = (long long)filled;
done:
    PyBuffer_Release(&work);
    PyBuffer_Release(&chunk);
    if (result == -2) {
        return NULL;
    }
    return PyLong_FromLongLong(result);
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
    {"play", (PyCFunction)(void (*)(void))EgressCore_play, METH_FASTCALL, play_doc},
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
    if (PyModule_AddType(m, &IngressCoreType) < 0 || PyModule_AddType(m, &EgressCoreType) < 0 ||
        PyModule_AddType(m, &PlayCursorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
