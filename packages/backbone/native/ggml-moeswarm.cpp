// ggml-moeswarm: a ggml backend (API version 2) that hands the routed-expert FFN of chosen MoE
// layers of an unmodified llama.cpp to moeswarm's dispatcher bridge.
//
// Loaded with GGML_BACKEND_PATH=/path/libggml-moeswarm.so into a process that already holds
// libggml-base (node-llama-cpp's addon, llama-server, the logits harness). Facts and file:line
// references this follows: shared/notes/llama-backend-plugin.md.
//
// - Device "MOESWARM", type ACCEL: no layers, no KV cache, one backend in every context.
// - Buffer type "MOESWARM": routed-expert weights are recorded and dropped at set_tensor (the
//   workers hold them); the address range is reserved without RAM. Compute buffers (the split's
//   inputs and output) are ordinary memory.
// - supports_op is structural, so that each remote MoE layer is exactly one split per ubatch:
//   gate/up MUL_MAT_ID -> activation -> down MUL_MAT_ID -> weighting MUL -> adds of the k views.
// - graph_compute sends one `dispatch` frame (mode "sum") per split over a Unix or TCP socket and
//   blocks until the combined `result`; an `error` frame or a dead socket fails the compute
//   (llama_decode returns an error), never a wrong value.
//
// Configuration (environment, or a JSON file MOESWARM_CONFIG with the same keys in camelCase:
// {"layers": "0,1", "bridge": "unix:/tmp/b.sock", "model": "m", "timeoutMs": 60000}; the
// environment wins):
//   MOESWARM_LAYERS      "all", "none" or "0,1,4-7": layers whose expert tensors the device claims
//                        in llama.cpp's load-time buffer-type probe (node-llama-cpp has no -ot).
//                        With llama-server's -ot '...=MOESWARM' this is not needed.
//   MOESWARM_BRIDGE      unix:/path/to/socket | tcp:host:port
//   MOESWARM_MODEL       model id in the dispatch frames (default "moeswarm")
//   MOESWARM_TIMEOUT_MS  how long one split may wait for its result (default 120000)
//   MOESWARM_CLAIM_FILE  optional, environment only: a line is appended to this file for every
//                        weight buffer the device allocates (proof of a claim for the host)
// They are read again whenever they change: a backend (one per llama context) keeps the values
// of its creation, the load-time probe uses the current ones.

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-impl.h"
#include "ggml.h"

#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-trace.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#define MOESWARM_NAME            "MOESWARM"
#define MOESWARM_MAX_LAYERS      4096
#define MOESWARM_ALIGNMENT       64
#define MOESWARM_ROLE_MAX_DEPTH  1024
#define MOESWARM_CACHE_MAX       512
#define MOESWARM_SAMPLES_MAX     8192
#define MOESWARM_TIMEOUT_DEFAULT 120000

//
// configuration
//

struct moeswarm_config {
    std::vector<bool> layers;   // claimed in the load-time probe
    bool        all_layers = false;
    std::string bridge;
    std::string model = "moeswarm";
    int         timeout_ms = MOESWARM_TIMEOUT_DEFAULT;
};

// "all", "none", "" or a comma list of N and A-B; false on anything else
static bool moeswarm_parse_layers(const std::string & text, moeswarm_config & cfg) {
    cfg.all_layers = false;
    cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    if (text == "all") {
        cfg.all_layers = true;
        return true;
    }
    if (text.empty() || text == "none") {
        return true;
    }
    size_t i = 0;
    while (i < text.size()) {
        auto read_num = [&](long & out) -> bool {
            size_t j = i;
            while (j < text.size() && text[j] == ' ') ++j;
            size_t k = j;
            out = 0;
            while (k < text.size() && text[k] >= '0' && text[k] <= '9' && k - j < 6) {
                out = out * 10 + (text[k] - '0');
                ++k;
            }
            if (k == j) return false;
            while (k < text.size() && text[k] == ' ') ++k;
            i = k;
            return true;
        };
        long a = 0, b = 0;
        if (!read_num(a)) return false;
        b = a;
        if (i < text.size() && text[i] == '-') {
            ++i;
            if (!read_num(b)) return false;
        }
        if (a > b || b >= MOESWARM_MAX_LAYERS) return false;
        for (long l = a; l <= b; ++l) cfg.layers[l] = true;
        if (i < text.size()) {
            if (text[i] != ',') return false;
            ++i;
        }
    }
    return true;
}

// the least JSON that a config file needs: an object of strings, numbers, arrays of numbers
struct moeswarm_json {
    const char * p;
    const char * end;

