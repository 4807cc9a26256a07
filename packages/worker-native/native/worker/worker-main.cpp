// moeswarm-expert-worker: the expert compute core behind the wire protocol (docs/protocol.md),
// for hosts without Node (phones above all). Length-prefixed msgpack frames (u32 little-endian
// length, then the payload) on stdin/stdout or on a TCP connection:
//   dispatch -> result | error      ping -> pong      drain -> exit 0
// It introduces itself with hello and register. A frame that fails validation gets an error
// frame and the worker reads on; an oversized length prefix, a stream cut inside a frame or
// another protocol version end the connection after a connection-level error (section 6).

#include "moeswarm-backend.h"
#include "moeswarm-dispatch.h"
#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-slice.h"
#include "moeswarm-trace.h"

#include "gguf.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include <string>
#include <vector>

#define MOESWARM_WORKER_VERSION "0.1.0"

static const char * k_usage =
    "usage: moeswarm-expert-worker --slice <file.gguf> [options]\n"
    "  --slice <path>        slice GGUF (or a full model file)\n"
    "  --threads <n>         compute threads (default: all CPUs)\n"
    "  --listen <host:port>  serve one TCP connection at a time instead of stdin/stdout\n"
    "  --model <name>        model id to register; dispatch frames for another model are refused\n"
    "                        (default: general.name of the slice, and any model is accepted)\n"
    "  --id <peer id>        id sent in hello (default moeswarm-expert-worker)\n"
    "  --max-frame <bytes>   largest accepted frame (default 67108864)\n"
    "  --act <name>          activation: auto|silu|gelu|relu|swiglu_oai|relu_sqr (default auto)\n"
    "  --no-repack           keep weights in plain CPU buffers (no CPU_REPACK)\n"
    "  --device <name>       cpu (default), gpu, or a ggml device of a GPU build (CUDA0, ROCm0...)\n"
    "  --max-batch-rows <n>  most (token, expert) rows per compute graph; more are computed in chunks\n"
    "                        (default: 512 on a GPU device, where the compute buffer is reserved at\n"
    "                        load for them and never grows; no limit on the CPU)\n"
    "  --reference           answer with one monolithic graph over the whole tensors, as llama.cpp's\n"
    "                        build_moe_ffn builds it (tests; ids are slab indices, every slot filled)\n"
    "  --version             print the version and the CPU features compiled in\n";

struct worker_options {
    const char * slice_path = nullptr;
    int32_t      n_threads  = 0;
    const char * listen     = nullptr;
    const char * model      = nullptr;
    const char * peer_id    = "moeswarm-expert-worker";
    uint64_t     max_frame  = MOESWARM_FRAME_MAX_DEFAULT;
    int32_t      act        = MOESWARM_ACT_AUTO;
    bool         repack     = true;
    const char * device     = nullptr;
    bool         reference  = false;
    uint32_t     max_rows   = 0;
};

struct worker_state {
    worker_options         opt;
    std::string            model;   // registered model id
    std::string            backend; // registered backend: "cpu", or the GPU device's name
    moeswarm_slice *       slice = nullptr;
    std::vector<uint8_t>   frame;
    moeswarm_dispatch_scratch scratch;
    std::vector<float>     y;
    moeswarm_mp_writer     out;
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec / 1e6;
}

// 1: n bytes read, 0: clean end of stream before the first byte, -1: error or end mid-way
static int read_exact(int fd, void * buf, size_t n) {
    uint8_t * p = (uint8_t *) buf;
    size_t got = 0;
    while (got < n) {
        const ssize_t r = read(fd, p + got, n - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return got == 0 && r == 0 ? 0 : -1;
        }
        got += (size_t) r;
    }
    return 1;
}

static bool write_all(int fd, const void * buf, size_t n) {
    const uint8_t * p = (const uint8_t *) buf;
    while (n > 0) {
        const ssize_t r = write(fd, p, n);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return false;
        }
        p += r;
        n -= (size_t) r;
    }
    return true;
}

