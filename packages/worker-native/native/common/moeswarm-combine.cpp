// Compiled with -ffp-contract=off (see CMakeLists.txt): a fused multiply-add here would round
// once instead of twice and break bit-identity with llama.cpp's separate mul and add nodes.
#include "moeswarm-combine.h"

#include <string.h>

void moeswarm_scatter_each(const float * y_rows, const int32_t * pair_of_slot, uint32_t n_tokens, uint32_t k,
        size_t n_embd, float * out) {
    const size_t n_slots = (size_t) n_tokens * k;
    for (size_t s = 0; s < n_slots; ++s) {
        float * dst = out + s * n_embd;
        const int32_t pi = pair_of_slot[s];
        if (pi < 0) {
            memset(dst, 0, n_embd * sizeof(float));
        } else {
            memcpy(dst, y_rows + (size_t) pi * n_embd, n_embd * sizeof(float));
        }
    }
}

void moeswarm_combine_sum(const float * y_rows, const int32_t * pair_of_slot, const float * w, uint32_t n_tokens,
        uint32_t k, size_t n_embd, float * out) {
    for (uint32_t i = 0; i < n_tokens; ++i) {
        float * acc = out + (size_t) i * n_embd;
        bool started = false;
        for (uint32_t j = 0; j < k; ++j) {
            const size_t s = (size_t) i * k + j;
            const int32_t pi = pair_of_slot[s];
            if (pi < 0) {
                continue; // empty slots are skipped (protocol v1, section 5)
            }
            const float wj = w[s];
            const float * y = y_rows + (size_t) pi * n_embd;
            if (!started) {
                for (size_t e = 0; e < n_embd; ++e) {
                    acc[e] = y[e] * wj;
                }
            } else {
                for (size_t e = 0; e < n_embd; ++e) {
                    const float prod = y[e] * wj;
                    acc[e] = acc[e] + prod;
                }
            }
            started = true;
        }
        if (!started) {
            memset(acc, 0, n_embd * sizeof(float));
        }
    }
}
