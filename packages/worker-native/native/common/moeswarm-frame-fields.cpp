// The field tables of the frames (section 4 of docs/protocol.md) and check 7: every present field
// of a frame has its type and range.

#include "moeswarm-frame-fields.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

//
// the field tables of section 4
//



static const field_spec k_hello[] = {
    { "role",  FK_ENUM, true,  0, 0,    0, { "worker", "backbone", nullptr }, false },
    { "id",    FK_STR,  true,  1, 128,  0, { nullptr },                       false },
    { "token", FK_STR,  true,  0, 8192, 0, { nullptr },                       false },
    { "caps",  FK_CAPS, false, 0, 0,    0, { nullptr },                       false },
};
static const field_spec k_caps[] = {
    { "backends", FK_STR_ARRAY, false, 1, 64,          64, { nullptr }, false },
    { "dtypes",   FK_STR_ARRAY, false, 1, 64,          64, { nullptr }, false },
    { "maxFrame", FK_UINT,      false, 0, 0xffffffffu, 0,  { nullptr }, false },
};
static const field_spec k_register[] = {
    { "model",    FK_STR,        true,  1, 256,               0,     { nullptr }, false },
    { "layers",   FK_UINT_ARRAY, true,  0, 65535,             4096,  { nullptr }, false },
    { "experts",  FK_UINT_ARRAY, true,  0, 0x7fffffffu,       65536, { nullptr }, true  },
    { "capacity", FK_UINT,       false, 0, MOESWARM_MAX_SAFE, 0,     { nullptr }, false },
    { "backend",  FK_STR,        false, 1, 64,                0,     { nullptr }, false },
};
static const field_spec k_dispatch[] = {
    { "id",       FK_UINT, true,  0, 0xffffffffu, 0, { nullptr },                false },
    { "to",       FK_STR,  false, 1, 128,         0, { nullptr },                false },
    { "from",     FK_STR,  false, 1, 128,         0, { nullptr },                false },
    { "model",    FK_STR,  true,  1, 256,         0, { nullptr },                false },
    { "layer",    FK_UINT, true,  0, 65535,       0, { nullptr },                false },
    { "n",        FK_UINT, true,  1, 65536,       0, { nullptr },                false },
    { "embd",     FK_UINT, true,  1, 65536,       0, { nullptr },                false },
    { "dtype",    FK_ENUM, true,  0, 0,           0, { "f32", "f16", "bf16", "q8_0", "q8_K" }, false },
    { "x",        FK_BIN,  true,  0, 0,           0, { nullptr },                false },
    { "k",        FK_UINT, true,  1, 256,         0, { nullptr },                false },
    { "ids",      FK_BIN,  true,  0, 0,           0, { nullptr },                false },
    { "w",        FK_BIN,  false, 0, 0,           0, { nullptr },                false },
    { "mode",     FK_ENUM, true,  0, 0,           0, { "each", "sum", nullptr }, false },
    { "deadline", FK_UINT, false, 0, 0xffffffffu, 0, { nullptr },                false },
    { "compact",  FK_BOOL, false, 0, 0,           0, { nullptr },                false },
};
static const field_spec k_result[] = {
    { "id",      FK_UINT,  true,  0, 0xffffffffu, 0, { nullptr },                false },
    { "to",      FK_STR,   false, 1, 128,         0, { nullptr },                false },
    { "from",    FK_STR,   false, 1, 128,         0, { nullptr },                false },
    { "mode",    FK_ENUM,  true,  0, 0,           0, { "each", "sum", nullptr }, false },
    { "n",       FK_UINT,  true,  1, 65536,       0, { nullptr },                false },
    { "k",       FK_UINT,  true,  1, 256,         0, { nullptr },                false },
    { "embd",    FK_UINT,  true,  1, 65536,       0, { nullptr },                false },
    { "y",       FK_BIN,   true,  0, 0,           0, { nullptr },                false },
    { "ms",      FK_FLOAT, false, 1, 0,           0, { nullptr },                false },
    { "compact", FK_BOOL,  false, 0, 0,           0, { nullptr },                false },
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
    "t",
    "v",
    "role",
    "id",
    "token",
    "caps",
    "model",
    "layers",
    "experts",
    "capacity",
    "backend",
    "to",
    "from",
    "layer",
    "n",
    "embd",
    "dtype",
    "x",
    "k",
    "ids",
    "w",
    "mode",
    "deadline",
    "y",
    "ms",
    "code",
    "msg",
    "seq",
    "ts",
    "reason",
    "compact",
};
#define N_KNOWN (sizeof(k_known_keys) / sizeof(k_known_keys[0]))
static_assert(N_KNOWN == MOESWARM_FRAME_N_KNOWN, "MOESWARM_FRAME_N_KNOWN is the number of known keys");



