// moeswarm-native-ping: one remote layer's round trip over the native data plane (docs/protocol.md
// section 10.9) with the plugin's own client code (moeswarm-tls, the frame codec), without llama.cpp
// in the way, so that `pnpm bench roundtrip` can time the native path next to its floors.
//
//   moeswarm-native-ping --addr 127.0.0.1:PORT --fp AA:BB:... --backbone bb --ticket T --model m
//                        --layer 0 --n 8 --embd 3072 --k 8 --experts 64 [--iters 200] [--warmup 30]
//
// It says hello as a backbone, waits for the worker's hello, then sends --warmup untimed and --iters
// timed dispatch frames (mode sum, random finite x and weights, ids (token + slot) % experts), one at
// a time, checking each result's shape and that its values are finite. stdout: one JSON line
// {"rtUs":[...],"workerMs":[...]} (workerMs: each result's `ms`). Exit status 0, or 1 with a message
// on stderr.
//
// The same TLS with nothing behind it, the native path's floor in the bench:
//   moeswarm-native-ping --serve-echo 127.0.0.1 --cert CERT.pem --key KEY.pem [--hold-us US]
// listens on an ephemeral port, prints {"port":N,"fingerprint":"AA:..."} and answers every frame with
// its own bytes, one connection at a time, until killed (--hold-us: each answer after that long
// busy, as a worker's compute keeps its core: the client's core then sleeps as it does for a worker); and `--echo 1` makes the client send its
// dispatch frames to such an echo (no hello; each answer must be the frame's own bytes; workerMs are 0).

#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-native-open.h"
#include "moeswarm-tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

static const char * USAGE =
    "usage: moeswarm-native-ping --addr HOST:PORT --fp FINGERPRINT --backbone ID --ticket TICKET --model M\n"
    "       --layer L --n TOKENS --embd N_EMBD --k K --experts N [--iters 200] [--warmup 30] [--timeout-ms 30000]\n"
    "       [--echo 1]  (to an echo: no hello, its bytes back)\n"
    "   or: moeswarm-native-ping --serve-echo HOST --cert CERT.pem --key KEY.pem [--hold-us US]\n";

static int fail(const std::string & msg) {
    fprintf(stderr, "moeswarm-native-ping: %s\n", msg.c_str());
    return 1;
}


struct ping_args {
    std::map<std::string, std::string> v;

    std::string str(const char * key) const {
        auto it = v.find(key);
        return it == v.end() ? "" : it->second;
    }

    long num(const char * key, long def) const {
        auto it = v.find(key);
        return it == v.end() ? def : strtol(it->second.c_str(), nullptr, 10);
    }
};

static bool parse_args(int argc, char ** argv, ping_args & a, std::string & err) {
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0 || i + 1 >= argc) {
            err = std::string("unexpected argument ") + argv[i];
            return false;
        }
        a.v[argv[i] + 2] = argv[i + 1];
        i++;
    }
    const bool echo = !a.str("echo").empty();
    for (const char * k : { "addr", "fp", "backbone", "ticket", "model" }) {
        if (a.str(k).empty() && !(echo && (strcmp(k, "backbone") == 0 || strcmp(k, "ticket") == 0))) {
            err = std::string("--") + k + " is required";
            return false;
        }
    }
    for (const char * k : { "layer", "n", "embd", "k", "experts" }) {
        if (a.num(k, -1) < (strcmp(k, "layer") == 0 ? 0 : 1)) {
            err = std::string("--") + k + " must be a positive integer";
            return false;
        }
    }
    if (a.num("k", 0) > a.num("experts", 0)) {
        err = "--k must not exceed --experts (each token's experts are distinct)";
        return false;
    }
    return true;
}

// a tiny PRNG (xorshift32): reproducible inputs without <random>'s weight
static float rand_unit(uint32_t & s) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return (float) (s >> 8) / (float) (1u << 24) * 2.0f - 1.0f;
}

