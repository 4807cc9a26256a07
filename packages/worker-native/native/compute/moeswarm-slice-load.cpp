// Reading a slice GGUF: checks every tensor and key before anything reaches ggml, then loads the
// weights into the device's buffers (CPU_REPACK where llama.cpp would repack them).

#include "moeswarm-slice-impl.h"
#include "moeswarm-backend.h"

#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

// RAII at the edges: the loader owns these until it hands them to the slice
struct moeswarm_gguf_guard {
    gguf_context * ctx = nullptr;
    ~moeswarm_gguf_guard() {
        if (ctx) gguf_free(ctx);
    }
};

struct moeswarm_slice_guard {
    moeswarm_slice * slice = nullptr;
    ~moeswarm_slice_guard() { moeswarm_slice_free(slice); }
};

struct moeswarm_map_guard {
    void * addr = MAP_FAILED;
    size_t size = 0;
    int fd      = -1;
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
    uint64_t v     = 0;
    int digits     = 0;
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
static bool moeswarm_read_u32_array(const gguf_context * ctx, const char * key, std::vector<uint32_t> & out, size_t max_n,
        bool * present, moeswarm_error * err) {
    *present         = false;
    const int64_t id = gguf_find_key(ctx, key);
    if (id < 0) {
        return true;
    }
    *present = true;
    if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of uint32", key);
    }
    const enum gguf_type at = gguf_get_arr_type(ctx, id);
    const size_t n          = gguf_get_arr_n(ctx, id);
    if (n == 0 || n > max_n) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_LIMIT", "%s has %zu entries (1..%zu allowed)", key, n, max_n);
    }
    const void * data = at == GGUF_TYPE_STRING ? nullptr : gguf_get_arr_data(ctx, id);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
        int64_t v;
        switch (at) {
            case GGUF_TYPE_UINT8: v = ((const uint8_t *) data)[i]; break;
            case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
            case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT8: v = ((const int8_t *) data)[i]; break;
            case GGUF_TYPE_INT16: v = ((const int16_t *) data)[i]; break;
            case GGUF_TYPE_INT32: v = ((const int32_t *) data)[i]; break;
            case GGUF_TYPE_INT64: v = ((const int64_t *) data)[i]; break;
            case GGUF_TYPE_UINT64: {
                const uint64_t u = ((const uint64_t *) data)[i];
                v                = u > UINT32_MAX ? -1 : (int64_t) u;
            } break;
            default: return moeswarm_error_set(err, "MOESWARM_GGUF_MISSING_KEY", "%s must be an array of uint32", key);
        }
        if (v < 0 || v > (int64_t) UINT32_MAX) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "%s[%zu] = %lld is not a uint32", key, i, (long long) v);
        }
        out[i] = (uint32_t) v;
    }
    return true;
}

// would the CPU_REPACK buffer type take this weight for MUL_MAT_ID? (as llama.cpp decides it)
static bool moeswarm_repack_supported(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, ggml_tensor * w) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, true };
    ggml_context * ctx  = ggml_init(ip);
    if (ctx == nullptr) {
        return false;
    }
    ggml_tensor * b             = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, 1);
    ggml_tensor * ids           = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 1);
    ggml_tensor * op            = ggml_mul_mat_id(ctx, w, b, ids);
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    ggml_backend_buffer_t saved = w->buffer;
    w->buffer                   = dummy;
    const bool ok               = dummy != nullptr && ggml_backend_dev_supports_op(dev, op);
    w->buffer                   = saved;
    if (dummy) {
        ggml_backend_buffer_free(dummy);
    }
    ggml_free(ctx);
    return ok;
}