    void ws() { while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) ++p; }
    bool lit(char c) { ws(); if (p < end && *p == c) { ++p; return true; } return false; }
    bool str(std::string & out) {
        ws();
        if (p >= end || *p != '"') return false;
        ++p;
        out.clear();
        while (p < end && *p != '"') {
            char c = *p++;
            if (c == '\\') {
                if (p >= end) return false;
                const char e = *p++;
                switch (e) {
                    case 'n': c = '\n'; break;
                    case 't': c = '\t'; break;
                    case 'r': c = '\r'; break;
                    case 'b': c = '\b'; break;
                    case 'f': c = '\f'; break;
                    case 'u': {
                        if (end - p < 4) return false;
                        unsigned v = 0;
                        for (int k = 0; k < 4; ++k) {
                            const char h = *p++;
                            v = v * 16 + (h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 :
                                          h >= 'A' && h <= 'F' ? h - 'A' + 10 : 0);
                        }
                        if (v < 0x80) { c = (char) v; break; }
                        // paths and ids are ASCII in practice; keep the escape readable otherwise
                        out += '?';
                        continue;
                    }
                    default: c = e; break;
                }
            }
            out += c;
        }
        if (p >= end) return false;
        ++p;
        return true;
    }
    bool num(double & out) {
        ws();
        char * q = nullptr;
        std::string tmp(p, std::min<size_t>(end - p, 64));
        out = strtod(tmp.c_str(), &q);
        if (q == tmp.c_str()) return false;
        p += q - tmp.c_str();
        return true;
    }
    // skips any value (for unknown keys)
    bool skip(int depth = 0) {
        ws();
        if (p >= end || depth > 32) return false;
        std::string s;
        double d;
        if (*p == '"') return str(s);
        if (*p == '{' || *p == '[') {
            const char close = *p == '{' ? '}' : ']';
            const bool obj = *p == '{';
            ++p;
            if (lit(close)) return true;
            do {
                if (obj && (!str(s) || !lit(':'))) return false;
                if (!skip(depth + 1)) return false;
            } while (lit(','));
            return lit(close);
        }
        for (const char * w : { "true", "false", "null" }) {
            const size_t n = strlen(w);
            if ((size_t) (end - p) >= n && strncmp(p, w, n) == 0) { p += n; return true; }
        }
        return num(d);
    }
};

static bool moeswarm_read_config_file(const char * path, moeswarm_config & cfg, std::string & layers, bool & has_layers,
        std::string & err) {
    FILE * f = fopen(path, "rb");
    if (f == nullptr) {
        err = std::string("cannot open MOESWARM_CONFIG ") + path + ": " + strerror(errno);
        return false;
    }
    std::string text;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0 && text.size() < (1u << 20)) {
        text.append(buf, n);
    }
    fclose(f);
    moeswarm_json j = { text.data(), text.data() + text.size() };
    if (!j.lit('{')) {
        err = "MOESWARM_CONFIG must hold a JSON object";
        return false;
    }
    if (!j.lit('}')) {
        do {
            std::string key;
            if (!j.str(key) || !j.lit(':')) {
                err = "MOESWARM_CONFIG: malformed JSON";
                return false;
            }
            if (key == "layers") {
                has_layers = true;
                j.ws();
                if (j.p < j.end && *j.p == '[') {
                    ++j.p;
                    layers.clear();
                    if (!j.lit(']')) {
                        do {
                            double d;
                            if (!j.num(d) || d < 0 || d >= MOESWARM_MAX_LAYERS || d != (long) d) {
                                err = "MOESWARM_CONFIG: layers must be layer numbers";
                                return false;
                            }
                            layers += (layers.empty() ? "" : ",") + std::to_string((long) d);
                        } while (j.lit(','));
                        if (!j.lit(']')) {
                            err = "MOESWARM_CONFIG: malformed layers array";
                            return false;
                        }
                    }
                } else if (!j.str(layers)) {
                    err = "MOESWARM_CONFIG: layers must be a string or an array";
                    return false;
                }
            } else if (key == "bridge" || key == "model") {
                std::string v;
                if (!j.str(v)) {
                    err = "MOESWARM_CONFIG: " + key + " must be a string";
                    return false;
                }
                (key == "bridge" ? cfg.bridge : cfg.model) = v;
            } else if (key == "timeoutMs") {
                double d;
                if (!j.num(d) || d < 1 || d > 86400000) {
                    err = "MOESWARM_CONFIG: timeoutMs must be 1..86400000";
                    return false;
                }
                cfg.timeout_ms = (int) d;
            } else if (!j.skip()) {
                err = "MOESWARM_CONFIG: malformed JSON";
                return false;
            }
        } while (j.lit(','));
        if (!j.lit('}')) {
            err = "MOESWARM_CONFIG: malformed JSON";
            return false;
        }
    }
    return true;
}

static moeswarm_config moeswarm_load_config(void) {
    moeswarm_config cfg;
    cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    std::string layers;
    bool has_layers = false;
    std::string err;
    const char * file = getenv("MOESWARM_CONFIG");
    if (file != nullptr && file[0] != '\0' && !moeswarm_read_config_file(file, cfg, layers, has_layers, err)) {
        GGML_LOG_ERROR("%s: %s; the MOESWARM device claims nothing\n", __func__, err.c_str());
        return moeswarm_config();
    }
    if (const char * v = getenv("MOESWARM_LAYERS")) {
        layers = v;
        has_layers = true;
    }
    if (const char * v = getenv("MOESWARM_BRIDGE")) {
        cfg.bridge = v;
    }
    if (const char * v = getenv("MOESWARM_MODEL"); v != nullptr && v[0] != '\0') {
        cfg.model = v;
    }
    if (const char * v = getenv("MOESWARM_TIMEOUT_MS"); v != nullptr && v[0] != '\0') {
        const long t = strtol(v, nullptr, 10);
        if (t >= 1 && t <= 86400000) {
            cfg.timeout_ms = (int) t;
        } else {
            GGML_LOG_WARN("%s: MOESWARM_TIMEOUT_MS=%s is not 1..86400000, using %d\n", __func__, v, cfg.timeout_ms);
        }
    }
    if (cfg.model.empty() || cfg.model.size() > 256) {
        GGML_LOG_WARN("%s: the model id must be 1..256 bytes, using \"moeswarm\"\n", __func__);
        cfg.model = "moeswarm";
    }
    if (has_layers && !moeswarm_parse_layers(layers, cfg)) {
        GGML_LOG_ERROR("%s: MOESWARM_LAYERS=\"%s\" is not \"all\", \"none\" or a list like 0,1,4-7; the MOESWARM "
            "device claims nothing\n", __func__, layers.c_str());
        cfg.all_layers = false;
        cfg.layers.assign(MOESWARM_MAX_LAYERS, false);
    }
    return cfg;
}

