// Activations on the wire in the weights' vec_dot_type (q8_0 / q8_K).
//
// ggml's CPU mul_mat_id converts f32 activations to the weights' vec_dot_type with ggml-cpu's
// from_float, row by row, before any dot product, and skips the conversion when they already are of
// that type. So a sender that runs the same from_float (the backbone machine's ggml-cpu: SIMD
// variants round differently from ggml-base's _ref functions, hence not ggml_quantize_chunk) sends
// ~3.7x fewer bytes and the worker computes the same bits.
//
// CPU_REPACK's mul_mat_id takes f32 only and converts each row with that same from_float: for a
// layer in repacked buffers the worker turns the rows into f32 values that from_float gives back
// byte for byte (moeswarm_q8_row_to_f32_exact), checked here before computing; a request with a row
// that has none is refused (MOESWARM_NATIVE_WIRE_INEXACT) and the sender sends it again in f32.

#include "moeswarm-slice-impl.h"

#include <math.h>
#include <string.h>

#include <algorithm>

#ifdef MOESWARM_LLAMA_SHARED
#include "moeswarm-backend.h"

#include <dlfcn.h>

#include <mutex>

// the llama-shared build links no CPU backend; its type traits are an exported symbol of the
// libggml-cpu-<variant>.so the registry loaded (found through one of its proc addresses)
struct ggml_type_traits_cpu {
    ggml_from_float_t from_float;
    void * vec_dot; // ggml_vec_dot_t
    enum ggml_type vec_dot_type;
    int64_t nrows;
};
typedef const struct ggml_type_traits_cpu * (*moeswarm_traits_cpu_t)(enum ggml_type type);

static const ggml_type_traits_cpu * moeswarm_traits_cpu(enum ggml_type type) {
    static moeswarm_traits_cpu_t fn = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        ggml_backend_dev_t dev = moeswarm_backend_find_device("cpu");
        ggml_backend_reg_t reg = dev != nullptr ? ggml_backend_dev_backend_reg(dev) : nullptr;
        void * proc = reg != nullptr ? ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features") : nullptr;
        Dl_info info;
        if (proc == nullptr || dladdr(proc, &info) == 0 || info.dli_fname == nullptr) {
            return;
        }
        void * lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
        if (lib != nullptr) {
            fn = (moeswarm_traits_cpu_t) dlsym(lib, "ggml_get_type_traits_cpu");
            dlclose(lib); // the registry keeps its own reference
        }
    });
    return fn != nullptr ? fn(type) : nullptr;
}
#else
#include "ggml-cpu.h"

static const ggml_type_traits_cpu * moeswarm_traits_cpu(enum ggml_type type) {
    return ggml_get_type_traits_cpu(type);
}
#endif

enum ggml_type moeswarm_vec_dot_type(enum ggml_type weight_type) {
    if (weight_type < 0 || weight_type >= GGML_TYPE_COUNT || ggml_blck_size(weight_type) == 0) {
        return GGML_TYPE_COUNT;
    }
    const ggml_type_traits_cpu * tc = moeswarm_traits_cpu(weight_type);
    return tc == nullptr || tc->vec_dot == nullptr ? GGML_TYPE_COUNT : tc->vec_dot_type;
}

static ggml_from_float_t moeswarm_from_float(enum ggml_type type) {
    const ggml_type_traits_cpu * tc = moeswarm_traits_cpu(type);
    return tc == nullptr ? nullptr : tc->from_float;
}

// ggml's dequantize_row_q8_0 / dequantize_row_q8_K (q8_K has no to_float in ggml's type traits):
// each value is its int8 times the block's f32 scale, one f32 product
static void moeswarm_q8_to_float(enum ggml_type type, const uint8_t * src, float * dst, int64_t n) {
    if (type == GGML_TYPE_Q8_0) {
        for (int64_t b = 0; b < n / 32; ++b) {
            const uint8_t * blk = src + b * 34;
            ggml_fp16_t h;
            memcpy(&h, blk, sizeof(h));
            const float d = ggml_fp16_to_fp32(h);
            for (int j = 0; j < 32; ++j) {
                dst[b * 32 + j] = (float) (int8_t) blk[2 + j] * d;
            }
        }
    } else {
        for (int64_t b = 0; b < n / 256; ++b) {
            const uint8_t * blk = src + b * 292;
            float d;
            memcpy(&d, blk, sizeof(d));
            for (int j = 0; j < 256; ++j) {
                dst[b * 256 + j] = d * (float) (int8_t) blk[4 + j];
            }
        }
    }
}

