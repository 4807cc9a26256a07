#include "moeswarm-slice-impl.h"
#include "moeswarm-backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>

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
    g_log_echo       = env != nullptr && strcmp(env, "1") == 0;
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

struct moeswarm_slice_params moeswarm_slice_default_params(void) {
    moeswarm_slice_params params;
    params.n_threads = 0;
    params.repack    = true;
    params.act       = MOESWARM_ACT_AUTO;
    params.n_graphs  = 16;
    params.device    = nullptr;
    params.max_rows  = 0;
    return params;
}

static int32_t moeswarm_default_threads(void) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int32_t) std::min<long>(n, GGML_MAX_N_THREADS) : 1;
}

void moeswarm_graph_free(moeswarm_graph & g) {
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
    if (slice->measure) {
        ggml_gallocr_free(slice->measure);
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
    ggml_threadpool * old  = slice->threadpool;
    ggml_threadpool * pool = nullptr;
    if (!moeswarm_backend_cpu_set_threads(slice->backend, n_threads, &pool)) {
        return;
    }
    slice->threadpool = pool;
    slice->n_threads  = n_threads;
    if (old != nullptr) {
        moeswarm_backend_cpu_threadpool_free(old);
    }
}

uint32_t moeswarm_slice_n_embd(const struct moeswarm_slice * slice) {
    return slice->n_embd;
}
uint32_t moeswarm_slice_n_expert(const struct moeswarm_slice * slice) {
    return slice->n_expert;
}
uint32_t moeswarm_slice_n_layer(const struct moeswarm_slice * slice) {
    return (uint32_t) slice->layers.size();
}
const uint32_t * moeswarm_slice_experts(const struct moeswarm_slice * slice) {
    return slice->experts.data();
}
const uint32_t * moeswarm_slice_layers(const struct moeswarm_slice * slice) {
    return slice->layers.data();
}
int32_t moeswarm_slice_act(const struct moeswarm_slice * slice) {
    return slice->act;
}
const char * moeswarm_slice_arch(const struct moeswarm_slice * slice) {
    return slice->arch.c_str();
}
int32_t moeswarm_slice_n_threads(const struct moeswarm_slice * slice) {
    return slice->on_cpu ? slice->n_threads : 0;
}
const char * moeswarm_slice_device(const struct moeswarm_slice * slice) {
    return slice->device.c_str();
}
size_t moeswarm_slice_weight_bytes(const struct moeswarm_slice * slice) {
    return slice->weight_bytes;
}
uint32_t moeswarm_slice_max_rows(const struct moeswarm_slice * slice) {
    return slice->max_rows;
}
size_t moeswarm_slice_compute_bytes(const struct moeswarm_slice * slice) {
    return slice->compute_bytes;
}

bool moeswarm_slice_layer_desc(const struct moeswarm_slice * slice, uint32_t i, struct moeswarm_layer_desc * desc) {
    if (i >= slice->layer_data.size()) {
        return false;
    }
    const moeswarm_layer & L = slice->layer_data[i];
    desc->layer              = L.layer;
    desc->n_ff               = L.n_ff;
    desc->merged             = L.gate_up != nullptr;
    desc->has_gate           = L.gate != nullptr || L.gate_up != nullptr;
    desc->type_gate          = L.gate ? L.gate->type : GGML_TYPE_COUNT;
    desc->type_up            = L.gate_up ? L.gate_up->type : L.up->type;
    desc->type_down          = L.down->type;
    desc->repacked           = L.repacked;
    desc->n_extra            = (L.gate_b != nullptr) + (L.up_b != nullptr) + (L.gate_up_b != nullptr) + (L.down_b != nullptr) +
            (L.gate_s != nullptr) + (L.up_s != nullptr) + (L.down_s != nullptr);
    desc->swiglu_limit = L.swiglu_limit;
    return true;
}
