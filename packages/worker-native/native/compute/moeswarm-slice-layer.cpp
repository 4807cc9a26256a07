// One layer of a slice GGUF: its expert tensors checked against each other's shapes and types,
// and the activation (with its per-layer SwiGLU clamp) that llama.cpp's model code would use.

#include "moeswarm-slice-impl.h"
#include "moeswarm-backend.h"

#include "gguf.h"

#include <stdio.h>
#include <string.h>

#include <cmath>

static int32_t moeswarm_act_for_arch(const std::string & arch) {
    if (arch == "gemma4" || arch == "grok" || arch == "bert") {
        return MOESWARM_ACT_GELU;
    }
    if (arch == "gpt-oss" || arch == "minimax-m3") {
        return MOESWARM_ACT_SWIGLU_OAI;
    }
    if (arch == "nemotron_h" || arch == "nemotron_h_moe") {
        return MOESWARM_ACT_RELU_SQR;
    }
    if (arch == "smallthinker") {
        return MOESWARM_ACT_RELU;
    }
    return MOESWARM_ACT_SILU;
}

// checks one tensor info and creates its metadata-only copy in ctx_w
static bool moeswarm_take_tensor(const gguf_context * gctx, ggml_context * ctx_w, const char * name, int n_dims_expected,
        const int64_t * ne_expected, bool weight, size_t file_size, std::vector<moeswarm_tensor_src> & srcs, ggml_tensor ** out,
        moeswarm_error * err) {
    *out              = nullptr;
    const int64_t tid = gguf_find_tensor(gctx, name);
    if (tid < 0) {
        return true;
    }
    const enum ggml_type type = gguf_get_tensor_type(gctx, tid);
    const int64_t * ne        = gguf_get_tensor_ne(gctx, tid);
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        const int64_t want = d < n_dims_expected ? ne_expected[d] : 1;
        if (want >= 0 && ne[d] != want) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                    "%s has shape [%lld, %lld, %lld, %lld], expected dimension %d to be %lld", name, (long long) ne[0],
                    (long long) ne[1], (long long) ne[2], (long long) ne[3], d, (long long) want);
        }
    }
    if (weight) {
        if (!moeswarm_backend_cpu_type_supported(type)) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_UNSUPPORTED_TYPE",
                    "%s has type %s, which ggml's CPU backend cannot use in mul_mat_id", name, ggml_type_name(type));
        }
    } else if (type != GGML_TYPE_F32) {
        return moeswarm_error_set(
                err, "MOESWARM_GGUF_UNSUPPORTED_TYPE", "%s has type %s, expected f32", name, ggml_type_name(type));
    }
    const size_t size   = gguf_get_tensor_size(gctx, tid);
    const size_t offset = gguf_get_data_offset(gctx) + gguf_get_tensor_offset(gctx, tid);
    if (offset > file_size || size > file_size - offset) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_TRUNCATED", "%s needs bytes [%zu, %zu) but the file has %zu bytes", name,
                offset, offset + size, file_size);
    }
    ggml_tensor * t = ggml_new_tensor(ctx_w, type, n_dims_expected, ne);
    ggml_set_name(t, name);
    srcs.push_back({ t, offset });
    *out = t;
    return true;
}

