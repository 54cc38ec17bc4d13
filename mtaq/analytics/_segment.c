/* mtaq.analytics._segment: the frame walk of one segment file in C (issue 38.4), for the analytics' fast path.

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
   its CRC; a SEAL must end the file. The tests check the two agree (tests/test_analytics_native.py). The GIL
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
    (void)self;
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

/* ---- decode: record payloads (msgpack arrays) straight into columns ----

   decode(buf, starts, ends, program, kinds, nullable)
     buf       a bytes-like object holding the payloads
     starts    bytes, int64 native order: where each payload starts in buf
     ends      bytes, int64 native order: where each payload ends
     program   bytes, int32 native order: the record class's grammar, as mtaq.analytics.columnar._program
               compiles it from the class's annotations (the opcodes below; each compound op says how many
               int32 it takes with its children, so that a nil or an empty array can step over them)
     kinds     bytes: each column's kind (OP_INT, OP_FLOAT, OP_BOOL, OP_STR)
     nullable  bytes: 1 where a column is under an optional value (it then keeps a validity byte per row)
   returns None when any payload is outside the grammar (the caller then decodes them all with msgspec), else
   a list with, for each column, (values, validity or None, string data or None): values are int64, float64
   or uint8 (booleans) per row, or for a string column the int32 offsets (rows + 1) into its data.

   The grammar is mtaq.analytics.columnar's (a strict subset of what msgspec accepts for the classes): every
   field present, integers in any msgpack width that fits int64, floats as float64 (0xcb), strings as msgpack
   str and valid UTF-8 (as Python decodes it: no overlong forms, no surrogates, nothing above U+10FFFF),
   booleans, nil only for an optional value, a struct's tag checked, every payload consumed to its last byte.
   Arrays at the top level keep their elements; inside an element, an array keeps its count and its elements
   are checked, not kept. Literals are checked by the caller. */

enum { OP_STRUCT = 1, OP_TUPLE = 2, OP_ARRAY = 3, OP_OPT = 4, OP_INT = 5, OP_FLOAT = 6, OP_BOOL = 7, OP_STR = 8 };

typedef struct {
    char *p;
    size_t len, cap;
} vec_t;

static inline int vec_put(vec_t *v, const void *src, size_t n) {
    if (__builtin_expect(v->len + n > v->cap, 0)) {
        size_t cap = v->cap ? v->cap : 1024;
        while (cap < v->len + n) cap *= 2;
        char *q = realloc(v->p, cap);
        if (q == NULL) return -1;
        v->p = q;
        v->cap = cap;
    }
    if (n) memcpy(v->p + v->len, src, n); /* n == 0 on an empty first string: v->p is still NULL */
    v->len += n;
    return 0;
}

typedef struct {
    int kind, nullable;
    vec_t vals, valid, data; /* data: a string column's bytes; vals then holds its int32 offsets */
} col_t;

typedef struct {
    const int32_t *prog;
    Py_ssize_t prog_len;
    col_t *cols;
    Py_ssize_t ncols;
    int oom;
} dec_t;

