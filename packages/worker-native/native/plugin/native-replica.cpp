// A whole-layer native split, with its replica (issue #15, phases 1 and 3; docs/protocol.md 10.10):
// the layer's table entry names one worker holding every expert (the primary) and maybe an `alt`
// holding them too. The same dispatch frame the bridge would get goes to the primary over TLS; the
// split is one part of the race in native-race.cpp (failover to the alt on the primary's fault, a
// hedge to it when the primary stays silent past its hedge moment; the first valid answer wins).
// Each failure closes its worker's link, backs the worker off and is reported; only when every asked
// worker failed does the split go through the bridge (no link is left owing an answer). The worker
// that answered is credited, once. A primary backing off (or with an expired ticket and no link) is
// not asked: the alt alone, when it may be.

#include "moeswarm-plugin.h"

// the largest result frame a split's mode-sum dispatch may get
static size_t moeswarm_native_result_max(const moeswarm_pattern & p) {
    return (size_t) p.n_tokens * (p.weighted_input ? p.k : 1) * p.n_embd * 4 + 4096;
}

// the split's one part: the mode-sum dispatch, and a result checked and written into the output
static void moeswarm_native_whole_part(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, moeswarm_native_part & part) {
    part.max_result = moeswarm_native_result_max(p);
    part.build      = [ctx, &cfg, &p](uint32_t id) { moeswarm_build_dispatch(ctx, cfg, p, id); };
    part.take       = [&p](const moeswarm_frame & f, std::string & err) {
        if (!moeswarm_check_result(f, p, true, err)) return false;
        moeswarm_write_out(f.y.ptr, p);
        return true;
    };
}

// the split answered: its filled ids credited to the worker whose result was used
static void moeswarm_native_whole_credit(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        const moeswarm_native_part & part) {
    uint64_t filled = 0;
    for (int32_t id : ctx->ids) {
        filled += id != -1;
    }
    moeswarm_native_note_routed(ctx->native, p.layer, ctx->ids);
    moeswarm_native_credit(ctx->native, part, p.layer, (uint64_t) p.n_tokens, filled);
}

// a whole-layer entry's split: the primary, then (failover or hedge) its alt, then the bridge
static moeswarm_native_outcome moeswarm_native_split_whole(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const moeswarm_native_entry & e, size_t & bytes_out, size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    const double t0      = moeswarm_now_us();
    moeswarm_native_part part;
    if (!moeswarm_native_part_init(nv, part, e, t0)) {
        return MOESWARM_NATIVE_SKIP;
    }
    moeswarm_native_whole_part(ctx, cfg, p, part);
    const double deadline = moeswarm_native_deadline(nv, cfg, t0);
    size_t lost           = 0;
    const bool ok         = moeswarm_native_race_run(ctx, p, &part, 1, t0, deadline, lost, bytes_out, bytes_in);
    std::string last_code;
    moeswarm_native_race_settle(nv, p, part, !ok, last_code);
    moeswarm_stats_native(ok, moeswarm_now_us() - t0, ok ? part.at[part.winner].ms : -1, last_code);
    if (!ok) {
        bytes_out = bytes_in = 0; // the bridge's round trip counts its own
        return MOESWARM_NATIVE_FAILED;
    }
    moeswarm_native_whole_credit(ctx, p, part);
    return MOESWARM_NATIVE_OK;
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
