#include "moeswarm-msgpack.h"

#include <string.h>

void moeswarm_mp_reader_init(struct moeswarm_mp_reader * r, const uint8_t * data, size_t size) {
    r->data = data;
    r->size = size;
    r->pos = 0;
}

static bool mp_take(moeswarm_mp_reader * r, size_t n, const uint8_t ** p) {
    if (n > r->size - r->pos) {
        return false;
    }
    *p = r->data + r->pos;
    r->pos += n;
    return true;
}

static uint64_t mp_be(const uint8_t * p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) {
        v = (v << 8) | p[i];
    }
    return v;
}

static bool mp_read_be(moeswarm_mp_reader * r, int n, uint64_t * v) {
    const uint8_t * p;
    if (!mp_take(r, (size_t) n, &p)) {
        return false;
    }
    *v = mp_be(p, n);
    return true;
}

static bool mp_read_payload(moeswarm_mp_reader * r, moeswarm_mp_value * v, uint64_t len) {
    if (len > UINT32_MAX) {
        return false;
    }
    v->n = (uint32_t) len;
    return mp_take(r, (size_t) len, &v->ptr);
}

static void mp_set_int(moeswarm_mp_value * v, int64_t x) {
    if (x >= 0) {
        v->type = MOESWARM_MP_UINT;
        v->u = (uint64_t) x;
    } else {
        v->type = MOESWARM_MP_INT;
        v->i = x;
    }
}

bool moeswarm_mp_read(struct moeswarm_mp_reader * r, struct moeswarm_mp_value * v) {
    memset(v, 0, sizeof(*v));
    const uint8_t * p;
    if (!mp_take(r, 1, &p)) {
        return false;
    }
    const uint8_t c = *p;
    uint64_t x = 0;
    if (c <= 0x7f) { v->type = MOESWARM_MP_UINT; v->u = c; return true; }
    if (c >= 0xe0) { v->type = MOESWARM_MP_INT; v->i = (int8_t) c; return true; }
    if ((c & 0xf0) == 0x80) { v->type = MOESWARM_MP_MAP; v->n = c & 0x0f; return true; }
    if ((c & 0xf0) == 0x90) { v->type = MOESWARM_MP_ARRAY; v->n = c & 0x0f; return true; }
    if ((c & 0xe0) == 0xa0) { v->type = MOESWARM_MP_STR; return mp_read_payload(r, v, c & 0x1f); }
    switch (c) {
        case 0xc0: v->type = MOESWARM_MP_NIL; return true;
        case 0xc2: v->type = MOESWARM_MP_BOOL; v->b = false; return true;
        case 0xc3: v->type = MOESWARM_MP_BOOL; v->b = true; return true;
        case 0xc4: case 0xc5: case 0xc6: {
            const int nb = c == 0xc4 ? 1 : c == 0xc5 ? 2 : 4;
            v->type = MOESWARM_MP_BIN;
            return mp_read_be(r, nb, &x) && mp_read_payload(r, v, x);
        }
        case 0xc7: case 0xc8: case 0xc9: {
            const int nb = c == 0xc7 ? 1 : c == 0xc8 ? 2 : 4;
            v->type = MOESWARM_MP_EXT;
            return mp_read_be(r, nb, &x) && mp_take(r, 1, &p) && mp_read_payload(r, v, x);
        }
        case 0xca: {
            if (!mp_read_be(r, 4, &x)) return false;
            const uint32_t bits = (uint32_t) x;
            float f;
            memcpy(&f, &bits, sizeof(f));
            v->type = MOESWARM_MP_FLOAT;
            v->f = f;
            return true;
        }
        case 0xcb: {
            if (!mp_read_be(r, 8, &x)) return false;
            double d;
            memcpy(&d, &x, sizeof(d));
            v->type = MOESWARM_MP_FLOAT;
            v->f = d;
            return true;
        }
        case 0xcc: case 0xcd: case 0xce: case 0xcf: {
            const int nb = 1 << (c - 0xcc);
            if (!mp_read_be(r, nb, &x)) return false;
            v->type = MOESWARM_MP_UINT;
            v->u = x;
            return true;
        }
        case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
            const int nb = 1 << (c - 0xd0);
            if (!mp_read_be(r, nb, &x)) return false;
            int64_t s;
            if (nb == 1) s = (int8_t) x;
            else if (nb == 2) s = (int16_t) x;
            else if (nb == 4) s = (int32_t) x;
            else s = (int64_t) x;
            mp_set_int(v, s);
            return true;
        }
        case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: {
            v->type = MOESWARM_MP_EXT;
            return mp_take(r, 1, &p) && mp_read_payload(r, v, (uint64_t) 1 << (c - 0xd4));
        }
        case 0xd9: case 0xda: case 0xdb: {
            const int nb = c == 0xd9 ? 1 : c == 0xda ? 2 : 4;
            v->type = MOESWARM_MP_STR;
            return mp_read_be(r, nb, &x) && mp_read_payload(r, v, x);
        }
        case 0xdc: case 0xdd: {
            if (!mp_read_be(r, c == 0xdc ? 2 : 4, &x)) return false;
            v->type = MOESWARM_MP_ARRAY;
            v->n = (uint32_t) x;
            return true;
        }
        case 0xde: case 0xdf: {
            if (!mp_read_be(r, c == 0xde ? 2 : 4, &x)) return false;
            v->type = MOESWARM_MP_MAP;
            v->n = (uint32_t) x;
            return true;
        }
        default:
            return false; // 0xc1 is never used
    }
}

