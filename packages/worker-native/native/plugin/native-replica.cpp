// A whole-layer native split, with its replica (issue #15, phases 1 and 3; docs/protocol.md 10.10):
// the layer's table entry names one worker holding every expert (the primary) and maybe an `alt`
// holding them too. The same dispatch frame the bridge would get goes to the primary over TLS.
// - Failover: when the primary fails in a way that is its fault or the link's (connect, pin, a
//   closed link, an error frame, a drain, a bad answer; not a refusal of our own frame, and not the
//   deadline, which leaves no time), the frame goes to the alt at once, natively, before the bridge.
// - Hedge: when the table has `hedgeMs` and the primary has not answered that long (or, with
//   `hedgeFactor`/`hedgeMinMs`, that many times its recent p50, as dispatch's adaptive hedge), the
//   frame also goes to the alt; the first valid answer wins. The loser is not backed off (it did nothing
//   wrong, as in dispatch's hedge.ts); its late answer stays on its link and is skipped by id on the
//   link's next use (moeswarm_native_read_one).
// Each failure backs its worker off and is reported; only when every asked worker failed does the
// split go through the bridge. The worker that answered is credited, once. A primary backing off (or
// with an expired ticket and no link) is not asked: the alt alone, when it may be.

#include "moeswarm-plugin.h"
#include "moeswarm-frame.h"
#include "moeswarm-trace.h"

#include <algorithm>

// one worker asked for this split: the primary or the alt
struct moeswarm_native_try {
    const moeswarm_native_target * t = nullptr;
    moeswarm_native_peer * pr        = nullptr;
    uint32_t id                      = 0;
    bool reused = false, retried = false, sent = false, failed = false;
    int fail_order = -1; // when several failed: the last one is the split's fallback
    moeswarm_native_err ne;
    double ms = -1;
};

// the largest result frame a split's mode-sum dispatch may get
static size_t moeswarm_native_result_max(const moeswarm_pattern & p) {
    return (size_t) p.n_tokens * (p.weighted_input ? p.k : 1) * p.n_embd * 4 + 4096;
}

// whether t may be asked now: not backing off, and a live ticket when a link must be opened (the
// bridge renews tickets before exp and pushes a new table)
static bool moeswarm_native_ready(const moeswarm_native_peer & pr, const moeswarm_native_target & t, double now_us) {
    if (now_us < pr.retry_at_us) return false;
    return pr.conn.fd >= 0 || (double) t.exp_ms > moeswarm_wall_ms() + 1000.0;
}

// the dispatch sent to a's worker with a fresh id of its link (moeswarm_native_send)
static bool moeswarm_native_ask(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        moeswarm_native_try & a, double deadline, size_t & bytes_out) {
    const auto build = [&] {
        a.id = moeswarm_next_id(a.pr->next_id);
        // what a late answer to this may take on the link (read and skipped after a lost race)
        a.pr->max_result = std::max(a.pr->max_result, moeswarm_native_result_max(p));
        moeswarm_build_dispatch(ctx, cfg, p, a.id);
    };
    const bool ok = moeswarm_native_send(ctx, *a.pr, *a.t, build, p.layer, deadline, a.reused, a.retried, a.ne, bytes_out);
    a.sent        = a.sent || ok;
    return ok;
}

// one frame from a's worker: RESULT when its result, checked and written into the split's output
static moeswarm_native_read moeswarm_native_take(const moeswarm_pattern & p, moeswarm_native_try & a, double deadline,
        size_t & bytes_in) {
    moeswarm_frame f;
    const moeswarm_native_read r = moeswarm_native_read_one(
            *a.pr, a.id, moeswarm_native_result_max(p), deadline, a.t->worker, p.layer, f, a.ne, bytes_in);
    if (r != MOESWARM_NATIVE_READ_RESULT) {
        return r;
    }
    std::string err;
    if (!moeswarm_check_result(f, p, true, err)) {
        a.ne.code = "MOESWARM_DISPATCH_BAD_RESULT";
        a.ne.msg  = err;
        a.ne.ours = false;
        return MOESWARM_NATIVE_READ_FAILED;
    }
    a.ms = moeswarm_native_result_ms(a.pr->rx.data(), a.pr->rx.size());
    moeswarm_write_out(f.y.ptr, p);
    return MOESWARM_NATIVE_READ_RESULT;
}