//
// tensor names
//

// blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias,scale}: which layer and projection; false
// for any other tensor
enum moeswarm_proj { MOESWARM_PROJ_GATE, MOESWARM_PROJ_UP, MOESWARM_PROJ_DOWN, MOESWARM_PROJ_GATE_UP };

static bool moeswarm_expert_name(const char * name, int * layer, moeswarm_proj * proj) {
    if (strncmp(name, "blk.", 4) != 0) {
        return false;
    }
    const char * p = name + 4;
    int l = 0, digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 5) {
        l = l * 10 + (*p - '0');
        ++p;
        ++digits;
    }
    if (digits == 0 || *p != '.') {
        return false;
    }
    ++p;
    static const struct { const char * prefix; moeswarm_proj proj; } k_projs[] = {
        { "ffn_gate_up_exps.", MOESWARM_PROJ_GATE_UP },
        { "ffn_gate_exps.",    MOESWARM_PROJ_GATE },
        { "ffn_up_exps.",      MOESWARM_PROJ_UP },
        { "ffn_down_exps.",    MOESWARM_PROJ_DOWN },
    };
    for (const auto & k : k_projs) {
        const size_t n = strlen(k.prefix);
        if (strncmp(p, k.prefix, n) == 0) {
            const char * suffix = p + n;
            if (strcmp(suffix, "weight") != 0 && strcmp(suffix, "bias") != 0 && strcmp(suffix, "scale") != 0) {
                return false;
            }
            if (layer) *layer = l;
            if (proj) *proj = k.proj;
            return true;
        }
    }
    return false;
}

//
// statistics (all backends of the process)
//

struct moeswarm_layer_stats {
    uint64_t count = 0;
    uint64_t failures = 0;
    uint64_t tokens = 0;
    double   us_total = 0;
    std::deque<double> samples; // most recent round trips, µs
};

struct moeswarm_stats {
    std::mutex mutex;
    std::map<int, moeswarm_layer_stats> layers;
    uint64_t splits = 0;
    uint64_t failures = 0;
    uint64_t bytes_out = 0;
    uint64_t bytes_in = 0;
    uint64_t cache_hits = 0;
    uint64_t cache_misses = 0;
    uint64_t weights_dropped = 0;  // bytes handed to set_tensor and not kept
    uint64_t weights_tensors = 0;
};

static moeswarm_stats & moeswarm_get_stats(void) {
    static moeswarm_stats s;
    return s;
}

static double moeswarm_now_us(void) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

// nearest rank
static double moeswarm_percentile(std::vector<double> v, double q) {
    if (v.empty()) {
        return 0;
    }
    std::sort(v.begin(), v.end());
    const double rank = std::ceil(q * (double) v.size());
    const size_t i = rank < 1 ? 0 : std::min(v.size() - 1, (size_t) rank - 1);
    return v[i];
}

// JSON of the counters; what the logits harness prints and a host can read through the
// registry's proc address "ggml_backend_moeswarm_stats"
static size_t moeswarm_stats_json(char * buf, size_t size) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    std::string out = "{\"splits\":" + std::to_string(s.splits) + ",\"failures\":" + std::to_string(s.failures) +
        ",\"bytesOut\":" + std::to_string(s.bytes_out) + ",\"bytesIn\":" + std::to_string(s.bytes_in) +
        ",\"graphCacheHits\":" + std::to_string(s.cache_hits) + ",\"graphCacheMisses\":" + std::to_string(s.cache_misses) +
        ",\"weightsDroppedBytes\":" + std::to_string(s.weights_dropped) +
        ",\"weightsDroppedTensors\":" + std::to_string(s.weights_tensors) + ",\"layers\":{";
    bool first = true;
    for (const auto & [layer, ls] : s.layers) {
        std::vector<double> v(ls.samples.begin(), ls.samples.end());
        char tmp[256];
        snprintf(tmp, sizeof(tmp), "%s\"%d\":{\"count\":%llu,\"failures\":%llu,\"tokens\":%llu,\"meanUs\":%.1f,\"p50Us\":%.1f,\"p99Us\":%.1f}",
            first ? "" : ",", layer, (unsigned long long) ls.count, (unsigned long long) ls.failures,
            (unsigned long long) ls.tokens, ls.count ? ls.us_total / ls.count : 0.0, moeswarm_percentile(v, 0.5),
            moeswarm_percentile(v, 0.99));
        out += tmp;
        first = false;
    }
    out += "}}";
    if (buf != nullptr && size > 0) {
        const size_t n = std::min(out.size(), size - 1);
        memcpy(buf, out.data(), n);
        buf[n] = '\0';
    }
    return out.size();
}

static void moeswarm_stats_reset(void) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.layers.clear();
    s.splits = s.failures = s.bytes_out = s.bytes_in = s.cache_hits = s.cache_misses = 0;
}

//
// the registry, device and buffer type (one each, for the process)
//

// The configuration is re-read when the environment that makes it changes, so that a host can set
// MOESWARM_* before each model load or context (createSwarmLlama does) and not only before the
// plugin is loaded. Readers keep a shared copy; a backend takes its own at creation.
struct moeswarm_device_context {
    std::mutex mutex;
    std::string fingerprint;
    std::shared_ptr<const moeswarm_config> config;
};

static std::string moeswarm_config_fingerprint(void) {
    std::string fp;
    for (const char * name : { "MOESWARM_CONFIG", "MOESWARM_LAYERS", "MOESWARM_BRIDGE", "MOESWARM_MODEL", "MOESWARM_TIMEOUT_MS" }) {
        const char * v = getenv(name);
        fp += v ? std::string("1") + v : std::string("0");
        fp += '\0';
    }
    return fp;
}

