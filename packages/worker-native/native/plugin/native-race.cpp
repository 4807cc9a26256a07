// The race of a native split's parts (issue #15, phase 3; docs/protocol.md 10.10), shared by the
// whole-layer split (native-replica.cpp: one part) and the split over several owners
// (native-split.cpp: one part per owner). A part asks its entry's worker first and may ask the
// entry's alt (the spare):
// - Failover: when the worker fails in a way that is its fault or the link's (not a refusal of our
//   own frame, and not the deadline, which leaves no time), the part's dispatch goes to the alt at once.
// - Hedge: when the worker has not answered by the part's hedge moment (`hedgeMs`, or adaptively
//   `hedgeFactor` x its recent p50, as dispatch's hedge), the part's dispatch also goes to the alt;
//   the first valid answer wins. The loser is not backed off (it did nothing wrong, as in dispatch's
//   hedge.ts); its late answer stays on its link and is skipped by id on the link's next use
//   (moeswarm_native_read_one; the link's max_result, raised when a dispatch is sent, lets a late
//   answer larger than the next split's be read whole).
// All the parts' workers are waited on at once (moeswarm_tls_wait_any), so one owner's hedge goes
// out on time while the other owners' answers come in, and the other parts are never touched.
// A race that fails leaves no link owing an answer open, for either kind of split: a failed worker's
// is closed as it is backed off, the others' still waiting by moeswarm_native_race_close.

#include "moeswarm-plugin.h"

#include <algorithm>