// sends the payload in st->out with its length prefix
static bool send_frame(worker_state * st, int fd) {
    const size_t n = st->out.buf.size();
    const uint8_t prefix[4] = { (uint8_t) n, (uint8_t) (n >> 8), (uint8_t) (n >> 16), (uint8_t) (n >> 24) };
    const bool ok = write_all(fd, prefix, 4) && write_all(fd, st->out.buf.data(), n);
    st->out.buf.clear();
    return ok;
}

static bool send_error(worker_state * st, int fd, const moeswarm_frame * req, const char * code, const char * msg) {
    st->out.buf.clear();
    moeswarm_frame_write_error(&st->out, req, code, msg);
    return send_frame(st, fd);
}

static bool handle_dispatch(worker_state * st, int fd, const moeswarm_frame * f) {
    moeswarm_error err;
    const uint32_t n_embd = moeswarm_slice_n_embd(st->slice);
    if (st->opt.model != nullptr && (f->model.len != st->model.size() || memcmp(f->model.ptr, st->model.data(), f->model.len) != 0)) {
        return send_error(st, fd, f, "MOESWARM_NATIVE_COMPUTE", "the dispatch is for another model than this worker's");
    }
    if (f->embd != n_embd) {
        char msg[160];
        snprintf(msg, sizeof(msg), "embd %u does not match the slice's n_embd %u", f->embd, n_embd);
        return send_error(st, fd, f, "MOESWARM_NATIVE_COMPUTE", msg);
    }
    moeswarm_run_params rp;
    moeswarm_dispatch_run_params(f, &st->scratch, &rp);
    const size_t n_out = moeswarm_run_output_len(st->slice, f->n, f->k, f->mode);
    st->y.resize(n_out);
    const double t0 = now_ms();
    const bool ok = st->opt.reference ? moeswarm_slice_run_reference(st->slice, &rp, st->y.data(), n_out, &err)
                                      : moeswarm_slice_run(st->slice, &rp, st->y.data(), n_out, &err);
    if (!ok) {
        return send_error(st, fd, f, err.code, err.msg);
    }
    const double ms = now_ms() - t0;
    st->out.buf.clear();
    moeswarm_frame_write_result(&st->out, f, st->y.data(), n_out, ms);
    return send_frame(st, fd);
}

enum serve_end { SERVE_EOF, SERVE_DRAIN, SERVE_BROKEN };

static serve_end serve(worker_state * st, int in_fd, int out_fd) {
    st->out.buf.clear();
    moeswarm_frame_write_hello(&st->out, st->opt.peer_id, st->backend.c_str(), (uint32_t) st->opt.max_frame);
    if (!send_frame(st, out_fd)) {
        return SERVE_BROKEN;
    }
    moeswarm_register_desc reg;
    reg.layers   = moeswarm_slice_layers(st->slice);
    reg.n_layer  = moeswarm_slice_n_layer(st->slice);
    reg.experts  = moeswarm_slice_experts(st->slice);
    reg.n_expert = moeswarm_slice_n_expert(st->slice);
    reg.capacity = moeswarm_slice_weight_bytes(st->slice);
    moeswarm_frame_write_register(&st->out, st->model.c_str(), &reg, st->backend.c_str());
    if (!send_frame(st, out_fd)) {
        return SERVE_BROKEN;
    }
    for (;;) {
        uint8_t prefix[4];
        int rc = read_exact(in_fd, prefix, 4);
        if (rc == 0) {
            return SERVE_EOF;
        }
        const uint32_t len = (uint32_t) prefix[0] | ((uint32_t) prefix[1] << 8) | ((uint32_t) prefix[2] << 16) |
                             ((uint32_t) prefix[3] << 24);
        if (rc > 0 && len > st->opt.max_frame) {
            // the framing is lost: refuse without allocating or reading, and close
            char msg[160];
            snprintf(msg, sizeof(msg), "frame of %u bytes exceeds the maximum of %llu", len, (unsigned long long) st->opt.max_frame);
            send_error(st, out_fd, nullptr, "MOESWARM_PROTOCOL_FRAME_TOO_LARGE", msg);
            return SERVE_BROKEN;
        }
        if (rc > 0) {
            st->frame.resize(len);
            rc = len == 0 ? 1 : read_exact(in_fd, st->frame.data(), len);
        }
        if (rc != 1) {
            send_error(st, out_fd, nullptr, "MOESWARM_PROTOCOL_TRUNCATED", "the stream ended inside a frame");
            return SERVE_BROKEN;
        }
        moeswarm_frame f;
        moeswarm_error err;
        if (!moeswarm_frame_decode(st->frame.data(), len, 0, &f, &err)) {
            if (strcmp(err.code, "MOESWARM_PROTOCOL_VERSION") == 0) {
                send_error(st, out_fd, nullptr, err.code, err.msg);
                return SERVE_BROKEN;
            }
            if (!send_error(st, out_fd, &f, err.code, err.msg)) {
                return SERVE_BROKEN;
            }
            continue;
        }
        bool ok = true;
        switch (f.type) {
            case MOESWARM_FRAME_DISPATCH:
                moeswarm_trace_hop("child.in", f.id);
                ok = handle_dispatch(st, out_fd, &f);
                moeswarm_trace_hop("child.out", f.id);
                break;
            case MOESWARM_FRAME_PING:
                st->out.buf.clear();
                moeswarm_frame_write_pong(&st->out, f.seq, f.ts);
                ok = send_frame(st, out_fd);
                break;
            case MOESWARM_FRAME_DRAIN:
                // frames are handled in order, so everything sent before the drain is answered
                return SERVE_DRAIN;
            default:
                // hello, register, result, error, pong: nothing for a worker to do
                break;
        }
        if (!ok) {
            return SERVE_BROKEN;
        }
    }
}