// the expert tensors of layer il (weights, biases, scales), each checked against the layer's shape
static bool moeswarm_take_layer_tensors(moeswarm_slice * slice, const gguf_context * gctx, uint32_t il, int64_t n_embd,
        int64_t n_exp, size_t file_size, std::vector<moeswarm_tensor_src> & srcs, moeswarm_layer & L, moeswarm_error * err) {
    char name[GGML_MAX_NAME];
    const int64_t n_ff       = L.n_ff;
    const int64_t ne_in[3]   = { n_embd, n_ff, n_exp };
    const int64_t ne_gu2[3]  = { n_embd, 2 * n_ff, n_exp };
    const int64_t ne_out[3]  = { n_ff, n_embd, n_exp };
    const int64_t ne_b_ff[2] = { n_ff, n_exp };
    const int64_t ne_b_gu[2] = { 2 * n_ff, n_exp };
    const int64_t ne_b_em[2] = { n_embd, n_exp };
    const int64_t ne_s[1]    = { n_exp };

    struct want {
        const char * suffix;
        int n_dims;
        const int64_t * ne;
        bool weight;
        ggml_tensor ** dst;
    };
    const want wants[] = {
        { "ffn_gate_exps.weight",    3, ne_in,   true,  &L.gate      },
        { "ffn_up_exps.weight",      3, ne_in,   true,  &L.up        },
        { "ffn_gate_up_exps.weight", 3, ne_gu2,  true,  &L.gate_up   },
        { "ffn_down_exps.weight",    3, ne_out,  true,  &L.down      },
        { "ffn_gate_exps.bias",      2, ne_b_ff, false, &L.gate_b    },
        { "ffn_up_exps.bias",        2, ne_b_ff, false, &L.up_b      },
        { "ffn_gate_up_exps.bias",   2, ne_b_gu, false, &L.gate_up_b },
        { "ffn_down_exps.bias",      2, ne_b_em, false, &L.down_b    },
        { "ffn_gate_exps.scale",     1, ne_s,    false, &L.gate_s    },
        { "ffn_up_exps.scale",       1, ne_s,    false, &L.up_s      },
        { "ffn_down_exps.scale",     1, ne_s,    false, &L.down_s    },
    };
    for (const want & w : wants) {
        snprintf(name, sizeof(name), "blk.%u.%s", il, w.suffix);
        if (!moeswarm_take_tensor(gctx, slice->ctx_w, name, w.n_dims, w.ne, w.weight, file_size, srcs, w.dst, err)) {
            return false;
        }
    }
    return true;
}

bool moeswarm_load_layer(moeswarm_slice * slice, const gguf_context * gctx, uint32_t il, size_t file_size,
        std::vector<moeswarm_tensor_src> & srcs, moeswarm_error * err) {
    moeswarm_layer L;
    memset(&L, 0, sizeof(L));
    L.layer = il;
    char name[GGML_MAX_NAME];

    auto tensor_ne = [&](const char * suffix, int64_t * ne, enum ggml_type * type) -> bool {
        snprintf(name, sizeof(name), "blk.%u.%s", il, suffix);
        const int64_t tid = gguf_find_tensor(gctx, name);
        if (tid < 0) {
            return false;
        }
        memcpy(ne, gguf_get_tensor_ne(gctx, tid), sizeof(int64_t) * GGML_MAX_DIMS);
        *type = gguf_get_tensor_type(gctx, tid);
        return true;
    };

    // shapes first: n_embd, n_ff and n_expert come from the tensors themselves
    int64_t ne_gate[4], ne_up[4], ne_gu[4], ne_down[4];
    enum ggml_type t_gate, t_up, t_gu, t_down;
    const bool has_gate = tensor_ne("ffn_gate_exps.weight", ne_gate, &t_gate);
    const bool has_up   = tensor_ne("ffn_up_exps.weight", ne_up, &t_up);
    const bool has_gu   = tensor_ne("ffn_gate_up_exps.weight", ne_gu, &t_gu);
    const bool has_down = tensor_ne("ffn_down_exps.weight", ne_down, &t_down);
    (void) t_gate;
    (void) t_up;
    (void) t_gu;
    (void) t_down;

    if (!has_down) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_NOT_MOE", "layer %u has no blk.%u.ffn_down_exps.weight", il, il);
    }
    if (has_gu && (has_gate || has_up)) {
        return moeswarm_error_set(
                err, "MOESWARM_GGUF_BAD_TENSOR", "layer %u has both ffn_gate_up_exps and separate gate/up expert tensors", il);
    }
    if (!has_gu && !has_up) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_NOT_MOE", "layer %u has no ffn_up_exps or ffn_gate_up_exps", il);
    }
    const int64_t n_ff   = ne_down[0];
    const int64_t n_embd = ne_down[1];
    const int64_t n_exp  = ne_down[2];
    if (n_ff <= 0 || n_ff > MOESWARM_MAX_FF || n_embd <= 0 || n_embd > MOESWARM_MAX_EMBD || n_exp <= 0 ||
            n_exp > MOESWARM_MAX_EXPERTS || ne_down[3] != 1) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                "blk.%u.ffn_down_exps.weight has shape [%lld, %lld, %lld, %lld]: expected [n_ff, n_embd, n_expert] "
                "with n_ff <= %d, n_embd <= %d, n_expert <= %d",
                il, (long long) ne_down[0], (long long) ne_down[1], (long long) ne_down[2], (long long) ne_down[3],
                MOESWARM_MAX_FF, MOESWARM_MAX_EMBD, MOESWARM_MAX_EXPERTS);
    }
    if (slice->n_embd == 0) {
        slice->n_embd   = (uint32_t) n_embd;
        slice->n_expert = (uint32_t) n_exp;
    } else if ((int64_t) slice->n_embd != n_embd || (int64_t) slice->n_expert != n_exp) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                "layer %u has n_embd %lld and %lld experts, other layers have %u and %u", il, (long long) n_embd,
                (long long) n_exp, slice->n_embd, slice->n_expert);
    }
    L.n_ff = (uint32_t) n_ff;

    if (!moeswarm_take_layer_tensors(slice, gctx, il, n_embd, n_exp, file_size, srcs, L, err)) {
        return false;
    }
    // a bias or scale without its weight would be silently ignored by llama.cpp's graph: refuse it
    if ((L.gate_b || L.gate_s) && !L.gate) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "layer %u has a gate bias/scale but no ffn_gate_exps", il);
    }
    if ((L.up_b || L.up_s) && !L.up) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "layer %u has an up bias/scale but no ffn_up_exps", il);
    }
    if (L.gate_up_b && !L.gate_up) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "layer %u has ffn_gate_up_exps.bias but no weight", il);
    }
    slice->layer_data.push_back(L);
    return true;
}

