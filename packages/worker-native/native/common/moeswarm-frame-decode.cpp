// Decoding and validating a frame of the wire protocol v1 in the order of docs/protocol.md section 6
// (unknown keys skipped, the first failure reported with its MOESWARM_PROTOCOL_* code).

#include "moeswarm-frame-fields.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <vector>

size_t moeswarm_dtype_size(enum moeswarm_dtype dtype) {
    return dtype == MOESWARM_DTYPE_F32 ? 4 : 2;
}

// bytes of n rows of embd activations in dtype; 0 when embd is not a whole number of q8 blocks
static uint64_t dispatch_x_bytes(enum moeswarm_dtype dtype, uint64_t n, uint64_t embd) {
    if (dtype == MOESWARM_DTYPE_Q8_0) {
        return embd % 32 == 0 ? n * (embd / 32) * 34 : 0;
    }
    if (dtype == MOESWARM_DTYPE_Q8_K) {
        return embd % 256 == 0 ? n * (embd / 256) * 292 : 0;
    }
    return n * embd * moeswarm_dtype_size(dtype);
}

static bool read_str(const uint8_t * data, size_t size, const known_value & kv, moeswarm_str * out) {
    out->present = false;
    if (!kv.seen) {
        return true;
    }
    moeswarm_mp_reader r;
    moeswarm_mp_value v;
    value_at(data, size, kv.pos, &v, &r);
    out->ptr     = v.ptr;
    out->len     = v.n;
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

static const known_value & kv_of(const known_value * known, const char * key) {
    return known[moeswarm_frame_known_index(key)];
}

// check 2: one well-formed map, string keys, no ext, depth <= 16, no repeated known key; records
// where each known key's value starts
static bool decode_map(const uint8_t * data, size_t size, known_value * known, moeswarm_error * err) {
    const char * malformed = "MOESWARM_PROTOCOL_MALFORMED";
    moeswarm_mp_reader r;
    moeswarm_mp_reader_init(&r, data, size);
    moeswarm_mp_value head;
    if (size == 0 || !moeswarm_mp_read(&r, &head) || head.type != MOESWARM_MP_MAP) {
        return moeswarm_error_set(err, malformed, "a frame is one msgpack map");
    }
    memset(known, 0, sizeof(known_value) * MOESWARM_FRAME_N_KNOWN);
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
            idx         = moeswarm_frame_known_index(name);
        }
        const size_t at = r.pos;
        if (!moeswarm_mp_skip(&r, MOESWARM_FRAME_DEPTH - 1)) {
            return moeswarm_error_set(err, malformed, "a value is truncated, nested too deep, or not plain msgpack");
        }
        if (idx >= 0) {
            if (known[idx].seen) {
                return moeswarm_error_set(err, malformed, "key `%s` appears twice", moeswarm_frame_known_key(idx));
            }
            known[idx].seen = true;
            known[idx].pos  = at;
        }
    }
    if (r.pos != size) {
        return moeswarm_error_set(err, malformed, "%zu bytes after the frame's map", size - r.pos);
    }
    return true;
}

// checks 3-5: t, v, the type; NULL (err set) when one fails
static const frame_spec * decode_type(const uint8_t * data, size_t size, const known_value * known, moeswarm_error * err) {
    if (!kv_of(known, "t").seen) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "field `t` is required");
        return nullptr;
    }
    moeswarm_mp_reader tr;
    moeswarm_mp_value t;
    value_at(data, size, kv_of(known, "t").pos, &t, &tr);
    if (t.type != MOESWARM_MP_STR || !moeswarm_utf8_valid(t.ptr, t.n)) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "field `t` must be a string");
        return nullptr;
    }
    if (!kv_of(known, "v").seen) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_MISSING_FIELD", "field `v` is required");
        return nullptr;
    }
    moeswarm_mp_value v;
    value_at(data, size, kv_of(known, "v").pos, &v, &tr);
    if (v.type != MOESWARM_MP_UINT && v.type != MOESWARM_MP_INT) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "field `v` must be an integer");
        return nullptr;
    }
    if (v.type != MOESWARM_MP_UINT || v.u != MOESWARM_PROTOCOL_VERSION) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_VERSION", "protocol version %lld (this worker speaks 1)",
                v.type == MOESWARM_MP_UINT ? (long long) v.u : (long long) v.i);
        return nullptr;
    }
    const frame_spec * spec = moeswarm_frame_spec_find(t.ptr, t.n);
    if (spec == nullptr) {
        moeswarm_error_set(err, "MOESWARM_PROTOCOL_UNKNOWN_TYPE", "unknown frame type `%.*s`", (int) (t.n < 32 ? t.n : 32),
                (const char *) t.ptr);
    }
    return spec;
}

