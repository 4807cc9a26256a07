// Reference oracle for the shard package's quantisers: ggml itself (libggml-base of the pinned
// llama.cpp release, as prebuilt by node-llama-cpp), driven through its public API.
//
//   ggml-ref info                              one line per type: id name blck_size type_size
//                                              is_quantized has_to_float requires_imatrix
//   ggml-ref quantize <type> <n_per_row> <nrows>   stdin: nrows*n_per_row f32 LE; stdout: the blocks
//   ggml-ref dequantize <type> <n>                 stdin: the blocks of n values; stdout: n f32 LE
//
// Exit status 2 with a message on stderr for bad usage or a type ggml cannot do.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"

// Q8_K has no to_float/from_float in ggml-base's type traits (it only feeds dot products); its
// reference routines are exported from ggml-quants.c under these names.
void quantize_row_q8_K_ref(const float * x, void * y, int64_t k);
void dequantize_row_q8_K(const void * x, float * y, int64_t k);

static void * read_all(size_t expected) {
    uint8_t * buf = malloc(expected ? expected : 1);
    if (!buf) { fprintf(stderr, "out of memory\n"); exit(2); }
    size_t got = 0;
    while (got < expected) {
        size_t n = fread(buf + got, 1, expected - got, stdin);
        if (n == 0) break;
        got += n;
    }
    if (got != expected || fgetc(stdin) != EOF) {
        fprintf(stderr, "stdin must hold exactly %zu bytes\n", expected);
        exit(2);
    }
    return buf;
}

static void write_all(const void * buf, size_t n) {
    if (fwrite(buf, 1, n, stdout) != n || fflush(stdout) != 0) {
        fprintf(stderr, "write failed\n");
        exit(2);
    }
}

static int64_t parse_i64(const char * s) {
    char * end = NULL;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < 0) { fprintf(stderr, "bad number: %s\n", s); exit(2); }
    return (int64_t) v;
}

static enum ggml_type parse_type(const char * s) {
    int64_t t = parse_i64(s);
    if (t >= GGML_TYPE_COUNT) { fprintf(stderr, "bad type %s\n", s); exit(2); }
    const struct ggml_type_traits * tr = ggml_get_type_traits((enum ggml_type) t);
    if (tr->blck_size == 0) { fprintf(stderr, "removed type %s\n", s); exit(2); }
    return (enum ggml_type) t;
}

int main(int argc, char ** argv) {
    if (argc >= 2 && strcmp(argv[1], "info") == 0) {
        for (int t = 0; t < GGML_TYPE_COUNT; t++) {
            const struct ggml_type_traits * tr = ggml_get_type_traits((enum ggml_type) t);
            if (tr->blck_size == 0) continue;
            printf("%d %s %lld %zu %d %d %d\n", t, tr->type_name, (long long) tr->blck_size, tr->type_size,
                   tr->is_quantized ? 1 : 0, (tr->to_float || t == GGML_TYPE_Q8_K) ? 1 : 0,
                   ggml_quantize_requires_imatrix((enum ggml_type) t) ? 1 : 0);
        }
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "quantize") == 0) {
        enum ggml_type type = parse_type(argv[2]);
        int64_t n_per_row = parse_i64(argv[3]);
        int64_t nrows = parse_i64(argv[4]);
        const struct ggml_type_traits * tr = ggml_get_type_traits(type);
        if (n_per_row % tr->blck_size != 0) { fprintf(stderr, "n_per_row not a multiple of the block\n"); return 2; }
        if (ggml_quantize_requires_imatrix(type)) { fprintf(stderr, "%s needs an imatrix\n", tr->type_name); return 2; }
        float * src = read_all((size_t) (n_per_row * nrows) * sizeof(float));
        size_t out_size = ggml_row_size(type, n_per_row) * (size_t) nrows;
        // zeroed, so fields a quantiser leaves untouched (q8_K bsums of an all-zero block) are defined
        void * dst = calloc(out_size ? out_size : 1, 1);
        if (type == GGML_TYPE_Q8_K) {
            quantize_row_q8_K_ref(src, dst, n_per_row * nrows);
        } else {
            size_t n = ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, NULL);
            if (n != out_size) { fprintf(stderr, "ggml wrote %zu bytes, expected %zu\n", n, out_size); return 2; }
        }
        write_all(dst, out_size);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "dequantize") == 0) {
        enum ggml_type type = parse_type(argv[2]);
        int64_t n = parse_i64(argv[3]);
        const struct ggml_type_traits * tr = ggml_get_type_traits(type);
        if (n % tr->blck_size != 0) { fprintf(stderr, "n not a multiple of the block\n"); return 2; }
        void * src = read_all(ggml_row_size(type, n));
        float * dst = malloc((size_t) (n ? n : 1) * sizeof(float));
        if (type == GGML_TYPE_F32) {
            memcpy(dst, src, (size_t) n * sizeof(float));
        } else if (type == GGML_TYPE_Q8_K) {
            dequantize_row_q8_K(src, dst, n);
        } else if (tr->to_float) {
            tr->to_float(src, dst, n);
        } else {
            fprintf(stderr, "%s has no to_float\n", tr->type_name);
            return 2;
        }
        write_all(dst, (size_t) n * sizeof(float));
        return 0;
    }
    fprintf(stderr, "usage: ggml-ref info | quantize <type> <n_per_row> <nrows> | dequantize <type> <n>\n");
    return 2;
}
