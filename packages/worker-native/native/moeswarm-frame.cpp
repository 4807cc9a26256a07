#include "moeswarm-frame.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#define MOESWARM_FRAME_DEPTH 16
#define MOESWARM_MAX_SAFE    9007199254740991ull // 2^53 - 1

size_t moeswarm_dtype_size(enum moeswarm_dtype dtype) {
    return dtype == MOESWARM_DTYPE_F32 ? 4 : 2;
}

//
// the field tables of section 4
//

enum field_kind {
    FK_UINT,       // lo..hi
    FK_FLOAT,      // finite; lo = 1 means >= 0
    FK_STR,        // UTF-8, lo..hi bytes
    FK_ENUM,       // one of `values`
    FK_BIN,
    FK_UINT_ARRAY, // at most hi2 entries, each lo..hi; `ascending` when strictly ascending
    FK_STR_ARRAY,  // at most hi2 entries, each lo..hi bytes
    FK_CAPS,       // the hello caps map
    FK_BOOL,       // true or false
};

struct field_spec {
    const char *  key;
    field_kind    kind;
    bool          required;
    uint64_t      lo;
    uint64_t      hi;
    uint64_t      hi2;
    const char *  values[3];
    bool          ascending;
};

static const field_spec k_hello[] = {
    { "role",  FK_ENUM, true,  0, 0,    0, { "worker", "backbone", nullptr }, false },
    { "id",    FK_STR,  true,  1, 128,  0, { nullptr }, false },
    { "token", FK_STR,  true,  0, 8192, 0, { nullptr }, false },
    { "caps",  FK_CAPS, false, 0, 0,    0, { nullptr }, false },
};
static const field_spec k_caps[] = {
    { "backends", FK_STR_ARRAY, false, 1, 64,          64, { nullptr }, false },
    { "dtypes",   FK_STR_ARRAY, false, 1, 64,          64, { nullptr }, false },
    { "maxFrame", FK_UINT,      false, 0, 0xffffffffu, 0,  { nullptr }, false },
};
static const field_spec k_register[] = {
    { "model",    FK_STR,        true,  1, 256,              0,     { nullptr }, false },
    { "layers",   FK_UINT_ARRAY, true,  0, 65535,            4096,  { nullptr }, false },
    { "experts",  FK_UINT_ARRAY, true,  0, 0x7fffffffu,      65536, { nullptr }, true },
    { "capacity", FK_UINT,       false, 0, MOESWARM_MAX_SAFE, 0,    { nullptr }, false },
    { "backend",  FK_STR,        false, 1, 64,               0,     { nullptr }, false },
};
static const field_spec k_dispatch[] = {
    { "id",       FK_UINT, true,  0, 0xffffffffu, 0, { nullptr }, false },
    { "to",       FK_STR,  false, 1, 128,         0, { nullptr }, false },
    { "from",     FK_STR,  false, 1, 128,         0, { nullptr }, false },
    { "model",    FK_STR,  true,  1, 256,         0, { nullptr }, false },
    { "layer",    FK_UINT, true,  0, 65535,       0, { nullptr }, false },
    { "n",        FK_UINT, true,  1, 65536,       0, { nullptr }, false },
    { "embd",     FK_UINT, true,  1, 65536,       0, { nullptr }, false },
    { "dtype",    FK_ENUM, true,  0, 0,           0, { "f32", "f16", "bf16" }, false },
    { "x",        FK_BIN,  true,  0, 0,           0, { nullptr }, false },
    { "k",        FK_UINT, true,  1, 256,         0, { nullptr }, false },
    { "ids",      FK_BIN,  true,  0, 0,           0, { nullptr }, false },
    { "w",        FK_BIN,  false, 0, 0,           0, { nullptr }, false },
    { "mode",     FK_ENUM, true,  0, 0,           0, { "each", "sum", nullptr }, false },
    { "deadline", FK_UINT, false, 0, 0xffffffffu, 0, { nullptr }, false },
    { "compact",  FK_BOOL, false, 0, 0,           0, { nullptr }, false },
};
static const field_spec k_result[] = {
    { "id",   FK_UINT,  true,  0, 0xffffffffu, 0, { nullptr }, false },
    { "to",   FK_STR,   false, 1, 128,         0, { nullptr }, false },
    { "from", FK_STR,   false, 1, 128,         0, { nullptr }, false },
    { "mode", FK_ENUM,  true,  0, 0,           0, { "each", "sum", nullptr }, false },
    { "n",    FK_UINT,  true,  1, 65536,       0, { nullptr }, false },
    { "k",    FK_UINT,  true,  1, 256,         0, { nullptr }, false },
    { "embd", FK_UINT,  true,  1, 65536,       0, { nullptr }, false },
    { "y",    FK_BIN,   true,  0, 0,           0, { nullptr }, false },
    { "ms",   FK_FLOAT, false, 1, 0,           0, { nullptr }, false },
    { "compact", FK_BOOL, false, 0, 0,         0, { nullptr }, false },
};
static const field_spec k_error[] = {
    { "id",   FK_UINT, false, 0, 0xffffffffu, 0, { nullptr }, false },
    { "to",   FK_STR,  false, 1, 128,         0, { nullptr }, false },
    { "from", FK_STR,  false, 1, 128,         0, { nullptr }, false },
    { "code", FK_STR,  true,  1, 64,          0, { nullptr }, false },
    { "msg",  FK_STR,  true,  0, 16384,       0, { nullptr }, false },
};
static const field_spec k_ping[] = {
    { "seq", FK_UINT,  true, 0, MOESWARM_MAX_SAFE, 0, { nullptr }, false },
    { "ts",  FK_FLOAT, true, 0, 0,                 0, { nullptr }, false },
};
static const field_spec k_drain[] = {
    { "reason", FK_STR, false, 0, 1024, 0, { nullptr }, false },
};

