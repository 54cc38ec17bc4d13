/* mtaq.analytics._walk: the frame walk of one segment file in C (issue 38.4), for the analytics' fast path.

   walk(buf, first, salt, magic, valid, data_type, seal_type, max_length)
     buf        a bytes-like object: the whole segment file
     first      the offset of the first frame (SEGMENT_HEADER_BYTES)
     salt       the segment's salt: the seed of every frame's CRC-32 (zlib's crc32)
     magic      FRAME_MAGIC, the frame header's first two bytes as a little-endian u16
     valid      256 bytes: valid[t] != 0 when t is a record type
     data_type  the DATA type (its frames are checked and stepped over, never kept)
     seal_type  the SEAL type (only as the last frame)
     max_length RECORD_BYTES_MAX
   returns None when anything does not check out, else (types, offsets, ends, frames, sealed):
     types      bytes, the type of each kept frame (every frame but DATA and SEAL), in file order
     offsets    bytes, int64 native order: the offset of each kept frame's header
     ends       bytes, int64 native order: the end of each kept frame's payload
     frames     the good frames walked (DATA included, the SEAL not)
     sealed     whether a SEAL ended the file

   It is mtaq.analytics.source._walk_loop, frame for frame: a frame header (u16 magic, u8 type, u8 flags 0,
   u32 length, u32 CRC; little-endian) must fit, name a valid type and a length up to max_length, its payload
   must fit, and the CRC-32 of its first 8 header bytes and its payload (seeded with the salt) must equal
   its CRC; a SEAL must end the file. The tests check the two agree (tests/test_analytics_walk.py). The GIL
   is released while the bytes are walked. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static inline uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* zlib's crc32(crc, p, n): the reflected CRC-32 (polynomial 0xEDB88320), slicing by 8. */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = le32(p) ^ crc, hi = le32(p + 4);
        crc = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
              crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
              crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#define HEADER_BYTES 12

typedef struct {
    unsigned char *types;
    int64_t *offsets, *ends;
    Py_ssize_t kept, cap;
} kept_t;

static int keep(kept_t *k, unsigned char type, int64_t off, int64_t end) {
    if (k->kept == k->cap) {
        Py_ssize_t cap = k->cap ? k->cap * 2 : 4096;
        unsigned char *t = realloc(k->types, (size_t)cap);
        if (t == NULL) return -1;
        k->types = t;
        int64_t *o = realloc(k->offsets, (size_t)cap * sizeof(int64_t));
        if (o == NULL) return -1;
        k->offsets = o;
        int64_t *e = realloc(k->ends, (size_t)cap * sizeof(int64_t));
        if (e == NULL) return -1;
        k->ends = e;
        k->cap = cap;
    }
    k->types[k->kept] = type;
    k->offsets[k->kept] = off;
    k->ends[k->kept] = end;
    k->kept++;
    return 0;
}

/* 1: walked to the end, 0: something does not check out, -1: out of memory. */
static int walk_frames(const unsigned char *buf, Py_ssize_t n, Py_ssize_t first, uint32_t salt, unsigned magic,
                       const unsigned char *valid, unsigned data_type, unsigned seal_type, uint64_t max_length,
                       kept_t *k, Py_ssize_t *frames, int *sealed) {
    Py_ssize_t off = first;
    *frames = 0;
    *sealed = 0;
    while (off < n) {
        if (off > n - HEADER_BYTES) return 0; /* a cut-off frame header */
        const unsigned char *h = buf + off;
        unsigned type = h[2];
        uint64_t length = le32(h + 4);
        if ((unsigned)(h[0] | h[1] << 8) != magic || h[3] != 0 || !valid[type] || length > max_length) return 0;
        Py_ssize_t start = off + HEADER_BYTES;
        if ((uint64_t)(n - start) < length) return 0; /* the payload does not fit */
        Py_ssize_t end = start + (Py_ssize_t)length;
        if (crc32_update(crc32_update(salt, h, 8), buf + start, (size_t)length) != le32(h + 8)) return 0;
        if (type != data_type) {
            if (type == seal_type) {
                if (end != n) return 0; /* bytes after a seal */
                *sealed = 1;
                break;
            }
            if (keep(k, (unsigned char)type, off, end) < 0) return -1;
        }
        (*frames)++;
        off = end;
    }
    return 1;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    Py_buffer view, valid;
    Py_ssize_t first;
    unsigned long salt;
    unsigned int magic, data_type, seal_type;
    unsigned long long max_length;
    if (!PyArg_ParseTuple(args, "y*nkIy*IIK", &view, &first, &salt, &magic, &valid, &data_type, &seal_type,
                          &max_length))
        return NULL;
    PyObject *result = NULL;
    if (valid.len != 256 || first < 0 || salt > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "walk: valid must be 256 bytes, first >= 0, salt a u32");
        goto done;
    }
    kept_t k = {NULL, NULL, NULL, 0, 0};
    Py_ssize_t frames;
    int sealed, ok;
    Py_BEGIN_ALLOW_THREADS
    ok = walk_frames(view.buf, view.len, first, (uint32_t)salt, magic, valid.buf, data_type, seal_type, max_length,
                     &k, &frames, &sealed);
    Py_END_ALLOW_THREADS
    if (ok < 0) {
        PyErr_NoMemory();
    } else if (ok == 0) {
        result = Py_NewRef(Py_None);
    } else {
        static const char none[1] = "";  /* y# of a NULL pointer would be None */
        result = Py_BuildValue("(y#y#y#nO)", k.types ? (const char *)k.types : none, k.kept,
                               k.offsets ? (const char *)k.offsets : none, k.kept * (Py_ssize_t)sizeof(int64_t),
                               k.ends ? (const char *)k.ends : none,
                               k.kept * (Py_ssize_t)sizeof(int64_t), frames, sealed ? Py_True : Py_False);
    }
    free(k.types);
    free(k.offsets);
    free(k.ends);
done:
    PyBuffer_Release(&valid);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "Walk the frames of one segment file (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walk", "The frame walk of a segment in C.", -1, methods};

PyMODINIT_FUNC PyInit__walk(void) {
    crc_init();
    return PyModule_Create(&module);
}