// whether t may be asked now: not backing off, and a live ticket when a link must be opened (the
// bridge renews tickets before exp and pushes a new table)
static bool moeswarm_native_ready(const moeswarm_native_peer & pr, const moeswarm_native_target & t, double now_us) {
    if (now_us < pr.retry_at_us) return false;
    return pr.conn.fd >= 0 || (double) t.exp_ms > moeswarm_wall_ms() + 1000.0;
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

double moeswarm_native_deadline(const moeswarm_native & nv, const moeswarm_config & cfg, double t0) {
    return t0 + std::min<double>(nv.table.deadline_ms, cfg.timeout_ms) * 1000.0;
}

bool moeswarm_native_part_init(moeswarm_native & nv, moeswarm_native_part & part, const moeswarm_native_entry & e,
        double t0) {
    moeswarm_native_peer * pp = &nv.peers[e.worker];
    moeswarm_native_peer * ap = e.has_alt ? &nv.peers[e.alt.worker] : nullptr;
    part.n                    = 0;
    if (moeswarm_native_ready(*pp, e, t0)) {
        part.at[part.n].t    = &e;
        part.at[part.n++].pr = pp;
    }
    if (ap && moeswarm_native_ready(*ap, e.alt, t0)) {
        part.at[part.n].t    = &e.alt;
        part.at[part.n++].pr = ap;
    }
    // a hedge only when the entry's worker is asked first and its alt is there
    const double hedge_us = part.n == 2 ? moeswarm_native_hedge_delay_us(nv.table, *pp) : 0;
    part.hedge_at         = hedge_us > 0 ? t0 + hedge_us : 0;
    return part.n > 0;
}

static void moeswarm_native_race_fail(moeswarm_native_part & part, moeswarm_native_try & a) {
    a.failed     = true;
    a.fail_order = part.failures++;
}

static bool moeswarm_native_waiting(const moeswarm_native_try & a) {
    return a.sent && !a.failed;
}

// the part's dispatch sent to a's worker with a fresh id of its link (moeswarm_native_send)
static bool moeswarm_native_ask(moeswarm_backend_context * ctx, const moeswarm_pattern & p, moeswarm_native_part & part,
        moeswarm_native_try & a, double deadline, size_t & bytes_out) {
    const auto build = [&] {
        a.id = moeswarm_next_id(a.pr->next_id);
        // what a late answer to this may take on the link (read and skipped after a lost race)
        a.pr->max_result = std::max(a.pr->max_result, part.max_result);
        part.build(a.id);
    };
    const bool ok = moeswarm_native_send(ctx, *a.pr, *a.t, build, p.layer, deadline, a.reused, a.retried, a.ne, bytes_out);
    a.sent        = a.sent || ok;
    return ok;
}

// one frame from a's worker: RESULT when its result, checked and taken by the part
static moeswarm_native_read moeswarm_native_take(const moeswarm_pattern & p, moeswarm_native_part & part,
        moeswarm_native_try & a, double deadline, size_t & bytes_in) {
    moeswarm_frame f;
    const moeswarm_native_read r = moeswarm_native_read_one(
            *a.pr, a.id, part.max_result, deadline, a.t->worker, p.layer, f, a.ne, bytes_in);
    if (r != MOESWARM_NATIVE_READ_RESULT) {
        return r;
    }
    std::string err;
    if (!part.take(f, err)) {
        a.ne.code = "MOESWARM_DISPATCH_BAD_RESULT";
        a.ne.msg  = err;
        a.ne.ours = false;
        return MOESWARM_NATIVE_READ_FAILED;
    }
    a.ms = moeswarm_native_result_ms(a.pr->rx.data(), a.pr->rx.size());
    return MOESWARM_NATIVE_READ_RESULT;
}

// the part's spare goes out when due: its first worker failed (failover, unless that refused our own
// frame or the time is up) or has been silent past the hedge moment (hedge)
static void moeswarm_native_race_spare(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        moeswarm_native_part & part, double deadline, size_t & bytes_out) {
    moeswarm_native_try & s = part.at[1];
    if (part.n < 2 || s.sent || s.failed) return;
    const double now      = moeswarm_now_us();
    const bool first_down = part.at[0].failed;
    const bool failover   = first_down && !part.at[0].ne.ours && now < deadline;
    const bool hedge      = !first_down && part.hedge_at > 0 && now >= part.hedge_at;
    if (!failover && !hedge) return;
    part.hedged = part.hedged || hedge;
    if (!moeswarm_native_ask(ctx, p, part, s, deadline, bytes_out)) {
        moeswarm_native_race_fail(part, s);
    }
}

// spares out where due; the first unanswered part left with nobody to wait on, or n
static size_t moeswarm_native_race_step(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        moeswarm_native_part * parts, size_t n, double deadline, size_t & bytes_out) {
    for (size_t i = 0; i < n; ++i) {
        moeswarm_native_part & part = parts[i];
        if (part.winner >= 0) continue;
        moeswarm_native_race_spare(ctx, p, part, deadline, bytes_out);
        if (!moeswarm_native_waiting(part.at[0]) && !moeswarm_native_waiting(part.at[1])) return i;
    }
    return n;
}

// the links of the unanswered parts' workers still owing an answer (conns), whose they are (who:
// part * 2 + try), and the moment to wait until: the earliest hedge still to come, else the deadline
static double moeswarm_native_race_gather(moeswarm_native_part * parts, size_t n, double deadline,
        std::vector<moeswarm_tls_conn *> & conns, std::vector<size_t> & who) {
    conns.clear();
    who.clear();
    double until = deadline;
    for (size_t i = 0; i < n; ++i) {
        moeswarm_native_part & part = parts[i];
        if (part.winner >= 0) continue;
        for (int j = 0; j < part.n; ++j) {
            if (!moeswarm_native_waiting(part.at[j])) continue;
            conns.push_back(&part.at[j].pr->conn);
            who.push_back(i * 2 + (size_t) j);
        }
        const bool spare_waits = part.n == 2 && !part.at[1].sent && !part.at[1].failed && part.hedge_at > 0;
        if (spare_waits) until = std::min(until, part.hedge_at);
    }
    return until;
}

// a frame from a's worker: its part answered, a frame skipped, or a failed (a reused link found
// closed is opened again and the dispatch sent once more: the worker closed it idle or restarted)
static void moeswarm_native_race_read(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        moeswarm_native_part & part, int which, double t0, double deadline, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_native_try & a       = part.at[which];
    const moeswarm_native_read rd = moeswarm_native_take(p, part, a, deadline, bytes_in);
    if (rd == MOESWARM_NATIVE_READ_RESULT) {
        part.winner = which;
        if (!part.hedged) {
            moeswarm_native_note_rt(*a.pr, moeswarm_now_us() - t0); // a hedged part's time is the race's
        }
        return;
    }
    if (rd == MOESWARM_NATIVE_READ_SKIPPED) return;
    if (a.reused && !a.retried && a.ne.code == "MOESWARM_TRANSPORT_CLOSED") {
        moeswarm_tls_close(a.pr->conn);
        a.retried = true;
        if (moeswarm_native_ask(ctx, p, part, a, deadline, bytes_out)) return;
    }
    moeswarm_native_race_fail(part, a);
}

// the deadline (or a failed wait): the first unanswered part's workers still asked failed, its
// first worker first; that part is the lost one
static size_t moeswarm_native_race_expire(moeswarm_native_part * parts, size_t n, bool timed_out,
        const std::string & err) {
    size_t i = 0;
    while (i < n && parts[i].winner >= 0) ++i;
    for (int j = 0; j < parts[i].n; ++j) {
        moeswarm_native_try & a = parts[i].at[j];
        if (!moeswarm_native_waiting(a)) continue;
        moeswarm_native_transport_err(a.ne, timed_out, "waiting for the result: " + err);
        moeswarm_native_race_fail(parts[i], a);
    }
    return i;
}

// a failed race: the links still owing an answer closed, so that none is read as a later split's
// answer and no worker goes on sending one. The failed workers' links are closed as they are backed
// off (moeswarm_native_failed); these are the rest: another part's worker still computing, or a
// hedge's loser. A whole-layer split (one part) has none left: all its workers asked have failed
static void moeswarm_native_race_close(moeswarm_native_part * parts, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        for (int j = 0; j < parts[i].n; ++j) {
            if (j != parts[i].winner && moeswarm_native_waiting(parts[i].at[j])) {
                moeswarm_tls_close(parts[i].at[j].pr->conn);
            }
        }
    }
}