// the state of one split's race over its (one or two) workers
struct moeswarm_native_race {
    moeswarm_native_try at[2];
    int n          = 0;  // at[0] is asked first; at[1], when set, is the spare (failover or hedge)
    int winner     = -1;
    int failures   = 0;
    bool hedged    = false;
    double hedge_at = 0; // 0: no hedge
};

static void moeswarm_native_race_fail(moeswarm_native_race & r, moeswarm_native_try & a) {
    a.failed     = true;
    a.fail_order = r.failures++;
}

// the spare goes out now: the first failed (failover, unless it refused our own frame or the time is
// up) or it has been silent for hedgeMs (hedge). Returns whether it was sent (or tried).
static bool moeswarm_native_race_spare(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, moeswarm_native_race & r, double deadline, size_t & bytes_out) {
    moeswarm_native_try & s = r.at[1];
    if (r.n < 2 || s.sent || s.failed) return false;
    const double now       = moeswarm_now_us();
    const bool first_down  = r.at[0].failed;
    const bool failover    = first_down && !r.at[0].ne.ours && now < deadline;
    const bool hedge       = !first_down && r.hedge_at > 0 && now >= r.hedge_at;
    if (!failover && !hedge) return false;
    r.hedged = r.hedged || hedge;
    if (!moeswarm_native_ask(ctx, cfg, p, s, deadline, bytes_out)) {
        moeswarm_native_race_fail(r, s);
    }
    return true;
}

// frames from the workers asked until one's valid result is written out, or every one asked failed
static void moeswarm_native_race_run(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, moeswarm_native_race & r, double deadline, size_t & bytes_out, size_t & bytes_in) {
    for (;;) {
        if (moeswarm_native_race_spare(ctx, cfg, p, r, deadline, bytes_out)) continue;
        moeswarm_tls_conn * conns[2];
        int which[2];
        int k = 0;
        for (int i = 0; i < r.n; ++i) {
            if (r.at[i].sent && !r.at[i].failed) {
                conns[k]   = &r.at[i].pr->conn;
                which[k++] = i;
            }
        }
        if (k == 0) return;
        // until the hedge moment while the spare is still unasked, else until the deadline
        const bool spare_waits = r.n == 2 && !r.at[1].sent && !r.at[1].failed && r.hedge_at > 0;
        const double until     = spare_waits ? std::min(r.hedge_at, deadline) : deadline;
        std::string err;
        bool timed_out = false;
        const int idx  = moeswarm_tls_wait_any(conns, (size_t) k, until, err, &timed_out);
        if (idx < 0) {
            if (timed_out && until < deadline) continue; // the hedge's moment
            // the deadline (or a failed wait): everyone still asked failed, the primary first
            for (int j = 0; j < k; ++j) {
                moeswarm_native_transport_err(r.at[which[j]].ne, timed_out, "waiting for the result: " + err);
                moeswarm_native_race_fail(r, r.at[which[j]]);
            }
            return;
        }
        moeswarm_native_try & a       = r.at[which[idx]];
        const moeswarm_native_read rd = moeswarm_native_take(p, a, deadline, bytes_in);
        if (rd == MOESWARM_NATIVE_READ_RESULT) {
            r.winner = which[idx];
            return;
        }
        if (rd == MOESWARM_NATIVE_READ_SKIPPED) continue;
        // a reused link found closed: the worker closed it idle or restarted; one fresh link
        if (a.reused && !a.retried && a.ne.code == "MOESWARM_TRANSPORT_CLOSED") {
            moeswarm_tls_close(a.pr->conn);
            a.retried = true;
            if (moeswarm_native_ask(ctx, cfg, p, a, deadline, bytes_out)) continue;
        }
        moeswarm_native_race_fail(r, a);
    }
}

