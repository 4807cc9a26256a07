// The native plane's frames on the bridge socket (docs/protocol.md, the plugin socket's frames):
// native-hello out when a connection opens, native-table in (pushed whenever the bridge's placement,
// tickets or backoffs change), native-receipts out at most once a second. Nothing here waits: the
// bridge path's deadline and latency stay what they were.

#include "moeswarm-plugin.h"
#include "moeswarm-msgpack.h"

#include <string.h>
#include <unistd.h>

#include <algorithm>

static bool moeswarm_mp_str_eq(const moeswarm_mp_value & v, const char * s) {
    return v.type == MOESWARM_MP_STR && v.n == strlen(s) && memcmp(v.ptr, s, v.n) == 0;
}

static std::string moeswarm_mp_string(const moeswarm_mp_value & v) {
    return std::string((const char *) v.ptr, v.n);
}

// `experts`: [lo, hi], a half-open range of expert ids, lo < hi (v: the array's header, read)
static bool moeswarm_native_parse_range(moeswarm_mp_reader & r, const moeswarm_mp_value & v, moeswarm_native_entry & e) {
    moeswarm_mp_value lo, hi;
    if (v.type != MOESWARM_MP_ARRAY || v.n != 2 || !moeswarm_mp_read(&r, &lo) || !moeswarm_mp_read(&r, &hi) ||
            lo.type != MOESWARM_MP_UINT || hi.type != MOESWARM_MP_UINT || lo.u >= hi.u || hi.u > INT32_MAX) {
        return false;
    }
    e.lo = (int64_t) lo.u;
    e.hi = (int64_t) hi.u;
    return true;
}

// a string field of a target (worker, addr, fp, ticket): non-empty, at most 8 KiB
static bool moeswarm_native_target_str(moeswarm_native_target & t, const std::string & key, const moeswarm_mp_value & v) {
    if (v.type != MOESWARM_MP_STR || v.n == 0 || v.n > 8192) return false;
    std::string & dst = key == "worker" ? t.worker : key == "addr" ? t.addr : key == "fp" ? t.fp : t.ticket;
    dst = moeswarm_mp_string(v);
    return true;
}

// a fingerprint is 32 hex pairs joined by ':'
static bool moeswarm_native_target_ok(const moeswarm_native_target & t) {
    return !t.worker.empty() && !t.addr.empty() && t.fp.size() == 95 && !t.ticket.empty() && t.exp_ms > 0;
}

// `alt`: {worker, addr, fp, ticket, exp} (other keys skipped; v: the map's header, read)
static bool moeswarm_native_parse_alt(moeswarm_mp_reader & r, const moeswarm_mp_value & v, moeswarm_native_target & t) {
    if (v.type != MOESWARM_MP_MAP) return false;
    for (uint32_t i = 0; i < v.n; ++i) {
        moeswarm_mp_value k, x;
        if (!moeswarm_mp_read(&r, &k) || k.type != MOESWARM_MP_STR) return false;
        const std::string key((const char *) k.ptr, k.n);
        if (key != "worker" && key != "addr" && key != "fp" && key != "ticket" && key != "exp") {
            if (!moeswarm_mp_skip(&r, 8)) return false;
            continue;
        }
        if (!moeswarm_mp_read(&r, &x)) return false;
        if (key == "exp") {
            if (x.type != MOESWARM_MP_UINT) return false;
            t.exp_ms = x.u;
        } else if (!moeswarm_native_target_str(t, key, x)) {
            return false;
        }
    }
    return moeswarm_native_target_ok(t);
}

// one entry of `layers`: a map with layer, worker, addr, fp, ticket, exp and optionally experts
// (other keys skipped)
static bool moeswarm_native_parse_entry(moeswarm_mp_reader & r, int & layer, moeswarm_native_entry & e) {
    moeswarm_mp_value m;
    if (!moeswarm_mp_read(&r, &m) || m.type != MOESWARM_MP_MAP) {
        return false;
    }
    layer = -1;
    for (uint32_t i = 0; i < m.n; ++i) {
        moeswarm_mp_value k, v;
        if (!moeswarm_mp_read(&r, &k) || k.type != MOESWARM_MP_STR) return false;
        const std::string key((const char *) k.ptr, k.n);
        const bool known = key == "layer" || key == "worker" || key == "addr" || key == "fp" || key == "ticket" ||
                key == "exp" || key == "experts" || key == "alt";
        if (!known) {
            if (!moeswarm_mp_skip(&r, 8)) return false;
            continue;
        }
        if (!moeswarm_mp_read(&r, &v)) return false;
        if (key == "experts") {
            if (!moeswarm_native_parse_range(r, v, e)) return false;
            continue;
        }
        if (key == "alt") {
            if (!moeswarm_native_parse_alt(r, v, e.alt)) return false;
            e.has_alt = true;
            continue;
        }
        if (key == "layer" || key == "exp") {
            if (v.type != MOESWARM_MP_UINT) return false;
            if (key == "layer") {
                if (v.u >= MOESWARM_MAX_LAYERS) return false;
                layer = (int) v.u;
            } else {
                e.exp_ms = v.u;
            }
            continue;
        }
        if (!moeswarm_native_target_str(e, key, v)) return false;
    }
    // an alt is another worker
    return layer >= 0 && moeswarm_native_target_ok(e) && (!e.has_alt || e.alt.worker != e.worker);
}

