#include "moeswarm-slice.h"
#include "moeswarm-backend.h"
#include "moeswarm-combine.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

// bounds of a request (the protocol's) and of a slice; anything beyond is refused before
// anything is allocated
#define MOESWARM_MAX_TOKENS   65536
#define MOESWARM_MAX_K        256
#define MOESWARM_MAX_EMBD     65536
#define MOESWARM_MAX_FF       (1 << 20)
#define MOESWARM_MAX_EXPERTS  65536
#define MOESWARM_MAX_LAYERS   4096
#define MOESWARM_GRAPH_NODES  64

//
// log (errors: moeswarm-error.cpp)
//

static thread_local char g_log_last[512];
static bool g_log_echo = false;

static void moeswarm_log_callback(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (g_log_echo) {
        fputs(text, stderr);
    }
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        // keep the last error line(s): they say why gguf_init refused a file
        size_t used = strlen(g_log_last);
        if (used > sizeof(g_log_last) / 2) {
            used = 0;
        }
        snprintf(g_log_last + used, sizeof(g_log_last) - used, "%s", text);
    }
}

void moeswarm_log_init(void) {
    const char * env = getenv("MOESWARM_GGML_LOG");
    g_log_echo = env != nullptr && strcmp(env, "1") == 0;
    ggml_log_set(moeswarm_log_callback, nullptr);
}

const char * moeswarm_log_last(void) {
    return g_log_last;
}

void moeswarm_log_reset(void) {
    g_log_last[0] = '\0';
}

//
// names
//

static const char * k_act_names[MOESWARM_ACT_COUNT] = { "silu", "gelu", "relu", "swiglu_oai", "relu_sqr" };

const char * moeswarm_act_name(int32_t act) {
    if (act < 0 || act >= MOESWARM_ACT_COUNT) {
        return "auto";
    }
    return k_act_names[act];
}

int32_t moeswarm_act_from_name(const char * name) {
    if (name == nullptr || strcmp(name, "auto") == 0) {
        return MOESWARM_ACT_AUTO;
    }
    for (int32_t i = 0; i < MOESWARM_ACT_COUNT; ++i) {
        if (strcmp(name, k_act_names[i]) == 0) {
            return i;
        }
    }
    return -2;
}

enum ggml_type moeswarm_type_from_name(const char * name) {
    for (int i = 0; i < GGML_TYPE_COUNT; ++i) {
        const enum ggml_type type = (enum ggml_type) i;
        if (ggml_blck_size(type) == 0) {
            continue; // removed types
        }
        const char * tn = ggml_type_name(type);
        if (tn != nullptr && strcasecmp(tn, name) == 0) {
            return type;
        }
    }
    return GGML_TYPE_COUNT;
}

const char * moeswarm_devices(void) {
    return moeswarm_backend_devices();
}

const char * moeswarm_cpu_features(void) {
    return moeswarm_backend_cpu_features();
}

//
// the slice
//

struct moeswarm_layer {
    uint32_t layer;
    uint32_t n_ff;
    ggml_tensor * gate;      // NULL without a gate or when merged
    ggml_tensor * up;        // NULL when merged
    ggml_tensor * gate_up;   // merged gate and up, [n_embd, 2*n_ff, n_expert]
    ggml_tensor * down;
    ggml_tensor * gate_b;
    ggml_tensor * up_b;
    ggml_tensor * gate_up_b;
    ggml_tensor * down_b;
    ggml_tensor * gate_s;
    ggml_tensor * up_s;
    ggml_tensor * down_s;
    float swiglu_limit;
    bool  repacked;
};

// a graph kept for reuse; the reference graphs carry their own shape in the key
struct moeswarm_graph {
    uint32_t layer;
    uint32_t n_rows;   // pairs (run) or tokens (reference)
    uint32_t k;        // 1 (run) or slots (reference)
    int32_t  kind;     // 0 run, 1 reference each, 2 reference sum
    uint64_t last_use;
    ggml_context * ctx;
    ggml_cgraph  * gf;
    ggml_tensor  * x;
    ggml_tensor  * ids;
    ggml_tensor  * w;
    ggml_tensor  * out;
};

struct moeswarm_expert_map {
    uint32_t global;
    int32_t  local;
};

struct moeswarm_slice {
    std::string arch;
    std::string device;   // ggml device name
    bool        on_cpu = true;
    uint32_t n_embd   = 0;
    uint32_t n_expert = 0;
    int32_t  act      = MOESWARM_ACT_SILU;
    int32_t  n_threads = 1;
    uint32_t n_graphs = 16;
    size_t   weight_bytes = 0;

    std::vector<uint32_t>            experts;    // global ids in slice order
    std::vector<moeswarm_expert_map> expert_map; // sorted by global id
    std::vector<uint32_t>            layers;     // ascending
    std::vector<moeswarm_layer>      layer_data; // same order as layers

    ggml_context *          ctx_w      = nullptr;  // weights in plain CPU buffers
    ggml_context *          ctx_w_repack = nullptr; // weights in CPU_REPACK buffers
    ggml_backend_buffer_t   buf_plain  = nullptr;
    ggml_backend_buffer_t   buf_repack = nullptr;
    ggml_backend_t          backend    = nullptr;
    ggml_threadpool *       threadpool = nullptr;
    ggml_gallocr_t          galloc     = nullptr;

    std::vector<moeswarm_graph> graphs;
    uint64_t clock = 0;

    // staging of one run, kept to avoid reallocations
    std::vector<float>   x_rows;
    std::vector<int32_t> pair_ids;
    std::vector<int32_t> pair_of_slot;
    std::vector<float>   y_rows;

    volatile bool * abort_flag = nullptr;
};

struct moeswarm_slice_params moeswarm_slice_default_params(void) {
    moeswarm_slice_params params;
    params.n_threads = 0;
    params.repack    = true;
    params.act       = MOESWARM_ACT_AUTO;
    params.n_graphs  = 16;
    params.device    = nullptr;
    return params;
}

static int32_t moeswarm_default_threads(void) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int32_t) std::min<long>(n, GGML_MAX_N_THREADS) : 1;
}

static void moeswarm_graph_free(moeswarm_graph & g) {
    if (g.ctx) {
        ggml_free(g.ctx);
        g.ctx = nullptr;
    }
}

