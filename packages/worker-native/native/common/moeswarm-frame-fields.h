#pragma once

// The frame decoder's tables (the fields of each frame type, section 4 of docs/protocol.md) and
// check 7 over them (moeswarm-frame-fields.cpp), shared with moeswarm-frame-decode.cpp.

#include "moeswarm-frame.h"

#include <string.h>

#define MOESWARM_FRAME_DEPTH   16
#define MOESWARM_FRAME_N_KNOWN 31 // keys any frame of section 4 may carry
#define MOESWARM_MAX_SAFE      9007199254740991ull // 2^53 - 1

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
    const char * key;
    field_kind kind;
    bool required;
    uint64_t lo;
    uint64_t hi;
    uint64_t hi2;
    const char * values[5];
    bool ascending;
};

struct frame_spec {
    const char * name;
    moeswarm_frame_type type;
    const field_spec * fields;
    size_t n_fields;
};

struct known_value {
    bool seen;
    size_t pos; // offset of the value in the payload
};

static inline bool bytes_eq(const uint8_t * p, size_t n, const char * lit) {
    return strlen(lit) == n && memcmp(p, lit, n) == 0;
}

// reads the value of a known key at its recorded offset
static inline bool value_at(const uint8_t * data, size_t size, size_t pos, moeswarm_mp_value * v, moeswarm_mp_reader * r) {
    moeswarm_mp_reader_init(r, data, size);
    r->pos = pos;
    return moeswarm_mp_read(r, v);
}

// index of a known key, or -1; and back
int          moeswarm_frame_known_index(const char * key);
const char * moeswarm_frame_known_key(int idx);
// the frame type of that name, or NULL
const frame_spec * moeswarm_frame_spec_find(const uint8_t * name, size_t n);
// check 7 for one present field (its value at pos, already known to be well-formed)
bool moeswarm_frame_check_field(const uint8_t * data, size_t size, size_t pos, const field_spec & fs, const char * frame,
        uint32_t max_expert, moeswarm_error * err);
