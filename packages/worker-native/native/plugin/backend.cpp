// The backend, device and registry that ggml sees: graph_compute sends one dispatch frame (mode
// "sum") per split, straight to the worker over its native link when the bridge's table allows
// (native-link.cpp), else to the bridge (round-trip.cpp), and blocks until the combined result.

#include "moeswarm-plugin.h"

#include <string.h>

#include <mutex>

struct moeswarm_device_context {
    std::mutex mutex;
    std::string fingerprint;
    std::shared_ptr<const moeswarm_config> config;
};

static const char * moeswarm_backend_get_name(ggml_backend_t backend) {
    return MOESWARM_NAME;
}

static void moeswarm_backend_free(ggml_backend_t backend) {
    moeswarm_backend_context * ctx = (moeswarm_backend_context *) backend->context;
    {
        std::lock_guard<std::mutex> lock(ctx->mutex);
        moeswarm_native_receipts(ctx, true); // the last counts, best effort
        moeswarm_native_close_all(ctx->native);
        moeswarm_conn_close(ctx->conn);
    }
    delete ctx;
    delete backend;
}

static void moeswarm_backend_synchronize(ggml_backend_t backend) {
    // graph_compute returns with the result written: nothing is ever pending
}

// the split's pattern, cached by split uid (a reused decode graph keeps its uids)
static moeswarm_pattern * moeswarm_split_pattern(moeswarm_backend_context * ctx, ggml_cgraph * cgraph) {
    auto it = ctx->cache.find(cgraph->uid);
    if (it != ctx->cache.end()) {
        moeswarm_stats_pattern(true);
        return &it->second;
    }
    moeswarm_pattern found;
    std::string err;
    if (!moeswarm_find_pattern(cgraph, found, err)) {
        GGML_LOG_ERROR("%s: %s (%d nodes, first %s)\n", __func__, err.c_str(), cgraph->n_nodes,
                cgraph->n_nodes ? ggml_op_desc(cgraph->nodes[0]) : "-");
        return nullptr;
    }
    if (ctx->cache_order.size() >= MOESWARM_CACHE_MAX) {
        ctx->cache.erase(ctx->cache_order.front());
        ctx->cache_order.pop_front();
    }
    ctx->cache_order.push_back(cgraph->uid);
    moeswarm_stats_pattern(false);
    return &(ctx->cache[cgraph->uid] = found);
}

// gather the inputs with their strides (the ids are a view of the argsort)
// (llama4's weighted input: K rows per token, whose weights are already in them)
static void moeswarm_gather_inputs(moeswarm_backend_context * ctx, const moeswarm_pattern * p) {
    const int64_t T = p->n_tokens, E = p->n_embd, K = p->k;
    const int64_t R = p->weighted_input ? K : 1;
    ctx->x.resize((size_t) T * R * E);
    ctx->ids.resize((size_t) T * K);
    ctx->w.resize((size_t) T * K);
    const ggml_tensor * x = p->x;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t r = 0; r < R; ++r) {
            const char * row = (const char *) x->data + t * x->nb[2] + r * x->nb[1];
            float * dst      = ctx->x.data() + (t * R + r) * E;
            if (x->nb[0] == 4) {
                memcpy(dst, row, E * 4);
            } else {
                for (int64_t e = 0; e < E; ++e)
                    memcpy(dst + e, row + e * x->nb[0], 4);
            }
        }
        for (int64_t j = 0; j < K; ++j) {
            memcpy(ctx->ids.data() + t * K + j, (const char *) p->ids->data + t * p->ids->nb[1] + j * p->ids->nb[0], 4);
            if (p->w == nullptr) {
                ctx->w[t * K + j] = 1.0f;
            } else {
                memcpy(ctx->w.data() + t * K + j, (const char *) p->w->data + t * p->w->nb[2] + j * p->w->nb[1], 4);
            }
        }
    }
}