// check 6: required fields present; check 7: each present field valid
static bool check_fields(const uint8_t * data, size_t size, const known_value * known, const frame_spec * spec,
        uint32_t max_expert, moeswarm_error * err) {
    for (size_t i = 0; i < spec->n_fields; ++i) {
        if (spec->fields[i].required && !kv_of(known, spec->fields[i].key).seen) {
            return moeswarm_error_set(
                    err, "MOESWARM_PROTOCOL_MISSING_FIELD", "%s.%s is required", spec->name, spec->fields[i].key);
        }
    }
    for (size_t i = 0; i < spec->n_fields; ++i) {
        const known_value & k = kv_of(known, spec->fields[i].key);
        if (k.seen && !moeswarm_frame_check_field(data, size, k.pos, spec->fields[i], spec->name, max_expert, err)) {
            return false;
        }
    }
    return true;
}

// result.y: n*k rows (n in mode sum), or when compact whole rows of at most n*k filled slots
static bool read_result_y(
        const uint8_t * data, size_t size, const known_value * known, moeswarm_frame * f, moeswarm_error * err) {
    read_str(data, size, kv_of(known, "y"), &f->y);
    if (f->compact) {
        const uint64_t row = (uint64_t) f->embd * 4;
        if (f->y.len % row != 0 || f->y.len > (uint64_t) f->n * f->k * row) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH",
                    "a compact result.y has %u bytes, not whole rows of n*k at most", f->y.len);
        }
        return true;
    }
    const uint64_t want = (uint64_t) f->n * (f->mode == MOESWARM_MODE_EACH ? f->k : 1) * f->embd * 4;
    if (f->y.len != want) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "result.y has %u bytes, its shape needs %llu", f->y.len,
                (unsigned long long) want);
    }
    return true;
}

// the fields of a dispatch, then checks 8-10: tensor lengths, weights for mode sum, ids and weights
static bool read_dispatch(const uint8_t * data, size_t size, const known_value * known, uint32_t max_expert, moeswarm_frame * f,
        moeswarm_error * err) {
    auto kv = [&](const char * key) -> const known_value & {
        return kv_of(known, key);
    };
    read_str(data, size, kv("model"), &f->model);
    f->layer = (uint32_t) read_uint(data, size, kv("layer"));
    moeswarm_str dtype = {};
    read_str(data, size, kv("dtype"), &dtype);
    f->dtype = bytes_eq(dtype.ptr, dtype.len, "f32") ? MOESWARM_DTYPE_F32 :
            bytes_eq(dtype.ptr, dtype.len, "f16")    ? MOESWARM_DTYPE_F16 :
            bytes_eq(dtype.ptr, dtype.len, "q8_0")   ? MOESWARM_DTYPE_Q8_0 :
            bytes_eq(dtype.ptr, dtype.len, "q8_K")   ? MOESWARM_DTYPE_Q8_K :
                                                       MOESWARM_DTYPE_BF16;
    read_str(data, size, kv("x"), &f->x);
    read_str(data, size, kv("ids"), &f->ids);
    read_str(data, size, kv("w"), &f->w);
    if (kv("deadline").seen) {
        f->has_deadline = true;
        f->deadline     = read_uint(data, size, kv("deadline"));
    }
    // check 8: tensor lengths
    const uint64_t nk     = (uint64_t) f->n * f->k;
    const uint64_t want_x = dispatch_x_bytes(f->dtype, f->n, f->embd);
    if (want_x == 0) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.embd %u is not a whole number of %s blocks",
                f->embd, f->dtype == MOESWARM_DTYPE_Q8_0 ? "q8_0" : "q8_K");
    }
    if (f->x.len != want_x) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.x has %u bytes, its shape needs %llu", f->x.len,
                (unsigned long long) want_x);
    }
    if (f->ids.len != nk * 4) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.ids has %u bytes, its shape needs %llu",
                f->ids.len, (unsigned long long) (nk * 4));
    }
    if (f->w.present && f->w.len != nk * 4) {
        return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_LENGTH", "dispatch.w has %u bytes, its shape needs %llu", f->w.len,
                (unsigned long long) (nk * 4));
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
                return moeswarm_error_set(
                        err, "MOESWARM_PROTOCOL_BAD_FIELD", "dispatch.w[%llu] is not finite", (unsigned long long) i);
            }
        }
    }
    return true;
}