static ggml_backend_buffer_type_t moeswarm_repack_buft(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra =
            (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
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
    const uint32_t version =
            (uint32_t) head[4] | ((uint32_t) head[5] << 8) | ((uint32_t) head[6] << 16) | ((uint32_t) head[7] << 24);
    if (version != 2 && version != 3) {
        return moeswarm_error_set(err, "MOESWARM_GGUF_UNSUPPORTED_VERSION", "GGUF version %u (2 and 3 are read)", version);
    }
    return true;
}

// the file: a regular file with a GGUF header that ggml's reader accepts
static gguf_context * moeswarm_open_gguf(const char * path, moeswarm_map_guard & map, size_t * file_size, moeswarm_error * err) {
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
    *file_size = (size_t) st.st_size;
    if (!moeswarm_check_magic(map.fd, *file_size, err)) {
        return nullptr;
    }
    gguf_init_params gp = { /*no_alloc =*/true, /*ctx =*/nullptr };
    gguf_context * ctx  = gguf_init_from_file(path, gp);
    if (ctx == nullptr) {
        const char * why     = moeswarm_log_last();
        const bool truncated = strstr(why, "failed to read") != nullptr || strstr(why, "seek") != nullptr;
        moeswarm_error_set(err, truncated ? "MOESWARM_GGUF_TRUNCATED" : "MOESWARM_GGUF_BAD_TENSOR",
                "ggml's GGUF reader refused %s: %s", path, why[0] ? why : "no reason given");
        return nullptr;
    }
    return ctx;
}

// layers: the slice's list, or every layer that has expert tensors
static bool moeswarm_find_layers(moeswarm_slice * slice, const gguf_context * gctx, const char * path, moeswarm_error * err) {
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
        return false;
    }
    if (has_layers) {
        std::vector<uint32_t> sorted = listed;
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.layers lists a layer twice");
        }
        if (sorted != found) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                    "moeswarm.slice.layers lists %zu layers but the file has expert tensors for %zu (they must match)",
                    sorted.size(), found.size());
        }
    }
    if (found.empty()) {
        return moeswarm_error_set(
                err, "MOESWARM_GGUF_NOT_MOE", "%s has no routed-expert tensors (blk.N.ffn_*_exps.weight)", path);
    }
    if (found.size() > MOESWARM_MAX_LAYERS) {
        return moeswarm_error_set(
                err, "MOESWARM_GGUF_LIMIT", "%zu expert layers (at most %d)", found.size(), MOESWARM_MAX_LAYERS);
    }
    slice->layers = found;
    return true;
}

// metadata-only tensors of every layer; allocated later once we know which go to CPU_REPACK
static bool moeswarm_read_layers(moeswarm_slice * slice, const gguf_context * gctx, size_t file_size,
        std::vector<moeswarm_tensor_src> & srcs, moeswarm_error * err) {
    ggml_init_params ip = { ggml_tensor_overhead() * (slice->layers.size() * 11 + 1), nullptr, true };
    slice->ctx_w        = ggml_init(ip);
    if (slice->ctx_w == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create a ggml context");
    }
    for (uint32_t il : slice->layers) {
        if (!moeswarm_load_layer(slice, gctx, il, file_size, srcs, err)) {
            return false;
        }
    }
    return true;
}

// experts: the slice's global ids, or 0..n_expert-1 for a full model file
static bool moeswarm_read_experts(moeswarm_slice * slice, const gguf_context * gctx, moeswarm_error * err) {
    bool has_experts = false;
    if (!moeswarm_read_u32_array(gctx, "moeswarm.slice.experts", slice->experts, MOESWARM_MAX_EXPERTS, &has_experts, err)) {
        return false;
    }
    if (has_experts) {
        if (slice->experts.size() != slice->n_expert) {
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR",
                    "moeswarm.slice.experts lists %zu experts but the tensors hold %u", slice->experts.size(), slice->n_expert);
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
            return moeswarm_error_set(err, "MOESWARM_GGUF_BAD_TENSOR", "expert id %u does not fit an int32", slice->experts[i]);
        }
        slice->expert_map[i] = { slice->experts[i], (int32_t) i };
    }
    std::sort(slice->expert_map.begin(), slice->expert_map.end(),
            [](const moeswarm_expert_map & a, const moeswarm_expert_map & b) { return a.global < b.global; });
    for (size_t i = 1; i < slice->expert_map.size(); ++i) {
        if (slice->expert_map[i].global == slice->expert_map[i - 1].global) {
            return moeswarm_error_set(
                    err, "MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.experts lists expert %u twice", slice->expert_map[i].global);
        }
    }
    return true;
}

