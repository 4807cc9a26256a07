// Conversions between f32 and ggml's storage types (the addon's quantize/dequantize).

#include "moeswarm-slice.h"

#include <string.h>

size_t moeswarm_row_bytes(enum ggml_type type, int64_t n_rows, int64_t n_per_row) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0 || n_rows < 0 || n_per_row <= 0 ||
            n_per_row % ggml_blck_size(type) != 0 || n_rows > INT64_MAX / n_per_row) {
        return 0;
    }
    return ggml_row_size(type, n_per_row) * (size_t) n_rows;
}

bool moeswarm_quantize(enum ggml_type type, const float * src, int64_t n_rows, int64_t n_per_row, void * dst, size_t dst_size,
        struct moeswarm_error * err) {
    const size_t need = moeswarm_row_bytes(type, n_rows, n_per_row);
    if (need == 0 && n_rows > 0) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "rows of %lld values cannot be stored as %s",
                (long long) n_per_row, type < GGML_TYPE_COUNT ? ggml_type_name(type) : "?");
    }
    if (dst_size != need) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "destination holds %zu bytes, expected %zu", dst_size, need);
    }
    // ggml_quantize_chunk asserts on a type it has no quantiser for (q8_K, q8_1: activation types)
    if (type == GGML_TYPE_Q8_1 || type == GGML_TYPE_Q8_K ||
            (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_BF16 &&
                    ggml_get_type_traits(type)->from_float_ref == nullptr)) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "ggml has no quantiser for %s", ggml_type_name(type));
    }
    if (ggml_quantize_requires_imatrix(type)) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "%s needs an importance matrix", ggml_type_name(type));
    }
    if (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_BF16 && !ggml_is_quantized(type)) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "%s is not a storage type", ggml_type_name(type));
    }
    if (!ggml_validate_row_data(GGML_TYPE_F32, src, (size_t) n_rows * n_per_row * sizeof(float))) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "the input holds non-finite values");
    }
    ggml_quantize_chunk(type, src, dst, 0, n_rows, n_per_row, nullptr);
    return true;
}

bool moeswarm_dequantize(
        enum ggml_type type, const void * src, size_t src_size, float * dst, int64_t n, struct moeswarm_error * err) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "unknown ggml type %d", (int) type);
    }
    const ggml_type_traits * tt = ggml_get_type_traits(type);
    if (type != GGML_TYPE_F32 && tt->to_float == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "%s has no to_float", ggml_type_name(type));
    }
    if (n < 0 || n % ggml_blck_size(type) != 0 || src_size != ggml_row_size(type, n)) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "%zu bytes are not %lld values of %s", src_size,
                (long long) n, ggml_type_name(type));
    }
    if (type == GGML_TYPE_F32) {
        memcpy(dst, src, src_size);
    } else {
        tt->to_float(src, dst, n);
    }
    return true;
}