int moeswarm_frame_known_index(const char * key) {
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



// check 7 for a string or enum field (and the shape of an error code)
static bool check_str_field(const moeswarm_mp_value & v, const field_spec & fs, const char * frame, moeswarm_error * err) {
    const char * bad = "MOESWARM_PROTOCOL_BAD_FIELD";
    char what[128];
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
            ok              = (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
        }
        if (!ok) {
            return fail_field(err, bad, frame, fs.key, "must match ^MOESWARM_[A-Z0-9_]+$");
        }
    }
    return true;
}

// check 7 for an array of integers (expert ids: below max_expert, strictly ascending) or strings;
// r is positioned at the array's first entry
static bool check_array_field(const moeswarm_mp_value & v, moeswarm_mp_reader & r, const field_spec & fs, const char * frame,
        uint32_t max_expert, moeswarm_error * err) {
    const char * bad = "MOESWARM_PROTOCOL_BAD_FIELD";
    char what[128];
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
                snprintf(what, sizeof(what), "entry %u is not an integer in %llu..%llu", i, (unsigned long long) fs.lo,
                        (unsigned long long) hi);
                return fail_field(err, bad, frame, fs.key, what);
            }
            if (fs.ascending && i > 0 && e.u <= prev) {
                return fail_field(err, bad, frame, fs.key, "must be strictly ascending");
            }
            prev = e.u;
        } else {
            if (e.type != MOESWARM_MP_STR || !moeswarm_utf8_valid(e.ptr, e.n) || e.n < fs.lo || e.n > fs.hi) {
                snprintf(what, sizeof(what), "entry %u is not a UTF-8 string of %llu..%llu bytes", i, (unsigned long long) fs.lo,
                        (unsigned long long) fs.hi);
                return fail_field(err, bad, frame, fs.key, what);
            }
        }
    }
    return true;
}

// check 7 for hello.caps: a map whose known keys are checked like fields (each at most once);
// r is positioned at the map's first key
static bool check_caps_field(const uint8_t * data, size_t size, const moeswarm_mp_value & v, moeswarm_mp_reader & r,
        const field_spec & fs, const char * frame, uint32_t max_expert, moeswarm_error * err) {
    if (v.type != MOESWARM_MP_MAP) {
        return fail_field(err, "MOESWARM_PROTOCOL_BAD_FIELD", frame, fs.key, "must be a map");
    }
    bool seen[3] = { false, false, false };
    for (uint32_t i = 0; i < v.n; ++i) {
        moeswarm_mp_value key;
        moeswarm_mp_read(&r, &key);
        const size_t at = r.pos;
        int idx         = -1;
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
            if (!moeswarm_frame_check_field(data, size, at, k_caps[idx], "hello.caps", max_expert, err)) {
                return false;
            }
        }
        r.pos = at;
        moeswarm_mp_skip(&r, MOESWARM_FRAME_DEPTH);
    }
    return true;
}

// check 7 for one present field
bool moeswarm_frame_check_field(const uint8_t * data, size_t size, size_t pos, const field_spec & fs, const char * frame,
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
                snprintf(what, sizeof(what), "%llu is outside %llu..%llu", (unsigned long long) v.u, (unsigned long long) fs.lo,
                        (unsigned long long) fs.hi);
                return fail_field(err, bad, frame, fs.key, what);
            }
            return true;
        case FK_FLOAT: {
            double d;
            if (v.type == MOESWARM_MP_FLOAT)
                d = v.f;
            else if (v.type == MOESWARM_MP_UINT)
                d = (double) v.u;
            else if (v.type == MOESWARM_MP_INT)
                d = (double) v.i;
            else
                return fail_field(err, bad, frame, fs.key, "must be a number");
            if (!isfinite(d) || (fs.lo == 1 && d < 0)) {
                return fail_field(err, bad, frame, fs.key, fs.lo == 1 ? "must be finite and >= 0" : "must be finite");
            }
            return true;
        }
        case FK_STR:
        case FK_ENUM: return check_str_field(v, fs, frame, err);
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
        case FK_STR_ARRAY: return check_array_field(v, r, fs, frame, max_expert, err);
        case FK_CAPS: return check_caps_field(data, size, v, r, fs, frame, max_expert, err);
    }
    return true;
}

const char * moeswarm_frame_known_key(int idx) {
    return k_known_keys[idx];
}

const frame_spec * moeswarm_frame_spec_find(const uint8_t * name, size_t n) {
    const frame_spec * spec = nullptr;
    for (const frame_spec & fs : k_frames) {
        if (bytes_eq(name, n, fs.name)) {
            spec = &fs;
        }
    }
    return spec;
}