static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) { /* ASCII, 8 bytes at a time */
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if ((c == 0xE0 && s[i + 1] < 0xA0) || (c == 0xED && s[i + 1] > 0x9F)) return 0; /* overlong, surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && s[i + 1] < 0x90) || (c == 0xF4 && s[i + 1] > 0x8F)) return 0; /* overlong, > U+10FFFF */
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static inline uint64_t be(const unsigned char *p, int w) {
    uint64_t u = 0;
    for (int k = 0; k < w; k++) u = u << 8 | p[k];
    return u;
}

static int rd_int(const unsigned char **pp, const unsigned char *end, int64_t *v) {
    const unsigned char *p = *pp;
    if (p >= end) return 0;
    unsigned b = *p++;
    if (b <= 0x7F) {
        *v = b;
    } else if (b >= 0xE0) {
        *v = (int64_t)b - 256;
    } else {
        int w, sgn = b >= 0xD0;
        switch (b) {
        case 0xCC: case 0xD0: w = 1; break;
        case 0xCD: case 0xD1: w = 2; break;
        case 0xCE: case 0xD2: w = 4; break;
        case 0xCF: case 0xD3: w = 8; break;
        default: return 0;
        }
        if (end - p < w) return 0;
        uint64_t u = be(p, w);
        p += w;
        if (!sgn) {
            if (u > (uint64_t)INT64_MAX) return 0; /* beyond int64: msgspec decides */
            *v = (int64_t)u;
        } else if (w < 8 && (u >> (w * 8 - 1)) & 1) {
            *v = (int64_t)u - ((int64_t)1 << (w * 8));
        } else {
            *v = (int64_t)u;
        }
    }
    *pp = p;
    return 1;
}

/* A str's or array's header: its length or count. */
static int rd_len(const unsigned char **pp, const unsigned char *end, int is_str, uint64_t *n) {
    const unsigned char *p = *pp;
    if (p >= end) return 0;
    unsigned b = *p++;
    int w;
    if (is_str && b >= 0xA0 && b <= 0xBF) {
        *n = b & 0x1F;
        w = 0;
    } else if (!is_str && b >= 0x90 && b <= 0x9F) {
        *n = b & 0x0F;
        w = 0;
    } else if (is_str) {
        w = b == 0xD9 ? 1 : b == 0xDA ? 2 : b == 0xDB ? 4 : -1;
    } else {
        w = b == 0xDC ? 2 : b == 0xDD ? 4 : -1;
    }
    if (w < 0) return 0;
    if (w) {
        if (end - p < w) return 0;
        *n = be(p, w);
        p += w;
    }
    *pp = p;
    return 1;
}

static int put_valid(dec_t *d, col_t *c, unsigned char ok) {
    if (c->nullable && vec_put(&c->valid, &ok, 1) < 0) return d->oom = 1, -1;
    return 0;
}

/* Parse the value of the op at prog[pos]; return the position after the op and its children, or -1. */
static Py_ssize_t parse(dec_t *d, Py_ssize_t pos, const unsigned char **pp, const unsigned char *end, int discard) {
    if (pos < 0 || pos + 2 > d->prog_len) return -1;
    const int32_t *op = d->prog + pos;
    switch (op[0]) {
    case OP_STRUCT:
    case OP_TUPLE: {
        uint64_t n;
        int tagged = op[0] == OP_STRUCT && op[3] >= 0;
        if (!rd_len(pp, end, 0, &n) || n != (uint64_t)op[2] + (uint64_t)tagged) return -1;
        if (tagged) {
            int64_t tag;
            if (!rd_int(pp, end, &tag) || tag != op[3]) return -1;
        }
        Py_ssize_t q = pos + (op[0] == OP_STRUCT ? 4 : 3);
        for (int32_t i = 0; i < op[2]; i++)
            if ((q = parse(d, q, pp, end, discard)) < 0) return -1;
        return pos + op[1];
    }
    case OP_ARRAY: {
        uint64_t n;
        if (!rd_len(pp, end, 0, &n)) return -1;
        if (!discard && op[2] >= 0) {
            col_t *c = &d->cols[op[2]];
            int64_t v = (int64_t)n;
            if (vec_put(&c->vals, &v, 8) < 0 || put_valid(d, c, 1) < 0) return d->oom = 1, -1;
        }
        for (uint64_t e = 0; e < n; e++)
            if (parse(d, pos + 4, pp, end, discard || !op[3]) < 0) return -1;
        return pos + op[1];
    }
    case OP_OPT: {
        if (*pp >= end) return -1;
        if (**pp == 0xC0) {
            (*pp)++;
            if (!discard) {
                for (int32_t i = 0; i < op[2]; i++) {
                    col_t *c = &d->cols[op[3 + i]];
                    static const char zeros[8] = {0};
                    if (c->kind == OP_STR) {
                        int32_t at = (int32_t)c->data.len;
                        if (vec_put(&c->vals, &at, 4) < 0) return d->oom = 1, -1;
                    } else if (vec_put(&c->vals, zeros, c->kind == OP_BOOL ? 1 : 8) < 0) {
                        return d->oom = 1, -1;
                    }
                    if (put_valid(d, c, 0) < 0) return -1;
                }
            }
            return pos + op[1];
        }
        if (parse(d, pos + 3 + op[2], pp, end, discard) < 0) return -1;
        return pos + op[1];
    }
    case OP_INT: {
        int64_t v;
        if (!rd_int(pp, end, &v)) return -1;
        if (!discard && op[1] >= 0) {
            col_t *c = &d->cols[op[1]];
            if (vec_put(&c->vals, &v, 8) < 0 || put_valid(d, c, 1) < 0) return d->oom = 1, -1;
        }
        return pos + 2;
    }
    case OP_FLOAT: {
        const unsigned char *p = *pp;
        if (end - p < 9 || p[0] != 0xCB) return -1;
        uint64_t u = be(p + 1, 8);
        double v;
        memcpy(&v, &u, 8);
        *pp = p + 9;
        if (!discard && op[1] >= 0) {
            col_t *c = &d->cols[op[1]];
            if (vec_put(&c->vals, &v, 8) < 0 || put_valid(d, c, 1) < 0) return d->oom = 1, -1;
        }
        return pos + 2;
    }
    case OP_BOOL: {
        if (*pp >= end || (**pp != 0xC2 && **pp != 0xC3)) return -1;
        unsigned char v = **pp == 0xC3;
        (*pp)++;
        if (!discard && op[1] >= 0) {
            col_t *c = &d->cols[op[1]];
            if (vec_put(&c->vals, &v, 1) < 0 || put_valid(d, c, 1) < 0) return d->oom = 1, -1;
        }
        return pos + 2;
    }
    case OP_STR: {
        uint64_t n;
        if (!rd_len(pp, end, 1, &n) || (uint64_t)(end - *pp) < n) return -1;
        const unsigned char *s = *pp;
        *pp += n;
        if (!utf8_ok(s, (size_t)n)) return -1;
        if (!discard && op[1] >= 0) {
            col_t *c = &d->cols[op[1]];
            if (c->data.len + n >= (uint64_t)INT32_MAX) return -1; /* int32 offsets: left to msgspec */
            if (vec_put(&c->data, s, (size_t)n) < 0) return d->oom = 1, -1;
            int32_t at = (int32_t)c->data.len;
            if (vec_put(&c->vals, &at, 4) < 0 || put_valid(d, c, 1) < 0) return d->oom = 1, -1;
        }
        return pos + 2;
    }
    default:
        return -1;
    }
}

/* The program is one op whose children fit its stated lengths, and every column it names has its kind: the
   position after the op, or -1. */
static Py_ssize_t prog_check(const dec_t *d, Py_ssize_t pos, int depth) {
    if (depth > 32 || pos < 0 || pos + 2 > d->prog_len) return -1;
    const int32_t *op = d->prog + pos;
    Py_ssize_t q;
    switch (op[0]) {
    case OP_STRUCT:
    case OP_TUPLE:
        q = pos + (op[0] == OP_STRUCT ? 4 : 3);
        if (q > d->prog_len || op[2] < 0) return -1;
        for (int32_t i = 0; i < op[2]; i++)
            if ((q = prog_check(d, q, depth + 1)) < 0) return -1;
        return q == pos + op[1] ? q : -1;
    case OP_ARRAY:
        if (pos + 4 > d->prog_len || op[2] >= d->ncols || (op[2] >= 0 && d->cols[op[2]].kind != OP_INT)) return -1;
        q = prog_check(d, pos + 4, depth + 1);
        return q >= 0 && q == pos + op[1] ? q : -1;
    case OP_OPT:
        if (pos + 3 > d->prog_len || op[2] < 0 || pos + 3 + op[2] > d->prog_len) return -1;
        for (int32_t i = 0; i < op[2]; i++)
            if (op[3 + i] < 0 || op[3 + i] >= d->ncols) return -1;
        q = prog_check(d, pos + 3 + op[2], depth + 1);
        return q >= 0 && q == pos + op[1] ? q : -1;
    case OP_INT:
    case OP_FLOAT:
    case OP_BOOL:
    case OP_STR:
        return op[1] < d->ncols && (op[1] < 0 || d->cols[op[1]].kind == op[0]) ? pos + 2 : -1;
    default:
        return -1;
    }
}

static PyObject *bytes_of(const vec_t *v) {
    return PyBytes_FromStringAndSize(v->p ? v->p : "", (Py_ssize_t)v->len);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view, starts, ends, prog, kinds, nullable;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*", &view, &starts, &ends, &prog, &kinds, &nullable)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = starts.len / 8, ncols = kinds.len;
    int32_t *ops = malloc((size_t)prog.len + 4); /* an aligned copy: the caller's buffer may be at any address */
    dec_t d = {ops, prog.len / 4, NULL, ncols, 0};
    if (ops == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(ops, prog.buf, (size_t)prog.len);
    if (starts.len % 8 || ends.len != starts.len || prog.len % 4 || nullable.len != kinds.len) {
        PyErr_SetString(PyExc_ValueError, "decode: starts and ends int64 of one length, program int32, "
                                          "kinds and nullable one byte a column");
        goto done;
    }
    d.cols = calloc((size_t)(ncols ? ncols : 1), sizeof(col_t));
    if (d.cols == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        d.cols[i].kind = ((unsigned char *)kinds.buf)[i];
        d.cols[i].nullable = ((unsigned char *)nullable.buf)[i] != 0;
        if (d.cols[i].kind < OP_INT || d.cols[i].kind > OP_STR) ok = 0;
    }
    if (!ok || prog_check(&d, 0, 0) != d.prog_len) {
        PyErr_SetString(PyExc_ValueError, "decode: a column of an unknown kind, or the program names a column "
                                          "it does not have");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (d.cols[i].kind == OP_STR) {
            int32_t zero = 0;
            if (vec_put(&d.cols[i].vals, &zero, 4) < 0) d.oom = 1;
        }
    }
    const unsigned char *base = view.buf;
    for (Py_ssize_t r = 0; ok && !d.oom && r < n; r++) {
        int64_t s0, e0; /* read with memcpy: the buffers may be at any address */
        memcpy(&s0, (const char *)starts.buf + r * 8, 8);
        memcpy(&e0, (const char *)ends.buf + r * 8, 8);
        if (s0 < 0 || e0 < s0 || e0 > view.len) {
            ok = 0;
            break;
        }
        const unsigned char *p = base + s0, *end = base + e0;
        if (parse(&d, 0, &p, end, 0) < 0 || p != end) ok = 0;
    }
    Py_END_ALLOW_THREADS
    if (d.oom) {
        PyErr_NoMemory();
    } else if (!ok) {
        result = Py_NewRef(Py_None);
    } else if ((result = PyList_New(ncols)) != NULL) {
        for (Py_ssize_t i = 0; i < ncols; i++) {
            col_t *c = &d.cols[i];
            PyObject *t = Py_BuildValue("(NNN)", bytes_of(&c->vals), c->nullable ? bytes_of(&c->valid) : Py_NewRef(Py_None),
                                        c->kind == OP_STR ? bytes_of(&c->data) : Py_NewRef(Py_None));
            if (t == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, t);
        }
    }
done:
    free(ops);
    if (d.cols != NULL) {
        for (Py_ssize_t i = 0; i < ncols; i++) {
            free(d.cols[i].vals.p);
            free(d.cols[i].valid.p);
            free(d.cols[i].data.p);
        }
        free(d.cols);
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&prog);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&nullable);
    return result;
}

/* domains(offsets, data): the lower-cased domain of each of n strings (Arrow's string layout: offsets, int32
   native order, n + 1 of them, into data), that is the bytes after its last '@' with A-Z lowered, or "" when
   it has none: mtaq.analytics.source._domains. Returns (offsets, data) of the domains in the same layout, or
   None when any string has a byte outside ASCII (the caller then lowers them as Python's str.lower does).
   ValueError when the offsets do not run forward inside data. The GIL is released while the bytes are read. */
static PyObject *domains(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer offs, data;
    if (!PyArg_ParseTuple(args, "y*y*", &offs, &data)) return NULL;
    PyObject *result = NULL;
    int32_t *in = NULL, *out = NULL;
    unsigned char *dom = NULL;
    Py_ssize_t n = offs.len / 4 - 1;
    if (offs.len % 4 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "domains: offsets are int32, n + 1 of them");
        goto done;
    }
    in = malloc((size_t)offs.len); /* an aligned copy: the caller's buffer may be at any address */
    out = malloc((size_t)offs.len);
    if (in == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(in, offs.buf, (size_t)offs.len);
    int ok = in[0] >= 0 && in[n] <= data.len;
    for (Py_ssize_t i = 0; ok && i < n; i++) ok = in[i] <= in[i + 1];
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "domains: offsets must run forward inside data");
        goto done;
    }
    dom = malloc((size_t)(in[n] - in[0]) + 1);
    if (dom == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ascii = 1;
    int32_t len = 0;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *b = data.buf;
    out[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t at = -1;
        unsigned char any = 0;
        for (int32_t j = in[i]; j < in[i + 1]; j++) {
            any |= b[j];
            if (b[j] == '@') at = j;
        }
        if (any & 0x80) {
            ascii = 0;
            break;
        }
        if (at >= 0) {
            for (int32_t j = at + 1; j < in[i + 1]; j++) {
                unsigned char ch = b[j];
                dom[len++] = (unsigned char)(ch >= 'A' && ch <= 'Z' ? ch + 32 : ch);
            }
        }
        out[i + 1] = len;
    }
    Py_END_ALLOW_THREADS
    if (!ascii)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("(y#y#)", (const char *)out, (Py_ssize_t)((n + 1) * 4), (const char *)dom, (Py_ssize_t)len);
done:
    free(in);
    free(out);
    free(dom);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"domains", domains, METH_VARARGS, "The lower-cased domain of each string (see the module's source)."},
    {"walk", walk, METH_VARARGS, "Walk the frames of one segment file (see the module's source)."},
    {"decode", decode, METH_VARARGS, "Decode record payloads into columns (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_segment", "The frame walk and payload decoding of a segment in C.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__segment(void) {
    crc_init();
    return PyModule_Create(&module);
}