void moeswarm_slice_free(struct moeswarm_slice * slice) {
    if (slice == nullptr) {
        return;
    }
    for (moeswarm_graph & g : slice->graphs) {
        moeswarm_graph_free(g);
    }
    if (slice->galloc) {
        ggml_gallocr_free(slice->galloc);
    }
    if (slice->backend) {
        ggml_backend_free(slice->backend);
    }
    if (slice->threadpool) {
        moeswarm_backend_cpu_threadpool_free(slice->threadpool);
    }
    if (slice->buf_plain) {
        ggml_backend_buffer_free(slice->buf_plain);
    }
    if (slice->buf_repack) {
        ggml_backend_buffer_free(slice->buf_repack);
    }
    if (slice->ctx_w) {
        ggml_free(slice->ctx_w);
    }
    if (slice->ctx_w_repack) {
        ggml_free(slice->ctx_w_repack);
    }
    delete slice;
}

// RAII at the edges: the loader owns these until it hands them to the slice
struct moeswarm_gguf_guard {
    gguf_context * ctx = nullptr;
    ~moeswarm_gguf_guard() { if (ctx) gguf_free(ctx); }
};

struct moeswarm_slice_guard {
    moeswarm_slice * slice = nullptr;
    ~moeswarm_slice_guard() { moeswarm_slice_free(slice); }
};

struct moeswarm_map_guard {
    void * addr = MAP_FAILED;
    size_t size = 0;
    int fd = -1;
    ~moeswarm_map_guard() {
        if (addr != MAP_FAILED) munmap(addr, size);
        if (fd >= 0) close(fd);
    }
};

// "blk.<n>.<rest>": parses <n>, returns the rest or NULL
static const char * moeswarm_parse_blk(const char * name, uint32_t * layer) {
    if (strncmp(name, "blk.", 4) != 0) {
        return nullptr;
    }
    const char * p = name + 4;
    uint64_t v = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t) (*p - '0');
        if (++digits > 6) {
            return nullptr;
        }
        ++p;
    }
    if (digits == 0 || *p != '.' || v > 65535) {
        return nullptr; // the protocol's layer ids are 0..65535
    }
    *layer = (uint32_t) v;
    return p + 1;
}

static bool moeswarm_is_expert_weight(const char * rest) {
    return strcmp(rest, "ffn_gate_exps.weight") == 0 || strcmp(rest, "ffn_up_exps.weight") == 0 ||
           strcmp(rest, "ffn_down_exps.weight") == 0 || strcmp(rest, "ffn_gate_up_exps.weight") == 0;
}

// reads an array of non-negative integers that fit uint32
static bool moeswarm_read_u32_array(const gguf_context * ctx, const char * key, std::vector<uint32_t> & out,
        size_t max_n, bool * present, moeswarm_error * err) {
    *present = false;
    const int64_t id = gguf_find_key(ctx, key);
    if (id < 0) {
        return true;
    }
    *present = true;
    if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of uint32", key);
    }
    const enum gguf_type at = gguf_get_arr_type(ctx, id);
    const size_t n = gguf_get_arr_n(ctx, id);
    if (n == 0 || n > max_n) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_LIMIT", "%s has %zu entries (1..%zu allowed)", key, n, max_n);
    }
    const void * data = at == GGUF_TYPE_STRING ? nullptr : gguf_get_arr_data(ctx, id);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
        int64_t v;
        switch (at) {
            case GGUF_TYPE_UINT8:  v = ((const uint8_t  *) data)[i]; break;
            case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
            case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT8:   v = ((const int8_t   *) data)[i]; break;
            case GGUF_TYPE_INT16:  v = ((const int16_t  *) data)[i]; break;
            case GGUF_TYPE_INT32:  v = ((const int32_t  *) data)[i]; break;
            case GGUF_TYPE_INT64:  v = ((const int64_t  *) data)[i]; break;
            case GGUF_TYPE_UINT64: {
                const uint64_t u = ((const uint64_t *) data)[i];
                v = u > UINT32_MAX ? -1 : (int64_t) u;
            } break;
            default:
                return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of uint32", key);
        }
        if (v < 0 || v > (int64_t) UINT32_MAX) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "%s[%zu] = %lld is not a uint32", key, i, (long long) v);
        }
        out[i] = (uint32_t) v;
    }
    return true;
}

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

struct moeswarm_tensor_src {
    ggml_tensor * t;
    size_t offset; // in the file
};

// checks one tensor info and creates its metadata-only copy in ctx_w
static bool moeswarm_take_tensor(const gguf_context * gctx, ggml_context * ctx_w, const char * name,
        int n_dims_expected, const int64_t * ne_expected, bool weight, size_t file_size,
        std::vector<moeswarm_tensor_src> & srcs, ggml_tensor ** out, moeswarm_error * err) {
    *out = nullptr;
    const int64_t tid = gguf_find_tensor(gctx, name);
    if (tid < 0) {
        return true;
    }
    const enum ggml_type type = gguf_get_tensor_type(gctx, tid);
    const int64_t * ne = gguf_get_tensor_ne(gctx, tid);
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        const int64_t want = d < n_dims_expected ? ne_expected[d] : 1;
        if (want >= 0 && ne[d] != want) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                "%s has shape [%lld, %lld, %lld, %lld], expected dimension %d to be %lld", name,
                (long long) ne[0], (long long) ne[1], (long long) ne[2], (long long) ne[3], d, (long long) want);
        }
    }
    if (weight) {
        if (!moeswarm_backend_cpu_type_supported(type)) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_UNSUPPORTED_TYPE",
                "%s has type %s, which ggml's CPU backend cannot use in mul_mat_id", name, ggml_type_name(type));
        }
    } else if (type != GGML_TYPE_F32) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_UNSUPPORTED_TYPE",
            "%s has type %s, expected f32", name, ggml_type_name(type));
    }
    const size_t size = gguf_get_tensor_size(gctx, tid);
    const size_t offset = gguf_get_data_offset(gctx) + gguf_get_tensor_offset(gctx, tid);
    if (offset > file_size || size > file_size - offset) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_TRUNCATED",
            "%s needs bytes [%zu, %zu) but the file has %zu bytes", name, offset, offset + size, file_size);
    }
    ggml_tensor * t = ggml_new_tensor(ctx_w, type, n_dims_expected, ne);
    ggml_set_name(t, name);
    srcs.push_back({ t, offset });
    *out = t;
    return true;
}

// would the CPU_REPACK buffer type take this weight for MUL_MAT_ID? (as llama.cpp decides it)
static bool moeswarm_repack_supported(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, ggml_tensor * w) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) {
        return false;
    }
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 1);
    ggml_tensor * op  = ggml_mul_mat_id(ctx, w, b, ids);
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    ggml_backend_buffer_t saved = w->buffer;
    w->buffer = dummy;
    const bool ok = dummy != nullptr && ggml_backend_dev_supports_op(dev, op);
    w->buffer = saved;
    if (dummy) {
        ggml_backend_buffer_free(dummy);
    }
    ggml_free(ctx);
    return ok;
}

