#pragma once

// The small part of msgpack the wire protocol uses (docs/protocol.md): maps with string keys,
// nil, bool, integers, float32/64, str, bin, arrays. A reader that never reads past its buffer
// and bounds nesting, and a writer that uses the smallest encoding for every integer. No
// extensions. Self-contained so the static phone build has no dependencies.

#include <stddef.h>
#include <stdint.h>

#include <vector>

enum moeswarm_mp_type {
    MOESWARM_MP_NIL,
    MOESWARM_MP_BOOL,
    MOESWARM_MP_UINT,   // any non-negative integer (positive fixint, uint*, int* >= 0)
    MOESWARM_MP_INT,    // a negative integer
    MOESWARM_MP_FLOAT,  // float32 or float64
    MOESWARM_MP_STR,
    MOESWARM_MP_BIN,
    MOESWARM_MP_ARRAY,  // n = element count; the elements follow
    MOESWARM_MP_MAP,    // n = pair count; the pairs follow
    MOESWARM_MP_EXT,
};

struct moeswarm_mp_value {
    enum moeswarm_mp_type type;
    bool            b;
    uint64_t        u;
    int64_t         i;
    double          f;
    const uint8_t * ptr; // str, bin, ext payload
    uint32_t        n;   // byte length (str, bin, ext) or element count (array, map)
};

struct moeswarm_mp_reader {
    const uint8_t * data;
    size_t          size;
    size_t          pos;
};

void moeswarm_mp_reader_init(struct moeswarm_mp_reader * r, const uint8_t * data, size_t size);
// one value, or only the header of an array or map; false on malformed or truncated input
bool moeswarm_mp_read(struct moeswarm_mp_reader * r, struct moeswarm_mp_value * v);
// a whole value with everything nested in it, checking that it is plain protocol msgpack: no
// extension types, string keys in every map, at most max_depth levels of containers (the value
// itself is the first level when it is a container)
bool moeswarm_mp_skip(struct moeswarm_mp_reader * r, int max_depth);

// a top-level key of a msgpack map: its value (only the header for a container) and its offset
// (pos may be NULL)
bool moeswarm_mp_map_find(const uint8_t * data, size_t size, const char * key, struct moeswarm_mp_value * v,
        size_t * pos);

bool moeswarm_utf8_valid(const uint8_t * s, size_t n);

struct moeswarm_mp_writer {
    std::vector<uint8_t> buf;
};

void moeswarm_mp_write_nil  (struct moeswarm_mp_writer * w);
void moeswarm_mp_write_bool (struct moeswarm_mp_writer * w, bool v);
void moeswarm_mp_write_uint (struct moeswarm_mp_writer * w, uint64_t v);
void moeswarm_mp_write_int  (struct moeswarm_mp_writer * w, int64_t v);
// the protocol's canonical number: an integer of magnitude <= 2^53 - 1 as the smallest int,
// anything else as float 64
void moeswarm_mp_write_number(struct moeswarm_mp_writer * w, double v);
void moeswarm_mp_write_f64  (struct moeswarm_mp_writer * w, double v);
void moeswarm_mp_write_str  (struct moeswarm_mp_writer * w, const char * s, size_t n);
void moeswarm_mp_write_cstr (struct moeswarm_mp_writer * w, const char * s);
void moeswarm_mp_write_bin  (struct moeswarm_mp_writer * w, const void * data, size_t n);
// reserves a bin of n bytes and returns where to write them (valid until the next write)
uint8_t * moeswarm_mp_write_bin_reserve(struct moeswarm_mp_writer * w, size_t n);
void moeswarm_mp_write_array(struct moeswarm_mp_writer * w, uint32_t n);
void moeswarm_mp_write_map  (struct moeswarm_mp_writer * w, uint32_t n);