// a layer's entries: one without a range (the whole layer), or disjoint ranges of distinct workers
// (sorted here by lo); an alt is no entry's worker and no other entry's alt (a link carries one
// exchange at a time)
static bool moeswarm_native_ranges_ok(std::vector<moeswarm_native_entry> & entries) {
    for (size_t i = 0; i < entries.size(); ++i) {
        for (size_t j = 0; j < entries.size() && entries[i].has_alt; ++j) {
            if (entries[j].worker == entries[i].alt.worker ||
                    (j != i && entries[j].has_alt && entries[j].alt.worker == entries[i].alt.worker)) {
                return false;
            }
        }
    }
    if (entries.size() == 1) {
        return true;
    }
    for (size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].lo < 0) {
            return false;
        }
        // one dispatch per worker and split: a worker's experts of a layer are one range
        for (size_t j = 0; j < i; ++j) {
            if (entries[j].worker == entries[i].worker) return false;
        }
    }
    std::sort(entries.begin(), entries.end(),
            [](const moeswarm_native_entry & a, const moeswarm_native_entry & b) { return a.lo < b.lo; });
    for (size_t i = 1; i < entries.size(); ++i) {
        if (entries[i].lo < entries[i - 1].hi) {
            return false;
        }
    }
    return true;
}

// the adaptive hedge (`hedgeFactor` with `hedgeMinMs`, both or neither), or false with err
static bool moeswarm_native_parse_adaptive(const uint8_t * data, size_t size, moeswarm_native_table & t, std::string & err) {
    moeswarm_mp_value f, m;
    const bool has_f = moeswarm_mp_map_find(data, size, "hedgeFactor", &f, nullptr);
    const bool has_m = moeswarm_mp_map_find(data, size, "hedgeMinMs", &m, nullptr);
    if (!has_f && !has_m) {
        return true;
    }
    const double factor = !has_f ? 0 : f.type == MOESWARM_MP_FLOAT ? f.f : f.type == MOESWARM_MP_UINT ? (double) f.u : 0;
    if (!has_f || !has_m || !(factor >= 1 && factor <= 100) || m.type != MOESWARM_MP_UINT || m.u == 0 ||
            m.u > 86400000 || t.hedge_ms > 0) {
        err = "hedgeFactor (1..100) and hedgeMinMs (1..86400000) go together, and not with hedgeMs";
        return false;
    }
    t.hedge_factor = factor;
    t.hedge_min_ms = (uint32_t) m.u;
    return true;
}