static std::shared_ptr<const moeswarm_config> moeswarm_config_current(void);

static ggml_backend_buffer_type_t moeswarm_buft(void);
static ggml_backend_dev_t         moeswarm_device(void);

//
// buffers
//

struct moeswarm_weight_record {
    std::string name;
    ggml_type   type;
    int64_t     ne[GGML_MAX_DIMS];
    size_t      offset;
};

struct moeswarm_buffer_context {
    void *  base = nullptr;
    size_t  size = 0;
    std::vector<moeswarm_weight_record> weights;
    std::mutex mutex;
};

static bool moeswarm_buffer_is_weights(ggml_backend_buffer_t buffer) {
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

static void moeswarm_buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data,
        size_t offset, size_t size) {
    moeswarm_buffer_context * ctx = (moeswarm_buffer_context *) buffer->context;
    if (moeswarm_buffer_is_weights(buffer)) {
        // the workers hold these: remember what llama.cpp loaded here, keep none of the bytes
        if (offset == 0) {
            if (!moeswarm_expert_name(tensor->name, nullptr, nullptr)) {
                GGML_LOG_ERROR("%s: %s is not a routed-expert tensor: the MOESWARM device cannot compute with it\n",
                    __func__, tensor->name);
            }
            moeswarm_weight_record r;
            r.name = tensor->name;
            r.type = tensor->type;
            for (int i = 0; i < GGML_MAX_DIMS; ++i) r.ne[i] = tensor->ne[i];
            r.offset = (size_t) ((const char *) tensor->data - (const char *) ctx->base);
            {
                std::lock_guard<std::mutex> lock(ctx->mutex);
                ctx->weights.push_back(r);
            }
            moeswarm_stats & s = moeswarm_get_stats();
            std::lock_guard<std::mutex> lock(s.mutex);
            s.weights_tensors++;
        }
        moeswarm_stats & s = moeswarm_get_stats();
        std::lock_guard<std::mutex> lock(s.mutex);
        s.weights_dropped += size;
        return;
    }
    memcpy((char *) tensor->data + offset, data, size);
}

static void moeswarm_buffer_get_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data,
        size_t offset, size_t size) {
    if (moeswarm_buffer_is_weights(buffer)) {
        // nothing was kept; zeros rather than stale or uninitialised bytes
        memset(data, 0, size);
        return;
    }
    memcpy(data, (const char *) tensor->data + offset, size);
}

static void moeswarm_buffer_memset_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value,
        size_t offset, size_t size) {
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
    ctx->base = base;
    ctx->size = size;
    moeswarm_note_claim(size);
    return ggml_backend_buffer_init(buft, k_moeswarm_buffer_i, ctx, size);
}

static size_t moeswarm_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    return MOESWARM_ALIGNMENT;
}

//
// what the device computes: the structural supports_op
//

// the part of the MoE FFN a tensor belongs to
enum moeswarm_role {
    MOESWARM_ROLE_NONE,     // not ours
    MOESWARM_ROLE_WEIGHT,   // an expert tensor in a MOESWARM buffer, or a view/repeat/get_rows of one
    MOESWARM_ROLE_FFN,      // the expert FFN before the weighting (projections, activation, bias, scale)
    MOESWARM_ROLE_OUT,      // the weighted outputs and their sum
};

// an expert tensor in one of our buffers. In llama.cpp's load-time probe (weight_buft_supported:
// a zero-size buffer of ours, usage not yet WEIGHTS) only the configured layers are claimed.
static bool moeswarm_is_our_weight(const ggml_tensor * t) {
    const ggml_tensor * base = t->view_src ? t->view_src : t;
    ggml_backend_buffer_t buf = base->buffer;
    if (buf == nullptr || ggml_backend_buffer_get_type(buf) != moeswarm_buft()) {
        return false;
    }
    int layer = -1;
    if (!moeswarm_expert_name(base->name, &layer, nullptr)) {
        return false;
    }
    const bool probe = ggml_backend_buffer_get_size(buf) == 0 && !moeswarm_buffer_is_weights(buf);
    if (!probe) {
        return moeswarm_buffer_is_weights(buf);
    }
    const std::shared_ptr<const moeswarm_config> cfg = moeswarm_config_current();
    return cfg->all_layers || (layer >= 0 && layer < MOESWARM_MAX_LAYERS && cfg->layers[layer]);
}