struct frame_spec {
    const char *       name;
    moeswarm_frame_type type;
    const field_spec * fields;
    size_t             n_fields;
};

#define SPEC(name, type, table) { name, type, table, sizeof(table) / sizeof(table[0]) }
static const frame_spec k_frames[] = {
    SPEC("hello", MOESWARM_FRAME_HELLO, k_hello),
    SPEC("register", MOESWARM_FRAME_REGISTER, k_register),
    SPEC("dispatch", MOESWARM_FRAME_DISPATCH, k_dispatch),
    SPEC("result", MOESWARM_FRAME_RESULT, k_result),
    SPEC("error", MOESWARM_FRAME_ERROR, k_error),
    SPEC("ping", MOESWARM_FRAME_PING, k_ping),
    SPEC("pong", MOESWARM_FRAME_PONG, k_ping),
    SPEC("drain", MOESWARM_FRAME_DRAIN, k_drain),
};
#undef SPEC

// every key a frame of section 4 may carry: these may not repeat
static const char * k_known_keys[] = {
    "t", "v", "role", "id", "token", "caps", "model", "layers", "experts", "capacity", "backend", "to", "from",
    "layer", "n", "embd", "dtype", "x", "k", "ids", "w", "mode", "deadline", "y", "ms", "code", "msg", "seq",
    "ts", "reason", "compact",
};
#define N_KNOWN (sizeof(k_known_keys) / sizeof(k_known_keys[0]))

struct known_value {
    bool   seen;
    size_t pos; // offset of the value in the payload
};

static bool bytes_eq(const uint8_t * p, size_t n, const char * lit) {
    return strlen(lit) == n && memcmp(p, lit, n) == 0;
}

static int known_index(const char * key) {
    for (size_t i = 0; i < N_KNOWN; ++i) {
        if (strcmp(k_known_keys[i], key) == 0) {
            return (int) i;
        }
    }
    return -1;
}

static bool fail_field(moeswarm_error * err, const char * code, const char * frame, const char * field, const char * what) {
    return moeswarm_error_set(err, code, "%s.%s: %s", frame, field, what);
}

// reads the value of a known key at its recorded offset
static bool value_at(const uint8_t * data, size_t size, size_t pos, moeswarm_mp_value * v, moeswarm_mp_reader * r) {
    moeswarm_mp_reader_init(r, data, size);
    r->pos = pos;
    return moeswarm_mp_read(r, v);
}

