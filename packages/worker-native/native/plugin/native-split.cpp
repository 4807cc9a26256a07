// A native split over several workers (issue #15, phase 2): a layer whose native-table entries carry
// disjoint `experts` ranges. Each owner with a filled slot gets one dispatch in mode "each" (compact):
// the rows of the tokens that have a slot of its own, the other owners' ids masked to -1. All are
// sent before any answer is read, so the owners compute in parallel; the answers are combined here
// with moeswarm_combine_sum, the compute core's sum (llama.cpp's mul and add nodes, bit for bit, no
// FMA). Any owner's failure fails the whole native split: the links still mid-exchange are closed
// (a late answer must never be read as the next split's), the failing worker backs off, and the split
// goes through the bridge, which computes the same bits. Phase 3: an entry with an `alt` (a replica
// of its range) fails over: when its owner fails by its own or its link's fault, that owner's
// dispatch alone goes to the alt natively (the other owners' are not sent again), and only the
// alt's failure fails the split; an owner backing off is replaced by its alt from the start.

#include "moeswarm-combine.h"
#include "moeswarm-plugin.h"
#include "moeswarm-frame.h"
#include "moeswarm-trace.h"

#include <string.h>

#include <algorithm>
#include <cmath>

// one owner of a split: its entry, the worker asked (the entry's, or its alt) and link, and what this
// split sent it
struct moeswarm_split_owner {
    const moeswarm_native_entry * e  = nullptr;
    const moeswarm_native_target * t = nullptr; // e itself, or &e->alt after a failover
    moeswarm_native_peer * pr        = nullptr;
    int32_t index                   = 0;     // in the layer's entries: slot_owner's value
    std::vector<int64_t> rows;               // the dispatch rows (of ctx->x) it gets
    uint64_t filled = 0, tokens = 0;         // its filled slots; the tokens with one of them
    uint32_t id     = 0;
    bool reused = false, sent = false, done = false, retried = false;
    double ms = -1;
};

// the entry whose range holds expert id, or -1 (entries are sorted by lo)
static int32_t moeswarm_split_owner_of(const std::vector<moeswarm_native_entry> & entries, int32_t id) {
    for (size_t i = 0; i < entries.size(); ++i) {
        if (id >= entries[i].lo && id < entries[i].hi) return (int32_t) i;
    }
    return -1;
}

// every filled slot's owner (-1 for an empty slot) into slot_owner, and the owners with a filled slot;
// false when a filled id is in no entry's range (the table does not cover this split)
static bool moeswarm_split_assign(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        const std::vector<moeswarm_native_entry> & entries, std::vector<int32_t> & slot_owner,
        std::vector<moeswarm_split_owner> & owners) {
    const int64_t rpt = p.weighted_input ? p.k : 1; // dispatch rows per token
    const int64_t kk  = p.k / rpt;                  // slots per dispatch row
    const int64_t R   = p.n_tokens * rpt;
    slot_owner.assign(ctx->ids.size(), -1);
    std::vector<int32_t> slot_of_owner(entries.size(), -1); // index in owners
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t j = 0; j < kk; ++j) {
            const int32_t id = ctx->ids[r * kk + j];
            if (id == -1) continue;
            const int32_t o = moeswarm_split_owner_of(entries, id);
            if (o < 0) return false;
            slot_owner[r * kk + j] = o;
            if (slot_of_owner[o] < 0) {
                slot_of_owner[o] = (int32_t) owners.size();
                owners.emplace_back();
                owners.back().e     = &entries[o];
                owners.back().index = o;
            }
            moeswarm_split_owner & ow = owners[slot_of_owner[o]];
            ow.filled++;
            if (ow.rows.empty() || ow.rows.back() != r) ow.rows.push_back(r);
        }
    }
    for (moeswarm_split_owner & ow : owners) {
        int64_t last_token = -1;
        for (int64_t r : ow.rows) {
            ow.tokens += r / rpt != last_token;
            last_token = r / rpt;
        }
    }
    return !owners.empty();
}

