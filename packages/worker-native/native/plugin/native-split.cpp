// A native split over several workers (issue #15, phase 2): a layer whose native-table entries carry
// disjoint `experts` ranges. Each owner with a filled slot gets one dispatch in mode "each" (compact):
// the rows of the tokens that have a slot of its own, the other owners' ids masked to -1. All are
// sent before any answer is read, so the owners compute in parallel; the answers are combined here
// with moeswarm_combine_sum, the compute core's sum (llama.cpp's mul and add nodes, bit for bit, no
// FMA). Phase 3: each owner is one part of the race in native-race.cpp, so an entry with an `alt` (a
// replica of its range) fails over and is hedged owner by owner: that owner's dispatch alone (its
// rows) goes to the alt when the owner fails by its own or its link's fault, or stays silent past
// its own hedge moment (the first valid answer wins); the other owners' are not sent again, and an
// owner backing off is replaced by its alt from the start. A part nobody could answer fails the
// whole native split: the links still owing an answer are closed, the failing worker backs off, and
// the split goes through the bridge, which computes the same bits.

#include "moeswarm-combine.h"
#include "moeswarm-plugin.h"
#include "moeswarm-frame.h"

#include <string.h>

#include <algorithm>

// one owner of a split: its entry, and the part of the dispatch it gets
struct moeswarm_split_owner {
    const moeswarm_native_entry * e = nullptr;
    int32_t index                   = 0; // in the layer's entries: slot_owner's value
    std::vector<int64_t> rows;           // the dispatch rows (of ctx->x) it gets
    uint64_t filled = 0, tokens = 0;     // its filled slots; the tokens with one of them
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
        const std::vector<int32_t> & slot_owner, const moeswarm_split_owner & ow, uint32_t id) {
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
    moeswarm_dispatch_desc d;
    d.id      = id;
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

// each owner's part of the race: its dispatch, and a result checked and scattered into ctx->y_slots;
// who it asks (its entry's worker and alt); false when some owner's part has nobody to ask now
static bool moeswarm_split_parts(moeswarm_backend_context * ctx, const moeswarm_config & cfg, const moeswarm_pattern & p,
        const std::vector<int32_t> & slot_owner, const std::vector<moeswarm_split_owner> & owners,
        std::vector<moeswarm_native_part> & parts, double t0) {
    parts.resize(owners.size());
    for (size_t i = 0; i < owners.size(); ++i) {
        const moeswarm_split_owner & ow = owners[i];
        moeswarm_native_part & part     = parts[i];
        if (!moeswarm_native_part_init(ctx->native, part, *ow.e, t0)) return false;
        part.max_result = ow.rows.size() * (size_t) p.k * p.n_embd * 4 + 4096;
        part.build      = [ctx, &cfg, &p, &slot_owner, &ow](uint32_t id) {
            moeswarm_split_build(ctx, cfg, p, slot_owner, ow, id);
        };
        part.take = [ctx, &p, &slot_owner, &ow](const moeswarm_frame & f, std::string & err) {
            if (!moeswarm_split_check(f, p, ow, err)) return false;
            moeswarm_split_scatter(ctx, f, p, slot_owner, ow);
            return true;
        };
    }
    return true;
}

// the answered split: the owners' answers combined into the output, each owner's part credited to
// the worker that answered it, the layer's split counted once
static void moeswarm_split_finish(moeswarm_backend_context * ctx, const moeswarm_pattern & p,
        const std::vector<moeswarm_split_owner> & owners, const std::vector<moeswarm_native_part> & parts) {
    moeswarm_native & nv = ctx->native;
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
    for (size_t i = 0; i < owners.size(); ++i) {
        lc.expert_tokens += owners[i].filled;
        moeswarm_native_credit(nv, parts[i], p.layer, owners[i].tokens, owners[i].filled);
    }
}

moeswarm_native_outcome moeswarm_native_split_ranges(moeswarm_backend_context * ctx, const moeswarm_config & cfg,
        const moeswarm_pattern & p, const std::vector<moeswarm_native_entry> & entries, size_t & bytes_out,
        size_t & bytes_in) {
    moeswarm_native & nv = ctx->native;
    std::vector<int32_t> slot_owner;
    std::vector<moeswarm_split_owner> owners;
    std::vector<moeswarm_native_part> parts;
    const double t0 = moeswarm_now_us();
    // an id no range holds, or an owner and its alt both backing off: the bridge's split, not a failure
    if (!moeswarm_split_assign(ctx, p, entries, slot_owner, owners) ||
            !moeswarm_split_parts(ctx, cfg, p, slot_owner, owners, parts, t0)) {
        return MOESWARM_NATIVE_SKIP;
    }
    const double deadline = moeswarm_native_deadline(nv, cfg, t0);
    const size_t n_slots  = ctx->ids.size();
    ctx->y_slots.resize(n_slots * p.n_embd);
    ctx->slot_row.assign(n_slots, -1);
    size_t lost   = 0;
    const bool ok = moeswarm_native_race_run(ctx, p, parts.data(), parts.size(), t0, deadline, lost, bytes_out, bytes_in);
    std::string last_code;
    double worker_ms = -1; // the owners compute in parallel: the slowest one's
    for (size_t i = 0; i < parts.size(); ++i) {
        moeswarm_native_race_settle(nv, p, parts[i], !ok && i == lost, last_code);
        if (parts[i].winner >= 0) worker_ms = std::max(worker_ms, parts[i].at[parts[i].winner].ms);
    }
    moeswarm_stats_native(ok, moeswarm_now_us() - t0, ok ? worker_ms : -1, last_code);
    if (!ok) {
        bytes_out = bytes_in = 0; // the bridge's round trip counts its own
        return MOESWARM_NATIVE_FAILED;
    }
    moeswarm_split_finish(ctx, p, owners, parts);
    return MOESWARM_NATIVE_OK;
}