// f32 values that from_float turns back into exactly these q8 blocks. The plain dequantisation
// (d * q) usually is one; for q8_K, whose scale is stored as d = 1/iscale, requantising gives a d
// one ulp off for about one block in ten (the q are the same): nudging the block's largest value,
// the one from_float derives the scale from, by a few ulps finds values that give d back. Every
// block is checked byte for byte after from_float, so what is returned true is exact by
// construction. false when some block has no such values (within the nudges tried).
static bool moeswarm_q8_row_to_f32_exact(enum ggml_type type, ggml_from_float_t from_float, const uint8_t * q, float * y,
        int64_t n, std::vector<uint8_t> & scratch) {
    const int64_t bk = type == GGML_TYPE_Q8_0 ? 32 : 256;
    const size_t bytes = type == GGML_TYPE_Q8_0 ? 34 : 292;
    scratch.resize(bytes);
    moeswarm_q8_to_float(type, q, y, n);
    for (int64_t b = 0; b < n / bk; ++b) {
        const uint8_t * qb = q + b * bytes;
        float * yb = y + b * bk;
        from_float(yb, scratch.data(), bk);
        if (memcmp(scratch.data(), qb, bytes) == 0) {
            continue;
        }
        // the values of largest magnitude: from_float takes its scale from the first of them (two of
        // opposite signs tie when the row's q holds both -127 and 127: then the sign must be kept)
        float amax = 0.0f;
        for (int64_t j = 0; j < bk; ++j) {
            amax = fmaxf(amax, fabsf(yb[j]));
        }
        bool found = false;
        for (int64_t m = 0; m < bk && !found; ++m) {
            if (fabsf(yb[m]) != amax) {
                continue;
            }
            const float orig = yb[m];
            for (int step = 1; step <= 8 && !found; ++step) {
                for (int dir = 0; dir < 2 && !found; ++dir) {
                    float v = orig;
                    for (int i = 0; i < step; ++i) {
                        v = nextafterf(v, dir == 0 ? INFINITY : -INFINITY);
                    }
                    yb[m] = v;
                    from_float(yb, scratch.data(), bk);
                    found = memcmp(scratch.data(), qb, bytes) == 0;
                }
            }
            if (!found) {
                yb[m] = orig;
            }
        }
        if (!found) {
            return false;
        }
    }
    return true;
}

// Weight types whose CPU mul_mat_id computes from the converted rows with vec_dot whatever src1's
// type. The grid IQ types (and IQ4_XS) take ggml's IQ panel path on f32 activations, which a q8
// src1 would bypass: they stay f32.
static bool moeswarm_wire_weight_type(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_MXFP4:
        case GGML_TYPE_Q2_K:
        case GGML_TYPE_Q3_K:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K: return true;
        default: return false;
    }
}

enum ggml_type moeswarm_wire_type_of_weight(enum ggml_type weight_type) {
    if (!moeswarm_wire_weight_type(weight_type)) {
        return GGML_TYPE_COUNT;
    }
    const enum ggml_type v = moeswarm_vec_dot_type(weight_type);
    return v == GGML_TYPE_Q8_0 || v == GGML_TYPE_Q8_K ? v : GGML_TYPE_COUNT;
}

static const moeswarm_layer * moeswarm_wire_find_layer(const moeswarm_slice * slice, uint32_t layer) {
    const auto it = std::lower_bound(slice->layers.begin(), slice->layers.end(), layer);
    if (it == slice->layers.end() || *it != layer) {
        return nullptr;
    }
    return &slice->layer_data[(size_t) (it - slice->layers.begin())];
}

static bool moeswarm_in_repack(const moeswarm_slice * slice, const ggml_tensor * t) {
    return t != nullptr && slice->buf_repack != nullptr && t->buffer == slice->buf_repack;
}

static enum ggml_type moeswarm_layer_wire_type(const moeswarm_slice * slice, const moeswarm_layer & L) {
    if (!slice->on_cpu || slice->weight_before_ffn) {
        return GGML_TYPE_COUNT;
    }
    // the tensors that read the activations: gate and up, or the merged gate_up
    const ggml_tensor * inputs[2] = { L.gate_up != nullptr ? L.gate_up : L.up, L.gate_up != nullptr ? nullptr : L.gate };
    enum ggml_type wire = GGML_TYPE_COUNT;
    for (const ggml_tensor * t : inputs) {
        if (t == nullptr) {
            continue;
        }
        const enum ggml_type v = moeswarm_wire_type_of_weight(t->type);
        if (v == GGML_TYPE_COUNT) {
            return GGML_TYPE_COUNT;
        }
        if (wire != GGML_TYPE_COUNT && wire != v) {
            return GGML_TYPE_COUNT; // gate and up convert to different types: one wire row cannot serve both
        }
        wire = v;
    }
    if (wire == GGML_TYPE_COUNT || slice->n_embd % ggml_blck_size(wire) != 0) {
        return GGML_TYPE_COUNT;
    }
    return wire;
}

enum ggml_type moeswarm_slice_wire_type(const struct moeswarm_slice * slice, uint32_t layer) {
    const moeswarm_layer * L = slice == nullptr ? nullptr : moeswarm_wire_find_layer(slice, layer);
    return L == nullptr ? GGML_TYPE_COUNT : moeswarm_layer_wire_type(slice, *L);
}