// failures backed off and kept for the receipts; stats; the winner credited
static moeswarm_native_outcome moeswarm_native_race_end(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        moeswarm_native_race & r, double t0, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    const bool ok        = r.winner >= 0;
    std::string last_code;
    for (int i = 0; i < r.n; ++i) {
        moeswarm_native_try & a = r.at[i];
        if (!a.failed) continue;
        // a failure the split survived natively (another worker asked), or the one before the bridge
        const bool failover = ok || a.fail_order + 1 < r.failures;
        if (failover) {
            moeswarm_stats_native_failover(a.ne.code);
        } else {
            last_code = a.ne.code;
        }
        moeswarm_native_failed(nv, *a.pr, a.t->worker, p, a.ne, failover);
    }
    if (r.hedged) {
        nv.hedges++;
        nv.hedge_wins += r.winner == 1;
        moeswarm_stats_native_hedge(r.winner == 1);
    }
    const double worker_ms = ok ? r.at[r.winner].ms : -1;
    moeswarm_stats_native(ok, moeswarm_now_us() - t0, worker_ms, last_code);
    if (!ok) {
        bytes_out = bytes_in = 0; // the bridge's round trip counts its own
        return MOESWARM_NATIVE_FAILED;
    }
    moeswarm_native_try & w = r.at[r.winner];
    w.pr->backoff_ms        = 0;
    if (!r.hedged) {
        moeswarm_native_note_rt(*w.pr, moeswarm_now_us() - t0); // a hedged split's time is the race's
    }
    uint64_t filled         = 0;
    for (int32_t id : ctx->ids) {
        filled += id != -1;
    }
    moeswarm_native_note_routed(nv, p.layer, ctx->ids);
    moeswarm_native_count & c = nv.counts[{ w.t->worker, p.layer }];
    c.splits++;
    c.tokens += (uint64_t) p.n_tokens;
    c.expert_tokens += filled;
    return MOESWARM_NATIVE_OK;
}

double moeswarm_native_hedge_delay_us(const moeswarm_native_table & t, const moeswarm_native_peer & pr) {
    if (t.hedge_ms > 0) {
        return t.hedge_ms * 1000.0;
    }
    if (t.hedge_factor <= 0 || pr.rt_n < MOESWARM_NATIVE_RT_MIN) {
        return 0;
    }
    const uint32_t n = std::min<uint32_t>(pr.rt_n, MOESWARM_NATIVE_RT_RING);
    float sorted[MOESWARM_NATIVE_RT_RING];
    std::copy(pr.rt_us, pr.rt_us + n, sorted);
    std::nth_element(sorted, sorted + n / 2, sorted + n);
    return std::max(t.hedge_min_ms * 1000.0, t.hedge_factor * (double) sorted[n / 2]);
}

void moeswarm_native_note_rt(moeswarm_native_peer & pr, double rt_us) {
    pr.rt_us[pr.rt_at] = (float) rt_us;
    pr.rt_at           = (pr.rt_at + 1) % MOESWARM_NATIVE_RT_RING;
    pr.rt_n++;
}

// a whole-layer entry's split: the primary, then (failover or hedge) its alt, then the bridge
static moeswarm_native_outcome moeswarm_native_split_whole(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const moeswarm_native_entry & e, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    const double t0      = moeswarm_now_us();
    moeswarm_native_race r;
    // the peers map may grow below (operator[]): take both pointers first, none after
    moeswarm_native_peer * pp = &nv.peers[e.worker];
    moeswarm_native_peer * ap = e.has_alt ? &nv.peers[e.alt.worker] : nullptr;
    if (moeswarm_native_ready(*pp, e, t0)) {
        r.at[r.n].t    = &e;
        r.at[r.n++].pr = pp;
    }
    if (ap && moeswarm_native_ready(*ap, e.alt, t0)) {
        r.at[r.n].t    = &e.alt;
        r.at[r.n++].pr = ap;
    }
    if (r.n == 0) {
        return MOESWARM_NATIVE_SKIP;
    }
    const double deadline = t0 + std::min<double>(nv.table.deadline_ms, cfg.timeout_ms) * 1000.0;
    // a hedge only when the primary is asked first and its alt is there
    const double hedge_us = r.n == 2 ? moeswarm_native_hedge_delay_us(nv.table, *pp) : 0;
    if (hedge_us > 0) {
        r.hedge_at = t0 + hedge_us;
    }
    if (!moeswarm_native_ask(ctx, cfg, p, r.at[0], deadline, bytes_out)) {
        moeswarm_native_race_fail(r, r.at[0]);
    }
    moeswarm_native_race_run(ctx, cfg, p, r, deadline, bytes_out, bytes_in);
    return moeswarm_native_race_end(ctx, p, r, t0, bytes_out, bytes_in);
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
    return moeswarm_native_split_whole(ctx, cfg, p, it->second.front(), bytes_out, bytes_in);
}