static ggml_backend_buffer_type_t moeswarm_repack_buft(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra == nullptr) {
        return nullptr;
    }
    for (ggml_backend_buffer_type_t * p = get_extra(dev); p && *p; ++p) {
        if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) {
            return *p;
        }
    }
    return nullptr;
}

static bool moeswarm_load_layer(moeswarm_slice * slice, const gguf_context * gctx, uint32_t il, size_t file_size,
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
    (void) t_gate; (void) t_up; (void) t_gu; (void) t_down;

    if (!has_down) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_NOT_MOE", "layer %u has no blk.%u.ffn_down_exps.weight", il, il);
    }
    if (has_gu && (has_gate || has_up)) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
            "layer %u has both ffn_gate_up_exps and separate gate/up expert tensors", il);
    }
    if (!has_gu && !has_up) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_NOT_MOE", "layer %u has no ffn_up_exps or ffn_gate_up_exps", il);
    }
    const int64_t n_ff   = ne_down[0];
    const int64_t n_embd = ne_down[1];
    const int64_t n_exp  = ne_down[2];
    if (n_ff <= 0 || n_ff > MOESWARM_MAX_FF || n_embd <= 0 || n_embd > MOESWARM_MAX_EMBD ||
        n_exp <= 0 || n_exp > MOESWARM_MAX_EXPERTS || ne_down[3] != 1) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
            "blk.%u.ffn_down_exps.weight has shape [%lld, %lld, %lld, %lld]: expected [n_ff, n_embd, n_expert] "
            "with n_ff <= %d, n_embd <= %d, n_expert <= %d", il, (long long) ne_down[0], (long long) ne_down[1],
            (long long) ne_down[2], (long long) ne_down[3], MOESWARM_MAX_FF, MOESWARM_MAX_EMBD, MOESWARM_MAX_EXPERTS);
    }
    if (slice->n_embd == 0) {
        slice->n_embd = (uint32_t) n_embd;
        slice->n_expert = (uint32_t) n_exp;
    } else if ((int64_t) slice->n_embd != n_embd || (int64_t) slice->n_expert != n_exp) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
            "layer %u has n_embd %lld and %lld experts, other layers have %u and %u", il, (long long) n_embd,
            (long long) n_exp, slice->n_embd, slice->n_expert);
    }
    L.n_ff = (uint32_t) n_ff;

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
        { "ffn_gate_exps.weight",    3, ne_in,   true,  &L.gate },
        { "ffn_up_exps.weight",      3, ne_in,   true,  &L.up },
        { "ffn_gate_up_exps.weight", 3, ne_gu2,  true,  &L.gate_up },
        { "ffn_down_exps.weight",    3, ne_out,  true,  &L.down },
        { "ffn_gate_exps.bias",      2, ne_b_ff, false, &L.gate_b },
        { "ffn_up_exps.bias",        2, ne_b_ff, false, &L.up_b },
        { "ffn_gate_up_exps.bias",   2, ne_b_gu, false, &L.gate_up_b },
        { "ffn_down_exps.bias",      2, ne_b_em, false, &L.down_b },
        { "ffn_gate_exps.scale",     1, ne_s,    false, &L.gate_s },
        { "ffn_up_exps.scale",       1, ne_s,    false, &L.up_s },
        { "ffn_down_exps.scale",     1, ne_s,    false, &L.down_s },
    };
    for (const want & w : wants) {
        snprintf(name, sizeof(name), "blk.%u.%s", il, w.suffix);
        if (!moeswarm_take_tensor(gctx, slice->ctx_w, name, w.n_dims, w.ne, w.weight, file_size, srcs, w.dst, err)) {
            return false;
        }
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

static bool moeswarm_resolve_act(moeswarm_slice * slice, const gguf_context * gctx, int32_t act_param, moeswarm_error * err) {
    const std::string & arch = slice->arch;
    if (arch == "llama4") {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD",
            "llama4 applies the router weights before the expert FFN; this worker does not support that yet");
    }
    if (arch == "kimi-k3") {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "kimi-k3's SITU activation is not supported yet");
    }
    slice->act = act_param == MOESWARM_ACT_AUTO ? moeswarm_act_for_arch(arch) : act_param;

    // per-layer SwiGLU clamp (<arch>.swiglu_clamp_exp), applied by llama.cpp only with a separate gate
    std::vector<float> limits;
    if (!arch.empty()) {
        const std::string key = arch + ".swiglu_clamp_exp";
        const int64_t id = gguf_find_key(gctx, key.c_str());
        if (id >= 0) {
            if (gguf_get_kv_type(gctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gctx, id) != GGUF_TYPE_FLOAT32) {
                return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of f32", key.c_str());
            }
            const size_t n = gguf_get_arr_n(gctx, id);
            const float * v = (const float *) gguf_get_arr_data(gctx, id);
            limits.assign(v, v + n);
        }
    }
    for (moeswarm_layer & L : slice->layer_data) {
        const bool has_gate = L.gate != nullptr || L.gate_up != nullptr;
        if (slice->act == MOESWARM_ACT_RELU_SQR && has_gate) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "layer %u: gated squared ReLU is not implemented (nor in llama.cpp)", L.layer);
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
                return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "%s.swiglu_clamp_exp[%u] is not finite", arch.c_str(), L.layer);
            }
            L.swiglu_limit = limits[L.layer];
        }
    }
    return true;
}

static bool moeswarm_check_magic(int fd, size_t file_size, moeswarm_error * err) {
    uint8_t head[8];
    if (file_size < 24) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_TRUNCATED", "the file has %zu bytes, less than a GGUF header", file_size);
    }
    if (pread(fd, head, sizeof(head), 0) != (ssize_t) sizeof(head)) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_IO", "cannot read the header: %s", strerror(errno));
    }
    if (memcmp(head, "GGUF", 4) != 0) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_MAGIC", "the file does not start with GGUF");
    }
    const uint32_t version = (uint32_t) head[4] | ((uint32_t) head[5] << 8) | ((uint32_t) head[6] << 16) | ((uint32_t) head[7] << 24);
    if (version != 2 && version != 3) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_UNSUPPORTED_VERSION", "GGUF version %u (2 and 3 are read)", version);
    }
    return true;
}