bool moeswarm_quantize_activations(enum ggml_type type, const float * x, int64_t n_rows, int64_t n_per_row, void * dst,
        size_t dst_size, struct moeswarm_error * err) {
    if (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q8_K) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "activations travel as q8_0 or q8_K, not %s",
                type >= 0 && type < GGML_TYPE_COUNT ? ggml_type_name(type) : "?");
    }
    const size_t need = moeswarm_row_bytes(type, n_rows, n_per_row);
    if (need == 0 && n_rows > 0) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "rows of %lld values cannot be stored as %s",
                (long long) n_per_row, ggml_type_name(type));
    }
    if (dst_size != need) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "destination holds %zu bytes, expected %zu", dst_size, need);
    }
    const ggml_from_float_t from_float = moeswarm_from_float(type);
    if (from_float == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_DTYPE", "the CPU backend has no from_float for %s", ggml_type_name(type));
    }
    // from_float on a non-finite value is undefined (int conversion): such rows travel in f32
    const size_t n = (size_t) n_rows * (size_t) n_per_row;
    for (size_t i = 0; i < n; ++i) {
        if (!isfinite(x[i])) {
            return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "activation %zu (row %zu) is not finite", i,
                    i / (size_t) n_per_row);
        }
    }
    const size_t row = ggml_row_size(type, n_per_row);
    for (int64_t r = 0; r < n_rows; ++r) {
        from_float(x + r * n_per_row, (char *) dst + (size_t) r * row, n_per_row);
    }
    return true;
}

bool moeswarm_wire_prepare(moeswarm_slice * slice, const moeswarm_layer & L, const moeswarm_run_params * p,
        std::vector<float> & f32, bool * use_f32, moeswarm_error * err) {
    *use_f32 = false;
    const enum ggml_type want = moeswarm_layer_wire_type(slice, L);
    if (want == GGML_TYPE_COUNT || p->x_type != want) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_DTYPE", "layer %u takes activations as %s, not %s", L.layer,
                want == GGML_TYPE_COUNT ? "f32" : ggml_type_name(want),
                p->x_type >= 0 && p->x_type < GGML_TYPE_COUNT ? ggml_type_name(p->x_type) : "?");
    }
    const size_t row = ggml_row_size(want, slice->n_embd);
    if (p->x_q == nullptr || p->x_q_size != row * p->n_tokens) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "x holds %zu bytes, expected n_tokens * %zu (%s rows)",
                p->x_q_size, row, ggml_type_name(want));
    }
    const ggml_tensor * in = L.gate_up != nullptr ? L.gate_up : L.up;
    if (!moeswarm_in_repack(slice, in) && !moeswarm_in_repack(slice, L.gate)) {
        return true; // ggml reads the rows as they came
    }
    // repacked weights take f32 only and convert it with from_float: exact only when that gives
    // back the bytes that came
    const size_t n_embd = slice->n_embd;
    const ggml_from_float_t from_float = moeswarm_from_float(want);
    if (from_float == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_DTYPE", "the CPU backend cannot convert %s", ggml_type_name(want));
    }
    std::vector<uint8_t> scratch;
    f32.resize(n_embd * p->n_tokens);
    for (uint32_t r = 0; r < p->n_tokens; ++r) {
        const uint8_t * q = (const uint8_t *) p->x_q + (size_t) r * row;
        float * y = f32.data() + (size_t) r * n_embd;
        if (!moeswarm_q8_row_to_f32_exact(want, from_float, q, y, (int64_t) n_embd, scratch)) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_INEXACT",
                    "layer %u is repacked and row %u has no f32 values that %s's from_float turns back into its blocks: "
                    "send f32", L.layer, r, ggml_type_name(want));
        }
    }
    *use_f32 = true;
    return true;
}

bool moeswarm_activations_round_trip(enum ggml_type type, const void * rows, size_t size, int64_t n_per_row, int32_t * same,
        struct moeswarm_error * err) {
    *same = 0;
    if (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q8_K) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "activations travel as q8_0 or q8_K");
    }
    const size_t row = moeswarm_row_bytes(type, 1, n_per_row);
    if (row == 0 || size % row != 0) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "%zu bytes are not rows of %lld values as %s", size,
                (long long) n_per_row, ggml_type_name(type));
    }
    const ggml_from_float_t from_float = moeswarm_from_float(type);
    if (from_float == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_DTYPE", "the CPU backend cannot convert %s", ggml_type_name(type));
    }
    std::vector<float> f32((size_t) n_per_row);
    std::vector<uint8_t> scratch;
    for (size_t off = 0; off < size; off += row) {
        if (!moeswarm_q8_row_to_f32_exact(type, from_float, (const uint8_t *) rows + off, f32.data(), n_per_row, scratch)) {
            return true;
        }
    }
    *same = 1;
    return true;
}