// a split through the native link when the bridge's table says so, else (or after any failure
// there) through the bridge, which then computes the same bits
static enum ggml_status moeswarm_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    moeswarm_backend_context * ctx = (moeswarm_backend_context *) backend->context;
    std::lock_guard<std::mutex> lock(ctx->mutex);
    const moeswarm_config & cfg = *ctx->config;

    moeswarm_pattern * p = moeswarm_split_pattern(ctx, cgraph);
    if (p == nullptr) {
        return GGML_STATUS_FAILED;
    }
    moeswarm_gather_inputs(ctx, p);
    const int64_t T = p->n_tokens;

    std::string err;
    size_t bytes_out = 0, bytes_in = 0;
    const double t0 = moeswarm_now_us();
    moeswarm_native_drain(ctx);
    bool ok = moeswarm_native_split(ctx, cfg, *p, bytes_out, bytes_in) == MOESWARM_NATIVE_OK;
    if (!ok) {
        ok = moeswarm_bridge_split(ctx, cfg, *p, err, bytes_out, bytes_in);
    }
    moeswarm_native_receipts(ctx, false);
    moeswarm_stats_record(p->layer, T, moeswarm_now_us() - t0, ok, bytes_out, bytes_in);
    if (!ok) {
        // a closed connection: the dispatcher is gone (or never came); an open one: it answered
        // with an error frame, which its own log explains
        if (ctx->conn.fd < 0) {
            GGML_LOG_ERROR("%s: layer %d, %lld tokens: %s\n"
                    "moeswarm: this request fails; check that moeswarm-dispatcher is running and listening on %s "
                    "(it prints the llama-server command to use), then send the request again\n",
                    __func__, p->layer, (long long) T, err.c_str(), cfg.bridge.c_str());
        } else {
            GGML_LOG_ERROR("%s: layer %d, %lld tokens: %s\n"
                    "moeswarm: the dispatcher could not compute this layer (its log says why); this request fails\n",
                    __func__, p->layer, (long long) T, err.c_str());
        }
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;
}

static const ggml_backend_i k_moeswarm_backend_i = {
    /* .get_name            = */ moeswarm_backend_get_name,
    /* .free                = */ moeswarm_backend_free,
    /* .set_tensor_async    = */ nullptr,
    /* .get_tensor_async    = */ nullptr,
    /* .set_tensor_2d_async = */ nullptr,
    /* .get_tensor_2d_async = */ nullptr,
    /* .cpy_tensor_async    = */ nullptr,
    /* .synchronize         = */ moeswarm_backend_synchronize,
    /* .graph_plan_create   = */ nullptr,
    /* .graph_plan_free     = */ nullptr,
    /* .graph_plan_update   = */ nullptr,
    /* .graph_plan_compute  = */ nullptr,
    /* .graph_compute       = */ moeswarm_backend_graph_compute,
    /* .event_record        = */ nullptr,
    /* .event_wait          = */ nullptr,
    /* .graph_optimize      = */ nullptr,
};

static ggml_guid_t moeswarm_guid(void) {
    static ggml_guid guid = { 0x6d, 0x6f, 0x65, 0x73, 0x77, 0x61, 0x72, 0x6d, 0x2d, 0x62, 0x61, 0x63, 0x6b, 0x62, 0x6f, 0x6e };
    return &guid;
}

//
// device
//

static const char * moeswarm_dev_get_name(ggml_backend_dev_t dev) {
    return MOESWARM_NAME;
}

static const char * moeswarm_dev_get_description(ggml_backend_dev_t dev) {
    return "moeswarm: routed experts computed by a swarm of workers";
}

static void moeswarm_dev_get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    // the weights live on the workers; nothing here to report
    *free  = 0;
    *total = 0;
}

static enum ggml_backend_dev_type moeswarm_dev_get_type(ggml_backend_dev_t dev) {
    // ACCEL: no layers and no KV cache are given to it, but a backend in every context
    return GGML_BACKEND_DEVICE_TYPE_ACCEL;
}

static void moeswarm_dev_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    memset(props, 0, sizeof(*props));
    props->name        = moeswarm_dev_get_name(dev);
    props->description = moeswarm_dev_get_description(dev);
    props->type        = moeswarm_dev_get_type(dev);
    moeswarm_dev_get_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.async                = false;
    props->caps.host_buffer          = false;
    props->caps.buffer_from_host_ptr = false;
    props->caps.events               = false;
}

// the bridge connection at once with the native plane, so that the table the bridge pushes after
// native-hello is there before the first split; a bridge not there yet is the first split's to report
static void moeswarm_backend_connect_early(moeswarm_backend_context * ctx) {
    const moeswarm_config & cfg = *ctx->config;
    std::string err;
    if (cfg.native && !cfg.bridge.empty() && moeswarm_conn_open(ctx->conn, cfg.bridge, err)) {
        moeswarm_native_on_connect(ctx, cfg);
    }
}

static ggml_backend_t moeswarm_dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    // one connection per backend: contexts compute concurrently, each with its own
    return new ggml_backend{
        /* .guid    = */ moeswarm_guid(),
        /* .iface   = */ k_moeswarm_backend_i,
        /* .device  = */ dev,
        /* .context = */
        [] {
            moeswarm_backend_context * ctx = new moeswarm_backend_context();
            ctx->config                    = moeswarm_config_current();
            moeswarm_backend_connect_early(ctx);
            return ctx;
        }(),
    };
}