// check 7 for one present field
static bool check_field(const uint8_t * data, size_t size, size_t pos, const field_spec & fs, const char * frame,
        uint32_t max_expert, moeswarm_error * err) {
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, pos, &v, &r); // already known to be well-formed
    const char * bad = "MOESWARM_PROTOCOL_BAD_FIELD";
    char what[128];
    switch (fs.kind) {
        case FK_UINT:
            if (v.type != MOESWARM_MP_UINT) {
                return fail_field(err, bad, frame, fs.key, "must be an unsigned integer");
            }
            if (v.u < fs.lo || v.u > fs.hi) {
                snprintf(what, sizeof(what), "%llu is outside %llu..%llu", (unsigned long long) v.u,
                    (unsigned long long) fs.lo, (unsigned long long) fs.hi);
                return fail_field(err, bad, frame, fs.key, what);
            }
            return true;
        case FK_FLOAT: {
            double d;
            if (v.type == MOESWARM_MP_FLOAT) d = v.f;
            else if (v.type == MOESWARM_MP_UINT) d = (double) v.u;
            else if (v.type == MOESWARM_MP_INT) d = (double) v.i;
            else return fail_field(err, bad, frame, fs.key, "must be a number");
            if (!isfinite(d) || (fs.lo == 1 && d < 0)) {
                return fail_field(err, bad, frame, fs.key, fs.lo == 1 ? "must be finite and >= 0" : "must be finite");
            }
            return true;
        }
        case FK_STR:
        case FK_ENUM:
            if (v.type != MOESWARM_MP_STR || !moeswarm_utf8_valid(v.ptr, v.n)) {
                return fail_field(err, bad, frame, fs.key, "must be a UTF-8 string");
            }
            if (fs.kind == FK_ENUM) {
                for (const char * e : fs.values) {
                    if (e != nullptr && bytes_eq(v.ptr, v.n, e)) {
                        return true;
                    }
                }
                return fail_field(err, bad, frame, fs.key, "is not one of the allowed values");
            }
            if (v.n < fs.lo || v.n > fs.hi) {
                snprintf(what, sizeof(what), "has %u bytes, allowed %llu..%llu", v.n, (unsigned long long) fs.lo,
                    (unsigned long long) fs.hi);
                return fail_field(err, bad, frame, fs.key, what);
            }
            if (strcmp(fs.key, "code") == 0) {
                bool ok = v.n > 9 && memcmp(v.ptr, "MOESWARM_", 9) == 0;
                for (uint32_t i = 9; ok && i < v.n; ++i) {
                    const uint8_t c = v.ptr[i];
                    ok = (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
                }
                if (!ok) {
                    return fail_field(err, bad, frame, fs.key, "must match ^MOESWARM_[A-Z0-9_]+$");
                }
            }
            return true;
        case FK_BIN:
            if (v.type != MOESWARM_MP_BIN) {
                return fail_field(err, bad, frame, fs.key, "must be bin");
            }
            return true;
        case FK_BOOL:
            if (v.type != MOESWARM_MP_BOOL) {
                return fail_field(err, bad, frame, fs.key, "must be true or false");
            }
            return true;
        case FK_UINT_ARRAY:
        case FK_STR_ARRAY: {
            if (v.type != MOESWARM_MP_ARRAY) {
                return fail_field(err, bad, frame, fs.key, "must be an array");
            }
            if (v.n > fs.hi2) {
                snprintf(what, sizeof(what), "has %u entries, at most %llu allowed", v.n, (unsigned long long) fs.hi2);
                return fail_field(err, bad, frame, fs.key, what);
            }
            uint64_t prev = 0;
            for (uint32_t i = 0; i < v.n; ++i) {
                moeswarm_mp_value e;
                moeswarm_mp_read(&r, &e);
                if (fs.kind == FK_UINT_ARRAY) {
                    uint64_t hi = fs.hi;
                    if (fs.ascending && max_expert > 0 && max_expert - 1 < hi) {
                        hi = max_expert - 1;
                    }
                    if (e.type != MOESWARM_MP_UINT || e.u < fs.lo || e.u > hi) {
                        snprintf(what, sizeof(what), "entry %u is not an integer in %llu..%llu", i,
                            (unsigned long long) fs.lo, (unsigned long long) hi);
                        return fail_field(err, bad, frame, fs.key, what);
                    }
                    if (fs.ascending && i > 0 && e.u <= prev) {
                        return fail_field(err, bad, frame, fs.key, "must be strictly ascending");
                    }
                    prev = e.u;
                } else {
                    if (e.type != MOESWARM_MP_STR || !moeswarm_utf8_valid(e.ptr, e.n) || e.n < fs.lo || e.n > fs.hi) {
                        snprintf(what, sizeof(what), "entry %u is not a UTF-8 string of %llu..%llu bytes", i,
                            (unsigned long long) fs.lo, (unsigned long long) fs.hi);
                        return fail_field(err, bad, frame, fs.key, what);
                    }
                }
            }
            return true;
        }
        case FK_CAPS: {
            if (v.type != MOESWARM_MP_MAP) {
                return fail_field(err, bad, frame, fs.key, "must be a map");
            }
            bool seen[3] = { false, false, false };
            for (uint32_t i = 0; i < v.n; ++i) {
                moeswarm_mp_value key;
                moeswarm_mp_read(&r, &key);
                const size_t at = r.pos;
                int idx = -1;
                for (int j = 0; j < 3; ++j) {
                    if (bytes_eq(key.ptr, key.n, k_caps[j].key)) {
                        idx = j;
                    }
                }
                if (idx >= 0) {
                    if (seen[idx]) {
                        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_MALFORMED", "hello.caps.%s appears twice", k_caps[idx].key);
                    }
                    seen[idx] = true;
                    if (!check_field(data, size, at, k_caps[idx], "hello.caps", max_expert, err)) {
                        return false;
                    }
                }
                r.pos = at;
                moeswarm_mp_skip(&r, MOESWARM_FRAME_DEPTH);
            }
            return true;
        }
    }
    return true;
}