// one dispatch out, its result in: the round trip in microseconds and the worker's ms, or false
// (rx is the caller's, reused as the plugin reuses its buffers: a fresh 1 MB vector per trip would
// time the allocator's page faults, not the path)
static bool round_trip(moeswarm_tls_conn & c, const std::vector<uint8_t> & out, std::vector<uint8_t> & rx, uint32_t id,
        size_t n_y, double timeout_us, double & rt_us, double & worker_ms, std::string & err) {
    const double t0 = moeswarm_tls_now_us();
    if (!moeswarm_tls_send_all(c, out.data(), out.size(), t0 + timeout_us, err) ||
            !moeswarm_tls_recv_frame(c, rx, MOESWARM_FRAME_MAX_DEFAULT, t0 + timeout_us, err)) {
        return false;
    }
    rt_us = moeswarm_tls_now_us() - t0;
    if (n_y == 0) {
        // an echo: its own bytes back, every one of them
        worker_ms = 0;
        if (rx.size() + 4 != out.size() || memcmp(rx.data(), out.data() + 4, rx.size()) != 0) {
            err = "the echo did not return the frame's bytes";
            return false;
        }
        return true;
    }
    moeswarm_frame f = {};
    moeswarm_error fe;
    if (!moeswarm_frame_decode(rx.data(), rx.size(), 0, &f, &fe)) {
        err = std::string("undecodable reply: ") + fe.code + " " + fe.msg;
        return false;
    }
    if (f.type == MOESWARM_FRAME_ERROR) {
        err = "the worker refused the dispatch: " + std::string((const char *) f.code.ptr, f.code.len) + " " +
              std::string((const char *) f.msg.ptr, f.msg.len);
        return false;
    }
    if (f.type != MOESWARM_FRAME_RESULT || !f.has_id || f.id != id || f.compact) {
        err = "the reply is not the dispatch's result";
        return false;
    }
    if (f.y.len != n_y * sizeof(float)) {
        err = "the result's y has " + std::to_string(f.y.len) + " bytes, not " + std::to_string(n_y * 4);
        return false;
    }
    for (size_t i = 0; i < n_y; i++) {
        float y;
        memcpy(&y, f.y.ptr + i * sizeof(float), sizeof(float));
        if (!isfinite(y)) {
            err = "the result has a non-finite value at " + std::to_string(i);
            return false;
        }
    }
    moeswarm_mp_value ms;
    if (!moeswarm_mp_map_find(rx.data(), rx.size(), "ms", &ms, nullptr) ||
            (ms.type != MOESWARM_MP_FLOAT && ms.type != MOESWARM_MP_UINT)) {
        err = "the result has no ms";
        return false;
    }
    worker_ms = ms.type == MOESWARM_MP_FLOAT ? ms.f : (double) ms.u;
    return true;
}


static void print_json(const std::vector<double> & rt, const std::vector<double> & ms) {
    printf("{\"rtUs\":[");
    for (size_t i = 0; i < rt.size(); i++) printf("%s%.3f", i ? "," : "", rt[i]);
    printf("],\"workerMs\":[");
    for (size_t i = 0; i < ms.size(); i++) printf("%s%.6f", i ? "," : "", ms[i]);
    printf("]}\n");
}

static bool read_file(const std::string & path, std::string & out) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    out = ss.str();
    return f.good() || f.eof();
}

// A TCP listener on host, an ephemeral port (blocking accepts: one connection at a time).
static int listen_any(const std::string & host, uint16_t & port, std::string & err) {
    sockaddr_in sa = {};
    sa.sin_family  = AF_INET;
    if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
        err = "--serve-echo takes an IPv4 address, not " + host;
        return -1;
    }
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = sizeof(sa);
    if (fd < 0 || bind(fd, (sockaddr *) &sa, sizeof(sa)) != 0 || listen(fd, 8) != 0 ||
            getsockname(fd, (sockaddr *) &sa, &len) != 0) {
        err = std::string("cannot listen on ") + host + ": " + strerror(errno);
        if (fd >= 0) close(fd);
        return -1;
    }
    port = ntohs(sa.sin_port);
    return fd;
}