// The op decides first which sources are looked at: the walk follows only the ops of the pattern,
// so asking about any other node (the scheduler asks about every node, several times) is O(1).
static moeswarm_role moeswarm_tensor_role(const ggml_tensor * t, int depth) {
    if (t == nullptr || depth > MOESWARM_ROLE_MAX_DEPTH) {
        return MOESWARM_ROLE_NONE;
    }
    auto role = [&](int i) { return moeswarm_tensor_role(t->src[i], depth + 1); };
    switch (t->op) {
        case GGML_OP_NONE:
            return moeswarm_is_our_weight(t) ? MOESWARM_ROLE_WEIGHT : MOESWARM_ROLE_NONE;
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return role(0);
        case GGML_OP_MUL_MAT_ID:
            return role(0) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_GET_ROWS:
        case GGML_OP_REPEAT:
            // per-expert scales: reshape -> repeat -> get_rows by the ids (build_lora_mm_id)
            return role(0) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_WEIGHT : MOESWARM_ROLE_NONE;
        case GGML_OP_ADD_ID:
            return role(0) == MOESWARM_ROLE_FFN && role(1) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_GLU:
            if (role(0) != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            return t->src[1] == nullptr || role(1) == MOESWARM_ROLE_FFN ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_UNARY:
        case GGML_OP_CLAMP:
        case GGML_OP_SCALE:
        case GGML_OP_SQR:
            return role(0) == MOESWARM_ROLE_FFN ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_MUL: {
            if (role(0) != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            const moeswarm_role b = role(1);
            if (b == MOESWARM_ROLE_WEIGHT || b == MOESWARM_ROLE_FFN) return MOESWARM_ROLE_FFN;
            // the router weights (ffn_moe_weighted): the last op that is not a sum
            return b == MOESWARM_ROLE_NONE ? MOESWARM_ROLE_OUT : MOESWARM_ROLE_NONE;
        }
        case GGML_OP_ADD: {
            // the sum of the k weighted views; the residual add (one side not ours) stays local
            const moeswarm_role a = role(0);
            if (a != MOESWARM_ROLE_OUT && a != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            return role(1) == a ? a : MOESWARM_ROLE_NONE;
        }
        case GGML_OP_CONT: {
            const moeswarm_role a = role(0);
            return a == MOESWARM_ROLE_OUT || a == MOESWARM_ROLE_FFN ? a : MOESWARM_ROLE_NONE;
        }
        default:
            return MOESWARM_ROLE_NONE;
    }
}

//
// the bridge connection
//

struct moeswarm_conn {
    int      fd = -1;
    uint32_t next_id = 1;
    std::vector<uint8_t> rx;
};

static void moeswarm_conn_close(moeswarm_conn & c) {
    if (c.fd >= 0) {
        close(c.fd);
        c.fd = -1;
    }
}

static bool moeswarm_conn_open(moeswarm_conn & c, const std::string & bridge, std::string & err) {
    if (bridge.rfind("unix:", 0) == 0) {
        const std::string path = bridge.substr(5);
        sockaddr_un addr;
        memset(&addr, 0, sizeof(addr));
        addr.sun_family = AF_UNIX;
        if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
            err = "the socket path of MOESWARM_BRIDGE is empty or longer than " + std::to_string(sizeof(addr.sun_path) - 1) + " bytes";
            return false;
        }
        memcpy(addr.sun_path, path.c_str(), path.size());
        const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (sockaddr *) &addr, sizeof(addr)) != 0) {
            err = "cannot connect to the bridge at " + bridge + ": " + strerror(errno);
            if (fd >= 0) close(fd);
            return false;
        }
        c.fd = fd;
        return true;
    }
    if (bridge.rfind("tcp:", 0) == 0) {
        const std::string hp = bridge.substr(4);
        const size_t colon = hp.rfind(':');
        if (colon == std::string::npos || colon == 0 || colon + 1 >= hp.size()) {
            err = "MOESWARM_BRIDGE tcp: needs host:port";
            return false;
        }
        std::string host = hp.substr(0, colon);
        if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
            host = host.substr(1, host.size() - 2);
        }
        const std::string port = hp.substr(colon + 1);
        addrinfo hints;
        memset(&hints, 0, sizeof(hints));
        hints.ai_socktype = SOCK_STREAM;
        addrinfo * res = nullptr;
        const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
        if (rc != 0) {
            err = "cannot resolve " + host + ": " + gai_strerror(rc);
            return false;
        }
        int fd = -1;
        std::string last = "no address";
        for (addrinfo * ai = res; ai != nullptr; ai = ai->ai_next) {
            fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
            if (fd < 0) continue;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
            last = strerror(errno);
            close(fd);
            fd = -1;
        }
        freeaddrinfo(res);
        if (fd < 0) {
            err = "cannot connect to the bridge at " + bridge + ": " + last;
            return false;
        }
        // one small frame per layer and token: latency, not throughput
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        c.fd = fd;
        return true;
    }
    err = bridge.empty() ? "MOESWARM_BRIDGE is not set (unix:/path or tcp:host:port)"
                         : "MOESWARM_BRIDGE must be unix:/path or tcp:host:port, got " + bridge;
    return false;
}

static bool moeswarm_wait_fd(int fd, short events, double deadline_us, std::string & err) {
    for (;;) {
        const double left_ms = (deadline_us - moeswarm_now_us()) / 1000.0;
        if (left_ms <= 0) {
            err = "timed out waiting for the bridge";
            return false;
        }
        pollfd p = { fd, events, 0 };
        const int r = poll(&p, 1, (int) std::min(left_ms + 1, 2e9));
        if (r > 0) {
            if (p.revents & (POLLERR | POLLNVAL)) {
                err = "the bridge connection failed";
                return false;
            }
            return true;
        }
        if (r < 0 && errno != EINTR) {
            err = std::string("poll: ") + strerror(errno);
            return false;
        }
    }
}

static bool moeswarm_send_all(moeswarm_conn & c, const uint8_t * data, size_t size, double deadline_us, std::string & err) {
    size_t done = 0;
    while (done < size) {
        const ssize_t n = send(c.fd, data + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t) n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!moeswarm_wait_fd(c.fd, POLLOUT, deadline_us, err)) return false;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        err = std::string("cannot write to the bridge: ") + (n < 0 ? strerror(errno) : "connection closed");
        return false;
    }
    return true;
}

static bool moeswarm_recv_all(moeswarm_conn & c, uint8_t * data, size_t size, double deadline_us, std::string & err) {
    size_t done = 0;
    while (done < size) {
        const ssize_t n = recv(c.fd, data + done, size - done, MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t) n;
            continue;
        }
        if (n == 0) {
            err = "the bridge closed the connection";
            return false;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (!moeswarm_wait_fd(c.fd, POLLIN, deadline_us, err)) return false;
            continue;
        }
        if (errno == EINTR) continue;
        err = std::string("cannot read from the bridge: ") + strerror(errno);
        return false;
    }
    return true;
}