bool moeswarm_resolve_act(moeswarm_slice * slice, const gguf_context * gctx, int32_t act_param, moeswarm_error * err) {
    const std::string & arch = slice->arch;
    // llama4 multiplies the expert *input* by the router weight (build_moe_ffn, weight_before_ffn)
    // and sums the outputs unweighted: the caller sends the weighted rows with weight 1 (the
    // dispatcher expands them, the plugin reads them from llama.cpp's graph), and a run with any
    // other weight is refused (moeswarm_check_run) rather than weighted after the FFN
    slice->weight_before_ffn = arch == "llama4";
    if (arch == "kimi-k3") {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "kimi-k3's SITU activation is not supported yet");
    }
    slice->act = act_param == MOESWARM_ACT_AUTO ? moeswarm_act_for_arch(arch) : act_param;

    // per-layer SwiGLU clamp (<arch>.swiglu_clamp_exp), applied by llama.cpp only with a separate gate
    std::vector<float> limits;
    if (!arch.empty()) {
        const std::string key = arch + ".swiglu_clamp_exp";
        const int64_t id      = gguf_find_key(gctx, key.c_str());
        if (id >= 0) {
            if (gguf_get_kv_type(gctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gctx, id) != GGUF_TYPE_FLOAT32) {
                return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of f32", key.c_str());
            }
            const size_t n  = gguf_get_arr_n(gctx, id);
            const float * v = (const float *) gguf_get_arr_data(gctx, id);
            limits.assign(v, v + n);
        }
    }
    for (moeswarm_layer & L : slice->layer_data) {
        const bool has_gate = L.gate != nullptr || L.gate_up != nullptr;
        if (slice->act == MOESWARM_ACT_RELU_SQR && has_gate) {
            return moeswarm_error_set(
                    err, "MOESWARM_NATIVE_LOAD", "layer %u: gated squared ReLU is not implemented (nor in llama.cpp)", L.layer);
        }
        if (slice->act == MOESWARM_ACT_SWIGLU_OAI && !has_gate) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "layer %u: swiglu_oai needs a gate tensor", L.layer);
        }
        L.swiglu_limit = 0.0f;
        if (slice->act == MOESWARM_ACT_SILU && L.gate != nullptr && L.layer < limits.size() && limits[L.layer] > 1e-6f) {
            if (arch == "dflash") {
                return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "dflash's clamped SwiGLU is not supported yet");
            }
            if (!std::isfinite(limits[L.layer])) {
                return moeswarm_error_set(
                        err, "MOESWARM_GGUF_BAD_TENSOR", "%s.swiglu_clamp_exp[%u] is not finite", arch.c_str(), L.layer);
            }
            L.swiglu_limit = limits[L.layer];
        }
    }
    return true;
}