struct moeswarm_slice * moeswarm_slice_init_from_file(
        const char * path, struct moeswarm_slice_params params, struct moeswarm_error * err) {
    moeswarm_error_clear(err);
    moeswarm_log_reset();
    if (path == nullptr || path[0] == '\0') {
        moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "no slice path");
        return nullptr;
    }
    if (params.act < MOESWARM_ACT_AUTO || params.act >= MOESWARM_ACT_COUNT) {
        moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "unknown activation %d", params.act);
        return nullptr;
    }

    moeswarm_map_guard map;
    map.fd = open(path, O_RDONLY | O_CLOEXEC);
    if (map.fd < 0) {
        moeswarm_error_set(err, "MOESWARM_GGUF_IO", "cannot open %s: %s", path, strerror(errno));
        return nullptr;
    }
    struct stat st;
    if (fstat(map.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        moeswarm_error_set(err, "MOESWARM_GGUF_IO", "%s is not a regular file", path);
        return nullptr;
    }
    const size_t file_size = (size_t) st.st_size;
    if (!moeswarm_check_magic(map.fd, file_size, err)) {
        return nullptr;
    }

    moeswarm_gguf_guard gg;
    {
        gguf_init_params gp = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
        gg.ctx = gguf_init_from_file(path, gp);
    }
    if (gg.ctx == nullptr) {
        const char * why = moeswarm_log_last();
        const bool truncated = strstr(why, "failed to read") != nullptr || strstr(why, "seek") != nullptr;
        moeswarm_error_set(err, truncated ? "MOESWARM_GGUF_TRUNCATED" : "MOESWARM_GGUF_BAD_TENSOR",
            "ggml's GGUF reader refused %s: %s", path, why[0] ? why : "no reason given");
        return nullptr;
    }
    const gguf_context * gctx = gg.ctx;

    moeswarm_slice_guard sg;
    sg.slice = new moeswarm_slice();
    moeswarm_slice * slice = sg.slice;
    slice->n_graphs = params.n_graphs > 0 ? params.n_graphs : 16;

    {
        const int64_t id = gguf_find_key(gctx, "general.architecture");
        if (id >= 0 && gguf_get_kv_type(gctx, id) == GGUF_TYPE_STRING) {
            slice->arch = gguf_get_val_str(gctx, id);
        }
    }

    // layers: the slice's list, or every layer that has expert tensors
    std::vector<uint32_t> found;
    const int64_t n_tensors = gguf_get_n_tensors(gctx);
    for (int64_t i = 0; i < n_tensors; ++i) {
        uint32_t il;
        const char * rest = moeswarm_parse_blk(gguf_get_tensor_name(gctx, i), &il);
        if (rest != nullptr && moeswarm_is_expert_weight(rest) && std::find(found.begin(), found.end(), il) == found.end()) {
            found.push_back(il);
        }
    }
    std::sort(found.begin(), found.end());
    bool has_layers = false;
    std::vector<uint32_t> listed;
    if (!moeswarm_read_u32_array(gctx, "moeswarm.slice.layers", listed, MOESWARM_MAX_LAYERS, &has_layers, err)) {
        return nullptr;
    }
    if (has_layers) {
        std::vector<uint32_t> sorted = listed;
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
            moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.layers lists a layer twice");
            return nullptr;
        }
        if (sorted != found) {
            moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                "moeswarm.slice.layers lists %zu layers but the file has expert tensors for %zu (they must match)",
                sorted.size(), found.size());
            return nullptr;
        }
    }
    if (found.empty()) {
        moeswarm_error_set(err, "MOESWARM_GGUF_NOT_MOE", "%s has no routed-expert tensors (blk.N.ffn_*_exps.weight)", path);
        return nullptr;
    }
    if (found.size() > MOESWARM_MAX_LAYERS) {
        moeswarm_error_set(err, "MOESWARM_GGUF_LIMIT", "%zu expert layers (at most %d)", found.size(), MOESWARM_MAX_LAYERS);
        return nullptr;
    }
    slice->layers = found;

    // metadata-only tensors; allocated below once we know which go to CPU_REPACK
    {
        ggml_init_params ip = { ggml_tensor_overhead() * (found.size() * 11 + 1), nullptr, true };
        slice->ctx_w = ggml_init(ip);
        if (slice->ctx_w == nullptr) {
            moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create a ggml context");
            return nullptr;
        }
    }
    std::vector<moeswarm_tensor_src> srcs;
    for (uint32_t il : found) {
        if (!moeswarm_load_layer(slice, gctx, il, file_size, srcs, err)) {
            return nullptr;
        }
    }

    // experts: the slice's global ids, or 0..n_expert-1 for a full model file
    bool has_experts = false;
    if (!moeswarm_read_u32_array(gctx, "moeswarm.slice.experts", slice->experts, MOESWARM_MAX_EXPERTS, &has_experts, err)) {
        return nullptr;
    }
    if (has_experts) {
        if (slice->experts.size() != slice->n_expert) {
            moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                "moeswarm.slice.experts lists %zu experts but the tensors hold %u", slice->experts.size(), slice->n_expert);
            return nullptr;
        }
    } else {
        slice->experts.resize(slice->n_expert);
        for (uint32_t i = 0; i < slice->n_expert; ++i) {
            slice->experts[i] = i;
        }
    }
    slice->expert_map.resize(slice->n_expert);
    for (uint32_t i = 0; i < slice->n_expert; ++i) {
        if (slice->experts[i] > INT32_MAX) {
            moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "expert id %u does not fit an int32", slice->experts[i]);
            return nullptr;
        }
        slice->expert_map[i] = { slice->experts[i], (int32_t) i };
    }
    std::sort(slice->expert_map.begin(), slice->expert_map.end(),
        [](const moeswarm_expert_map & a, const moeswarm_expert_map & b) { return a.global < b.global; });
    for (size_t i = 1; i < slice->expert_map.size(); ++i) {
        if (slice->expert_map[i].global == slice->expert_map[i - 1].global) {
            moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.experts lists expert %u twice", slice->expert_map[i].global);
            return nullptr;
        }
    }

    if (!moeswarm_resolve_act(slice, gctx, params.act, err)) {
        return nullptr;
    }

    // device, backend, buffers
    ggml_backend_dev_t dev = moeswarm_backend_find_device(params.device);
    if (dev == nullptr) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "no ggml device %s in this build (devices: %s)", params.device,
            moeswarm_devices());
        return nullptr;
    }
    slice->device = ggml_backend_dev_name(dev);
    slice->on_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    slice->backend = ggml_backend_dev_init(dev, nullptr);
    if (slice->backend == nullptr) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot initialise ggml's %s backend", slice->device.c_str());
        return nullptr;
    }
    ggml_backend_buffer_type_t buft_plain = slice->on_cpu ? moeswarm_backend_cpu_buffer_type(dev) : ggml_backend_dev_buffer_type(dev);
    ggml_backend_buffer_type_t buft_repack = params.repack && slice->on_cpu ? moeswarm_repack_buft(dev) : nullptr;

    // move the repackable weights into a second context so each context maps to one buffer type
    ggml_context * ctx_repack = nullptr;
    std::vector<bool> is_repack(srcs.size(), false);
    if (buft_repack != nullptr) {
        for (size_t i = 0; i < srcs.size(); ++i) {
            ggml_tensor * t = srcs[i].t;
            if (ggml_n_dims(t) == 3 && moeswarm_repack_supported(dev, buft_repack, t)) {
                is_repack[i] = true;
            }
        }
    }
    size_t n_repack = 0;
    for (bool b : is_repack) {
        n_repack += b ? 1 : 0;
    }
    ggml_context * ctx_plain = nullptr;
    {
        ggml_init_params ip = { ggml_tensor_overhead() * (srcs.size() + 1), nullptr, true };
        ctx_plain = ggml_init(ip);
        if (n_repack > 0) {
            ctx_repack = ggml_init(ip);
        }
    }
    if (ctx_plain == nullptr || (n_repack > 0 && ctx_repack == nullptr)) {
        if (ctx_plain) ggml_free(ctx_plain);
        if (ctx_repack) ggml_free(ctx_repack);
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create a ggml context");
        return nullptr;
    }
    // re-create each tensor in its buffer's context and point the layer at the new one
    for (size_t i = 0; i < srcs.size(); ++i) {
        ggml_tensor * old_t = srcs[i].t;
        ggml_tensor * new_t = ggml_dup_tensor(is_repack[i] ? ctx_repack : ctx_plain, old_t);
        ggml_set_name(new_t, old_t->name);
        for (moeswarm_layer & L : slice->layer_data) {
            ggml_tensor ** slots[] = { &L.gate, &L.up, &L.gate_up, &L.down, &L.gate_b, &L.up_b, &L.gate_up_b,
                                       &L.down_b, &L.gate_s, &L.up_s, &L.down_s };
            for (ggml_tensor ** s : slots) {
                if (*s == old_t) {
                    *s = new_t;
                    if (is_repack[i]) {
                        L.repacked = true;
                    }
                }
            }
        }
        srcs[i].t = new_t;
    }
    ggml_free(slice->ctx_w);
    slice->ctx_w = ctx_plain;
    slice->ctx_w_repack = ctx_repack;
    // a context without tensors gets no buffer (ggml returns NULL for nothing to allocate)
    const bool need_plain = n_repack < srcs.size();
    if (need_plain) {
        slice->buf_plain = ggml_backend_alloc_ctx_tensors_from_buft(ctx_plain, buft_plain);
    }
    if (ctx_repack != nullptr) {
        slice->buf_repack = ggml_backend_alloc_ctx_tensors_from_buft(ctx_repack, buft_repack);
    }
    if ((need_plain && slice->buf_plain == nullptr) || (ctx_repack != nullptr && slice->buf_repack == nullptr)) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot allocate the weight buffers (out of memory?)");
        return nullptr;
    }
    if (slice->buf_plain) {
        ggml_backend_buffer_set_usage(slice->buf_plain, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    if (slice->buf_repack) {
        ggml_backend_buffer_set_usage(slice->buf_repack, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }

    // copy the data from a read-only mapping of the file (the page cache, no staging copy)
    map.size = file_size;
    map.addr = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, map.fd, 0);
    if (map.addr == MAP_FAILED) {
        moeswarm_error_set(err, "MOESWARM_GGUF_IO", "cannot map %s: %s", path, strerror(errno));
        return nullptr;
    }
    for (const moeswarm_tensor_src & s : srcs) {
        ggml_backend_tensor_set(s.t, (const uint8_t *) map.addr + s.offset, 0, ggml_nbytes(s.t));
        slice->weight_bytes += ggml_nbytes(s.t);
    }

    slice->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(slice->backend));
    if (slice->galloc == nullptr) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create the graph allocator");
        return nullptr;
    }
    if (slice->on_cpu) {
        moeswarm_slice_set_n_threads(slice, params.n_threads);
        if (slice->threadpool == nullptr) {
            moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot start %d compute threads", slice->n_threads);
            return nullptr;
        }
    }

    moeswarm_slice * out = sg.slice;
    sg.slice = nullptr;
    return out;
}

