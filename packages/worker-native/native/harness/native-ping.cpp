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

#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-tls.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <string>
#include <vector>

static const char * USAGE =
    "usage: moeswarm-native-ping --addr HOST:PORT --fp FINGERPRINT --backbone ID --ticket TICKET --model M\n"
    "       --layer L --n TOKENS --embd N_EMBD --k K --experts N [--iters 200] [--warmup 30] [--timeout-ms 30000]\n";

static int fail(const std::string & msg) {
    fprintf(stderr, "moeswarm-native-ping: %s\n", msg.c_str());
    return 1;
}

// the u32 little-endian length prefix of protocol section 7 into the 4 bytes reserved at the front
static void set_frame_len(std::vector<uint8_t> & buf) {
    const uint32_t len = (uint32_t) (buf.size() - 4);
    memcpy(buf.data(), &len, 4);
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
    for (const char * k : { "addr", "fp", "backbone", "ticket", "model" }) {
        if (a.str(k).empty()) {
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
static bool round_trip(moeswarm_tls_conn & c, const std::vector<uint8_t> & out, uint32_t id, size_t n_y,
        double timeout_us, double & rt_us, double & worker_ms, std::string & err) {
    std::vector<uint8_t> rx;
    const double t0 = moeswarm_tls_now_us();
    if (!moeswarm_tls_send_all(c, out.data(), out.size(), t0 + timeout_us, err) ||
            !moeswarm_tls_recv_frame(c, rx, MOESWARM_FRAME_MAX_DEFAULT, t0 + timeout_us, err)) {
        return false;
    }
    rt_us = moeswarm_tls_now_us() - t0;
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

static bool hello(moeswarm_tls_conn & c, const ping_args & a, double deadline, std::string & err) {
    moeswarm_mp_writer w;
    w.buf.resize(4);
    moeswarm_frame_write_backbone_hello(&w, a.str("backbone").c_str(), a.str("ticket").c_str());
    set_frame_len(w.buf);
    std::vector<uint8_t> rx;
    if (!moeswarm_tls_send_all(c, w.buf.data(), w.buf.size(), deadline, err) ||
            !moeswarm_tls_recv_frame(c, rx, 1u << 20, deadline, err)) {
        err = "no hello from the worker: " + err;
        return false;
    }
    moeswarm_frame f = {};
    moeswarm_error fe;
    if (!moeswarm_frame_decode(rx.data(), rx.size(), 0, &f, &fe) || f.type != MOESWARM_FRAME_HELLO) {
        err = f.type == MOESWARM_FRAME_ERROR ?
                  "the worker refused the hello: " + std::string((const char *) f.msg.ptr, f.msg.len) :
                  "the worker answered the hello with something else";
        return false;
    }
    return true;
}

static void print_json(const std::vector<double> & rt, const std::vector<double> & ms) {
    printf("{\"rtUs\":[");
    for (size_t i = 0; i < rt.size(); i++) printf("%s%.3f", i ? "," : "", rt[i]);
    printf("],\"workerMs\":[");
    for (size_t i = 0; i < ms.size(); i++) printf("%s%.6f", i ? "," : "", ms[i]);
    printf("]}\n");
}

int main(int argc, char ** argv) {
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        fputs(USAGE, stdout);
        return 0;
    }
    ping_args a;
    std::string err;
    if (!parse_args(argc, argv, a, err)) return fail(err + "\n" + USAGE);
    if (!moeswarm_tls_available(err)) return fail("no OpenSSL 3 on this host: " + err);
    const uint32_t n = (uint32_t) a.num("n", 1), embd = (uint32_t) a.num("embd", 1), k = (uint32_t) a.num("k", 1);
    const uint32_t experts = (uint32_t) a.num("experts", 1);
    const long iters = a.num("iters", 200), warmup = a.num("warmup", 30);
    const double timeout_us = (double) a.num("timeout-ms", 30000) * 1000.0;

    moeswarm_tls_conn c;
    if (!moeswarm_tls_connect(c, a.str("addr"), a.str("fp"), moeswarm_tls_now_us() + timeout_us, err)) {
        moeswarm_tls_close(c);
        return fail("cannot connect to " + a.str("addr") + ": " + err);
    }
    if (!hello(c, a, moeswarm_tls_now_us() + timeout_us, err)) {
        moeswarm_tls_close(c);
        return fail(err);
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
    for (long it = 0; it < warmup + iters; it++) {
        const uint32_t id = (uint32_t) it + 1;
        const moeswarm_dispatch_desc d = { id, model.c_str(), (uint32_t) a.num("layer", 0), n, embd, x.data(), k,
            ids.data(), wts.data(), MOESWARM_MODE_SUM, false };
        moeswarm_mp_writer w;
        w.buf.resize(4);
        moeswarm_frame_write_dispatch(&w, &d);
        set_frame_len(w.buf);
        double rt_us = 0, worker_ms = 0;
        if (!round_trip(c, w.buf, id, (size_t) n * embd, timeout_us, rt_us, worker_ms, err)) {
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