static bool read_str(const uint8_t * data, size_t size, const known_value & kv, moeswarm_str * out) {
    out->present = false;
    if (!kv.seen) {
        return true;
    }
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, kv.pos, &v, &r);
    out->ptr = v.ptr;
    out->len = v.n;
    out->present = true;
    return true;
}

static uint64_t read_uint(const uint8_t * data, size_t size, const known_value & kv) {
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, kv.pos, &v, &r);
    return v.u;
}

static double read_float(const uint8_t * data, size_t size, const known_value & kv) {
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, kv.pos, &v, &r);
    return v.type == MOESWARM_MP_FLOAT ? v.f : v.type == MOESWARM_MP_UINT ? (double) v.u : (double) v.i;
}

static bool read_bool(const uint8_t * data, size_t size, const known_value & kv) {
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, kv.pos, &v, &r);
    return v.type == MOESWARM_MP_BOOL && v.b;
}

bool moeswarm_frame_decode(const uint8_t * data, size_t size, uint32_t max_expert, struct moeswarm_frame * f,
        struct moeswarm_error * err) {
    memset(f, 0, sizeof(*f));
    moeswarm_error_clear(err);
    const char * malformed = "MOESWARM_PROTOCOL_MALFORMED";

    // check 2: one well-formed map, string keys, no ext, depth <= 16, no repeated known key
    moeswarm_mp_reader r;
    moeswarm_mp_reader_init(&r, data, size);
    moeswarm_mp_value head;
    if (size == 0 || !moeswarm_mp_read(&r, &head) || head.type != MOESWARM_MP_MAP) {
        return moeswarm_error_set(err, malformed, "a frame is one msgpack map");
    }
    known_value known[N_KNOWN];
    memset(known, 0, sizeof(known));
    for (uint32_t i = 0; i < head.n; ++i) {
        moeswarm_mp_value key;
        if (!moeswarm_mp_read(&r, &key) || key.type != MOESWARM_MP_STR) {
            return moeswarm_error_set(err, malformed, "map key %u is not a string", i);
        }
        char name[16];
        int idx = -1;
        if (key.n < sizeof(name)) {
            memcpy(name, key.ptr, key.n);
            name[key.n] = '\0';
            idx = known_index(name);
        }
        const size_t at = r.pos;
        if (!moeswarm_mp_skip(&r, MOESWARM_FRAME_DEPTH - 1)) {
            return moeswarm_error_set(err, malformed, "a value is truncated, nested too deep, or not plain msgpack");
        }
        if (idx >= 0) {
            if (known[idx].seen) {
                return moeswarm_error_set(err, malformed, "key `%s` appears twice", k_known_keys[idx]);
            }
            known[idx].seen = true;
            known[idx].pos = at;
        }
    }
    if (r.pos != size) {
        return moeswarm_error_set(err, malformed, "%zu bytes after the frame's map", size - r.pos);
    }
    auto kv = [&](const char * key) -> const known_value & { return known[known_index(key)]; };

    // the request id, so that later errors can carry it (it is the first field of dispatch and result)
    if (kv("id").seen) {
        moeswarm_mp_reader ir;
        moeswarm_mp_value iv;
        value_at(data, size, kv("id").pos, &iv, &ir);
        if (iv.type == MOESWARM_MP_UINT && iv.u <= 0xffffffffu) {
            f->has_id = true;
            f->id = iv.u;
        }
    }

    // checks 3-5: t, v, the type
    if (!kv("t").seen) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "field `t` is required");
    }
    moeswarm_mp_reader tr;
    moeswarm_mp_value t;
    value_at(data, size, kv("t").pos, &t, &tr);
    if (t.type != MOESWARM_MP_STR || !moeswarm_utf8_valid(t.ptr, t.n)) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "field `t` must be a string");
    }
    if (!kv("v").seen) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "field `v` is required");
    }
    moeswarm_mp_value v;
    value_at(data, size, kv("v").pos, &v, &tr);
    if (v.type != MOESWARM_MP_UINT && v.type != MOESWARM_MP_INT) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "field `v` must be an integer");
    }
    if (v.type != MOESWARM_MP_UINT || v.u != MOESWARM_PROTOCOL_VERSION) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_VERSION", "protocol version %lld (this worker speaks 1)",
            v.type == MOESWARM_MP_UINT ? (long long) v.u : (long long) v.i);
    }
    const frame_spec * spec = nullptr;
    for (const frame_spec & fs : k_frames) {
        if (bytes_eq(t.ptr, t.n, fs.name)) {
            spec = &fs;
        }
    }
    if (spec == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_UNKNOWN_TYPE", "unknown frame type `%.*s`",
            (int) (t.n < 32 ? t.n : 32), (const char *) t.ptr);
    }
    f->type = spec->type;

    // check 6: required fields present; check 7: each present field valid
    for (size_t i = 0; i < spec->n_fields; ++i) {
        if (spec->fields[i].required && !kv(spec->fields[i].key).seen) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "%s.%s is required", spec->name,
                spec->fields[i].key);
        }
    }
    for (size_t i = 0; i < spec->n_fields; ++i) {
        const known_value & k = kv(spec->fields[i].key);
        if (k.seen && !check_field(data, size, k.pos, spec->fields[i], spec->name, max_expert, err)) {
            return false;
        }
    }

    read_str(data, size, kv("to"), &f->to);
    read_str(data, size, kv("from"), &f->from);

    if (f->type == MOESWARM_FRAME_DISPATCH || f->type == MOESWARM_FRAME_RESULT) {
        f->n = (uint32_t) read_uint(data, size, kv("n"));
        f->k = (uint32_t) read_uint(data, size, kv("k"));
        f->embd = (uint32_t) read_uint(data, size, kv("embd"));
        moeswarm_str mode;
        read_str(data, size, kv("mode"), &mode);
        f->mode = bytes_eq(mode.ptr, mode.len, "sum") ? MOESWARM_MODE_SUM : MOESWARM_MODE_EACH;
    }
    if (f->type == MOESWARM_FRAME_DISPATCH || f->type == MOESWARM_FRAME_RESULT) {
        f->compact = kv("compact").seen && read_bool(data, size, kv("compact"));
        if (f->compact && f->mode != MOESWARM_MODE_EACH) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "compact is for mode each only");
        }
    }
    if (f->type == MOESWARM_FRAME_RESULT && f->compact) {
        // the filled slots' rows: a whole number of rows, at most n*k
        read_str(data, size, kv("y"), &f->y);
        const uint64_t row = (uint64_t) f->embd * 4;
        if (f->y.len % row != 0 || f->y.len > (uint64_t) f->n * f->k * row) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "a compact result.y has %u bytes, not whole rows of n*k at most",
                f->y.len);
        }
    } else if (f->type == MOESWARM_FRAME_RESULT) {
        moeswarm_str & y = f->y;
        read_str(data, size, kv("y"), &y);
        const uint64_t want = (uint64_t) f->n * (f->mode == MOESWARM_MODE_EACH ? f->k : 1) * f->embd * 4;
        if (y.len != want) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "result.y has %u bytes, its shape needs %llu",
                y.len, (unsigned long long) want);
        }
    }
    if (f->type == MOESWARM_FRAME_ERROR) {
        read_str(data, size, kv("code"), &f->code);
        read_str(data, size, kv("msg"), &f->msg);
    }
    if (f->type == MOESWARM_FRAME_DISPATCH) {
        read_str(data, size, kv("model"), &f->model);
        f->layer = (uint32_t) read_uint(data, size, kv("layer"));
        moeswarm_str dtype;
        read_str(data, size, kv("dtype"), &dtype);
        f->dtype = bytes_eq(dtype.ptr, dtype.len, "f32") ? MOESWARM_DTYPE_F32
                 : bytes_eq(dtype.ptr, dtype.len, "f16") ? MOESWARM_DTYPE_F16 : MOESWARM_DTYPE_BF16;
        read_str(data, size, kv("x"), &f->x);
        read_str(data, size, kv("ids"), &f->ids);
        read_str(data, size, kv("w"), &f->w);
        if (kv("deadline").seen) {
            f->has_deadline = true;
            f->deadline = read_uint(data, size, kv("deadline"));
        }
        // check 8: tensor lengths
        const uint64_t nk = (uint64_t) f->n * f->k;
        const uint64_t want_x = (uint64_t) f->n * f->embd * moeswarm_dtype_size(f->dtype);
        if (f->x.len != want_x) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.x has %u bytes, its shape needs %llu",
                f->x.len, (unsigned long long) want_x);
        }
        if (f->ids.len != nk * 4) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.ids has %u bytes, its shape needs %llu",
                f->ids.len, (unsigned long long) (nk * 4));
        }
        if (f->w.present && f->w.len != nk * 4) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.w has %u bytes, its shape needs %llu",
                f->w.len, (unsigned long long) (nk * 4));
        }
        // check 9: weights for mode sum
        if (f->mode == MOESWARM_MODE_SUM && !f->w.present) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "dispatch.w is required in mode sum");
        }
        // check 10: ids >= -1 (and below max_expert), weights finite
        for (uint64_t i = 0; i < nk; ++i) {
            int32_t id;
            memcpy(&id, f->ids.ptr + 4 * i, 4);
            if (id < -1 || (max_expert > 0 && id >= 0 && (uint32_t) id >= max_expert)) {
                return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "dispatch.ids[%llu] = %d is not a valid expert id",
                    (unsigned long long) i, id);
            }
        }
        if (f->w.present) {
            for (uint64_t i = 0; i < nk; ++i) {
                float wv;
                memcpy(&wv, f->w.ptr + 4 * i, 4);
                if (!isfinite(wv)) {
                    return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "dispatch.w[%llu] is not finite",
                        (unsigned long long) i);
                }
            }
        }
    }
    if (f->type == MOESWARM_FRAME_PING || f->type == MOESWARM_FRAME_PONG) {
        f->seq = read_uint(data, size, kv("seq"));
        f->ts = read_float(data, size, kv("ts"));
    }
    return true;
}