static int serve_tcp(worker_state * st) {
    std::string spec = st->opt.listen;
    const size_t colon = spec.rfind(':');
    if (colon == std::string::npos) {
        fprintf(stderr, "moeswarm-expert-worker: --listen needs host:port\n");
        return 2;
    }
    std::string host = spec.substr(0, colon);
    const std::string port = spec.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    // numeric addresses first: a static binary on Android has no NSS to resolve names with
    hints.ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV;
    struct addrinfo * res = nullptr;
    int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
    if (gai != 0) {
        hints.ai_flags = AI_PASSIVE;
        gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
    }
    if (gai != 0 || res == nullptr) {
        fprintf(stderr, "moeswarm-expert-worker: cannot resolve %s: %s\n", st->opt.listen, gai_strerror(gai));
        return 2;
    }
    int lfd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
    const int one = 1;
    if (lfd >= 0) {
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    }
    if (lfd < 0 || bind(lfd, res->ai_addr, res->ai_addrlen) != 0 || listen(lfd, 4) != 0) {
        fprintf(stderr, "moeswarm-expert-worker: cannot listen on %s: %s\n", st->opt.listen, strerror(errno));
        freeaddrinfo(res);
        return 2;
    }
    freeaddrinfo(res);
    struct sockaddr_storage bound;
    socklen_t blen = sizeof(bound);
    getsockname(lfd, (struct sockaddr *) &bound, &blen);
    char addr[INET6_ADDRSTRLEN] = "?";
    int bport = 0;
    if (bound.ss_family == AF_INET) {
        const struct sockaddr_in * a = (const struct sockaddr_in *) &bound;
        inet_ntop(AF_INET, &a->sin_addr, addr, sizeof(addr));
        bport = ntohs(a->sin_port);
    } else if (bound.ss_family == AF_INET6) {
        const struct sockaddr_in6 * a = (const struct sockaddr_in6 *) &bound;
        inet_ntop(AF_INET6, &a->sin6_addr, addr, sizeof(addr));
        bport = ntohs(a->sin6_port);
    }
    // the one line a supervisor reads to learn the port (useful with port 0)
    printf("listening %s %d\n", addr, bport);
    fflush(stdout);
    for (;;) {
        const int cfd = accept(lfd, nullptr, nullptr);
        if (cfd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) {
                continue;
            }
            fprintf(stderr, "moeswarm-expert-worker: accept: %s\n", strerror(errno));
            close(lfd);
            return 1;
        }
        setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        const serve_end end = serve(st, cfd, cfd);
        close(cfd);
        if (end == SERVE_DRAIN) {
            close(lfd);
            return 0;
        }
    }
}