bool moeswarm_mp_skip(struct moeswarm_mp_reader * r, int max_depth) {
    moeswarm_mp_value v;
    if (!moeswarm_mp_read(r, &v)) {
        return false;
    }
    if (v.type == MOESWARM_MP_EXT) {
        return false; // the protocol uses no extension types, anywhere
    }
    if (v.type != MOESWARM_MP_ARRAY && v.type != MOESWARM_MP_MAP) {
        return true;
    }
    if (max_depth <= 0) {
        return false; // this container is one level too deep
    }
    const uint64_t n = v.type == MOESWARM_MP_MAP ? 2 * (uint64_t) v.n : v.n;
    // every element takes at least one byte: a count larger than what is left is malformed
    if (n > r->size - r->pos) {
        return false;
    }
    for (uint64_t i = 0; i < n; ++i) {
        if (v.type == MOESWARM_MP_MAP && i % 2 == 0) {
            // map keys are strings at every level
            moeswarm_mp_value key;
            if (!moeswarm_mp_read(r, &key) || key.type != MOESWARM_MP_STR) {
                return false;
            }
            continue;
        }
        if (!moeswarm_mp_skip(r, max_depth - 1)) {
            return false;
        }
    }
    return true;
}

bool moeswarm_utf8_valid(const uint8_t * s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp;
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; }
        else return false;
        if (n - i < len) {
            return false;
        }
        for (size_t j = 1; j < len; ++j) {
            if ((s[i + j] & 0xc0) != 0x80) {
                return false;
            }
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        // no overlong forms, no surrogates, nothing above U+10FFFF
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) {
            return false;
        }
        i += len;
    }
    return true;
}

static void mp_put(moeswarm_mp_writer * w, uint8_t c) {
    w->buf.push_back(c);
}

static void mp_put_be(moeswarm_mp_writer * w, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) {
        w->buf.push_back((uint8_t) (v >> (8 * i)));
    }
}

void moeswarm_mp_write_nil(struct moeswarm_mp_writer * w) { mp_put(w, 0xc0); }

void moeswarm_mp_write_bool(struct moeswarm_mp_writer * w, bool v) { mp_put(w, v ? 0xc3 : 0xc2); }

void moeswarm_mp_write_uint(struct moeswarm_mp_writer * w, uint64_t v) {
    if (v <= 0x7f) {
        mp_put(w, (uint8_t) v);
    } else if (v <= 0xff) {
        mp_put(w, 0xcc); mp_put_be(w, v, 1);
    } else if (v <= 0xffff) {
        mp_put(w, 0xcd); mp_put_be(w, v, 2);
    } else if (v <= 0xffffffffull) {
        mp_put(w, 0xce); mp_put_be(w, v, 4);
    } else {
        mp_put(w, 0xcf); mp_put_be(w, v, 8);
    }
}

