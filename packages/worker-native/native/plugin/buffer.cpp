// The MOESWARM buffer type: routed-expert weights are recorded and dropped at set_tensor (the
// workers hold them) in an address range reserved without RAM; compute buffers are ordinary memory.

#include "moeswarm-plugin.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>

struct moeswarm_weight_record {
    std::string name;
    ggml_type type;
    int64_t ne[GGML_MAX_DIMS];
    size_t offset;
};

struct moeswarm_buffer_context {
    void * base = nullptr;
    size_t size = 0;
    std::vector<moeswarm_weight_record> weights;
    std::mutex mutex;
};

bool moeswarm_buffer_is_weights(ggml_backend_buffer_t buffer) {
    return ggml_backend_buffer_get_usage(buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS;
}

static void moeswarm_buffer_free(ggml_backend_buffer_t buffer) {
    moeswarm_buffer_context * ctx = (moeswarm_buffer_context *) buffer->context;
    if (ctx->base != nullptr) {
        munmap(ctx->base, ctx->size);
    }
    delete ctx;
}

static void * moeswarm_buffer_get_base(ggml_backend_buffer_t buffer) {
    return ((moeswarm_buffer_context *) buffer->context)->base;
}

static void moeswarm_buffer_set_tensor(
        ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    moeswarm_buffer_context * ctx = (moeswarm_buffer_context *) buffer->context;
    if (moeswarm_buffer_is_weights(buffer)) {
        // the workers hold these: remember what llama.cpp loaded here, keep none of the bytes
        if (offset == 0) {
            if (!moeswarm_expert_name(tensor->name, nullptr, nullptr)) {
                GGML_LOG_ERROR("%s: %s is not a routed-expert tensor: the MOESWARM device cannot compute with it\n", __func__,
                        tensor->name);
            }
            moeswarm_weight_record r;
            r.name = tensor->name;
            r.type = tensor->type;
            for (int i = 0; i < GGML_MAX_DIMS; ++i)
                r.ne[i] = tensor->ne[i];
            r.offset = (size_t) ((const char *) tensor->data - (const char *) ctx->base);
            std::lock_guard<std::mutex> lock(ctx->mutex);
            ctx->weights.push_back(r);
        }
        moeswarm_stats_weights(size, offset == 0);
        return;
    }
    memcpy((char *) tensor->data + offset, data, size);
}

static void moeswarm_buffer_get_tensor(
        ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    if (moeswarm_buffer_is_weights(buffer)) {
        // nothing was kept; zeros rather than stale or uninitialised bytes
        memset(data, 0, size);
        return;
    }
    memcpy(data, (const char *) tensor->data + offset, size);
}

static void moeswarm_buffer_memset_tensor(
        ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    if (moeswarm_buffer_is_weights(buffer)) {
        return;
    }
    memset((char *) tensor->data + offset, value, size);
}

static void moeswarm_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    moeswarm_buffer_context * ctx = (moeswarm_buffer_context *) buffer->context;
    if (moeswarm_buffer_is_weights(buffer) || ctx->base == nullptr) {
        return; // touching the reserved range would cost the RAM it avoids
    }
    memset(ctx->base, value, ctx->size);
}

static const ggml_backend_buffer_i k_moeswarm_buffer_i = {
    /* .free_buffer   = */ moeswarm_buffer_free,
    /* .get_base      = */ moeswarm_buffer_get_base,
    /* .init_tensor   = */ nullptr,
    /* .memset_tensor = */ moeswarm_buffer_memset_tensor,
    /* .set_tensor    = */ moeswarm_buffer_set_tensor,
    /* .get_tensor    = */ moeswarm_buffer_get_tensor,
    /* .set_tensor_2d = */ nullptr,
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ nullptr,
    /* .clear         = */ moeswarm_buffer_clear,
    /* .reset         = */ nullptr,
};

static const char * moeswarm_buft_get_name(ggml_backend_buffer_type_t buft) {
    return MOESWARM_NAME;
}

// MOESWARM_CLAIM_FILE: a host that cannot see llama.cpp's load log (node-llama-cpp routes it to the
// logger of its first Llama only) learns from this file that the device claimed weights: one line
// per weight buffer allocated (ggml never calls alloc_buffer for the load probe's empty buffers).
static void moeswarm_note_claim(size_t size) {
    const char * path = getenv("MOESWARM_CLAIM_FILE");
    if (path == nullptr || path[0] == '\0') {
        return;
    }
    const int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) {
        GGML_LOG_WARN("%s: cannot open MOESWARM_CLAIM_FILE %s: %s\n", __func__, path, strerror(errno));
        return;
    }
    char line[64];
    const int n = snprintf(line, sizeof(line), "buffer %zu\n", size);
    if (n > 0 && write(fd, line, (size_t) n) != (ssize_t) n) {
        GGML_LOG_WARN("%s: cannot write MOESWARM_CLAIM_FILE %s\n", __func__, path);
    }
    close(fd);
}

static ggml_backend_buffer_t moeswarm_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    // address space only: pages cost RAM when first written, and weight pages never are
    void * base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
        GGML_LOG_ERROR("%s: cannot reserve %zu bytes: %s\n", __func__, size, strerror(errno));
        return nullptr;
    }
    moeswarm_buffer_context * ctx = new moeswarm_buffer_context();
    ctx->base                     = base;
    ctx->size                     = size;
    moeswarm_note_claim(size);
    return ggml_backend_buffer_init(buft, k_moeswarm_buffer_i, ctx, size);
}

static size_t moeswarm_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    return MOESWARM_ALIGNMENT;
}

ggml_backend_buffer_type_t moeswarm_buft(void) {
    static ggml_backend_buffer_type buft = {
        /* .iface   = */ {
                          /* .get_name       = */ moeswarm_buft_get_name,
                          /* .alloc_buffer   = */ moeswarm_buft_alloc_buffer,
                          /* .get_alignment  = */ moeswarm_buft_get_alignment,
                          /* .get_max_size   = */ nullptr,
                          /* .get_alloc_size = */ nullptr,
                          /* .is_host        = */ nullptr,
                          },
        /* .device  = */
         moeswarm_device(),
        /* .context = */ nullptr,
    };
    return &buft;
}