//
// encoders (canonical key order of section 4)
//

static void write_key(moeswarm_mp_writer * w, const char * key) {
    moeswarm_mp_write_cstr(w, key);
}

static void write_envelope(moeswarm_mp_writer * w, uint32_t n_fields, const char * type) {
    moeswarm_mp_write_map(w, n_fields + 2);
    write_key(w, "t");
    moeswarm_mp_write_cstr(w, type);
    write_key(w, "v");
    moeswarm_mp_write_uint(w, MOESWARM_PROTOCOL_VERSION);
}

// a reply goes back where the request came from: to = the request's from, from = its to
static uint32_t route_fields(const moeswarm_frame * req) {
    return req == nullptr ? 0 : (uint32_t) req->from.present + (uint32_t) req->to.present;
}

static void write_route(moeswarm_mp_writer * w, const moeswarm_frame * req) {
    if (req != nullptr && req->from.present) {
        write_key(w, "to");
        moeswarm_mp_write_str(w, (const char *) req->from.ptr, req->from.len);
    }
    if (req != nullptr && req->to.present) {
        write_key(w, "from");
        moeswarm_mp_write_str(w, (const char *) req->to.ptr, req->to.len);
    }
}

void moeswarm_frame_write_hello(struct moeswarm_mp_writer * w, const char * id, const char * backend, uint32_t max_frame) {
    write_envelope(w, 4, "hello");
    write_key(w, "role");
    moeswarm_mp_write_cstr(w, "worker");
    write_key(w, "id");
    moeswarm_mp_write_cstr(w, id);
    write_key(w, "token");
    moeswarm_mp_write_cstr(w, "");
    write_key(w, "caps");
    moeswarm_mp_write_map(w, 3);
    write_key(w, "backends");
    moeswarm_mp_write_array(w, 1);
    moeswarm_mp_write_cstr(w, backend);
    write_key(w, "dtypes");
    moeswarm_mp_write_array(w, 3);
    moeswarm_mp_write_cstr(w, "f32");
    moeswarm_mp_write_cstr(w, "f16");
    moeswarm_mp_write_cstr(w, "bf16");
    write_key(w, "maxFrame");
    moeswarm_mp_write_uint(w, max_frame);
}