// The baseline armv8-a binary runs everywhere; when the CPU has dotprod (armv8.2-a+dotprod)
// and the faster sibling sits next to this file, it hands over to it (same arguments).
// Returns the sibling to run, or "" to stay.
static std::string arm_dispatch_target(void) {
#if defined(__aarch64__) && defined(__linux__) && defined(MOESWARM_ARM_DISPATCH_SUFFIX)
    const char * off = getenv("MOESWARM_NO_DISPATCH");
    if (off != nullptr && off[0] != '\0' && strcmp(off, "0") != 0) {
        return "";
    }
    const unsigned long hwcap = getauxval(AT_HWCAP);
    const unsigned long need = 1ul << 20; // HWCAP_ASIMDDP
    if ((hwcap & need) != need) {
        return "";
    }
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 64);
    if (n <= 0) {
        return "";
    }
    self[n] = '\0';
    std::string target = std::string(self) + MOESWARM_ARM_DISPATCH_SUFFIX;
    return access(target.c_str(), X_OK) == 0 ? target : "";
#else
    return "";
#endif
}

static bool model_name_ok(const char * s) {
    const size_t n = strlen(s);
    return n >= 1 && n <= 256 && moeswarm_utf8_valid((const uint8_t *) s, n);
}

// the model id to register: --model, else the slice's general.name, else "unnamed"
static std::string model_of(const char * path, const char * flag) {
    if (flag != nullptr) {
        return flag;
    }
    gguf_init_params gp = { true, nullptr };
    gguf_context * ctx = gguf_init_from_file(path, gp);
    std::string name = "unnamed";
    if (ctx != nullptr) {
        const int64_t id = gguf_find_key(ctx, "general.name");
        if (id >= 0 && gguf_get_kv_type(ctx, id) == GGUF_TYPE_STRING && model_name_ok(gguf_get_val_str(ctx, id))) {
            name = gguf_get_val_str(ctx, id);
        }
        gguf_free(ctx);
    }
    return name;
}

static bool parse_u64(const char * s, uint64_t lo, uint64_t hi, uint64_t * out) {
    if (s == nullptr || *s == '\0') {
        return false;
    }
    char * end = nullptr;
    errno = 0;
    const unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || s[0] == '-' || v < lo || v > hi) {
        return false;
    }
    *out = v;
    return true;
}

// -1: go on; otherwise the exit code (--help, --version, a bad argument)
static int parse_args(int argc, char ** argv, worker_options & opt) {
    for (int i = 1; i < argc; ++i) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : nullptr;
        uint64_t u = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(k_usage, stdout);
            return 0;
        } else if (strcmp(a, "--version") == 0) {
#ifdef MOESWARM_LLAMA_SHARED
            unsetenv("GGML_BACKEND_PATH");
#endif
            printf("moeswarm-expert-worker %s (ggml CPU: %s; devices: %s; ggml: %s)\n", MOESWARM_WORKER_VERSION,
                moeswarm_cpu_features(), moeswarm_devices(), moeswarm_backend_kind());
            return 0;
        } else if (strcmp(a, "--slice") == 0 && v) {
            opt.slice_path = v; ++i;
        } else if (strcmp(a, "--threads") == 0 && parse_u64(v, 0, 512, &u)) {
            opt.n_threads = (int32_t) u; ++i;
        } else if (strcmp(a, "--listen") == 0 && v) {
            opt.listen = v; ++i;
        } else if (strcmp(a, "--model") == 0 && v && model_name_ok(v)) {
            opt.model = v; ++i;
        } else if (strcmp(a, "--id") == 0 && v && strlen(v) >= 1 && strlen(v) <= 128 &&
                   moeswarm_utf8_valid((const uint8_t *) v, strlen(v))) {
            opt.peer_id = v; ++i;
        } else if (strcmp(a, "--max-frame") == 0 && parse_u64(v, 64, UINT32_MAX, &u)) {
            opt.max_frame = u; ++i;
        } else if (strcmp(a, "--act") == 0 && v && moeswarm_act_from_name(v) >= MOESWARM_ACT_AUTO) {
            opt.act = moeswarm_act_from_name(v); ++i;
        } else if (strcmp(a, "--device") == 0 && v) {
            opt.device = v; ++i;
        } else if (strcmp(a, "--max-batch-rows") == 0 && parse_u64(v, 1, 65536, &u)) {
            opt.max_rows = (uint32_t) u; ++i;
        } else if (strcmp(a, "--no-repack") == 0) {
            opt.repack = false;
        } else if (strcmp(a, "--reference") == 0) {
            opt.reference = true;
        } else {
            fprintf(stderr, "moeswarm-expert-worker: bad argument %s\n%s", a, k_usage);
            return 2;
        }
    }
    if (opt.slice_path == nullptr) {
        fprintf(stderr, "moeswarm-expert-worker: --slice is required\n%s", k_usage);
        return 2;
    }
    return -1;
}