// the owner's dispatch (mode each, compact, no weights) into ctx->tx: its rows, others' ids masked
static void moeswarm_split_build(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        const std::vector<int32_t> & slot_owner, moeswarm_split_owner & ow) {
    const int64_t kk = p.weighted_input ? 1 : p.k;
    const int64_t E  = p.n_embd;
    ctx->sub_x.resize(ow.rows.size() * E);
    ctx->sub_ids.resize(ow.rows.size() * kk);
    for (size_t i = 0; i < ow.rows.size(); ++i) {
        const int64_t r = ow.rows[i];
        memcpy(ctx->sub_x.data() + i * E, ctx->x.data() + r * E, E * sizeof(float));
        for (int64_t j = 0; j < kk; ++j) {
            ctx->sub_ids[i * kk + j] = slot_owner[r * kk + j] == ow.index ? ctx->ids[r * kk + j] : -1;
        }
    }
    ow.id = moeswarm_next_id(ow.pr->next_id);
    moeswarm_dispatch_desc d;
    d.id      = ow.id;
    d.model   = cfg.model.c_str();
    d.layer   = (uint32_t) p.layer;
    d.n       = (uint32_t) ow.rows.size();
    d.embd    = (uint32_t) E;
    d.x       = ctx->sub_x.data();
    d.k       = (uint32_t) kk;
    d.ids     = ctx->sub_ids.data();
    d.weights = nullptr; // mode each ignores them: the combine here applies ctx->w
    d.mode    = MOESWARM_MODE_EACH;
    d.compact = true; // the native listener answers with the filled slots' rows only
    moeswarm_write_prefixed_dispatch(ctx->tx, d);
}

// the owner's dispatch sent on its link (moeswarm_native_send)
static bool moeswarm_split_send(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        const std::vector<int32_t> & slot_owner, moeswarm_split_owner & ow, double deadline, moeswarm_native_err & ne,
        size_t & bytes_out) {
    const bool ok = moeswarm_native_send(ctx, *ow.pr, *ow.t, [&] { moeswarm_split_build(ctx, cfg, p, slot_owner, ow); },
            p.layer, deadline, ow.reused, ow.retried, ne, bytes_out);
    ow.sent       = ow.sent || ok;
    return ok;
}

// a result for the owner's dispatch: mode each, its shape (compact: its filled rows), all finite
static bool moeswarm_split_check(const moeswarm_frame & f, const moeswarm_pattern & p, const moeswarm_split_owner & ow,
        std::string & err) {
    const uint32_t kk = (uint32_t) (p.weighted_input ? 1 : p.k);
    const size_t rows = f.compact ? ow.filled : ow.rows.size() * kk;
    const size_t want = rows * (size_t) p.n_embd;
    if (f.mode != MOESWARM_MODE_EACH || f.n != ow.rows.size() || f.k != kk || f.embd != p.n_embd || f.y.len != want * 4) {
        err = "the result has the wrong shape";
        return false;
    }
    return moeswarm_all_finite(f.y.ptr, want, err);
}

// the owner's rows of a checked result into ctx->y_slots at their slots' places
static void moeswarm_split_scatter(moeswarm_backend_context * ctx, const moeswarm_frame & f, const moeswarm_pattern & p,
        const std::vector<int32_t> & slot_owner, const moeswarm_split_owner & ow) {
    const int64_t kk = p.weighted_input ? 1 : p.k;
    const size_t row = (size_t) p.n_embd * 4;
    size_t next      = 0; // compact: the next row of y
    for (size_t i = 0; i < ow.rows.size(); ++i) {
        for (int64_t j = 0; j < kk; ++j) {
            const int64_t s = ow.rows[i] * kk + j;
            if (slot_owner[s] != ow.index) continue;
            const size_t from = f.compact ? next++ : i * kk + j;
            memcpy(ctx->y_slots.data() + s * p.n_embd, f.y.ptr + from * row, row);
            ctx->slot_row[s] = (int32_t) s;
        }
    }
}