#ifndef MOESWARM_FRAME_NO_SLICE
void moeswarm_frame_write_register(struct moeswarm_mp_writer * w, const char * model, const struct moeswarm_slice * slice,
        const char * backend) {
    const uint32_t n_layer = moeswarm_slice_n_layer(slice);
    const uint32_t n_expert = moeswarm_slice_n_expert(slice);
    write_envelope(w, 5, "register");
    write_key(w, "model");
    moeswarm_mp_write_cstr(w, model);
    write_key(w, "layers");
    moeswarm_mp_write_array(w, n_layer);
    for (uint32_t i = 0; i < n_layer; ++i) {
        moeswarm_mp_write_uint(w, moeswarm_slice_layers(slice)[i]);
    }
    // the protocol lists the experts strictly ascending (the slice order may differ)
    std::vector<uint32_t> sorted(moeswarm_slice_experts(slice), moeswarm_slice_experts(slice) + n_expert);
    for (size_t i = 1; i < sorted.size(); ++i) {
        for (size_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) {
            const uint32_t tmp = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = tmp;
        }
    }
    write_key(w, "experts");
    moeswarm_mp_write_array(w, n_expert);
    for (uint32_t e : sorted) {
        moeswarm_mp_write_uint(w, e);
    }
    write_key(w, "capacity");
    moeswarm_mp_write_uint(w, moeswarm_slice_weight_bytes(slice));
    write_key(w, "backend");
    moeswarm_mp_write_cstr(w, backend);
}
#endif

