/* The polyphase resampler's per-frame work in C: PolyphaseCore.process().
 *
 * Why this exists: media/resample.py's numpy path runs L numpy convolutions per call, each over the whole input
 * (for 48 -> 16 kHz it computes three times the outputs it keeps), plus about ten numpy calls of set-up and
 * rounding. benchmarks/plugin_paths.py measured it as the largest single cost of the LiveKit plugin's co-located
 * frame (~50 us per 20 ms frame on a quiet CI VM, ~200 us beside another busy process: cold caches after every
 * sleep). Here the same filter is one call that computes only the outputs it returns.
 *
 * media/resample.py stays the reference: it designs the filter, owns the plan (which phase and input offset each
 * output residue uses) and keeps the numpy path, used when this module is not built (no compiler); the tests run
 * both paths against the same cases (tests/test_media_resample.py).
 *
 * The filter, for output j = p*L + r (r = j mod L):  y[j] = sum_k bank[r][k] * xe[p*M + offset[r] + k]
 * where xe is the stream as float32 with (taps - 1) samples of history in front, and bank[r] is the phase filter
 * of residue r stored reversed (a convolution becomes a dot product over consecutive input). Input is consumed in
 * whole periods of M samples; a remainder below M waits in `pending` for the next call, so any chunking of one
 * stream gives the same output. Sums are float32 in eight lanes (two 4-float vectors), rounded half to even and clipped
 * to int16, as the numpy path does (the last bit may differ: the order of the additions does).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    int up, down, taps;
    float *bank;        /* [up][taps], each phase reversed */
    Py_ssize_t *offset; /* [up]: input offset of residue r's first output */
    float *xe;          /* history (taps - 1) + the period-aligned input of one call */
    Py_ssize_t xe_cap;  /* floats xe can hold */
    int16_t *pending;   /* [down]: input that does not fill a period yet */
    int npending;
} PolyphaseCore;

static void
PolyphaseCore_dealloc(PolyphaseCore *self)
{
    PyMem_Free(self->bank);
    PyMem_Free(self->offset);
    PyMem_Free(self->xe);
    PyMem_Free(self->pending);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A 1-D C-contiguous buffer of `itemsize`-byte items in format `fmt` ('h' int16 or 'f' float32). */
static int
get_typed_buffer(PyObject *obj, Py_buffer *buf, char fmt, Py_ssize_t itemsize, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, buf, flags) < 0) {
        return -1;
    }
    const char *f = buf->format ? buf->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if (buf->ndim > 1 || f[0] != fmt || f[1] != '\0' || buf->itemsize != itemsize) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D %s array", what, fmt == 'h' ? "int16" : "float32");
        return -1;
    }
    return 0;
}

static int
PolyphaseCore_init(PolyphaseCore *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"bank", "offsets", "up", "down", NULL};
    PyObject *bank_obj, *offsets_obj;
    int up, down;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOii", kwlist, &bank_obj, &offsets_obj, &up, &down)) {
        return -1;
    }
    if (self->bank != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PolyphaseCore is already initialised");
        return -1;
    }
    if (up < 1 || down < 1 || up > 64 || down > 64) {
        PyErr_SetString(PyExc_ValueError, "up and down must be in 1..64");
        return -1;
    }
    Py_buffer bank;
    if (get_typed_buffer(bank_obj, &bank, 'f', 4, 0, "bank") < 0) {
        return -1;
    }
    Py_ssize_t n = bank.len / 4;
    if (n == 0 || n % up) {
        PyBuffer_Release(&bank);
        PyErr_SetString(PyExc_ValueError, "bank must hold up * taps floats");
        return -1;
    }
    PyObject *offsets = PySequence_Fast(offsets_obj, "offsets must be a sequence of ints");
    if (offsets == NULL) {
        PyBuffer_Release(&bank);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(offsets) != up) {
        Py_DECREF(offsets);
        PyBuffer_Release(&bank);
        PyErr_SetString(PyExc_ValueError, "offsets must hold one int per output residue (up of them)");
        return -1;
    }
    self->up = up;
    self->down = down;
    self->taps = (int)(n / up);
    self->bank = PyMem_Malloc((size_t)n * sizeof(float));
    self->offset = PyMem_Malloc((size_t)up * sizeof(Py_ssize_t));
    self->pending = PyMem_Calloc((size_t)down, sizeof(int16_t));
    self->xe_cap = self->taps - 1 + 4096;
    self->xe = PyMem_Calloc((size_t)self->xe_cap, sizeof(float));
    if (!self->bank || !self->offset || !self->pending || !self->xe) {
        Py_DECREF(offsets);
        PyBuffer_Release(&bank);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->bank, bank.buf, (size_t)n * sizeof(float));
    PyBuffer_Release(&bank);
    for (int r = 0; r < up; r++) {
        Py_ssize_t q = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(offsets, r));
        if (q == -1 && PyErr_Occurred()) {
            Py_DECREF(offsets);
            return -1;
        }
        if (q < 0 || q >= down) {
            Py_DECREF(offsets);
            PyErr_SetString(PyExc_ValueError, "each offset must be in 0..down-1");
            return -1;
        }
        self->offset[r] = q;
    }
    Py_DECREF(offsets);
    self->npending = 0;
    return 0;
}

/* Four-float vectors (GCC/clang vector extensions: SSE on x86-64, NEON on arm64). Written out rather than left
 * to the auto-vectoriser, which vectorised across outputs here and spilled its registers (~9x slower). */
typedef float v4f __attribute__((vector_size(16)));