//
// the backend
//

// what one split is: found once per split (graph uid), then only read
struct moeswarm_pattern {
    int           layer = -1;
    ggml_tensor * x = nullptr;     // [n_embd, 1, n_tokens] f32: the normed hidden rows
    ggml_tensor * ids = nullptr;   // [k, n_tokens] i32, strided (a view of the argsort)
    ggml_tensor * w = nullptr;     // [1, k, n_tokens] f32: the router weights
    ggml_tensor * out = nullptr;   // [n_embd, n_tokens] f32: ffn_moe_out
    int64_t       n_embd = 0;
    int64_t       n_tokens = 0;
    int64_t       k = 0;
};

struct moeswarm_backend_context {
    std::mutex    mutex;
    std::shared_ptr<const moeswarm_config> config; // as it was when the backend was created
    moeswarm_conn conn;
    std::unordered_map<uint64_t, moeswarm_pattern> cache;
    std::deque<uint64_t> cache_order;
    std::vector<float>   x;
    std::vector<int32_t> ids;
    std::vector<float>   w;
    moeswarm_mp_writer   tx;
};

static const char * moeswarm_backend_get_name(ggml_backend_t backend) {
    return MOESWARM_NAME;
}

static void moeswarm_backend_free(ggml_backend_t backend) {
    moeswarm_backend_context * ctx = (moeswarm_backend_context *) backend->context;
    moeswarm_conn_close(ctx->conn);
    delete ctx;
    delete backend;
}

static void moeswarm_backend_synchronize(ggml_backend_t backend) {
    // graph_compute returns with the result written: nothing is ever pending
}

static bool moeswarm_find_pattern(const ggml_cgraph * cgraph, moeswarm_pattern & p, std::string & err) {
    std::unordered_set<const ggml_tensor *> nodes;
    for (int i = 0; i < cgraph->n_nodes; ++i) {
        nodes.insert(cgraph->nodes[i]);
    }
    int n_add = 0, n_mmid = 0, n_weighting = 0;
    for (int i = 0; i < cgraph->n_nodes; ++i) {
        ggml_tensor * node = cgraph->nodes[i];
        if (node->op == GGML_OP_MUL_MAT_ID) {
            int layer = -1;
            moeswarm_proj proj;
            if (!moeswarm_expert_name(node->src[0]->name, &layer, &proj)) {
                err = std::string("MUL_MAT_ID on ") + node->src[0]->name + ", not a routed-expert tensor";
                return false;
            }
            if (p.layer >= 0 && p.layer != layer) {
                err = "one split holds the experts of layers " + std::to_string(p.layer) + " and " + std::to_string(layer);
                return false;
            }
            p.layer = layer;
            ++n_mmid;
            if (proj != MOESWARM_PROJ_DOWN) {
                if (p.x != nullptr && (p.x != node->src[1] || p.ids != node->src[2])) {
                    err = "the gate and up projections read different inputs";
                    return false;
                }
                p.x = node->src[1];
                p.ids = node->src[2];
            }
        } else if (node->op == GGML_OP_MUL && node->src[1] != nullptr && nodes.count(node->src[1]) == 0 &&
                   !(node->src[1]->buffer && moeswarm_buffer_is_weights(node->src[1]->buffer)) &&
                   (node->src[1]->view_src == nullptr || nodes.count(node->src[1]->view_src) == 0)) {
            // src[1] comes from outside the split and is not a weight: the router weights
            p.w = node->src[1];
            ++n_weighting;
        } else if (node->op == GGML_OP_ADD) {
            ++n_add;
        }
    }
    if (cgraph->n_nodes == 0 || p.x == nullptr || p.w == nullptr || n_weighting != 1 || n_mmid < 2) {
        err = "not the routed-expert FFN of one layer (projections, weighting and sum)";
        return false;
    }
    p.out = cgraph->nodes[cgraph->n_nodes - 1];
    p.n_embd = p.x->ne[0];
    p.n_tokens = p.x->ne[2];
    p.k = p.ids->ne[0];
    const bool ok =
        p.x->type == GGML_TYPE_F32 && p.x->ne[1] == 1 && p.x->ne[3] == 1 &&
        p.ids->type == GGML_TYPE_I32 && p.ids->ne[1] == p.n_tokens && p.ids->ne[2] == 1 &&
        p.w->type == GGML_TYPE_F32 && p.w->ne[0] == 1 && p.w->ne[1] == p.k && p.w->ne[2] == p.n_tokens &&
        p.out->type == GGML_TYPE_F32 && p.out->ne[0] == p.n_embd && p.out->ne[1] == p.n_tokens &&
        p.out->ne[2] == 1 && p.out->ne[3] == 1 &&
        (p.k == 1 ? p.out->op == GGML_OP_CONT : (p.out->op == GGML_OP_ADD && n_add == p.k - 1));
    if (!ok || p.k < 1 || p.k > 256 || p.n_tokens < 1 || p.n_tokens > 65536 || p.n_embd < 1 || p.n_embd > 65536) {
        err = "unexpected shapes in the MoE split of layer " + std::to_string(p.layer);
        return false;
    }
    return true;
}