bool moeswarm_native_race_run(moeswarm_backend_context * ctx, const moeswarm_pattern & p, moeswarm_native_part * parts,
        size_t n, double t0, double deadline, size_t & lost, size_t & bytes_out, size_t & bytes_in) {
    // all sent before any answer is read, so that the workers compute in parallel
    for (size_t i = 0; i < n; ++i) {
        if (!moeswarm_native_ask(ctx, p, parts[i], parts[i].at[0], deadline, bytes_out)) {
            moeswarm_native_race_fail(parts[i], parts[i].at[0]);
        }
    }
    std::vector<moeswarm_tls_conn *> conns;
    std::vector<size_t> who;
    for (;;) {
        lost = moeswarm_native_race_step(ctx, p, parts, n, deadline, bytes_out);
        if (lost < n) {
            moeswarm_native_race_close(parts, n);
            return false;
        }
        const double until = moeswarm_native_race_gather(parts, n, deadline, conns, who);
        if (conns.empty()) return true; // every part answered
        std::string err;
        bool timed_out = false;
        const int idx  = moeswarm_tls_wait_any(conns.data(), conns.size(), until, err, &timed_out);
        if (idx < 0 && timed_out && until < deadline) continue; // a hedge's moment
        if (idx < 0) {
            lost = moeswarm_native_race_expire(parts, n, timed_out, err);
            moeswarm_native_race_close(parts, n);
            return false;
        }
        const size_t w = who[(size_t) idx];
        moeswarm_native_race_read(ctx, p, parts[w / 2], (int) (w % 2), t0, deadline, bytes_out, bytes_in);
    }
}

void moeswarm_native_race_settle(moeswarm_native & nv, const moeswarm_pattern & p, moeswarm_native_part & part,
        bool lost, std::string & last_code) {
    for (int i = 0; i < part.n; ++i) {
        moeswarm_native_try & a = part.at[i];
        if (!a.failed) continue;
        // a failure the part survived natively (the other worker asked after it, or racing), or the
        // lost part's last one, the split's fallback
        const bool failover = !lost || a.fail_order + 1 < part.failures;
        if (failover) {
            moeswarm_stats_native_failover(a.ne.code);
        } else {
            last_code = a.ne.code;
        }
        moeswarm_native_failed(nv, *a.pr, a.t->worker, p, a.ne, failover);
    }
    if (part.hedged) {
        nv.hedges++;
        nv.hedge_wins += part.winner == 1;
        moeswarm_stats_native_hedge(part.winner == 1);
    }
}

void moeswarm_native_credit(moeswarm_native & nv, const moeswarm_native_part & part, int layer, uint64_t tokens,
        uint64_t filled) {
    const moeswarm_native_try & w = part.at[part.winner];
    w.pr->backoff_ms              = 0;
    moeswarm_native_count & c     = nv.counts[{ w.t->worker, layer }];
    c.splits++;
    c.tokens += tokens;
    c.expert_tokens += filled;
}
