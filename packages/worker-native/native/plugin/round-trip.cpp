// A split's frames and today's path: the dispatch frame (the same bytes for the bridge and for a
// native link), the check of a result, the one writer of out, and the round trip through the bridge.

#include "moeswarm-plugin.h"
#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-trace.h"

#include <string.h>

#include <algorithm>
#include <cmath>

void moeswarm_build_dispatch(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        uint32_t id) {
    moeswarm_dispatch_desc d;
    d.id    = id;
    d.model = cfg.model.c_str();
    d.layer = (uint32_t) p.layer;
    // weighted input (llama4): one row per (token, slot), each with its one slot of weight 1
    const int64_t rows_per_token = p.weighted_input ? p.k : 1;
    d.n       = (uint32_t) (p.n_tokens * rows_per_token);
    d.embd    = (uint32_t) p.n_embd;
    d.x       = ctx->x.data();
    d.k       = (uint32_t) (p.k / rows_per_token);
    d.ids     = ctx->ids.data();
    d.weights = ctx->w.data();
    d.mode    = MOESWARM_MODE_SUM;
    d.compact = false;
    moeswarm_write_prefixed_dispatch(ctx->tx, d);
}

uint32_t moeswarm_next_id(uint32_t & next) {
    const uint32_t id = next;
    next              = next == 0xffffffffu ? 1 : next + 1; // 0 is never an id
    return id;
}

void moeswarm_write_prefixed_dispatch(moeswarm_mp_writer & tx, const moeswarm_dispatch_desc & d) {
    tx.buf.assign(4, 0);
    moeswarm_frame_write_dispatch(&tx, &d);
    moeswarm_frame_prefix(tx.buf);
}

bool moeswarm_check_result(const moeswarm_frame & f, const moeswarm_pattern & p, bool check_finite, std::string & err) {
    const int64_t n_rows = p.n_tokens * (p.weighted_input ? p.k : 1);
    const size_t want    = (size_t) n_rows * p.n_embd;
    if (f.mode != MOESWARM_MODE_SUM || f.n != n_rows || f.embd != p.n_embd || f.y.len != want * 4) {
        err = "the result has the wrong shape";
        return false;
    }
    return !check_finite || moeswarm_all_finite(f.y.ptr, want, err);
}

bool moeswarm_all_finite(const uint8_t * y, size_t n, std::string & err) {
    for (size_t i = 0; i < n; ++i) {
        float v;
        memcpy(&v, y + i * 4, 4);
        if (!std::isfinite(v)) {
            err = "the result holds a non-finite value (y[" + std::to_string(i) + "])";
            return false;
        }
    }
    return true;
}

// llama4's k per-slot rows of each token added in slot order into out, as llama.cpp adds the k
// views of ffn_moe_down (((y0 + y1) + y2) ...)
static void moeswarm_sum_rows(const uint8_t * y, int64_t rows_per_token, const moeswarm_pattern & p) {
    ggml_tensor * out = p.out;
    for (int64_t t = 0; t < p.n_tokens; ++t) {
        for (int64_t e = 0; e < p.n_embd; ++e) {
            float acc;
            memcpy(&acc, y + ((t * rows_per_token) * p.n_embd + e) * 4, 4);
            for (int64_t r = 1; r < rows_per_token; ++r) {
                float v;
                memcpy(&v, y + ((t * rows_per_token + r) * p.n_embd + e) * 4, 4);
                acc = acc + v;
            }
            memcpy((char *) out->data + t * out->nb[1] + e * out->nb[0], &acc, 4);
        }
    }
}

void moeswarm_write_out(const uint8_t * y, const moeswarm_pattern & p) {
    ggml_tensor * out = p.out;
    if (p.weighted_input) {
        moeswarm_sum_rows(y, p.k, p);
    } else if (out->nb[0] == 4 && out->nb[1] == (size_t) p.n_embd * 4) {
        memcpy(out->data, y, (size_t) p.n_tokens * p.n_embd * 4);
    } else {
        for (int64_t t = 0; t < p.n_tokens; ++t) {
            for (int64_t e = 0; e < p.n_embd; ++e) {
                memcpy((char *) out->data + t * out->nb[1] + e * out->nb[0], y + (t * p.n_embd + e) * 4, 4);
            }
        }
    }
}