static void moeswarm_record(int layer, int64_t n_tokens, double us, bool ok, size_t out, size_t in) {
    moeswarm_stats & s = moeswarm_get_stats();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.splits++;
    s.bytes_out += out;
    s.bytes_in += in;
    moeswarm_layer_stats & ls = s.layers[layer];
    if (!ok) {
        s.failures++;
        ls.failures++;
        return;
    }
    ls.count++;
    ls.tokens += (uint64_t) n_tokens;
    ls.us_total += us;
    ls.samples.push_back(us);
    if (ls.samples.size() > MOESWARM_SAMPLES_MAX) {
        ls.samples.pop_front();
    }
}

// one round trip: the dispatch frame out, its result (or error) back into out
static bool moeswarm_round_trip(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        std::string & err, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_conn & c = ctx->conn;
    if (c.fd < 0 && !moeswarm_conn_open(c, cfg.bridge, err)) {
        return false;
    }
    const double deadline = moeswarm_now_us() + cfg.timeout_ms * 1000.0;
    const uint32_t id = c.next_id;
    c.next_id = c.next_id == 0xffffffffu ? 1 : c.next_id + 1;

    moeswarm_dispatch_desc d;
    d.id = id;
    d.model = cfg.model.c_str();
    d.layer = (uint32_t) p.layer;
    d.n = (uint32_t) p.n_tokens;
    d.embd = (uint32_t) p.n_embd;
    d.x = ctx->x.data();
    d.k = (uint32_t) p.k;
    d.ids = ctx->ids.data();
    d.weights = ctx->w.data();
    d.mode = MOESWARM_MODE_SUM;
    ctx->tx.buf.clear();
    ctx->tx.buf.resize(4);
    moeswarm_frame_write_dispatch(&ctx->tx, &d);
    const uint32_t len = (uint32_t) (ctx->tx.buf.size() - 4);
    for (int i = 0; i < 4; ++i) ctx->tx.buf[i] = (uint8_t) (len >> (8 * i));
    bytes_out = ctx->tx.buf.size();
    moeswarm_trace_hop("plugin.send", p.layer);
    if (!moeswarm_send_all(c, ctx->tx.buf.data(), ctx->tx.buf.size(), deadline, err)) {
        moeswarm_conn_close(c);
        return false;
    }
    const size_t want = (size_t) p.n_tokens * p.n_embd;
    // a result is its y plus a small header; anything much larger is not ours to allocate
    const size_t max_frame = std::max<size_t>(MOESWARM_FRAME_MAX_DEFAULT, want * 4 + 4096);
    for (;;) {
        uint8_t hdr[4];
        if (!moeswarm_recv_all(c, hdr, 4, deadline, err)) {
            moeswarm_conn_close(c);
            return false;
        }
        const uint32_t n = hdr[0] | (hdr[1] << 8) | (hdr[2] << 16) | ((uint32_t) hdr[3] << 24);
        if (n > max_frame) {
            err = "the bridge sent a frame of " + std::to_string(n) + " bytes";
            moeswarm_conn_close(c);
            return false;
        }
        c.rx.resize(n);
        if (!moeswarm_recv_all(c, c.rx.data(), n, deadline, err)) {
            moeswarm_conn_close(c);
            return false;
        }
        bytes_in += 4 + n;
        moeswarm_frame f;
        moeswarm_error ferr;
        if (!moeswarm_frame_decode(c.rx.data(), n, 0, &f, &ferr)) {
            err = std::string("bad frame from the bridge: ") + ferr.code + ": " + ferr.msg;
            moeswarm_conn_close(c);
            return false;
        }
        if (f.type == MOESWARM_FRAME_ERROR && (!f.has_id || f.id == id)) {
            err = std::string(f.code.present ? std::string((const char *) f.code.ptr, f.code.len) : "error") +
                  ": " + std::string((const char *) f.msg.ptr, f.msg.len);
            if (!f.has_id) {
                moeswarm_conn_close(c);
            }
            return false;
        }
        if (f.type != MOESWARM_FRAME_RESULT || f.id != id) {
            continue; // pings, or a late answer to a request given up on
        }
        if (f.mode != MOESWARM_MODE_SUM || f.n != p.n_tokens || f.embd != p.n_embd || f.y.len != want * 4) {
            err = "the bridge's result has the wrong shape";
            moeswarm_conn_close(c);
            return false;
        }
        moeswarm_trace_hop("plugin.recv", p.layer);
        const uint8_t * y = f.y.ptr;
        ggml_tensor * out = p.out;
        if (out->nb[0] == 4 && out->nb[1] == (size_t) p.n_embd * 4) {
            memcpy(out->data, y, want * 4);
        } else {
            for (int64_t t = 0; t < p.n_tokens; ++t) {
                for (int64_t e = 0; e < p.n_embd; ++e) {
                    memcpy((char *) out->data + t * out->nb[1] + e * out->nb[0], y + (t * p.n_embd + e) * 4, 4);
                }
            }
        }
        return true;
    }
}