void moeswarm_slice_set_n_threads(struct moeswarm_slice * slice, int32_t n_threads) {
    if (!slice->on_cpu) {
        return; // a GPU backend has no thread count
    }
    if (n_threads <= 0) {
        n_threads = moeswarm_default_threads();
    }
    n_threads = std::min<int32_t>(n_threads, GGML_MAX_N_THREADS);
    if (slice->threadpool != nullptr && slice->n_threads == n_threads) {
        return;
    }
    // the backend lets go of (pauses) the old pool when it gets the new one: free it after that
    ggml_threadpool * old = slice->threadpool;
    ggml_threadpool * pool = nullptr;
    if (!moeswarm_backend_cpu_set_threads(slice->backend, n_threads, &pool)) {
        return;
    }
    slice->threadpool = pool;
    slice->n_threads = n_threads;
    if (old != nullptr) {
        moeswarm_backend_cpu_threadpool_free(old);
    }
}

uint32_t moeswarm_slice_n_embd(const struct moeswarm_slice * slice) { return slice->n_embd; }
uint32_t moeswarm_slice_n_expert(const struct moeswarm_slice * slice) { return slice->n_expert; }
uint32_t moeswarm_slice_n_layer(const struct moeswarm_slice * slice) { return (uint32_t) slice->layers.size(); }
const uint32_t * moeswarm_slice_experts(const struct moeswarm_slice * slice) { return slice->experts.data(); }
const uint32_t * moeswarm_slice_layers(const struct moeswarm_slice * slice) { return slice->layers.data(); }
int32_t moeswarm_slice_act(const struct moeswarm_slice * slice) { return slice->act; }
const char * moeswarm_slice_arch(const struct moeswarm_slice * slice) { return slice->arch.c_str(); }
int32_t moeswarm_slice_n_threads(const struct moeswarm_slice * slice) { return slice->on_cpu ? slice->n_threads : 0; }
const char * moeswarm_slice_device(const struct moeswarm_slice * slice) { return slice->device.c_str(); }
size_t moeswarm_slice_weight_bytes(const struct moeswarm_slice * slice) { return slice->weight_bytes; }