static ggml_backend_buffer_type_t moeswarm_dev_get_buffer_type(ggml_backend_dev_t dev) {
    return moeswarm_buft();
}

static bool moeswarm_dev_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    return moeswarm_supports_op(op);
}

static bool moeswarm_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return buft == moeswarm_buft();
}

static const ggml_backend_device_i k_moeswarm_device_i = {
    /* .get_name             = */ moeswarm_dev_get_name,
    /* .get_description      = */ moeswarm_dev_get_description,
    /* .get_memory           = */ moeswarm_dev_get_memory,
    /* .get_type             = */ moeswarm_dev_get_type,
    /* .get_props            = */ moeswarm_dev_get_props,
    /* .init_backend         = */ moeswarm_dev_init_backend,
    /* .get_buffer_type      = */ moeswarm_dev_get_buffer_type,
    /* .get_host_buffer_type = */ nullptr,
    /* .buffer_from_host_ptr = */ nullptr,
    /* .supports_op          = */ moeswarm_dev_supports_op,
    /* .supports_buft        = */ moeswarm_dev_supports_buft,
    /* .offload_op           = */ nullptr,
    /* .event_new            = */ nullptr,
    /* .event_free           = */ nullptr,
    /* .event_synchronize    = */ nullptr,
};

//
// registry
//

static const char * moeswarm_reg_get_name(ggml_backend_reg_t reg) {
    return MOESWARM_NAME;
}

static size_t moeswarm_reg_get_device_count(ggml_backend_reg_t reg) {
    return 1;
}

static ggml_backend_dev_t moeswarm_reg_get_device(ggml_backend_reg_t reg, size_t index) {
    GGML_ASSERT(index == 0);
    return moeswarm_device();
}

typedef size_t (*ggml_backend_moeswarm_stats_t)(char * buf, size_t size);
typedef void (*ggml_backend_moeswarm_stats_reset_t)(void);

static void * moeswarm_reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    if (strcmp(name, "ggml_backend_moeswarm_stats") == 0) {
        return (void *) (ggml_backend_moeswarm_stats_t) moeswarm_stats_json;
    }
    if (strcmp(name, "ggml_backend_moeswarm_stats_reset") == 0) {
        return (void *) (ggml_backend_moeswarm_stats_reset_t) moeswarm_stats_reset;
    }
    return nullptr;
}

static const ggml_backend_reg_i k_moeswarm_reg_i = {
    /* .get_name         = */ moeswarm_reg_get_name,
    /* .get_device_count = */ moeswarm_reg_get_device_count,
    /* .get_device       = */ moeswarm_reg_get_device,
    /* .get_proc_address = */ moeswarm_reg_get_proc_address,
};

static ggml_backend_reg_t moeswarm_reg(void);

ggml_backend_dev_t moeswarm_device(void) {
    static moeswarm_device_context ctx;
    static ggml_backend_device dev = {
        /* .iface   = */ k_moeswarm_device_i,
        /* .reg     = */ moeswarm_reg(),
        /* .context = */ &ctx,
    };
    return &dev;
}

std::shared_ptr<const moeswarm_config> moeswarm_config_current(void) {
    moeswarm_device_context * ctx = (moeswarm_device_context *) moeswarm_device()->context;
    std::string fp                = moeswarm_config_fingerprint();
    std::lock_guard<std::mutex> lock(ctx->mutex);
    if (!ctx->config || fp != ctx->fingerprint) {
        ctx->config      = std::make_shared<const moeswarm_config>(moeswarm_load_config());
        ctx->fingerprint = std::move(fp);
    }
    return ctx->config;
}

static ggml_backend_reg_t moeswarm_reg(void) {
    // one object for the process: ggml_backend_init may be called again (a second
    // load_all_from_path) and the registry then finds the same reg and adds nothing
    static ggml_backend_reg reg = {
        /* .api_version = */ GGML_BACKEND_API_VERSION,
        /* .iface       = */ k_moeswarm_reg_i,
        /* .context     = */ nullptr,
    };
    return &reg;
}

static ggml_backend_reg_t moeswarm_backend_init(void) {
    moeswarm_config_current(); // a bad configuration is reported when the plugin loads
    static std::once_flag warned;
    std::call_once(warned, moeswarm_warn_split_batches);
    return moeswarm_reg();
}

static int moeswarm_backend_score(void) {
    return 1;
}

GGML_BACKEND_DL_IMPL(moeswarm_backend_init)
GGML_BACKEND_DL_SCORE_IMPL(moeswarm_backend_score)