// the TLS echo: every frame back as it came, through the same moeswarm-tls as both product ends
static int serve_echo(const ping_args & a) {
    std::string cert, key, err;
    if (!read_file(a.str("cert"), cert) || !read_file(a.str("key"), key) || cert.empty() || key.empty()) {
        return fail("--serve-echo needs readable --cert and --key PEM files");
    }
    moeswarm_tls_server * tls = moeswarm_tls_server_new(cert, key, err);
    if (tls == nullptr) return fail("no TLS server: " + err);
    uint16_t port = 0;
    const int lfd = listen_any(a.str("serve-echo"), port, err);
    if (lfd < 0) return fail(err);
    printf("{\"port\":%u,\"fingerprint\":\"%s\"}\n", port, moeswarm_tls_server_fingerprint(tls).c_str());
    fflush(stdout);
    const double hold_us = (double) a.num("hold-us", 0);
    std::vector<uint8_t> frame;
    for (;;) {
        const int fd = accept(lfd, nullptr, nullptr);
        if (fd < 0) continue;
        moeswarm_tls_conn c;
        if (!moeswarm_tls_accept(tls, fd, c, moeswarm_tls_now_us() + 10e6, err)) continue;
        // prefix and payload read into one buffer, which goes back as it is: no copy of our own (and
        // the buffer only grows, so no frame pays for zeroing it)
        for (;;) {
            if (frame.size() < 4) frame.resize(4);
            if (!moeswarm_tls_recv_all(c, frame.data(), 4, moeswarm_tls_now_us() + 600e6, err)) break;
            uint32_t len = 0;
            memcpy(&len, frame.data(), 4);
            if (len > MOESWARM_FRAME_MAX_DEFAULT) break;
            if (frame.size() < 4 + (size_t) len) frame.resize(4 + (size_t) len);
            if (!moeswarm_tls_recv_all(c, frame.data() + 4, len, moeswarm_tls_now_us() + 30e6, err)) break;
            // a worker computing: busy on its core while the client waits (and its core idles)
            const double until = moeswarm_tls_now_us() + hold_us;
            while (moeswarm_tls_now_us() < until) {
            }
            if (!moeswarm_tls_send_all(c, frame.data(), 4 + (size_t) len, moeswarm_tls_now_us() + 30e6, err)) break;
        }
        moeswarm_tls_close(c);
    }
}

int main(int argc, char ** argv) {
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--serve-echo") == 0) {
        ping_args a;
        for (int i = 1; i + 1 < argc; i += 2) a.v[argv[i] + 2] = argv[i + 1];
        std::string err;
        if (!moeswarm_tls_available(err)) return fail("no OpenSSL 3 on this host: " + err);
        return serve_echo(a);
    }
    ping_args a;
    std::string err;
    if (!parse_args(argc, argv, a, err)) return fail(err + "\n" + USAGE);
    if (!moeswarm_tls_available(err)) return fail("no OpenSSL 3 on this host: " + err);
    const uint32_t n = (uint32_t) a.num("n", 1), embd = (uint32_t) a.num("embd", 1), k = (uint32_t) a.num("k", 1);
    const uint32_t experts = (uint32_t) a.num("experts", 1);
    const long iters = a.num("iters", 200), warmup = a.num("warmup", 30);
    const double timeout_us = (double) a.num("timeout-ms", 30000) * 1000.0;

    // opened as the plugin opens it (moeswarm-native-open.h); an echo takes no hello
    moeswarm_tls_conn c;
    moeswarm_native_err ne;
    std::vector<uint8_t> hello_rx;
    const double open_by = moeswarm_tls_now_us() + timeout_us;
    const bool echo      = !a.str("echo").empty();
    if (!moeswarm_native_dial(c, a.str("addr"), a.str("fp"), open_by, ne) ||
            (!echo && !moeswarm_native_hello(c, a.str("backbone"), a.str("ticket"), open_by, hello_rx, ne))) {
        moeswarm_tls_close(c);
        return fail(ne.code + ": " + ne.msg);
    }
    uint32_t seed = 0x9e3779b9u;
    std::vector<float> x((size_t) n * embd), wts((size_t) n * k);
    std::vector<int32_t> ids((size_t) n * k);
    for (float & v : x) v = rand_unit(seed);
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t j = 0; j < k; j++) {
            ids[(size_t) i * k + j] = (int32_t) ((i + j) % experts);
            wts[(size_t) i * k + j] = 0.5f / (float) k + 0.5f * fabsf(rand_unit(seed)) / (float) k;
        }
    }
    const std::string model = a.str("model");
    std::vector<double> rt, ms;
    moeswarm_mp_writer w;
    std::vector<uint8_t> rx;
    for (long it = 0; it < warmup + iters; it++) {
        const uint32_t id = (uint32_t) it + 1;
        const moeswarm_dispatch_desc d = { id, model.c_str(), (uint32_t) a.num("layer", 0), n, embd, x.data(), k,
            ids.data(), wts.data(), MOESWARM_MODE_SUM, false };
        w.buf.clear();
        w.buf.resize(4);
        moeswarm_frame_write_dispatch(&w, &d);
        moeswarm_frame_prefix(w.buf);
        double rt_us = 0, worker_ms = 0;
        if (!round_trip(c, w.buf, rx, id, echo ? 0 : (size_t) n * embd, timeout_us, rt_us, worker_ms, err)) {
            moeswarm_tls_close(c);
            return fail("round trip " + std::to_string(it + 1) + ": " + err);
        }
        if (it >= warmup) {
            rt.push_back(rt_us);
            ms.push_back(worker_ms);
        }
    }
    moeswarm_tls_close(c);
    print_json(rt, ms);
    return 0;
}