bool moeswarm_slice_layer_desc(const struct moeswarm_slice * slice, uint32_t i, struct moeswarm_layer_desc * desc) {
    if (i >= slice->layer_data.size()) {
        return false;
    }
    const moeswarm_layer & L = slice->layer_data[i];
    desc->layer     = L.layer;
    desc->n_ff      = L.n_ff;
    desc->merged    = L.gate_up != nullptr;
    desc->has_gate  = L.gate != nullptr || L.gate_up != nullptr;
    desc->type_gate = L.gate ? L.gate->type : GGML_TYPE_COUNT;
    desc->type_up   = L.gate_up ? L.gate_up->type : L.up->type;
    desc->type_down = L.down->type;
    desc->repacked  = L.repacked;
    desc->n_extra   = (L.gate_b != nullptr) + (L.up_b != nullptr) + (L.gate_up_b != nullptr) + (L.down_b != nullptr) +
                      (L.gate_s != nullptr) + (L.up_s != nullptr) + (L.down_s != nullptr);
    desc->swiglu_limit = L.swiglu_limit;
    return true;
}

//
// graphs
//

// build_lora_mm_id of llama.cpp without LoRA: mul_mat_id, then the per-expert scale
static ggml_tensor * moeswarm_mm_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids, ggml_tensor * w_s) {
    ggml_tensor * res = ggml_mul_mat_id(ctx, w, cur, ids);
    if (w_s) {
        const int64_t n_expert = w_s->ne[0];
        const int64_t n_tokens = cur->ne[2];
        ggml_tensor * s = ggml_reshape_3d(ctx, w_s, 1, n_expert, 1);
        s = ggml_repeat_4d(ctx, s, 1, n_expert, n_tokens, 1);
        s = ggml_get_rows(ctx, s, ids);
        res = ggml_mul(ctx, res, s);
    }
    return res;
}

// the expert FFN of build_moe_ffn: cur [n_embd, 1, n_tokens], ids [k, n_tokens] -> [n_embd, k, n_tokens]
static ggml_tensor * moeswarm_build_ffn(ggml_context * ctx, const moeswarm_slice * slice, const moeswarm_layer & L,
        ggml_tensor * cur, ggml_tensor * ids) {
    ggml_tensor * up = nullptr;
    if (L.gate_up) {
        ggml_tensor * gate_up = moeswarm_mm_id(ctx, L.gate_up, cur, ids, nullptr);
        if (L.gate_up_b) {
            gate_up = ggml_add_id(ctx, gate_up, L.gate_up_b, ids);
        }
        const int64_t n_ff = gate_up->ne[0] / 2;
        cur = ggml_view_3d(ctx, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], 0);
        up  = ggml_view_3d(ctx, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], n_ff * gate_up->nb[0]);
    } else {
        up = moeswarm_mm_id(ctx, L.up, cur, ids, L.up_s);
        if (L.up_b) {
            up = ggml_add_id(ctx, up, L.up_b, ids);
        }
        if (L.gate) {
            cur = moeswarm_mm_id(ctx, L.gate, cur, ids, L.gate_s);
        } else {
            cur = up;
        }
        if (L.gate_b) {
            cur = ggml_add_id(ctx, cur, L.gate_b, ids);
        }
    }
    const bool has_gate = L.gate != nullptr || L.gate_up != nullptr;

    switch (slice->act) {
        case MOESWARM_ACT_SILU:
            if (L.swiglu_limit > 0.0f) {
                const float limit = L.swiglu_limit;
                if (slice->arch == "deepseek4") {
                    cur = ggml_swiglu_clamp(ctx, cur, up, limit);
                } else {
                    up = ggml_clamp(ctx, up, -limit, limit);
                    ggml_tensor * gate_act = ggml_silu(ctx, cur);
                    gate_act = ggml_clamp(ctx, gate_act, -INFINITY, limit);
                    cur = ggml_mul(ctx, gate_act, up);
                }
            } else if (has_gate) {
                cur = ggml_swiglu_split(ctx, cur, up);
            } else {
                cur = ggml_silu(ctx, cur);
            }
            break;
        case MOESWARM_ACT_GELU:
            cur = has_gate ? ggml_geglu_split(ctx, cur, up) : ggml_gelu(ctx, cur);
            break;
        case MOESWARM_ACT_RELU:
            cur = has_gate ? ggml_reglu_split(ctx, cur, up) : ggml_relu(ctx, cur);
            break;
        case MOESWARM_ACT_SWIGLU_OAI:
            cur = ggml_swiglu_oai(ctx, cur, up, 1.702f, 7.0f);
            break;
        case MOESWARM_ACT_RELU_SQR:
            cur = ggml_sqr(ctx, ggml_relu(ctx, cur));
            break;
        default:
            break;
    }

    ggml_tensor * experts = moeswarm_mm_id(ctx, L.down, cur, ids, L.down_s);
    if (L.down_b) {
        experts = ggml_add_id(ctx, experts, L.down_b, ids);
    }
    return experts;
}

static const moeswarm_layer * moeswarm_find_layer(const moeswarm_slice * slice, uint32_t layer) {
    const auto it = std::lower_bound(slice->layers.begin(), slice->layers.end(), layer);
    if (it == slice->layers.end() || *it != layer) {
        return nullptr;
    }
    return &slice->layer_data[(size_t) (it - slice->layers.begin())];
}

static int32_t moeswarm_local_id(const moeswarm_slice * slice, int32_t global) {
    if (global < 0) {
        return -1;
    }
    const auto it = std::lower_bound(slice->expert_map.begin(), slice->expert_map.end(), (uint32_t) global,
        [](const moeswarm_expert_map & m, uint32_t g) { return m.global < g; });
    if (it == slice->expert_map.end() || it->global != (uint32_t) global) {
        return -2;
    }
    return it->local;
}