// a whole native-table, or false (then the plane is off until a good one comes: doubt means bridge)
static bool moeswarm_native_parse_table(const uint8_t * data, size_t size, moeswarm_native_table & t, std::string & err) {
    moeswarm_mp_value v;
    if (!moeswarm_mp_map_find(data, size, "v", &v, nullptr) || v.type != MOESWARM_MP_UINT || v.u != 1) {
        err = "no v 1";
        return false;
    }
    if (!moeswarm_mp_map_find(data, size, "seq", &v, nullptr) || v.type != MOESWARM_MP_UINT) {
        err = "no seq";
        return false;
    }
    t.seq = v.u;
    if (!moeswarm_mp_map_find(data, size, "backbone", &v, nullptr) || v.type != MOESWARM_MP_STR || v.n == 0 || v.n > 128) {
        err = "no backbone id";
        return false;
    }
    t.backbone = moeswarm_mp_string(v);
    if (!moeswarm_mp_map_find(data, size, "deadlineMs", &v, nullptr) || v.type != MOESWARM_MP_UINT || v.u == 0 ||
            v.u > 86400000) {
        err = "no deadlineMs in 1..86400000";
        return false;
    }
    t.deadline_ms = (uint32_t) v.u;
    if (moeswarm_mp_map_find(data, size, "hedgeMs", &v, nullptr)) {
        if (v.type != MOESWARM_MP_UINT || v.u == 0 || v.u > 86400000) {
            err = "hedgeMs not in 1..86400000";
            return false;
        }
        t.hedge_ms = (uint32_t) v.u;
    }
    if (!moeswarm_native_parse_adaptive(data, size, t, err)) {
        return false;
    }
    size_t pos    = 0;
    if (!moeswarm_mp_map_find(data, size, "layers", &v, &pos) || v.type != MOESWARM_MP_ARRAY) {
        err = "no layers array";
        return false;
    }
    moeswarm_mp_reader r;
    moeswarm_mp_reader_init(&r, data, size);
    r.pos = pos;
    moeswarm_mp_read(&r, &v); // the array's header again, found above
    for (uint32_t i = 0; i < v.n; ++i) {
        int layer = -1;
        moeswarm_native_entry e;
        if (!moeswarm_native_parse_entry(r, layer, e)) {
            err = "layers[" + std::to_string(i) + "] is not {layer, worker, addr, fp, ticket, exp[, experts: [lo, hi]]}";
            return false;
        }
        t.layers[layer].push_back(std::move(e));
    }
    for (auto & [layer, entries] : t.layers) {
        if (!moeswarm_native_ranges_ok(entries)) {
            err = "layer " + std::to_string(layer) +
                    " has several entries that are not disjoint `experts` ranges, or one without a range among others";
            return false;
        }
    }
    return true;
}

// links whose worker left the table, or moved (address, certificate), are closed; backoffs stay
static void moeswarm_native_apply(moeswarm_native & nv, moeswarm_native_table && t) {
    for (auto & [worker, peer] : nv.peers) {
        bool keep = false;
        for (const auto & [layer, entries] : t.layers) {
            for (const moeswarm_native_entry & e : entries) {
                keep = keep || (e.worker == worker && e.addr == peer.addr && e.fp == peer.fp) ||
                        (e.has_alt && e.alt.worker == worker && e.alt.addr == peer.addr && e.alt.fp == peer.fp);
            }
        }
        if (!keep) {
            moeswarm_tls_close(peer.conn);
        }
    }
    nv.table = std::move(t);
}

// a bridge older than the native plane answers native-hello with a connection-level error (no id)
// MOESWARM_PROTOCOL_UNKNOWN_TYPE: that is its "no", not a failure of the split waiting then
static bool moeswarm_native_refused(moeswarm_native & nv, const uint8_t * payload, size_t size) {
    moeswarm_mp_value v;
    if (!nv.on || nv.table_seen || !moeswarm_mp_map_find(payload, size, "t", &v, nullptr) ||
            !moeswarm_mp_str_eq(v, "error") || moeswarm_mp_map_find(payload, size, "id", &v, nullptr) ||
            !moeswarm_mp_map_find(payload, size, "code", &v, nullptr) ||
            !moeswarm_mp_str_eq(v, "MOESWARM_PROTOCOL_UNKNOWN_TYPE")) {
        return false;
    }
    nv.on = false;
    GGML_LOG_INFO("moeswarm: the bridge has no native data plane (an older moeswarm-dispatcher?): every split goes "
                  "through it\n");
    return true;
}

bool moeswarm_native_on_frame(moeswarm_backend_context * ctx, const uint8_t * payload, size_t size) {
    moeswarm_native & nv = ctx->native;
    if (moeswarm_native_refused(nv, payload, size)) {
        return true;
    }
    moeswarm_mp_value t;
    if (!moeswarm_mp_map_find(payload, size, "t", &t, nullptr) || t.type != MOESWARM_MP_STR || t.n < 7 ||
            memcmp(t.ptr, "native-", 7) != 0) {
        return false;
    }
    if (!moeswarm_mp_str_eq(t, "native-table")) {
        return true; // a native frame of a later version: not ours to read
    }
    moeswarm_native_table table;
    std::string err;
    if (!moeswarm_native_parse_table(payload, size, table, err)) {
        GGML_LOG_WARN("moeswarm: a native-table from the bridge is malformed (%s); every split goes through the bridge "
                      "until a good one comes\n",
                err.c_str());
        moeswarm_native_apply(nv, moeswarm_native_table());
        return true;
    }
    if (!nv.on || (nv.table_seen && table.seq <= nv.table.seq)) {
        return true; // not asked for on this connection, or an older one overtaken
    }
    nv.table_seen = true;
    moeswarm_native_apply(nv, std::move(table));
    return true;
}