static inline v4f
load4(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline float
dot(const float *g, const float *x, int n)
{
    v4f a0 = {0, 0, 0, 0}, a1 = {0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        a0 += load4(g + k) * load4(x + k);
        a1 += load4(g + k + 4) * load4(x + k + 4);
    }
    v4f a = a0 + a1;
    float s = (a[0] + a[2]) + (a[1] + a[3]);
    for (; k < n; k++) {
        s += g[k] * x[k];
    }
    return s;
}

PyDoc_STRVAR(process_doc,
"process(pcm, out) -> int\n\n"
"Resample the next chunk `pcm` (1-D int16) into `out` (1-D int16, writable, at least\n"
"out_samples(len(pcm)) long). Returns the number of samples written.");

static PyObject *
PolyphaseCore_process(PolyphaseCore *self, PyObject *args)
{
    PyObject *pcm_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OO", &pcm_obj, &out_obj)) {
        return NULL;
    }
    Py_buffer in, out;
    if (get_typed_buffer(pcm_obj, &in, 'h', 2, 0, "resampler input") < 0) {
        return NULL;
    }
    if (get_typed_buffer(out_obj, &out, 'h', 2, 1, "resampler output") < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    const int16_t *x = in.buf;
    Py_ssize_t n_in = in.len / 2;
    int up = self->up, down = self->down, k1 = self->taps - 1;
    Py_ssize_t total = self->npending + n_in;
    Py_ssize_t periods = total / down;
    Py_ssize_t n_out = periods * up;
    if (out.len / 2 < n_out) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "output holds %zd samples, %zd needed", out.len / 2, n_out);
        return NULL;
    }
    if (periods == 0) {
        memcpy(self->pending + self->npending, x, (size_t)n_in * sizeof(int16_t));
        self->npending = (int)total;
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        return PyLong_FromLong(0);
    }
    Py_ssize_t used = periods * down;
    if (self->xe_cap < k1 + used) {
        float *grown = PyMem_Realloc(self->xe, (size_t)(k1 + used) * sizeof(float));
        if (grown == NULL) {
            PyBuffer_Release(&in);
            PyBuffer_Release(&out);
            return PyErr_NoMemory();
        }
        self->xe = grown;
        self->xe_cap = k1 + used;
    }
    float *xe = self->xe; /* xe[0:k1] already holds the history */
    Py_ssize_t pos = k1;
    for (int i = 0; i < self->npending; i++) {
        xe[pos++] = (float)self->pending[i];
    }
    Py_ssize_t take = used - self->npending;
    for (Py_ssize_t i = 0; i < take; i++) {
        xe[pos++] = (float)x[i];
    }
    self->npending = (int)(n_in - take);
    memcpy(self->pending, x + take, (size_t)self->npending * sizeof(int16_t));

    int16_t *y = out.buf;
    const float *bank = self->bank;
    int taps = self->taps;
    for (Py_ssize_t p = 0, j = 0; p < periods; p++) {
        const float *base = xe + p * down;
        for (int r = 0; r < up; r++, j++) {
            float v = nearbyintf(dot(bank + (Py_ssize_t)r * taps, base + self->offset[r], taps));
            y[j] = v > 32767.0f ? 32767 : v < -32768.0f ? -32768 : (int16_t)v;
        }
    }
    memmove(xe, xe + used, (size_t)k1 * sizeof(float)); /* the next call's history */
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(n_out);
}

PyDoc_STRVAR(out_samples_doc, "out_samples(n_in) -> int\n\nSamples the next process() of n_in samples returns.");

static PyObject *
PolyphaseCore_out_samples(PolyphaseCore *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n_in must be >= 0");
        return NULL;
    }
    return PyLong_FromSsize_t((self->npending + n) / self->down * self->up);
}

PyDoc_STRVAR(reset_doc, "reset()\n\nForget the history and the pending input.");

static PyObject *
PolyphaseCore_reset(PolyphaseCore *self, PyObject *Py_UNUSED(ignored))
{
    memset(self->xe, 0, (size_t)(self->taps - 1) * sizeof(float));
    self->npending = 0;
    Py_RETURN_NONE;
}

static PyObject *
PolyphaseCore_get_pending(PolyphaseCore *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->npending);
}

static PyMethodDef PolyphaseCore_methods[] = {
    {"process", (PyCFunction)PolyphaseCore_process, METH_VARARGS, process_doc},
    {"out_samples", (PyCFunction)PolyphaseCore_out_samples, METH_O, out_samples_doc},
    {"reset", (PyCFunction)PolyphaseCore_reset, METH_NOARGS, reset_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PolyphaseCore_getset[] = {
    {"pending", (getter)PolyphaseCore_get_pending, NULL, "input samples waiting for a whole period", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PolyphaseCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "media._polyphase.PolyphaseCore",
    .tp_basicsize = sizeof(PolyphaseCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The per-call work of media.resample.PolyphaseResampler (see the module docstring).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PolyphaseCore_init,
    .tp_dealloc = (destructor)PolyphaseCore_dealloc,
    .tp_methods = PolyphaseCore_methods,
    .tp_getset = PolyphaseCore_getset,
};

static struct PyModuleDef polyphase_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "media._polyphase",
    .m_doc = "The polyphase resampler's per-frame work in C (see media/resample.py).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__polyphase(void)
{
    if (PyType_Ready(&PolyphaseCoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&polyphase_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&PolyphaseCoreType);
    if (PyModule_AddObject(m, "PolyphaseCore", (PyObject *)&PolyphaseCoreType) < 0) {
        Py_DECREF(&PolyphaseCoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