// kind 0: run over n_rows (token, slot) pairs; 1/2: reference over n_rows tokens x k slots
static moeswarm_graph * moeswarm_graph_get(moeswarm_slice * slice, const moeswarm_layer & L, int32_t kind,
        uint32_t n_rows, uint32_t k, moeswarm_error * err) {
    slice->clock++;
    for (moeswarm_graph & g : slice->graphs) {
        if (g.kind == kind && g.layer == L.layer && g.n_rows == n_rows && g.k == k) {
            g.last_use = slice->clock;
            return &g;
        }
    }
    // evict the least recently used graph when the cache is full
    moeswarm_graph * lru = nullptr;
    for (moeswarm_graph & g : slice->graphs) {
        if (lru == nullptr || g.last_use < lru->last_use) {
            lru = &g;
        }
    }
    if (slice->graphs.size() >= slice->n_graphs && lru != nullptr) {
        moeswarm_graph_free(*lru);
        *lru = slice->graphs.back();
        slice->graphs.pop_back();
    }

    moeswarm_graph g;
    memset(&g, 0, sizeof(g));
    g.kind = kind;
    g.layer = L.layer;
    g.n_rows = n_rows;
    g.k = k;
    g.last_use = slice->clock;
    const size_t n_nodes = MOESWARM_GRAPH_NODES + 2 * (size_t) k;
    ggml_init_params ip = { ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), nullptr, true };
    g.ctx = ggml_init(ip);
    if (g.ctx == nullptr) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "cannot create a ggml context for the graph");
        return nullptr;
    }
    ggml_context * ctx = g.ctx;
    const int64_t n_embd = slice->n_embd;

    g.x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, n_rows);
    ggml_set_name(g.x, "moeswarm_x");
    ggml_set_input(g.x);
    g.ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_rows);
    ggml_set_name(g.ids, "moeswarm_ids");
    ggml_set_input(g.ids);

    ggml_tensor * cur = ggml_reshape_3d(ctx, g.x, n_embd, 1, n_rows);
    ggml_tensor * experts = moeswarm_build_ffn(ctx, slice, L, cur, g.ids); // [n_embd, k, n_rows]
    ggml_tensor * out = experts;
    g.gf = ggml_new_graph_custom(ctx, n_nodes, false);
    if (kind == 2) {
        // llama.cpp: weighting, then the views ordered before the adds, added in slot order
        g.w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, n_rows);
        ggml_set_name(g.w, "moeswarm_w");
        ggml_set_input(g.w);
        experts = ggml_mul(ctx, experts, g.w);
        ggml_build_forward_expand(g.gf, experts);
        std::vector<ggml_tensor *> views(k);
        for (uint32_t i = 0; i < k; ++i) {
            views[i] = ggml_view_2d(ctx, experts, n_embd, n_rows, experts->nb[2], i * experts->nb[1]);
            ggml_build_forward_expand(g.gf, views[i]);
        }
        out = views[0];
        for (uint32_t i = 1; i < k; ++i) {
            out = ggml_add(ctx, out, views[i]);
            ggml_build_forward_expand(g.gf, out);
        }
        if (k == 1) {
            out = ggml_cont(ctx, out);
        }
    }
    ggml_set_name(out, "moeswarm_out");
    ggml_set_output(out);
    ggml_build_forward_expand(g.gf, out);
    g.out = out;
    // a GPU backend may lack an op or a type: refuse here rather than abort inside ggml
    for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
        ggml_tensor * node = ggml_graph_node(g.gf, i);
        if (!ggml_backend_supports_op(slice->backend, node)) {
            moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "the %s backend cannot run %s (%s) of this graph",
                slice->device.c_str(), ggml_op_desc(node), node->src[0] ? ggml_type_name(node->src[0]->type) : "-");
            ggml_free(g.ctx);
            return nullptr;
        }
    }
    slice->graphs.push_back(g);
    return &slice->graphs.back();
}

// A cached graph keeps the addresses of its last allocation, and ggml-alloc skips tensors that
// already have data: after another graph (re)used or regrew the shared compute buffer, those
// addresses are stale. Forget them so that ggml_gallocr_alloc_graph places every tensor anew
// (views of the weights are re-derived from them).
static bool moeswarm_graph_alloc(moeswarm_slice * slice, moeswarm_graph * g, moeswarm_error * err) {
    for (ggml_tensor * t = ggml_get_first_tensor(g->ctx); t != nullptr; t = ggml_get_next_tensor(g->ctx, t)) {
        t->data = nullptr;
        t->buffer = nullptr;
    }
    if (!ggml_gallocr_alloc_graph(slice->galloc, g->gf)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "cannot allocate the compute buffer (out of memory?)");
    }
    return true;
}

static bool moeswarm_abort_callback(void * data) {
    const moeswarm_slice * slice = (const moeswarm_slice *) data;
    return slice->abort_flag != nullptr && *slice->abort_flag;
}

static bool moeswarm_graph_compute(moeswarm_slice * slice, moeswarm_graph * g, volatile bool * abort_flag,
        moeswarm_error * err) {
    slice->abort_flag = abort_flag;
    if (slice->on_cpu) {
        moeswarm_backend_cpu_set_abort_callback(slice->backend, moeswarm_abort_callback, slice);
    }
    const enum ggml_status st = ggml_backend_graph_compute(slice->backend, g->gf);
    slice->abort_flag = nullptr;
    if (st == GGML_STATUS_ABORTED) {
        return moeswarm_error_set(err, "MOESWARM_ABORTED", "the compute was aborted");
    }
    if (st != GGML_STATUS_SUCCESS) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "ggml_backend_graph_compute failed (status %d)", (int) st);
    }
    return true;
}

size_t moeswarm_run_output_len(const struct moeswarm_slice * slice, uint32_t n_tokens, uint32_t k, int32_t mode) {
    return (size_t) n_tokens * (mode == MOESWARM_MODE_EACH ? k : 1) * slice->n_embd;
}

static bool moeswarm_check_run(const moeswarm_slice * slice, const moeswarm_run_params * p, size_t out_len,
        const moeswarm_layer ** L, moeswarm_error * err) {
    if (p == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "no run parameters");
    }
    *L = moeswarm_find_layer(slice, p->layer);
    if (*L == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "layer %u is not in this slice", p->layer);
    }
    if (p->n_tokens < 1 || p->n_tokens > MOESWARM_MAX_TOKENS) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "n_tokens %u is outside 1..%d", p->n_tokens, MOESWARM_MAX_TOKENS);
    }
    if (p->k < 1 || p->k > MOESWARM_MAX_K) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "k %u is outside 1..%d", p->k, MOESWARM_MAX_K);
    }
    if (p->mode != MOESWARM_MODE_EACH && p->mode != MOESWARM_MODE_SUM) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "unknown mode %d", p->mode);
    }
    if (p->x == nullptr || p->ids == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "x and ids are required");
    }
    if (p->mode == MOESWARM_MODE_SUM && p->weights == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "mode sum needs the router weights");
    }
    if (out_len != moeswarm_run_output_len(slice, p->n_tokens, p->k, p->mode)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "output holds %zu floats, expected %zu", out_len,
            moeswarm_run_output_len(slice, p->n_tokens, p->k, p->mode));
    }
    if (p->weights != nullptr) {
        const size_t n = (size_t) p->n_tokens * p->k;
        for (size_t i = 0; i < n; ++i) {
            if (!std::isfinite(p->weights[i])) {
                return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "router weight %zu (token %zu, slot %zu) is not finite",
                    i, i / p->k, i % p->k);
            }
        }
    }
    return true;
}