// one round trip: the dispatch frame out, its result (or error) back into out. *lost is set when
// the connection itself failed (not an error frame, not the deadline): worth one more try on a
// fresh connection, since the compute is a pure function of the frame.
static bool moeswarm_round_trip(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        double deadline, std::string & err, size_t & bytes_out, size_t & bytes_in, bool * lost) {
    moeswarm_conn & c = ctx->conn;
    *lost             = false;
    if (c.fd < 0) {
        if (!moeswarm_conn_open(c, cfg.bridge, err)) {
            return false;
        }
        moeswarm_native_on_connect(ctx, cfg);
    }
    // every transport failure below closes the connection; it counts as lost unless the deadline did it
    struct lost_on_close {
        moeswarm_conn & c;
        double deadline;
        bool * lost;
        ~lost_on_close() { *lost = c.fd < 0 && moeswarm_now_us() < deadline; }
    } classify{ c, deadline, lost };
    const uint32_t id = moeswarm_next_id(c.next_id);
    moeswarm_build_dispatch(ctx, cfg, p, id);
    bytes_out = ctx->tx.buf.size();
    moeswarm_trace_hop("plugin.send", p.layer);
    if (!moeswarm_send_all(c, ctx->tx.buf.data(), ctx->tx.buf.size(), deadline, err)) {
        moeswarm_conn_close(c);
        return false;
    }
    const size_t want = (size_t) p.n_tokens * (p.weighted_input ? p.k : 1) * p.n_embd;
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
        if (moeswarm_native_on_frame(ctx, c.rx.data(), n)) {
            continue; // a native-table pushed while this split waits
        }
        moeswarm_frame f;
        moeswarm_error ferr;
        if (!moeswarm_frame_decode(c.rx.data(), n, 0, &f, &ferr)) {
            err = std::string("bad frame from the bridge: ") + ferr.code + ": " + ferr.msg;
            moeswarm_conn_close(c);
            return false;
        }
        if (f.type == MOESWARM_FRAME_ERROR && (!f.has_id || f.id == id)) {
            err = std::string(f.code.present ? std::string((const char *) f.code.ptr, f.code.len) : "error") + ": " +
                    std::string((const char *) f.msg.ptr, f.msg.len);
            if (!f.has_id) {
                moeswarm_conn_close(c);
            }
            return false;
        }
        if (f.type != MOESWARM_FRAME_RESULT || f.id != id) {
            continue; // pings, or a late answer to a request given up on
        }
        // the bridge's answer is trusted as before (it verified and combined it): shape only
        if (!moeswarm_check_result(f, p, false, err)) {
            err = "the bridge's result has the wrong shape";
            moeswarm_conn_close(c);
            return false;
        }
        moeswarm_trace_hop("plugin.recv", p.layer);
        moeswarm_write_out(f.y.ptr, p);
        return true;
    }
}

bool moeswarm_bridge_split(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        std::string & err, size_t & bytes_out, size_t & bytes_in) {
    const double deadline = moeswarm_now_us() + cfg.timeout_ms * 1000.0;
    const bool reused     = ctx->conn.fd >= 0;
    bool lost             = false;
    bool ok               = moeswarm_round_trip(ctx, cfg, p, deadline, err, bytes_out, bytes_in, &lost);
    if (!ok && lost && reused) {
        // the dispatcher restarted (or the socket broke) since this backend's last split: one more
        // try on a fresh connection, within the same deadline
        GGML_LOG_WARN("%s: layer %d: %s; reconnecting to %s once\n", __func__, p.layer, err.c_str(), cfg.bridge.c_str());
        err.clear();
        bytes_out = bytes_in = 0;
        ok = moeswarm_round_trip(ctx, cfg, p, deadline, err, bytes_out, bytes_in, &lost);
    }
    return ok;
}