static enum ggml_status moeswarm_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    moeswarm_backend_context * ctx = (moeswarm_backend_context * ) backend->context;
    std::lock_guard<std::mutex> lock(ctx->mutex);
    const moeswarm_config & cfg = *ctx->config;

    // the pattern, cached by split uid (a reused decode graph keeps its uids)
    moeswarm_pattern * p = nullptr;
    auto it = ctx->cache.find(cgraph->uid);
    if (it != ctx->cache.end()) {
        p = &it->second;
        std::lock_guard<std::mutex> slock(moeswarm_get_stats().mutex);
        moeswarm_get_stats().cache_hits++;
    } else {
        moeswarm_pattern found;
        std::string err;
        if (!moeswarm_find_pattern(cgraph, found, err)) {
            GGML_LOG_ERROR("%s: %s (%d nodes, first %s)\n", __func__, err.c_str(), cgraph->n_nodes,
                cgraph->n_nodes ? ggml_op_desc(cgraph->nodes[0]) : "-");
            return GGML_STATUS_FAILED;
        }
        if (ctx->cache_order.size() >= MOESWARM_CACHE_MAX) {
            ctx->cache.erase(ctx->cache_order.front());
            ctx->cache_order.pop_front();
        }
        ctx->cache_order.push_back(cgraph->uid);
        p = &(ctx->cache[cgraph->uid] = found);
        std::lock_guard<std::mutex> slock(moeswarm_get_stats().mutex);
        moeswarm_get_stats().cache_misses++;
    }

    // gather the inputs with their strides (the ids are a view of the argsort)
    const int64_t T = p->n_tokens, E = p->n_embd, K = p->k;
    ctx->x.resize((size_t) T * E);
    ctx->ids.resize((size_t) T * K);
    ctx->w.resize((size_t) T * K);
    const ggml_tensor * x = p->x;
    for (int64_t t = 0; t < T; ++t) {
        const char * row = (const char *) x->data + t * x->nb[2];
        if (x->nb[0] == 4) {
            memcpy(ctx->x.data() + t * E, row, E * 4);
        } else {
            for (int64_t e = 0; e < E; ++e) memcpy(ctx->x.data() + t * E + e, row + e * x->nb[0], 4);
        }
        for (int64_t j = 0; j < K; ++j) {
            memcpy(ctx->ids.data() + t * K + j, (const char *) p->ids->data + t * p->ids->nb[1] + j * p->ids->nb[0], 4);
            memcpy(ctx->w.data() + t * K + j, (const char *) p->w->data + t * p->w->nb[2] + j * p->w->nb[1], 4);
        }
    }

    std::string err;
    size_t bytes_out = 0, bytes_in = 0;
    const double t0 = moeswarm_now_us();
    const bool ok = moeswarm_round_trip(ctx, cfg, *p, err, bytes_out, bytes_in);
    moeswarm_record(p->layer, T, moeswarm_now_us() - t0, ok, bytes_out, bytes_in);
    if (!ok) {
        GGML_LOG_ERROR("%s: layer %d, %lld tokens: %s\n", __func__, p->layer, (long long) T, err.c_str());
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
    *free = 0;
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

static ggml_backend_t moeswarm_dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    // one connection per backend: contexts compute concurrently, each with its own
    return new ggml_backend {
        /* .guid    = */ moeswarm_guid(),
        /* .iface   = */ k_moeswarm_backend_i,
        /* .device  = */ dev,
        /* .context = */ [] {
            moeswarm_backend_context * ctx = new moeswarm_backend_context();
            ctx->config = moeswarm_config_current();
            return ctx;
        }(),
    };
}

static ggml_backend_buffer_type_t moeswarm_dev_get_buffer_type(ggml_backend_dev_t dev) {
    return moeswarm_buft();
}

static bool moeswarm_dev_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    // llama.cpp's load-time probe (weight_buft_supported) puts the weight in a zero-size buffer of
    // ours and asks about one op built around it (MUL_MAT_ID for weights and scales, ADD_ID for
    // biases, whose other operand is not ours): answer for the tensor, by name and configuration
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        const ggml_tensor * s = op->src[i];
        if (s != nullptr && s->buffer != nullptr && ggml_backend_buffer_get_type(s->buffer) == moeswarm_buft() &&
            ggml_backend_buffer_get_size(s->buffer) == 0 && !moeswarm_buffer_is_weights(s->buffer)) {
            const bool expert_op = op->op == GGML_OP_MUL_MAT_ID || op->op == GGML_OP_ADD_ID || op->op == GGML_OP_MUL;
            return expert_op && moeswarm_is_our_weight(s);
        }
    }
    // leaves: our weights (the scheduler asks before it assigns them); ops: the MoE pattern on them
    return moeswarm_tensor_role(op, 0) != MOESWARM_ROLE_NONE;
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
typedef void   (*ggml_backend_moeswarm_stats_reset_t)(void);

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

static ggml_backend_dev_t moeswarm_device(void) {
    static moeswarm_device_context ctx;
    static ggml_backend_device dev = {
        /* .iface   = */ k_moeswarm_device_i,
        /* .reg     = */ moeswarm_reg(),
        /* .context = */ &ctx,
    };
    return &dev;
}

static std::shared_ptr<const moeswarm_config> moeswarm_config_current(void) {
    moeswarm_device_context * ctx = (moeswarm_device_context *) moeswarm_device()->context;
    std::string fp = moeswarm_config_fingerprint();
    std::lock_guard<std::mutex> lock(ctx->mutex);
    if (!ctx->config || fp != ctx->fingerprint) {
        ctx->config = std::make_shared<const moeswarm_config>(moeswarm_load_config());
        ctx->fingerprint = std::move(fp);
    }
    return ctx->config;
}

static ggml_backend_buffer_type_t moeswarm_buft(void) {
    static ggml_backend_buffer_type buft = {
        /* .iface   = */ {
            /* .get_name       = */ moeswarm_buft_get_name,
            /* .alloc_buffer   = */ moeswarm_buft_alloc_buffer,
            /* .get_alignment  = */ moeswarm_buft_get_alignment,
            /* .get_max_size   = */ nullptr,
            /* .get_alloc_size = */ nullptr,
            /* .is_host        = */ nullptr,
        },
        /* .device  = */ moeswarm_device(),
        /* .context = */ nullptr,
    };
    return &buft;
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
    return moeswarm_reg();
}

static int moeswarm_backend_score(void) {
    return 1;
}

GGML_BACKEND_DL_IMPL(moeswarm_backend_init)
GGML_BACKEND_DL_SCORE_IMPL(moeswarm_backend_score)
