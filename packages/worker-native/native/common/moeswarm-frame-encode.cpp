// Encoders of the frames of the wire protocol v1 (docs/protocol.md, section 8: canonical key
// order of section 4). Decoding: moeswarm-frame-decode.cpp.

#include "moeswarm-frame.h"

#include <string.h>

#include <vector>

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

// The padding entry `_` (a bin of 0..7 zero bytes) that comes right before the main tensor `x` or
// `y` (protocol section 8): it puts the tensor's first data byte at a multiple of 8 from the
// payload's first byte (`start` in the buffer), so that a receiver holding the payload at an
// aligned address reads the tensor in place. `n` is the tensor's byte length (its bin header).
static void write_pad(moeswarm_mp_writer * w, size_t start, size_t n) {
    const size_t bin_header = n <= 0xff ? 2 : n <= 0xffff ? 3 : 5;
    // the entry without padding bytes (key 2, bin 8 header 2), then the tensor's key and header
    const size_t at  = w->buf.size() - start + 4 + 2 + bin_header;
    const size_t pad = (8 - at % 8) % 8;
    write_key(w, "_");
    moeswarm_mp_write_bin_reserve(w, pad);
    memset(w->buf.data() + w->buf.size() - pad, 0, pad);
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

void moeswarm_frame_write_backbone_hello(struct moeswarm_mp_writer * w, const char * id, const char * token) {
    write_envelope(w, 3, "hello");
    write_key(w, "role");
    moeswarm_mp_write_cstr(w, "backbone");
    write_key(w, "id");
    moeswarm_mp_write_cstr(w, id);
    write_key(w, "token");
    moeswarm_mp_write_cstr(w, token);
}

void moeswarm_frame_write_register(
        struct moeswarm_mp_writer * w, const char * model, const struct moeswarm_register_desc * d, const char * backend) {
    write_envelope(w, 5, "register");
    write_key(w, "model");
    moeswarm_mp_write_cstr(w, model);
    write_key(w, "layers");
    moeswarm_mp_write_array(w, d->n_layer);
    for (uint32_t i = 0; i < d->n_layer; ++i) {
        moeswarm_mp_write_uint(w, d->layers[i]);
    }
    // the protocol lists the experts strictly ascending (the slice order may differ)
    std::vector<uint32_t> sorted(d->experts, d->experts + d->n_expert);
    for (size_t i = 1; i < sorted.size(); ++i) {
        for (size_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) {
            const uint32_t tmp = sorted[j];
            sorted[j]          = sorted[j - 1];
            sorted[j - 1]      = tmp;
        }
    }
    write_key(w, "experts");
    moeswarm_mp_write_array(w, d->n_expert);
    for (uint32_t e : sorted) {
        moeswarm_mp_write_uint(w, e);
    }
    write_key(w, "capacity");
    moeswarm_mp_write_uint(w, d->capacity);
    write_key(w, "backend");
    moeswarm_mp_write_cstr(w, backend);
}

void moeswarm_frame_write_error(
        struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const char * code, const char * msg) {
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
        size_t len      = 1;
        const uint8_t c = (uint8_t) msg[i];
        if (c >= 0xf0)
            len = 4;
        else if (c >= 0xe0)
            len = 3;
        else if (c >= 0xc0)
            len = 2;
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

// every field of a result up to its y (the count includes y, ms and compact)
static void write_result_head(moeswarm_mp_writer * w, const moeswarm_frame * req, bool compact) {
    write_envelope(w, 8 + route_fields(req) + (compact ? 1 : 0), "result");
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
}

float * moeswarm_frame_write_result_begin(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, size_t n_y) {
    const size_t start = w->buf.size();
    write_result_head(w, req, false);
    write_pad(w, start, n_y * sizeof(float));
    write_key(w, "y");
    // little-endian hosts only (x86-64, aarch64): the floats are their own wire bytes
    return (float *) moeswarm_mp_write_bin_reserve(w, n_y * sizeof(float));
}

void moeswarm_frame_write_result_end(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, double ms) {
    write_key(w, "ms");
    moeswarm_mp_write_number(w, ms);
    if (req->compact && req->mode == MOESWARM_MODE_EACH) {
        write_key(w, "compact");
        moeswarm_mp_write_bool(w, true);
    }
}

void moeswarm_frame_write_result(
        struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const float * y, size_t n_y, double ms) {
    // a compact answer to a compact dispatch: the filled slots' rows only (protocol section 5)
    if (!(req->compact && req->mode == MOESWARM_MODE_EACH)) {
        memcpy(moeswarm_frame_write_result_begin(w, req, n_y), y, n_y * sizeof(float));
        moeswarm_frame_write_result_end(w, req, ms);
        return;
    }
    const size_t start = w->buf.size();
    write_result_head(w, req, true);
    const size_t nk = (size_t) req->n * req->k;
    size_t filled   = 0;
    for (size_t s = 0; s < nk; ++s) {
        int32_t id;
        memcpy(&id, req->ids.ptr + 4 * s, 4);
        filled += id >= 0 ? 1 : 0;
    }
    const size_t row = (size_t) req->embd;
    write_pad(w, start, filled * row * sizeof(float));
    write_key(w, "y");
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
    moeswarm_frame_write_result_end(w, req, ms);
}

void moeswarm_frame_write_dispatch(struct moeswarm_mp_writer * w, const struct moeswarm_dispatch_desc * d) {
    const size_t nk   = (size_t) d->n * d->k;
    const bool with_w  = d->weights != nullptr;
    const bool compact = d->compact && d->mode == MOESWARM_MODE_EACH;
    const size_t start = w->buf.size();
    write_envelope(w, 11 + (with_w ? 1 : 0) + (compact ? 1 : 0), "dispatch");
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
    write_pad(w, start, (size_t) d->n * d->embd * sizeof(float));
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
    if (compact) {
        write_key(w, "compact");
        moeswarm_mp_write_bool(w, true);
    }
}

void moeswarm_frame_prefix(std::vector<uint8_t> & buf) {
    const uint32_t len = (uint32_t) (buf.size() - 4);
    for (int i = 0; i < 4; ++i)
        buf[i] = (uint8_t) (len >> (8 * i));
}