void moeswarm_native_on_connect(moeswarm_backend_context * ctx, const moeswarm_config & cfg) {
    moeswarm_native & nv = ctx->native;
    // a table belongs to the connection it came on (a restarted bridge pushes its own)
    moeswarm_native_apply(nv, moeswarm_native_table());
    nv.on         = false;
    nv.table_seen = false;
    if (!cfg.native) {
        return;
    }
    std::string why;
    if (!moeswarm_tls_available(why)) {
        static bool logged = false;
        if (!logged) {
            logged = true;
            GGML_LOG_INFO("moeswarm: no native data plane (%s): every split goes through the bridge\n", why.c_str());
        }
        return;
    }
    moeswarm_mp_writer w;
    w.buf.resize(4);
    moeswarm_mp_write_map(&w, 3);
    moeswarm_mp_write_cstr(&w, "v");
    moeswarm_mp_write_uint(&w, 1);
    moeswarm_mp_write_cstr(&w, "t");
    moeswarm_mp_write_cstr(&w, "native-hello");
    moeswarm_mp_write_cstr(&w, "pid");
    moeswarm_mp_write_uint(&w, (uint64_t) getpid());
    moeswarm_frame_prefix(w.buf);
    // a fresh socket takes 20 bytes at once; if not, the bridge path is all there is anyway
    nv.on = moeswarm_send_nowait(ctx->conn, w.buf.data(), w.buf.size());
}

void moeswarm_native_drain(moeswarm_backend_context * ctx) {
    moeswarm_conn & c = ctx->conn;
    if (c.fd < 0 || !ctx->native.on) {
        return;
    }
    std::string err;
    if (!moeswarm_conn_fill(c, err)) {
        moeswarm_conn_close(c); // the bridge path reopens it (and says hello again)
        moeswarm_native_apply(ctx->native, moeswarm_native_table());
        return;
    }
    // whole frames only; a partial one stays for the round trip (or the next drain) to finish
    while (c.in.size() - c.in_pos >= 4) {
        const uint8_t * h = c.in.data() + c.in_pos;
        const uint32_t n  = h[0] | (h[1] << 8) | (h[2] << 16) | ((uint32_t) h[3] << 24);
        if (c.in.size() - c.in_pos - 4 < n) {
            break;
        }
        // anything else complete here is a ping or a late answer to a request given up on
        moeswarm_native_on_frame(ctx, h + 4, n);
        c.in_pos += 4 + (size_t) n;
    }
}

void moeswarm_native_note_routed(moeswarm_native & nv, int layer, const std::vector<int32_t> & ids) {
    std::map<int32_t, uint64_t> & by_expert = nv.routed[layer];
    for (int32_t id : ids) {
        if (id >= 0) {
            by_expert[id]++;
        }
    }
}

// `routing`: per layer, the experts its native splits chose and how often
static void moeswarm_write_routed(const moeswarm_native & nv, moeswarm_mp_writer & w) {
    moeswarm_mp_write_cstr(&w, "routing");
    moeswarm_mp_write_array(&w, (uint32_t) nv.routed.size());
    for (const auto & [layer, by_expert] : nv.routed) {
        moeswarm_mp_write_map(&w, 3);
        moeswarm_mp_write_cstr(&w, "layer");
        moeswarm_mp_write_uint(&w, (uint64_t) layer);
        moeswarm_mp_write_cstr(&w, "experts");
        moeswarm_mp_write_array(&w, (uint32_t) by_expert.size());
        for (const auto & e : by_expert) {
            moeswarm_mp_write_uint(&w, (uint64_t) e.first);
        }
        moeswarm_mp_write_cstr(&w, "counts");
        moeswarm_mp_write_array(&w, (uint32_t) by_expert.size());
        for (const auto & e : by_expert) {
            moeswarm_mp_write_uint(&w, e.second);
        }
    }
}