int main(int argc, char ** argv) {
    if (argc == 2 && strcmp(argv[1], "--dispatch-target") == 0) {
        // what the launcher logic below would run (for tests; exec needs binfmt under qemu)
        const std::string target = arm_dispatch_target();
        printf("%s\n", target.empty() ? "self" : target.c_str());
        return 0;
    }
    {
        const std::string target = arm_dispatch_target();
        if (!target.empty()) {
            setenv("MOESWARM_NO_DISPATCH", "1", 1);
            execv(target.c_str(), argv);
            // exec failed (no binfmt under qemu, noexec mount...): carry on with the baseline
        }
    }
    signal(SIGPIPE, SIG_IGN);
    worker_state st;
    const int parsed = parse_args(argc, argv, st.opt);
    if (parsed >= 0) {
        return parsed;
    }

#ifdef MOESWARM_LLAMA_SHARED
    // the worker needs only the CPU backend: a GGML_BACKEND_PATH inherited from a llama.cpp host
    // (the backbone's plugin) is not for it
    unsetenv("GGML_BACKEND_PATH");
#endif
    moeswarm_log_init();
    moeswarm_slice_params params = moeswarm_slice_default_params();
    params.n_threads = st.opt.n_threads;
    params.act = st.opt.act;
    params.repack = st.opt.repack;
    params.device = st.opt.device;
    params.max_rows = st.opt.max_rows;
    moeswarm_error err;
    st.slice = moeswarm_slice_init_from_file(st.opt.slice_path, params, &err);
    if (st.slice == nullptr) {
        fprintf(stderr, "moeswarm-expert-worker: %s: %s\n", err.code, err.msg);
        // on stdio the supervisor also gets it as a connection-level error frame
        if (st.opt.listen == nullptr) {
            send_error(&st, 1, nullptr, err.code, err.msg);
        }
        return 3;
    }

    if (moeswarm_slice_compute_bytes(st.slice) > 0) {
        // for the operator and the supervisor (the VRAM headroom it offers must cover this)
        fprintf(stderr, "moeswarm-expert-worker: %s compute buffer: %zu bytes reserved for %u rows\n",
                moeswarm_slice_device(st.slice), moeswarm_slice_compute_bytes(st.slice), moeswarm_slice_max_rows(st.slice));
    }
    st.model = model_of(st.opt.slice_path, st.opt.model);
    st.backend = moeswarm_slice_device(st.slice);
    for (char & c : st.backend) {
        c = (char) tolower((unsigned char) c);
    }
#ifdef MOESWARM_LLAMA_SHARED
    if (st.backend == "cpu") {
        st.backend = "llama-cpu"; // llama.cpp's own CPU backend library, not this package's static ggml
    }
#endif

    int rc = 0;
    if (st.opt.listen != nullptr) {
        rc = serve_tcp(&st);
    } else {
        const serve_end end = serve(&st, 0, 1);
        rc = end == SERVE_BROKEN ? 1 : 0;
    }
    moeswarm_slice_free(st.slice);
    return rc;
}