// the device and its backend; NULL device name: the CPU
static ggml_backend_dev_t moeswarm_init_backend(moeswarm_slice * slice, const char * device, moeswarm_error * err) {
    ggml_backend_dev_t dev = moeswarm_backend_find_device(device);
    if (dev == nullptr) {
        moeswarm_error_set(
                err, "MOESWARM_NATIVE_LOAD", "no ggml device %s in this build (devices: %s)", device, moeswarm_devices());
        return nullptr;
    }
    slice->device  = ggml_backend_dev_name(dev);
    slice->on_cpu  = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    slice->backend = ggml_backend_dev_init(dev, nullptr);
    if (slice->backend == nullptr) {
        moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot initialise ggml's %s backend", slice->device.c_str());
        return nullptr;
    }
    return dev;
}

// re-creates each tensor in the context of its buffer type (CPU_REPACK or plain) and points the
// layers at the new one, so that each context maps to one buffer type
static bool moeswarm_split_contexts(moeswarm_slice * slice, std::vector<moeswarm_tensor_src> & srcs,
        const std::vector<bool> & is_repack, size_t n_repack, moeswarm_error * err) {
    ggml_context * ctx_repack = nullptr;
    ggml_context * ctx_plain  = nullptr;
    {
        ggml_init_params ip = { ggml_tensor_overhead() * (srcs.size() + 1), nullptr, true };
        ctx_plain           = ggml_init(ip);
        if (n_repack > 0) {
            ctx_repack = ggml_init(ip);
        }
    }
    if (ctx_plain == nullptr || (n_repack > 0 && ctx_repack == nullptr)) {
        if (ctx_plain) ggml_free(ctx_plain);
        if (ctx_repack) ggml_free(ctx_repack);
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create a ggml context");
    }
    for (size_t i = 0; i < srcs.size(); ++i) {
        ggml_tensor * old_t = srcs[i].t;
        ggml_tensor * new_t = ggml_dup_tensor(is_repack[i] ? ctx_repack : ctx_plain, old_t);
        ggml_set_name(new_t, old_t->name);
        for (moeswarm_layer & L : slice->layer_data) {
            ggml_tensor ** slots[] = { &L.gate, &L.up, &L.gate_up, &L.down, &L.gate_b, &L.up_b, &L.gate_up_b, &L.down_b,
                &L.gate_s, &L.up_s, &L.down_s };
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
    slice->ctx_w        = ctx_plain;
    slice->ctx_w_repack = ctx_repack;
    return true;
}

// the weight buffers: the repackable weights (as llama.cpp decides it) in CPU_REPACK, the rest plain
static bool moeswarm_alloc_weights(moeswarm_slice * slice, ggml_backend_dev_t dev, bool repack,
        std::vector<moeswarm_tensor_src> & srcs, moeswarm_error * err) {
    ggml_backend_buffer_type_t buft_plain =
            slice->on_cpu ? moeswarm_backend_cpu_buffer_type(dev) : ggml_backend_dev_buffer_type(dev);
    ggml_backend_buffer_type_t buft_repack = repack && slice->on_cpu ? moeswarm_repack_buft(dev) : nullptr;

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
    if (!moeswarm_split_contexts(slice, srcs, is_repack, n_repack, err)) {
        return false;
    }
    // a context without tensors gets no buffer (ggml returns NULL for nothing to allocate)
    const bool need_plain = n_repack < srcs.size();
    if (need_plain) {
        slice->buf_plain = ggml_backend_alloc_ctx_tensors_from_buft(slice->ctx_w, buft_plain);
    }
    if (slice->ctx_w_repack != nullptr) {
        slice->buf_repack = ggml_backend_alloc_ctx_tensors_from_buft(slice->ctx_w_repack, buft_repack);
    }
    if ((need_plain && slice->buf_plain == nullptr) || (slice->ctx_w_repack != nullptr && slice->buf_repack == nullptr)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot allocate the weight buffers (out of memory?)");
    }
    if (slice->buf_plain) {
        ggml_backend_buffer_set_usage(slice->buf_plain, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    if (slice->buf_repack) {
        ggml_backend_buffer_set_usage(slice->buf_repack, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    return true;
}

// reads a tensor's bytes straight into its host buffer (no mapping: the slice's bytes are held once)
static bool moeswarm_pread_all(int fd, uint8_t * dst, size_t n, size_t offset) {
    while (n > 0) {
        const ssize_t got = pread(fd, dst, n, (off_t) offset);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            return false;
        }
        dst += got;
        n -= (size_t) got;
        offset += (size_t) got;
    }
    return true;
}

// Loads the weights holding one copy of the slice at a time, so that a worker's peak RSS is ~1x its
// slice, not ~2x: a host buffer in the plain layout is read into directly; other buffers (repacked
// layouts, device memory) copy from a read-only mapping of the file, each tensor's mapped pages
// dropped from this process as soon as they are copied (the page cache keeps them).
static bool moeswarm_copy_weights(moeswarm_slice * slice, const char * path, moeswarm_map_guard & map, size_t file_size,
        const std::vector<moeswarm_tensor_src> & srcs, moeswarm_error * err) {
    const long page = sysconf(_SC_PAGESIZE);
    const size_t pg = page > 0 ? (size_t) page : 4096;
    for (const moeswarm_tensor_src & s : srcs) {
        const size_t n = ggml_nbytes(s.t);
        ggml_backend_buffer_t buf = s.t->buffer;
        if (buf != nullptr && buf == slice->buf_plain && ggml_backend_buffer_is_host(buf) && s.t->data != nullptr) {
            errno = 0;
            if (!moeswarm_pread_all(map.fd, (uint8_t *) s.t->data, n, s.offset)) {
                return moeswarm_error_set(err, "MOESWARM_GGUF_IO", "cannot read %s at %zu: %s", path, s.offset,
                        errno != 0 ? strerror(errno) : "short read");
            }
        } else {
            if (map.addr == MAP_FAILED) {
                map.size = file_size;
                map.addr = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, map.fd, 0);
                if (map.addr == MAP_FAILED) {
                    return moeswarm_error_set(err, "MOESWARM_GGUF_IO", "cannot map %s: %s", path, strerror(errno));
                }
            }
            ggml_backend_tensor_set(s.t, (const uint8_t *) map.addr + s.offset, 0, n);
            const size_t first = s.offset / pg * pg;
            madvise((uint8_t *) map.addr + first, s.offset + n - first, MADV_DONTNEED);
        }
        slice->weight_bytes += n;
    }
    return true;
}

// the graph allocator and, on the CPU, the compute threads
static bool moeswarm_start_compute(moeswarm_slice * slice, int32_t n_threads, moeswarm_error * err) {
    slice->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(slice->backend));
    if (slice->galloc == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create the graph allocator");
    }
    if (slice->on_cpu) {
        moeswarm_slice_set_n_threads(slice, n_threads);
        if (slice->threadpool == nullptr) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot start %d compute threads", slice->n_threads);
        }
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
    size_t file_size = 0;
    moeswarm_gguf_guard gg;
    gg.ctx = moeswarm_open_gguf(path, map, &file_size, err);
    if (gg.ctx == nullptr) {
        return nullptr;
    }
    const gguf_context * gctx = gg.ctx;

    moeswarm_slice_guard sg;
    sg.slice               = new moeswarm_slice();
    moeswarm_slice * slice = sg.slice;
    slice->n_graphs        = params.n_graphs > 0 ? params.n_graphs : 16;
    {
        const int64_t id = gguf_find_key(gctx, "general.architecture");
        if (id >= 0 && gguf_get_kv_type(gctx, id) == GGUF_TYPE_STRING) {
            slice->arch = gguf_get_val_str(gctx, id);
        }
    }

    std::vector<moeswarm_tensor_src> srcs;
    if (!moeswarm_find_layers(slice, gctx, path, err) || !moeswarm_read_layers(slice, gctx, file_size, srcs, err) ||
            !moeswarm_read_experts(slice, gctx, err) || !moeswarm_resolve_act(slice, gctx, params.act, err)) {
        return nullptr;
    }
    ggml_backend_dev_t dev = moeswarm_init_backend(slice, params.device, err);
    if (dev == nullptr || !moeswarm_alloc_weights(slice, dev, params.repack, srcs, err) ||
            !moeswarm_copy_weights(slice, path, map, file_size, srcs, err) ||
            !moeswarm_start_compute(slice, params.n_threads, err) ||
            !moeswarm_reserve_compute(slice, params.max_rows, err)) {
        return nullptr;
    }

    moeswarm_slice * out = sg.slice;
    sg.slice             = nullptr;
    return out;
}
