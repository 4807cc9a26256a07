#pragma once

// Frames of the wire protocol v1 (docs/protocol.md is normative; packages/core implements it in
// TypeScript) as the executable worker needs them: decoding and validating any frame in the
// order of section 6 (unknown keys skipped, the first failure reported with its
// MOESWARM_PROTOCOL_* code), and encoding hello, register, result, error and pong canonically
// (section 8; a result's and a dispatch's padding entry `_`, rule 9, included: the decoder skips
// it as any unknown key).

#include "moeswarm-error.h"
#include "moeswarm-mode.h"
#include "moeswarm-msgpack.h"

#include <stddef.h>
#include <stdint.h>

#define MOESWARM_PROTOCOL_VERSION 1
#define MOESWARM_FRAME_MAX_DEFAULT (64u * 1024u * 1024u)

enum moeswarm_frame_type {
    MOESWARM_FRAME_UNKNOWN = 0,
    MOESWARM_FRAME_HELLO,
    MOESWARM_FRAME_REGISTER,
    MOESWARM_FRAME_DISPATCH,
    MOESWARM_FRAME_RESULT,
    MOESWARM_FRAME_ERROR,
    MOESWARM_FRAME_PING,
    MOESWARM_FRAME_PONG,
    MOESWARM_FRAME_DRAIN,
};

enum moeswarm_dtype {
    MOESWARM_DTYPE_F32 = 0,
    MOESWARM_DTYPE_F16,
    MOESWARM_DTYPE_BF16,
    MOESWARM_DTYPE_Q8_0, // ggml block_q8_0 rows (32 values in 34 bytes): x is the raw blocks
    MOESWARM_DTYPE_Q8_K, // ggml block_q8_K rows (256 values in 292 bytes)
};

struct moeswarm_str {
    const uint8_t * ptr; // points into the decoded buffer
    uint32_t        len;
    bool            present;
};

struct moeswarm_frame {
    enum moeswarm_frame_type type;

    bool     has_id;       // request id (dispatch, result, error); also set when a later check failed
    uint64_t id;
    struct moeswarm_str to;
    struct moeswarm_str from;

    // dispatch
    struct moeswarm_str model;
    uint32_t layer;
    uint32_t n;
    uint32_t embd;
    enum moeswarm_dtype dtype;
    struct moeswarm_str x;
    uint32_t k;
    struct moeswarm_str ids;
    struct moeswarm_str w;
    int32_t  mode;         // enum moeswarm_mode
    bool     has_deadline;
    uint64_t deadline;
    bool     compact;      // dispatch: a compact result is welcome; result: y is compact (mode each)

    // ping / pong
    uint64_t seq;
    double   ts;

    // result: y (n*embd or n*k*embd f32, length checked); error: code, msg
    struct moeswarm_str y;
    struct moeswarm_str code;
    struct moeswarm_str msg;
};

// Decodes and validates one frame payload (without its length prefix). On failure err holds
// the MOESWARM_PROTOCOL_* code; f->has_id says whether the request id could be read, and
// f->type is set once `t` was recognised. max_expert: expert ids must be below it (0: no bound).
bool moeswarm_frame_decode(const uint8_t * data, size_t size, uint32_t max_expert, struct moeswarm_frame * f,
        struct moeswarm_error * err);

// what a register frame announces (a slice's layers, experts in any order, weight bytes)
struct moeswarm_register_desc {
    const uint32_t * layers;
    uint32_t         n_layer;
    const uint32_t * experts;
    uint32_t         n_expert;
    uint64_t         capacity;
};

// encoders append one canonical payload (no length prefix) to w
void moeswarm_frame_write_hello(struct moeswarm_mp_writer * w, const char * id, const char * backend, uint32_t max_frame);
// a backbone's hello on a native link (protocol section 10.9): role backbone, its id, the ticket
// the hub signed for this worker as token
void moeswarm_frame_write_backbone_hello(struct moeswarm_mp_writer * w, const char * id, const char * token);
// the u32 little-endian length prefix of section 7 into the 4 bytes reserved at the front of buf
void moeswarm_frame_prefix(std::vector<uint8_t> & buf);
void moeswarm_frame_write_register(struct moeswarm_mp_writer * w, const char * model,
        const struct moeswarm_register_desc * d, const char * backend);
// the reply to req; the message is made valid UTF-8 and cut to the protocol's 16384 bytes
void moeswarm_frame_write_error(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const char * code,
        const char * msg);
void moeswarm_frame_write_pong(struct moeswarm_mp_writer * w, uint64_t seq, double ts);
// the result of req with y (n*k*embd floats in mode each, n*embd in mode sum), as f32 LE
void moeswarm_frame_write_result(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, const float * y,
        size_t n_y, double ms);
// The same frame in two halves around the compute, for a result that is not compact: _begin writes
// every field up to y and returns where y's n_y floats go (8-byte aligned from the payload's start;
// valid until the next write to w), _end writes ms. Between them the compute writes y in place, so
// the result is never copied into its frame.
float * moeswarm_frame_write_result_begin(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, size_t n_y);
void moeswarm_frame_write_result_end(struct moeswarm_mp_writer * w, const struct moeswarm_frame * req, double ms);

// a dispatch request (no to/from/deadline): x is n*embd f32, ids and weights n*k; weights may be
// NULL in mode each; compact (mode each only) asks for the filled slots' rows alone. Little-endian
// hosts only, like the result encoder.
struct moeswarm_dispatch_desc {
    uint32_t        id;
    const char *    model;
    uint32_t        layer;
    uint32_t        n;
    uint32_t        embd;
    const float *   x;
    uint32_t        k;
    const int32_t * ids;
    const float *   weights;
    int32_t         mode;   // enum moeswarm_mode
    bool            compact;
};
void moeswarm_frame_write_dispatch(struct moeswarm_mp_writer * w, const struct moeswarm_dispatch_desc * d);

size_t moeswarm_dtype_size(enum moeswarm_dtype dtype);