void moeswarm_frame_write_error(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const char * code,
        const char * msg) {
    const bool with_id = req != nullptr && req->has_id;
    write_envelope(w, 2 + (with_id ? 1 : 0) + route_fields(req), "error");
    if (with_id) {
        write_key(w, "id");
        moeswarm_mp_write_uint(w, req->id);
    }
    write_route(w, req);
    write_key(w, "code");
    moeswarm_mp_write_cstr(w, code);
    // valid UTF-8 of at most 16384 bytes: replace stray bytes (file paths may hold any)
    std::vector<char> clean;
    const size_t n = strlen(msg);
    for (size_t i = 0; i < n && clean.size() < 16380;) {
        size_t len = 1;
        const uint8_t c = (uint8_t) msg[i];
        if (c >= 0xf0) len = 4; else if (c >= 0xe0) len = 3; else if (c >= 0xc0) len = 2;
        if (i + len <= n && moeswarm_utf8_valid((const uint8_t *) msg + i, len)) {
            clean.insert(clean.end(), msg + i, msg + i + len);
            i += len;
        } else {
            clean.push_back('?');
            i += 1;
        }
    }
    write_key(w, "msg");
    moeswarm_mp_write_str(w, clean.data(), clean.size());
}

void moeswarm_frame_write_pong(struct moeswarm_mp_writer * w, uint64_t seq, double ts) {
    write_envelope(w, 2, "pong");
    write_key(w, "seq");
    moeswarm_mp_write_uint(w, seq);
    write_key(w, "ts");
    moeswarm_mp_write_number(w, ts);
}

