// A native link to a worker (spec C of #15, docs/protocol.md section 10.9): TLS, pinned, the ticket's
// hello; one frame read at a time; a failure closes the link, backs the worker off (1 s doubling to
// 60 s) and is reported in the next native-receipts. The whole-layer split that uses them is in
// native-replica.cpp, the split over several workers in native-split.cpp.

#include "moeswarm-plugin.h"
#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-trace.h"

#include <string.h>
#include <sys/time.h>

#include <algorithm>

#define MOESWARM_NATIVE_BACKOFF_MIN_MS 1000.0
#define MOESWARM_NATIVE_BACKOFF_MAX_MS 60000.0
#define MOESWARM_NATIVE_FAILURES_MAX   64 // listed per receipt; more are a storm already reported

double moeswarm_wall_ms(void) {
    timeval tv;
    gettimeofday(&tv, nullptr);
    return tv.tv_sec * 1e3 + tv.tv_usec / 1e3;
}

bool moeswarm_native_send(moeswarm_backend_context * ctx, moeswarm_native_peer & pr, const moeswarm_native_target & t,
        const std::function<void()> & build, int layer, double deadline, bool & reused, bool & retried,
        moeswarm_native_err & ne, size_t & bytes_out) {
    for (;;) {
        reused = pr.conn.fd >= 0;
        if (!reused && !moeswarm_native_connect(pr, ctx->native.table, t, deadline, ne)) {
            return false;
        }
        build();
        std::string err;
        bool timed_out = false;
        moeswarm_trace_hop("plugin.native.send", layer);
        if (moeswarm_tls_send_all(pr.conn, ctx->tx.buf.data(), ctx->tx.buf.size(), deadline, err, &timed_out)) {
            bytes_out += ctx->tx.buf.size();
            return true;
        }
        moeswarm_native_transport_err(ne, timed_out, "sending the dispatch to " + t.worker + ": " + err);
        moeswarm_tls_close(pr.conn);
        if (!reused || retried || timed_out) {
            return false;
        }
        retried = true;
    }
}

bool moeswarm_native_connect(moeswarm_native_peer & pr, const moeswarm_native_table & t,
        const moeswarm_native_target & e, double deadline, moeswarm_native_err & ne) {
    if (!moeswarm_native_dial(pr.conn, e.addr, e.fp, deadline, ne)) {
        return false;
    }
    pr.addr       = e.addr;
    pr.fp         = e.fp;
    pr.next_id    = 1;
    pr.max_result = 0;
    if (!moeswarm_native_hello(pr.conn, t.backbone, e.ticket, deadline, pr.rx, ne)) {
        ne.msg += " (" + e.addr + ")";
        return false;
    }
    return true;
}

double moeswarm_native_result_ms(const uint8_t * data, size_t size) {
    moeswarm_mp_value v;
    if (!moeswarm_mp_map_find(data, size, "ms", &v, nullptr)) return -1;
    if (v.type == MOESWARM_MP_FLOAT) return v.f;
    if (v.type == MOESWARM_MP_UINT) return (double) v.u;
    return -1;
}

moeswarm_native_read moeswarm_native_read_one(moeswarm_native_peer & pr, uint64_t id, size_t max_frame, double deadline,
        const std::string & who, int layer, moeswarm_frame & f, moeswarm_native_err & ne, size_t & bytes_in) {
    std::string err;
    bool timed_out = false;
    pr.max_result = std::max(pr.max_result, max_frame);
    if (!moeswarm_tls_recv_frame(pr.conn, pr.rx, pr.max_result, deadline, err, &timed_out)) {
        moeswarm_native_transport_err(ne, timed_out, "waiting for " + who + "'s result: " + err);
        return MOESWARM_NATIVE_READ_FAILED;
    }
    bytes_in += 4 + pr.rx.size();
    moeswarm_error fe;
    if (!moeswarm_frame_decode(pr.rx.data(), pr.rx.size(), 0, &f, &fe)) {
        ne.code = fe.code;
        ne.msg  = std::string("a bad frame from ") + who + ": " + fe.msg;
        return MOESWARM_NATIVE_READ_FAILED;
    }
    if (f.type == MOESWARM_FRAME_ERROR && (!f.has_id || f.id == id)) {
        moeswarm_native_error_frame(ne, f, "the dispatch");
        return MOESWARM_NATIVE_READ_FAILED;
    }
    if (f.type == MOESWARM_FRAME_DRAIN) {
        ne.code = "MOESWARM_TRANSPORT_DRAINING";
        ne.msg  = who + " is draining";
        return MOESWARM_NATIVE_READ_FAILED;
    }
    if (f.type == MOESWARM_FRAME_RESULT && f.id == id) {
        moeswarm_trace_hop("plugin.native.recv", layer);
        return MOESWARM_NATIVE_READ_RESULT;
    }
    // a pong, or a late answer to a split given up on or a hedge this worker lost
    return MOESWARM_NATIVE_READ_SKIPPED;
}

void moeswarm_native_failed(moeswarm_native & nv, moeswarm_native_peer & pr, const std::string & worker,
        const moeswarm_pattern & p, const moeswarm_native_err & ne, bool failover) {
    moeswarm_tls_close(pr.conn);
    pr.backoff_ms  = pr.backoff_ms == 0 ? MOESWARM_NATIVE_BACKOFF_MIN_MS :
                                          std::min(pr.backoff_ms * 2, MOESWARM_NATIVE_BACKOFF_MAX_MS);
    pr.retry_at_us = moeswarm_now_us() + pr.backoff_ms * 1000.0;
    if (nv.failures.size() < MOESWARM_NATIVE_FAILURES_MAX) {
        nv.failures.push_back({ worker, ne.code, ne.msg, failover });
    }
    GGML_LOG_WARN("moeswarm: layer %d: the native split to worker %s failed (%s: %s); this split goes %s, and the "
                  "worker gets no native split for %.0f s\n",
            p.layer, worker.c_str(), ne.code.c_str(), ne.msg.c_str(),
            failover ? "to its replica natively" : "through the bridge", pr.backoff_ms / 1000.0);
}

void moeswarm_native_close_all(moeswarm_native & nv) {
    for (auto & [worker, peer] : nv.peers) {
        moeswarm_tls_close(peer.conn);
    }
}