void moeswarm_mp_write_int(struct moeswarm_mp_writer * w, int64_t v) {
    if (v >= 0) {
        moeswarm_mp_write_uint(w, (uint64_t) v);
    } else if (v >= -32) {
        mp_put(w, (uint8_t) (int8_t) v);
    } else if (v >= INT8_MIN) {
        mp_put(w, 0xd0); mp_put_be(w, (uint64_t) v, 1);
    } else if (v >= INT16_MIN) {
        mp_put(w, 0xd1); mp_put_be(w, (uint64_t) v, 2);
    } else if (v >= INT32_MIN) {
        mp_put(w, 0xd2); mp_put_be(w, (uint64_t) v, 4);
    } else {
        mp_put(w, 0xd3); mp_put_be(w, (uint64_t) v, 8);
    }
}

void moeswarm_mp_write_number(struct moeswarm_mp_writer * w, double v) {
    const double limit = 9007199254740991.0; // 2^53 - 1
    if (v == v && v >= -limit && v <= limit && v == (double) (int64_t) v) {
        moeswarm_mp_write_int(w, (int64_t) v); // -0 becomes the integer 0
    } else {
        moeswarm_mp_write_f64(w, v);
    }
}

void moeswarm_mp_write_f64(struct moeswarm_mp_writer * w, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof(bits));
    mp_put(w, 0xcb);
    mp_put_be(w, bits, 8);
}

void moeswarm_mp_write_str(struct moeswarm_mp_writer * w, const char * s, size_t n) {
    if (n <= 31) {
        mp_put(w, (uint8_t) (0xa0 | n));
    } else if (n <= 0xff) {
        mp_put(w, 0xd9); mp_put_be(w, n, 1);
    } else if (n <= 0xffff) {
        mp_put(w, 0xda); mp_put_be(w, n, 2);
    } else {
        mp_put(w, 0xdb); mp_put_be(w, n, 4);
    }
    w->buf.insert(w->buf.end(), (const uint8_t *) s, (const uint8_t *) s + n);
}

void moeswarm_mp_write_cstr(struct moeswarm_mp_writer * w, const char * s) {
    moeswarm_mp_write_str(w, s, strlen(s));
}

uint8_t * moeswarm_mp_write_bin_reserve(struct moeswarm_mp_writer * w, size_t n) {
    if (n <= 0xff) {
        mp_put(w, 0xc4); mp_put_be(w, n, 1);
    } else if (n <= 0xffff) {
        mp_put(w, 0xc5); mp_put_be(w, n, 2);
    } else {
        mp_put(w, 0xc6); mp_put_be(w, n, 4);
    }
    const size_t at = w->buf.size();
    w->buf.resize(at + n);
    return w->buf.data() + at;
}

void moeswarm_mp_write_bin(struct moeswarm_mp_writer * w, const void * data, size_t n) {
    uint8_t * dst = moeswarm_mp_write_bin_reserve(w, n);
    if (n > 0) {
        memcpy(dst, data, n);
    }
}

void moeswarm_mp_write_array(struct moeswarm_mp_writer * w, uint32_t n) {
    if (n <= 15) {
        mp_put(w, (uint8_t) (0x90 | n));
    } else if (n <= 0xffff) {
        mp_put(w, 0xdc); mp_put_be(w, n, 2);
    } else {
        mp_put(w, 0xdd); mp_put_be(w, n, 4);
    }
}

void moeswarm_mp_write_map(struct moeswarm_mp_writer * w, uint32_t n) {
    if (n <= 15) {
        mp_put(w, (uint8_t) (0x80 | n));
    } else if (n <= 0xffff) {
        mp_put(w, 0xde); mp_put_be(w, n, 2);
    } else {
        mp_put(w, 0xdf); mp_put_be(w, n, 4);
    }
}

bool moeswarm_mp_map_find(const uint8_t * data, size_t size, const char * key, moeswarm_mp_value * v, size_t * pos) {
    moeswarm_mp_reader r;
    moeswarm_mp_reader_init(&r, data, size);
    moeswarm_mp_value m;
    if (!moeswarm_mp_read(&r, &m) || m.type != MOESWARM_MP_MAP) {
        return false;
    }
    const size_t klen = strlen(key);
    for (uint32_t i = 0; i < m.n; ++i) {
        moeswarm_mp_value k;
        if (!moeswarm_mp_read(&r, &k) || k.type != MOESWARM_MP_STR) {
            return false;
        }
        if (k.n == klen && memcmp(k.ptr, key, klen) == 0) {
            if (pos != nullptr) {
                *pos = r.pos;
            }
            return moeswarm_mp_read(&r, v);
        }
        if (!moeswarm_mp_skip(&r, 16)) {
            return false;
        }
    }
    return false;
}