// frames in from the owner until its result, checked and scattered
static bool moeswarm_split_recv(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        const std::vector<int32_t> & slot_owner, moeswarm_split_owner & ow, double deadline, moeswarm_native_err & ne,
        size_t & bytes_in) {
    moeswarm_native_peer & pr = *ow.pr;
    const size_t max_frame    = ow.rows.size() * (size_t) p.k * p.n_embd * 4 + 4096;
    moeswarm_frame f;
    if (!moeswarm_native_await(pr, ow.id, max_frame, deadline, ow.t->worker, p.layer, f, ne, bytes_in)) {
        return false;
    }
    std::string err;
    if (!moeswarm_split_check(f, p, ow, err)) {
        ne.code = "MOESWARM_DISPATCH_BAD_RESULT";
        ne.msg  = err;
        return false;
    }
    ow.ms = moeswarm_native_result_ms(pr.rx.data(), pr.rx.size());
    moeswarm_split_scatter(ctx, f, p, slot_owner, ow);
    ow.done = true;
    return true;
}

// whether a worker may be asked now: not backing off, and a live ticket for a link to open
static bool moeswarm_split_target_ready(const moeswarm_native_peer & pr, const moeswarm_native_target & t, double now_us) {
    if (now_us < pr.retry_at_us) return false;
    return pr.conn.fd >= 0 || (double) t.exp_ms > moeswarm_wall_ms() + 1000.0;
}

// the owner failed with ne: when the failure is its or its link's (not a refusal of our frame),
// time is left and its entry's alt may be asked, the failure is reported as a failover, the worker
// backed off, and the owner's dispatch (its rows only) goes to the alt. true: the alt's dispatch went
// out (ne cleared); false: ne says why the owner, or its alt, failed
static bool moeswarm_split_failover(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const std::vector<int32_t> & slot_owner, moeswarm_split_owner & ow, double deadline,
        moeswarm_native_err & ne, size_t & bytes_out) {
    const moeswarm_native_entry & e = *ow.e;
    const double now                = moeswarm_now_us();
    if (ow.t != &e || !e.has_alt || ne.ours || now >= deadline) return false;
    moeswarm_native_peer & ap = ctx->native.peers[e.alt.worker];
    if (!moeswarm_split_target_ready(ap, e.alt, now)) return false;
    moeswarm_stats_native_failover(ne.code);
    moeswarm_native_failed(ctx->native, *ow.pr, e.worker, p, ne, true);
    ow.t       = &e.alt;
    ow.pr      = &ap;
    ow.reused  = ow.retried = ow.sent = ow.done = false;
    ne         = moeswarm_native_err();
    return moeswarm_split_send(ctx, cfg, p, slot_owner, ow, deadline, ne, bytes_out);
}

// every owner's dispatch out, then every answer in; a reused link found closed while waiting is
// opened again and its dispatch sent once more; an owner that fails otherwise hands its part to its
// entry's alt (once). false: ne and *failed say what and whose
static bool moeswarm_split_exchange(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const std::vector<int32_t> & slot_owner, std::vector<moeswarm_split_owner> & owners,
        double deadline, moeswarm_native_err & ne, size_t * failed, size_t & bytes_out, size_t & bytes_in) {
    for (size_t i = 0; i < owners.size(); ++i) {
        if (!moeswarm_split_send(ctx, cfg, p, slot_owner, owners[i], deadline, ne, bytes_out) &&
                !moeswarm_split_failover(ctx, cfg, p, slot_owner, owners[i], deadline, ne, bytes_out)) {
            *failed = i;
            return false;
        }
    }
    for (size_t i = 0; i < owners.size(); ++i) {
        moeswarm_split_owner & ow = owners[i];
        for (;;) {
            bool ok = moeswarm_split_recv(ctx, p, slot_owner, ow, deadline, ne, bytes_in);
            if (!ok && ow.reused && !ow.retried && ne.code == "MOESWARM_TRANSPORT_CLOSED") {
                moeswarm_tls_close(ow.pr->conn);
                ow.retried = true;
                ok = moeswarm_split_send(ctx, cfg, p, slot_owner, ow, deadline, ne, bytes_out) &&
                        moeswarm_split_recv(ctx, p, slot_owner, ow, deadline, ne, bytes_in);
            }
            if (ok) break;
            if (moeswarm_split_failover(ctx, cfg, p, slot_owner, ow, deadline, ne, bytes_out)) continue;
            *failed = i;
            return false;
        }
    }
    return true;
}