bool moeswarm_frame_decode(
        const uint8_t * data, size_t size, uint32_t max_expert, struct moeswarm_frame * f, struct moeswarm_error * err) {
    memset(f, 0, sizeof(*f));
    moeswarm_error_clear(err);
    known_value known[MOESWARM_FRAME_N_KNOWN];
    if (!decode_map(data, size, known, err)) {
        return false;
    }
    auto kv = [&](const char * key) -> const known_value & {
        return kv_of(known, key);
    };

    // the request id, so that later errors can carry it (it is the first field of dispatch and result)
    if (kv("id").seen) {
        moeswarm_mp_reader ir;
        moeswarm_mp_value iv;
        value_at(data, size, kv("id").pos, &iv, &ir);
        if (iv.type == MOESWARM_MP_UINT && iv.u <= 0xffffffffu) {
            f->has_id = true;
            f->id     = iv.u;
        }
    }
    const frame_spec * spec = decode_type(data, size, known, err);
    if (spec == nullptr) {
        return false;
    }
    f->type = spec->type;
    if (!check_fields(data, size, known, spec, max_expert, err)) {
        return false;
    }

    read_str(data, size, kv("to"), &f->to);
    read_str(data, size, kv("from"), &f->from);

    if (f->type == MOESWARM_FRAME_DISPATCH || f->type == MOESWARM_FRAME_RESULT) {
        f->n    = (uint32_t) read_uint(data, size, kv("n"));
        f->k    = (uint32_t) read_uint(data, size, kv("k"));
        f->embd = (uint32_t) read_uint(data, size, kv("embd"));
        moeswarm_str mode = {};
        read_str(data, size, kv("mode"), &mode);
        f->mode    = bytes_eq(mode.ptr, mode.len, "sum") ? MOESWARM_MODE_SUM : MOESWARM_MODE_EACH;
        f->compact = kv("compact").seen && read_bool(data, size, kv("compact"));
        if (f->compact && f->mode != MOESWARM_MODE_EACH) {
            return moeswarm_error_set(err, "MOESWARM_PROTOCOL_BAD_FIELD", "compact is for mode each only");
        }
    }
    if (f->type == MOESWARM_FRAME_RESULT && !read_result_y(data, size, known, f, err)) {
        return false;
    }
    if (f->type == MOESWARM_FRAME_ERROR) {
        read_str(data, size, kv("code"), &f->code);
        read_str(data, size, kv("msg"), &f->msg);
    }
    if (f->type == MOESWARM_FRAME_DISPATCH && !read_dispatch(data, size, known, max_expert, f, err)) {
        return false;
    }
    if (f->type == MOESWARM_FRAME_PING || f->type == MOESWARM_FRAME_PONG) {
        f->seq = read_uint(data, size, kv("seq"));
        f->ts  = read_float(data, size, kv("ts"));
    }
    return true;
}