bool moeswarm_slice_run(struct moeswarm_slice * slice, const struct moeswarm_run_params * p,
        float * out, size_t out_len, struct moeswarm_error * err) {
    moeswarm_error_clear(err);
    const moeswarm_layer * L = nullptr;
    if (!moeswarm_check_run(slice, p, out_len, &L, err)) {
        return false;
    }
    const uint32_t n_tokens = p->n_tokens;
    const uint32_t k = p->k;
    const size_t n_embd = slice->n_embd;

    // every (token, slot) pair with an expert becomes one row of a k = 1 mul_mat_id: each expert
    // sees the same rows in the same order as in the monolithic graph, and ggml computes each
    // row on its own, so the results are the same bits; empty slots never reach ggml
    slice->pair_of_slot.resize((size_t) n_tokens * k);
    size_t n_pairs = 0;
    for (uint32_t i = 0; i < n_tokens; ++i) {
        for (uint32_t j = 0; j < k; ++j) {
            const int32_t gid = p->ids[(size_t) i * k + j];
            const int32_t lid = moeswarm_local_id(slice, gid);
            if (lid == -2 || gid < -1) {
                return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                    "expert %d (token %u, slot %u) is not in this slice", gid, i, j);
            }
            slice->pair_of_slot[(size_t) i * k + j] = lid < 0 ? -1 : (int32_t) n_pairs;
            if (lid >= 0) {
                n_pairs++;
            }
        }
    }
    slice->pair_ids.resize(n_pairs);
    slice->x_rows.resize(n_pairs * n_embd);
    for (uint32_t i = 0; i < n_tokens; ++i) {
        for (uint32_t j = 0; j < k; ++j) {
            const int32_t pi = slice->pair_of_slot[(size_t) i * k + j];
            if (pi >= 0) {
                slice->pair_ids[pi] = moeswarm_local_id(slice, p->ids[(size_t) i * k + j]);
                memcpy(&slice->x_rows[(size_t) pi * n_embd], p->x + (size_t) i * n_embd, n_embd * sizeof(float));
            }
        }
    }

    slice->y_rows.resize(n_pairs * n_embd);
    if (n_pairs > 0) {
        moeswarm_graph * g = moeswarm_graph_get(slice, *L, 0, (uint32_t) n_pairs, 1, err);
        if (g == nullptr) {
            return false;
        }
        if (!moeswarm_graph_alloc(slice, g, err)) {
            return false;
        }
        ggml_backend_tensor_set(g->x, slice->x_rows.data(), 0, ggml_nbytes(g->x));
        ggml_backend_tensor_set(g->ids, slice->pair_ids.data(), 0, ggml_nbytes(g->ids));
        if (!moeswarm_graph_compute(slice, g, p->abort_flag, err)) {
            return false;
        }
        ggml_backend_tensor_get(g->out, slice->y_rows.data(), 0, ggml_nbytes(g->out));
    }

    if (p->mode == MOESWARM_MODE_EACH) {
        moeswarm_scatter_each(slice->y_rows.data(), slice->pair_of_slot.data(), n_tokens, k, n_embd, out);
    } else {
        moeswarm_combine_sum(slice->y_rows.data(), slice->pair_of_slot.data(), p->weights, n_tokens, k, n_embd, out);
    }
    return true;
}

bool moeswarm_slice_run_reference(struct moeswarm_slice * slice, const struct moeswarm_run_params * p,
        float * out, size_t out_len, struct moeswarm_error * err) {
    moeswarm_error_clear(err);
    const moeswarm_layer * L = nullptr;
    if (!moeswarm_check_run(slice, p, out_len, &L, err)) {
        return false;
    }
    const size_t n = (size_t) p->n_tokens * p->k;
    std::vector<int32_t> local(n);
    for (size_t i = 0; i < n; ++i) {
        const int32_t lid = moeswarm_local_id(slice, p->ids[i]);
        if (lid < 0) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                "the reference graph needs every slot filled with an expert of the file (slot %zu has %d)", i, p->ids[i]);
        }
        local[i] = lid;
    }
    const int32_t kind = p->mode == MOESWARM_MODE_SUM ? 2 : 1;
    moeswarm_graph * g = moeswarm_graph_get(slice, *L, kind, p->n_tokens, p->k, err);
    if (g == nullptr) {
        return false;
    }
    if (!moeswarm_graph_alloc(slice, g, err)) {
        return false;
    }
    ggml_backend_tensor_set(g->x, p->x, 0, ggml_nbytes(g->x));
    ggml_backend_tensor_set(g->ids, local.data(), 0, ggml_nbytes(g->ids));
    if (g->w) {
        ggml_backend_tensor_set(g->w, p->weights, 0, ggml_nbytes(g->w));
    }
    if (!moeswarm_graph_compute(slice, g, p->abort_flag, err)) {
        return false;
    }
    if (ggml_nbytes(g->out) != out_len * sizeof(float)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "reference output size mismatch");
    }
    ggml_backend_tensor_get(g->out, out, 0, ggml_nbytes(g->out));
    return true;
}

//
// conversions
//

size_t moeswarm_row_bytes(enum ggml_type type, int64_t n_rows, int64_t n_per_row) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0 || n_rows < 0 || n_per_row <= 0 ||
        n_per_row % ggml_blck_size(type) != 0 || n_rows > INT64_MAX / n_per_row) {
        return 0;
    }
    return ggml_row_size(type, n_per_row) * (size_t) n_rows;
}

bool moeswarm_quantize(enum ggml_type type, const float * src, int64_t n_rows, int64_t n_per_row,
        void * dst, size_t dst_size, struct moeswarm_error * err) {
    const size_t need = moeswarm_row_bytes(type, n_rows, n_per_row);
    if (need == 0 && n_rows > 0) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "rows of %lld values cannot be stored as %s",
            (long long) n_per_row, type < GGML_TYPE_COUNT ? ggml_type_name(type) : "?");
    }
    if (dst_size != need) {
        return moeswarm_error_set(err, "MOESWARM_INVALID_ARGUMENT", "destination holds %zu bytes, expected %zu", dst_size, need);
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

bool moeswarm_dequantize(enum ggml_type type, const void * src, size_t src_size, float * dst, int64_t n,
        struct moeswarm_error * err) {
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