void moeswarm_frame_write_result(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const float * y,
        size_t n_y, double ms) {
    // a compact answer to a compact dispatch: the filled slots' rows only (protocol section 5)
    const bool compact = req->compact && req->mode == MOESWARM_MODE_EACH;
    write_envelope(w, 7 + route_fields(req) + (compact ? 1 : 0), "result");
    write_key(w, "id");
    moeswarm_mp_write_uint(w, req->id);
    write_route(w, req);
    write_key(w, "mode");
    moeswarm_mp_write_cstr(w, req->mode == MOESWARM_MODE_SUM ? "sum" : "each");
    write_key(w, "n");
    moeswarm_mp_write_uint(w, req->n);
    write_key(w, "k");
    moeswarm_mp_write_uint(w, req->k);
    write_key(w, "embd");
    moeswarm_mp_write_uint(w, req->embd);
    write_key(w, "y");
    // little-endian hosts only (x86-64, aarch64): the floats are their own wire bytes
    if (compact) {
        const size_t nk = (size_t) req->n * req->k;
        size_t filled = 0;
        for (size_t s = 0; s < nk; ++s) {
            int32_t id;
            memcpy(&id, req->ids.ptr + 4 * s, 4);
            filled += id >= 0 ? 1 : 0;
        }
        const size_t row = (size_t) req->embd;
        uint8_t * dst = moeswarm_mp_write_bin_reserve(w, filled * row * sizeof(float));
        for (size_t s = 0; s < nk && s * row < n_y; ++s) {
            int32_t id;
            memcpy(&id, req->ids.ptr + 4 * s, 4);
            if (id < 0) {
                continue;
            }
            memcpy(dst, y + s * row, row * sizeof(float));
            dst += row * sizeof(float);
        }
    } else {
        uint8_t * dst = moeswarm_mp_write_bin_reserve(w, n_y * sizeof(float));
        memcpy(dst, y, n_y * sizeof(float));
    }
    write_key(w, "ms");
    moeswarm_mp_write_number(w, ms);
    if (compact) {
        write_key(w, "compact");
        moeswarm_mp_write_bool(w, true);
    }
}

void moeswarm_frame_write_dispatch(struct moeswarm_mp_writer * w, const struct moeswarm_dispatch_desc * d) {
    const size_t nk = (size_t) d->n * d->k;
    const bool with_w = d->weights != nullptr;
    write_envelope(w, 10 + (with_w ? 1 : 0), "dispatch");
    write_key(w, "id");
    moeswarm_mp_write_uint(w, d->id);
    write_key(w, "model");
    moeswarm_mp_write_cstr(w, d->model);
    write_key(w, "layer");
    moeswarm_mp_write_uint(w, d->layer);
    write_key(w, "n");
    moeswarm_mp_write_uint(w, d->n);
    write_key(w, "embd");
    moeswarm_mp_write_uint(w, d->embd);
    write_key(w, "dtype");
    moeswarm_mp_write_cstr(w, "f32");
    write_key(w, "x");
    moeswarm_mp_write_bin(w, d->x, (size_t) d->n * d->embd * sizeof(float));
    write_key(w, "k");
    moeswarm_mp_write_uint(w, d->k);
    write_key(w, "ids");
    moeswarm_mp_write_bin(w, d->ids, nk * sizeof(int32_t));
    if (with_w) {
        write_key(w, "w");
        moeswarm_mp_write_bin(w, d->weights, nk * sizeof(float));
    }
    write_key(w, "mode");
    moeswarm_mp_write_cstr(w, d->mode == MOESWARM_MODE_SUM ? "sum" : "each");
}
