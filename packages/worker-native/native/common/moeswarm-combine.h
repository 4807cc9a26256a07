#pragma once

// Output layout of a run, kept apart from the graph code because of its floating-point
// contract: moeswarm-combine.cpp is compiled with -ffp-contract=off.

#include <stddef.h>
#include <stdint.h>

// out[(i*k + j)*n_embd ...] = row pair_of_slot[i*k + j] of y_rows, zeros for empty slots (-1)
void moeswarm_scatter_each(const float * y_rows, const int32_t * pair_of_slot, uint32_t n_tokens, uint32_t k,
        size_t n_embd, float * out);

// out[i*n_embd + e] = ((w_i0*y_i0[e] + w_i1*y_i1[e]) + w_i2*y_i2[e]) + ..., each product rounded to
// f32 and each sum rounded to f32, in slot order; empty slots are skipped, the first filled one
// starts the sum, a token without any is +0 (protocol v1, section 5). With every slot filled these
// are the ggml_mul and ggml_add nodes that end llama.cpp's build_moe_ffn, bit for bit.
void moeswarm_combine_sum(const float * y_rows, const int32_t * pair_of_slot, const float * w, uint32_t n_tokens,
        uint32_t k, size_t n_embd, float * out);