static void moeswarm_write_receipts(moeswarm_native & nv, moeswarm_mp_writer & w) {
    w.buf.resize(4);
    const bool hedged = nv.hedges > 0;
    moeswarm_mp_write_map(&w, (nv.split_layers.empty() ? 5 : 6) + (hedged ? 2 : 0) + (nv.routed.empty() ? 0 : 1));
    moeswarm_mp_write_cstr(&w, "v");
    moeswarm_mp_write_uint(&w, 1);
    moeswarm_mp_write_cstr(&w, "t");
    moeswarm_mp_write_cstr(&w, "native-receipts");
    moeswarm_mp_write_cstr(&w, "seq");
    moeswarm_mp_write_uint(&w, nv.receipts_seq + 1);
    moeswarm_mp_write_cstr(&w, "counts");
    moeswarm_mp_write_array(&w, (uint32_t) nv.counts.size());
    for (const auto & [key, c] : nv.counts) {
        moeswarm_mp_write_map(&w, 5);
        moeswarm_mp_write_cstr(&w, "worker");
        moeswarm_mp_write_str(&w, key.first.data(), key.first.size());
        moeswarm_mp_write_cstr(&w, "layer");
        moeswarm_mp_write_uint(&w, (uint64_t) key.second);
        moeswarm_mp_write_cstr(&w, "splits");
        moeswarm_mp_write_uint(&w, c.splits);
        moeswarm_mp_write_cstr(&w, "tokens");
        moeswarm_mp_write_uint(&w, c.tokens);
        moeswarm_mp_write_cstr(&w, "expertTokens");
        moeswarm_mp_write_uint(&w, c.expert_tokens);
    }
    if (!nv.split_layers.empty()) {
        // a split layer's tokens once per split: the owners' counts above each have their own
        moeswarm_mp_write_cstr(&w, "layers");
        moeswarm_mp_write_array(&w, (uint32_t) nv.split_layers.size());
        for (const auto & [layer, c] : nv.split_layers) {
            moeswarm_mp_write_map(&w, 3);
            moeswarm_mp_write_cstr(&w, "layer");
            moeswarm_mp_write_uint(&w, (uint64_t) layer);
            moeswarm_mp_write_cstr(&w, "splits");
            moeswarm_mp_write_uint(&w, c.splits);
            moeswarm_mp_write_cstr(&w, "tokens");
            moeswarm_mp_write_uint(&w, c.tokens);
        }
    }
    if (!nv.routed.empty()) {
        moeswarm_write_routed(nv, w);
    }
    if (hedged) {
        moeswarm_mp_write_cstr(&w, "hedges");
        moeswarm_mp_write_uint(&w, nv.hedges);
        moeswarm_mp_write_cstr(&w, "hedgeWins");
        moeswarm_mp_write_uint(&w, nv.hedge_wins);
    }
    moeswarm_mp_write_cstr(&w, "failures");
    moeswarm_mp_write_array(&w, (uint32_t) nv.failures.size());
    for (const moeswarm_native_failure & f : nv.failures) {
        moeswarm_mp_write_map(&w, f.failover ? 4 : 3);
        if (f.failover) {
            moeswarm_mp_write_cstr(&w, "failover");
            moeswarm_mp_write_bool(&w, true);
        }
        moeswarm_mp_write_cstr(&w, "worker");
        moeswarm_mp_write_str(&w, f.worker.data(), f.worker.size());
        moeswarm_mp_write_cstr(&w, "code");
        moeswarm_mp_write_str(&w, f.code.data(), f.code.size());
        moeswarm_mp_write_cstr(&w, "msg");
        // a message is ours (ASCII) or the worker's error text, which its decoder checked as UTF-8:
        // cut at a character boundary, or the bridge drops the whole receipt as malformed
        size_t n = std::min<size_t>(f.msg.size(), 1024);
        while (n < f.msg.size() && n > 0 && ((uint8_t) f.msg[n] & 0xc0) == 0x80) {
            --n;
        }
        moeswarm_mp_write_str(&w, f.msg.data(), n);
    }
    moeswarm_frame_prefix(w.buf);
}

void moeswarm_native_receipts(moeswarm_backend_context * ctx, bool force) {
    moeswarm_native & nv = ctx->native;
    if (nv.counts.empty() && nv.failures.empty()) {
        return;
    }
    const double now = moeswarm_now_us();
    if (!force && nv.last_receipt_us != 0 && now - nv.last_receipt_us < 1e6) {
        return;
    }
    if (ctx->conn.fd < 0) {
        return; // kept: the next connection carries them
    }
    moeswarm_mp_writer w;
    moeswarm_write_receipts(nv, w);
    const bool sent = moeswarm_send_nowait(ctx->conn, w.buf.data(), w.buf.size());
    moeswarm_stats_receipts(sent);
    if (!sent) {
        return; // kept whole for the next try: the counts are credits, not to be lost to a full socket
    }
    nv.receipts_seq++;
    nv.last_receipt_us = now;
    nv.counts.clear();
    nv.split_layers.clear();
    nv.routed.clear();
    nv.failures.clear();
    nv.hedges = nv.hedge_wins = 0;
}