// whether every owner may be asked now (not backing off, a live ticket for a link to open), or else
// its entry's alt, which then takes its part from the start
static bool moeswarm_split_ready(moeswarm_native & nv, std::vector<moeswarm_split_owner> & owners, double now_us) {
    for (moeswarm_split_owner & ow : owners) {
        ow.t  = ow.e;
        ow.pr = &nv.peers[ow.e->worker];
        if (moeswarm_split_target_ready(*ow.pr, *ow.e, now_us)) continue;
        if (!ow.e->has_alt) return false;
        moeswarm_native_peer & ap = nv.peers[ow.e->alt.worker];
        if (!moeswarm_split_target_ready(ap, ow.e->alt, now_us)) return false;
        ow.t  = &ow.e->alt;
        ow.pr = &ap;
    }
    return true;
}

moeswarm_native_outcome moeswarm_native_split_ranges(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const std::vector<moeswarm_native_entry> & entries, size_t & bytes_out,
        size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    std::vector<int32_t> slot_owner;
    std::vector<moeswarm_split_owner> owners;
    const double t0 = moeswarm_now_us();
    // an id no range holds, or a worker backing off: the bridge's split, not a failure
    if (!moeswarm_split_assign(ctx, p, entries, slot_owner, owners) || !moeswarm_split_ready(nv, owners, t0)) {
        return MOESWARM_NATIVE_SKIP;
    }
    const double deadline = t0 + std::min<double>(nv.table.deadline_ms, cfg.timeout_ms) * 1000.0;
    const size_t n_slots  = ctx->ids.size();
    ctx->y_slots.resize(n_slots * p.n_embd);
    ctx->slot_row.assign(n_slots, -1);
    moeswarm_native_err ne;
    size_t failed = 0;
    const bool ok = moeswarm_split_exchange(ctx, cfg, p, slot_owner, owners, deadline, ne, &failed, bytes_out, bytes_in);
    double worker_ms = -1; // the owners compute in parallel: the slowest one's
    for (const moeswarm_split_owner & ow : owners) {
        worker_ms = std::max(worker_ms, ow.ms);
    }
    moeswarm_stats_native(ok, moeswarm_now_us() - t0, ok ? worker_ms : -1, ne.code);
    if (!ok) {
        for (size_t i = 0; i < owners.size(); ++i) {
            if (i != failed && owners[i].sent && !owners[i].done) {
                moeswarm_tls_close(owners[i].pr->conn); // its answer would be the next split's
            }
        }
        moeswarm_native_failed(nv, *owners[failed].pr, owners[failed].t->worker, p, ne);
        bytes_out = bytes_in = 0; // the bridge's round trip counts its own
        return MOESWARM_NATIVE_FAILED;
    }
    // the sum of the whole dispatch's rows, exactly the worker's mode sum (llama.cpp's combine)
    const int64_t rpt = p.weighted_input ? p.k : 1;
    ctx->y_sum.resize((size_t) p.n_tokens * rpt * p.n_embd);
    moeswarm_combine_sum(ctx->y_slots.data(), ctx->slot_row.data(), ctx->w.data(), (uint32_t) (p.n_tokens * rpt),
            (uint32_t) (p.k / rpt), (size_t) p.n_embd, ctx->y_sum.data());
    moeswarm_write_out((const uint8_t *) ctx->y_sum.data(), p);
    moeswarm_native_note_routed(nv, p.layer, ctx->ids);
    moeswarm_native_count & lc = nv.split_layers[p.layer];
    lc.splits++;
    lc.tokens += (uint64_t) p.n_tokens;
    for (const moeswarm_split_owner & ow : owners) {
        lc.expert_tokens += ow.filled;
        ow.pr->backoff_ms         = 0;
        moeswarm_native_count & c = nv.counts[{ ow.t->worker, p.layer }];
        c.splits++;
        c.tokens += ow.tokens;
        c.expert_tokens += ow.filled;
    }
    return MOESWARM_NATIVE_OK;
}
