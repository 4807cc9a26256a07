// The native split (spec C of #15, docs/protocol.md section 10.9): a layer whose every expert one
// worker holds goes straight to that worker's native listener over TLS, the same dispatch frame the
// bridge would get. Any doubt (no link, a pin mismatch, a refused hello, an error frame, the table's
// deadline, a result of the wrong shape or with a non-finite value) closes the link, backs the worker
// off (1 s doubling to 60 s), is reported in the next native-receipts, and the split goes through the
// bridge, which computes the same bits.

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

// a transport failure: the deadline's, or the link's
void moeswarm_native_transport_err(moeswarm_native_err & e, bool timed_out, const std::string & what) {
    e.code = timed_out ? "MOESWARM_TRANSPORT_TIMEOUT" : "MOESWARM_TRANSPORT_CLOSED";
    e.msg  = what;
}

void moeswarm_native_error_frame(moeswarm_native_err & e, const moeswarm_frame & f, const char * when) {
    e.code = f.code.present ? std::string((const char *) f.code.ptr, f.code.len) : "MOESWARM_TRANSPORT_CLOSED";
    e.msg  = std::string("the worker refused ") + when + ": " + std::string((const char *) f.msg.ptr, f.msg.len);
}

bool moeswarm_native_connect(moeswarm_native_peer & pr, const moeswarm_native_table & t,
        const moeswarm_native_entry & e, double deadline, moeswarm_native_err & ne) {
    std::string err;
    if (!moeswarm_tls_connect(pr.conn, e.addr, e.fp, deadline, err)) {
        moeswarm_tls_close(pr.conn);
        const bool pin = err.rfind("MOESWARM_TRANSPORT_PIN_MISMATCH", 0) == 0;
        ne.code        = pin ? "MOESWARM_TRANSPORT_PIN_MISMATCH" :
                         moeswarm_now_us() >= deadline ? "MOESWARM_TRANSPORT_TIMEOUT" : "MOESWARM_TRANSPORT_CONNECT";
        ne.msg = "cannot open the native link to " + e.addr + ": " + err;
        return false;
    }
    pr.addr    = e.addr;
    pr.fp      = e.fp;
    pr.next_id = 1;
    moeswarm_mp_writer w;
    w.buf.resize(4);
    moeswarm_frame_write_backbone_hello(&w, t.backbone.c_str(), e.ticket.c_str());
    moeswarm_frame_prefix(w.buf);
    bool timed_out = false;
    if (!moeswarm_tls_send_all(pr.conn, w.buf.data(), w.buf.size(), deadline, err, &timed_out) ||
            !moeswarm_tls_recv_frame(pr.conn, pr.rx, 1u << 20, deadline, err, &timed_out)) {
        moeswarm_native_transport_err(ne, timed_out, "no hello from the worker on " + e.addr + ": " + err);
        return false;
    }
    moeswarm_frame f;
    moeswarm_error fe;
    if (!moeswarm_frame_decode(pr.rx.data(), pr.rx.size(), 0, &f, &fe)) {
        ne.code = fe.code;
        ne.msg  = std::string("the worker's first frame: ") + fe.msg;
        return false;
    }
    if (f.type == MOESWARM_FRAME_ERROR) {
        moeswarm_native_error_frame(ne, f, "the hello");
        return false;
    }
    if (f.type != MOESWARM_FRAME_HELLO) {
        ne.code = "MOESWARM_AUTH_MISSING";
        ne.msg  = "the worker answered the hello with another frame";
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

// the dispatch out, frames in until its result: true with out written
static bool moeswarm_native_exchange(moeswarm_backend_context * ctx, moeswarm_native_peer & pr, const moeswarm_config & cfg,
        const moeswarm_pattern & p, double deadline, moeswarm_native_err & ne, double & worker_ms, size_t & bytes_out,
        size_t & bytes_in) {
    const uint32_t id = moeswarm_next_id(pr.next_id);
    moeswarm_build_dispatch(ctx, cfg, p, id);
    bytes_out += ctx->tx.buf.size();
    std::string err;
    bool timed_out = false;
    moeswarm_trace_hop("plugin.native.send", p.layer);
    if (!moeswarm_tls_send_all(pr.conn, ctx->tx.buf.data(), ctx->tx.buf.size(), deadline, err, &timed_out)) {
        moeswarm_native_transport_err(ne, timed_out, "sending the dispatch: " + err);
        return false;
    }
    const size_t want = (size_t) p.n_tokens * (p.weighted_input ? p.k : 1) * p.n_embd;
    moeswarm_frame f;
    if (!moeswarm_native_await(pr, id, want * 4 + 4096, deadline, "the worker", p.layer, f, ne, bytes_in)) {
        return false;
    }
    if (!moeswarm_check_result(f, p, true, err)) {
        ne.code = "MOESWARM_DISPATCH_BAD_RESULT";
        ne.msg  = err;
        return false;
    }
    worker_ms = moeswarm_native_result_ms(pr.rx.data(), pr.rx.size());
    moeswarm_write_out(f.y.ptr, p);
    return true;
}

bool moeswarm_native_await(moeswarm_native_peer & pr, uint64_t id, size_t max_frame, double deadline,
        const std::string & who, int layer, moeswarm_frame & f, moeswarm_native_err & ne, size_t & bytes_in) {
    std::string err;
    bool timed_out = false;
    for (;;) {
        if (!moeswarm_tls_recv_frame(pr.conn, pr.rx, max_frame, deadline, err, &timed_out)) {
            moeswarm_native_transport_err(ne, timed_out, "waiting for " + who + "'s result: " + err);
            return false;
        }
        bytes_in += 4 + pr.rx.size();
        moeswarm_error fe;
        if (!moeswarm_frame_decode(pr.rx.data(), pr.rx.size(), 0, &f, &fe)) {
            ne.code = fe.code;
            ne.msg  = std::string("a bad frame from ") + who + ": " + fe.msg;
            return false;
        }
        if (f.type == MOESWARM_FRAME_ERROR && (!f.has_id || f.id == id)) {
            moeswarm_native_error_frame(ne, f, "the dispatch");
            return false;
        }
        if (f.type == MOESWARM_FRAME_DRAIN) {
            ne.code = "MOESWARM_TRANSPORT_DRAINING";
            ne.msg  = who + " is draining";
            return false;
        }
        if (f.type == MOESWARM_FRAME_RESULT && f.id == id) {
            moeswarm_trace_hop("plugin.native.recv", layer);
            return true;
        }
        // a pong, or a late answer to a split given up on
    }
}

void moeswarm_native_failed(moeswarm_native & nv, moeswarm_native_peer & pr, const std::string & worker,
        const moeswarm_pattern & p, const moeswarm_native_err & ne) {
    moeswarm_tls_close(pr.conn);
    pr.backoff_ms  = pr.backoff_ms == 0 ? MOESWARM_NATIVE_BACKOFF_MIN_MS :
                                          std::min(pr.backoff_ms * 2, MOESWARM_NATIVE_BACKOFF_MAX_MS);
    pr.retry_at_us = moeswarm_now_us() + pr.backoff_ms * 1000.0;
    if (nv.failures.size() < MOESWARM_NATIVE_FAILURES_MAX) {
        nv.failures.push_back({ worker, ne.code, ne.msg });
    }
    GGML_LOG_WARN("moeswarm: layer %d: the native split to worker %s failed (%s: %s); this split goes through the "
                  "bridge, and the worker gets no native split for %.0f s\n",
            p.layer, worker.c_str(), ne.code.c_str(), ne.msg.c_str(), pr.backoff_ms / 1000.0);
}

moeswarm_native_outcome moeswarm_native_split(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    if (!nv.on) {
        return MOESWARM_NATIVE_SKIP;
    }
    auto it = nv.table.layers.find(p.layer);
    if (it == nv.table.layers.end() || it->second.empty()) {
        return MOESWARM_NATIVE_SKIP;
    }
    if (it->second.front().lo >= 0) {
        return moeswarm_native_split_ranges(ctx, cfg, p, it->second, bytes_out, bytes_in);
    }
    const moeswarm_native_entry & e = it->second.front();
    moeswarm_native_peer & pr       = nv.peers[e.worker];
    const double t0                 = moeswarm_now_us();
    if (t0 < pr.retry_at_us) {
        return MOESWARM_NATIVE_SKIP;
    }
    // a new link needs a live ticket; the bridge renews them before exp and pushes a new table
    if (pr.conn.fd < 0 && (double) e.exp_ms <= moeswarm_wall_ms() + 1000.0) {
        return MOESWARM_NATIVE_SKIP;
    }
    const double deadline = t0 + std::min<double>(nv.table.deadline_ms, cfg.timeout_ms) * 1000.0;
    moeswarm_native_err ne;
    double worker_ms = -1;
    const std::string worker = e.worker; // e may not outlive a failure's bookkeeping
    const bool reused        = pr.conn.fd >= 0;
    bool ok = (reused || moeswarm_native_connect(pr, nv.table, e, deadline, ne)) &&
            moeswarm_native_exchange(ctx, pr, cfg, p, deadline, ne, worker_ms, bytes_out, bytes_in);
    if (!ok && reused && ne.code == "MOESWARM_TRANSPORT_CLOSED") {
        // the worker closed an idle link (10 minutes) or restarted: one fresh link, same deadline
        moeswarm_tls_close(pr.conn);
        bytes_out = bytes_in = 0;
        ok = moeswarm_native_connect(pr, nv.table, e, deadline, ne) &&
                moeswarm_native_exchange(ctx, pr, cfg, p, deadline, ne, worker_ms, bytes_out, bytes_in);
    }
    const double us = moeswarm_now_us() - t0;
    moeswarm_stats_native(ok, us, worker_ms, ne.code);
    if (!ok) {
        moeswarm_native_failed(nv, pr, worker, p, ne);
        bytes_out = bytes_in = 0; // the bridge's round trip counts its own
        return MOESWARM_NATIVE_FAILED;
    }
    pr.backoff_ms = 0;
    uint64_t filled = 0;
    for (int32_t id : ctx->ids) {
        filled += id != -1;
    }
    moeswarm_native_count & c = nv.counts[{ worker, p.layer }];
    c.splits++;
    c.tokens += (uint64_t) p.n_tokens;
    c.expert_tokens += filled;
    return MOESWARM_NATIVE_OK;
}

void moeswarm_native_close_all(moeswarm_native & nv) {
    for (auto & [worker, peer] : nv.peers) {
        moeswarm_tls_close(peer.conn);
    }
}
