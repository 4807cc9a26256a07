// The expert FFN graphs of a slice (cached per layer and shape) and the two ways of running them:
// one (token, slot) pair per row (moeswarm_slice_run) and llama.cpp's own graph shape
// (moeswarm_slice_run_reference).

#include "moeswarm-slice-impl.h"
#include "moeswarm-backend.h"
#include "moeswarm-combine.h"

#include <math.h>
#include <string.h>

#include <algorithm>
#include <cmath>

//
// graphs
//

// build_lora_mm_id of llama.cpp without LoRA: mul_mat_id, then the per-expert scale
static ggml_tensor * moeswarm_mm_id(
        ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids, ggml_tensor * w_s) {
    ggml_tensor * res = ggml_mul_mat_id(ctx, w, cur, ids);
    if (w_s) {
        const int64_t n_expert = w_s->ne[0];
        const int64_t n_tokens = cur->ne[2];
        ggml_tensor * s        = ggml_reshape_3d(ctx, w_s, 1, n_expert, 1);
        s                      = ggml_repeat_4d(ctx, s, 1, n_expert, n_tokens, 1);
        s                      = ggml_get_rows(ctx, s, ids);
        res                    = ggml_mul(ctx, res, s);
    }
    return res;
}

// the expert FFN of build_moe_ffn: cur [n_embd, 1, n_tokens], ids [k, n_tokens] -> [n_embd, k, n_tokens]
static ggml_tensor * moeswarm_build_ffn(
        ggml_context * ctx, const moeswarm_slice * slice, const moeswarm_layer & L, ggml_tensor * cur, ggml_tensor * ids) {
    ggml_tensor * up = nullptr;
    if (L.gate_up) {
        ggml_tensor * gate_up = moeswarm_mm_id(ctx, L.gate_up, cur, ids, nullptr);
        if (L.gate_up_b) {
            gate_up = ggml_add_id(ctx, gate_up, L.gate_up_b, ids);
        }
        const int64_t n_ff = gate_up->ne[0] / 2;
        cur                = ggml_view_3d(ctx, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], 0);
        up                 = ggml_view_3d(
                ctx, gate_up, n_ff, gate_up->ne[1], gate_up->ne[2], gate_up->nb[1], gate_up->nb[2], n_ff * gate_up->nb[0]);
    } else {
        up = moeswarm_mm_id(ctx, L.up, cur, ids, L.up_s);
        if (L.up_b) {
            up = ggml_add_id(ctx, up, L.up_b, ids);
        }
        if (L.gate) {
            cur = moeswarm_mm_id(ctx, L.gate, cur, ids, L.gate_s);
        } else {
            cur = up;
        }
        if (L.gate_b) {
            cur = ggml_add_id(ctx, cur, L.gate_b, ids);
        }
    }
    const bool has_gate = L.gate != nullptr || L.gate_up != nullptr;

    switch (slice->act) {
        case MOESWARM_ACT_SILU:
            if (L.swiglu_limit > 0.0f) {
                const float limit = L.swiglu_limit;
                if (slice->arch == "deepseek4") {
                    cur = ggml_swiglu_clamp(ctx, cur, up, limit);
                } else {
                    up                     = ggml_clamp(ctx, up, -limit, limit);
                    ggml_tensor * gate_act = ggml_silu(ctx, cur);
                    gate_act               = ggml_clamp(ctx, gate_act, -INFINITY, limit);
                    cur                    = ggml_mul(ctx, gate_act, up);
                }
            } else if (has_gate) {
                cur = ggml_swiglu_split(ctx, cur, up);
            } else {
                cur = ggml_silu(ctx, cur);
            }
            break;
        case MOESWARM_ACT_GELU: cur = has_gate ? ggml_geglu_split(ctx, cur, up) : ggml_gelu(ctx, cur); break;
        case MOESWARM_ACT_RELU: cur = has_gate ? ggml_reglu_split(ctx, cur, up) : ggml_relu(ctx, cur); break;
        case MOESWARM_ACT_SWIGLU_OAI: cur = ggml_swiglu_oai(ctx, cur, up, 1.702f, 7.0f); break;
        case MOESWARM_ACT_RELU_SQR: cur = ggml_sqr(ctx, ggml_relu(ctx, cur)); break;
        default: break;
    }

    ggml_tensor * experts = moeswarm_mm_id(ctx, L.down, cur, ids, L.down_s);
    if (L.down_b) {
        experts = ggml_add_id(ctx, experts, L.down_b, ids);
    }
    return experts;
}

static const moeswarm_layer * moeswarm_find_layer(const moeswarm_slice * slice, uint32_t layer) {
    const auto it = std::lower_bound(slice->layers.begin(), slice->layers.end(), layer);
    if (it == slice->layers.end() || *it != layer) {
        return nullptr;
    }
    return &slice->layer_data[(size_t) (it - slice->layers.begin())];
}

static int32_t moeswarm_local_id(const moeswarm_slice * slice, int32_t global) {
    if (global < 0) {
        return -1;
    }
    const auto it = std::lower_bound(slice->expert_map.begin(), slice->expert_map.end(), (uint32_t) global,
            [](const moeswarm_expert_map & m, uint32_t g) { return m.global < g; });
    if (it == slice->expert_map.end() || it->global != (uint32_t) global) {
        return -2;
    }
    return it->local;
}

// kind 0: run over n_rows (token, slot) pairs; 1/2: reference over n_rows tokens x k slots
bool moeswarm_graph_build(moeswarm_slice * slice, const moeswarm_layer & L, int32_t kind, uint32_t n_rows, uint32_t k,
        enum ggml_type x_type, moeswarm_graph & g, moeswarm_error * err) {
    memset(&g, 0, sizeof(g));
    g.kind               = kind;
    g.layer              = L.layer;
    g.n_rows             = n_rows;
    g.k                  = k;
    g.x_type             = x_type;
    g.last_use           = slice->clock;
    const size_t n_nodes = MOESWARM_GRAPH_NODES + 2 * (size_t) k;
    ggml_init_params ip  = { ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), nullptr, true };
    g.ctx                = ggml_init(ip);
    if (g.ctx == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "cannot create a ggml context for the graph");
    }
    ggml_context * ctx   = g.ctx;
    const int64_t n_embd = slice->n_embd;

    g.x = ggml_new_tensor_2d(ctx, x_type, n_embd, n_rows);
    ggml_set_name(g.x, "moeswarm_x");
    ggml_set_input(g.x);
    g.ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, n_rows);
    ggml_set_name(g.ids, "moeswarm_ids");
    ggml_set_input(g.ids);

    ggml_tensor * cur     = ggml_reshape_3d(ctx, g.x, n_embd, 1, n_rows);
    ggml_tensor * experts = moeswarm_build_ffn(ctx, slice, L, cur, g.ids); // [n_embd, k, n_rows]
    ggml_tensor * out     = experts;
    g.gf                  = ggml_new_graph_custom(ctx, n_nodes, false);
    if (kind == 2) {
        // llama.cpp: weighting, then the views ordered before the adds, added in slot order
        g.w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, n_rows);
        ggml_set_name(g.w, "moeswarm_w");
        ggml_set_input(g.w);
        experts = ggml_mul(ctx, experts, g.w);
        ggml_build_forward_expand(g.gf, experts);
        std::vector<ggml_tensor *> views(k);
        for (uint32_t i = 0; i < k; ++i) {
            views[i] = ggml_view_2d(ctx, experts, n_embd, n_rows, experts->nb[2], i * experts->nb[1]);
            ggml_build_forward_expand(g.gf, views[i]);
        }
        out = views[0];
        for (uint32_t i = 1; i < k; ++i) {
            out = ggml_add(ctx, out, views[i]);
            ggml_build_forward_expand(g.gf, out);
        }
        if (k == 1) {
            out = ggml_cont(ctx, out);
        }
    }
    ggml_set_name(out, "moeswarm_out");
    ggml_set_output(out);
    ggml_build_forward_expand(g.gf, out);
    g.out = out;
    // a GPU backend may lack an op or a type: refuse here rather than abort inside ggml
    for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
        ggml_tensor * node = ggml_graph_node(g.gf, i);
        if (!ggml_backend_supports_op(slice->backend, node)) {
            moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "the %s backend cannot run %s (%s) of this graph",
                    slice->device.c_str(), ggml_op_desc(node), node->src[0] ? ggml_type_name(node->src[0]->type) : "-");
            moeswarm_graph_free(g);
            return false;
        }
    }
    return true;
}

static moeswarm_graph * moeswarm_graph_get(moeswarm_slice * slice, const moeswarm_layer & L, int32_t kind, uint32_t n_rows,
        uint32_t k, enum ggml_type x_type, moeswarm_error * err) {
    slice->clock++;
    for (moeswarm_graph & g : slice->graphs) {
        if (g.kind == kind && g.layer == L.layer && g.n_rows == n_rows && g.k == k && g.x_type == x_type) {
            g.last_use = slice->clock;
            return &g;
        }
    }
    moeswarm_graph g;
    if (!moeswarm_graph_build(slice, L, kind, n_rows, k, x_type, g, err)) {
        return nullptr;
    }
    if (!moeswarm_graph_check_fits(slice, g, err)) {
        moeswarm_graph_free(g);
        return nullptr;
    }
    // evict the least recently used graph when the cache is full
    moeswarm_graph * lru = nullptr;
    for (moeswarm_graph & c : slice->graphs) {
        if (lru == nullptr || c.last_use < lru->last_use) {
            lru = &c;
        }
    }
    if (slice->graphs.size() >= slice->n_graphs && lru != nullptr) {
        moeswarm_graph_free(*lru);
        *lru = slice->graphs.back();
        slice->graphs.pop_back();
    }
    slice->graphs.push_back(g);
    return &slice->graphs.back();
}

// A cached graph keeps the addresses of its last allocation, and ggml-alloc skips tensors that
// already have data: after another graph (re)used or regrew the shared compute buffer, those
// addresses are stale. Forget them so that ggml_gallocr_alloc_graph places every tensor anew
// (views of the weights are re-derived from them).
static bool moeswarm_graph_alloc(moeswarm_slice * slice, moeswarm_graph * g, moeswarm_error * err) {
    for (ggml_tensor * t = ggml_get_first_tensor(g->ctx); t != nullptr; t = ggml_get_next_tensor(g->ctx, t)) {
        t->data   = nullptr;
        t->buffer = nullptr;
    }
    if (!ggml_gallocr_alloc_graph(slice->galloc, g->gf)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "cannot allocate the compute buffer (out of memory?)");
    }
    return moeswarm_check_not_grown(slice, *g, err);
}

static bool moeswarm_abort_callback(void * data) {
    const moeswarm_slice * slice = (const moeswarm_slice *) data;
    return slice->abort_flag != nullptr && *slice->abort_flag;
}

static bool moeswarm_graph_compute(moeswarm_slice * slice, moeswarm_graph * g, volatile bool * abort_flag, moeswarm_error * err) {
    slice->abort_flag = abort_flag;
    if (slice->on_cpu) {
        moeswarm_backend_cpu_set_abort_callback(slice->backend, moeswarm_abort_callback, slice);
    }
    const enum ggml_status st = ggml_backend_graph_compute(slice->backend, g->gf);
    slice->abort_flag         = nullptr;
    if (st == GGML_STATUS_ABORTED) {
        return moeswarm_error_set(err, "MOESWARM_ABORTED", "the compute was aborted");
    }
    if (st != GGML_STATUS_SUCCESS) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "ggml_backend_graph_compute failed (status %d)", (int) st);
    }
    return true;
}

size_t moeswarm_run_output_len(const struct moeswarm_slice * slice, uint32_t n_tokens, uint32_t k, int32_t mode) {
    return (size_t) n_tokens * (mode == MOESWARM_MODE_EACH ? k : 1) * slice->n_embd;
}

static bool moeswarm_check_run(const moeswarm_slice * slice, const moeswarm_run_params * p, size_t out_len,
        const moeswarm_layer ** L, moeswarm_error * err) {
    if (p == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "no run parameters");
    }
    *L = moeswarm_find_layer(slice, p->layer);
    if (*L == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "layer %u is not in this slice", p->layer);
    }
    if (p->n_tokens < 1 || p->n_tokens > MOESWARM_MAX_TOKENS) {
        return moeswarm_error_set(
                err, "MOESWARM_NATIVE_COMPUTE", "n_tokens %u is outside 1..%d", p->n_tokens, MOESWARM_MAX_TOKENS);
    }
    if (p->k < 1 || p->k > MOESWARM_MAX_K) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "k %u is outside 1..%d", p->k, MOESWARM_MAX_K);
    }
    if (p->mode != MOESWARM_MODE_EACH && p->mode != MOESWARM_MODE_SUM) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "unknown mode %d", p->mode);
    }
    if ((p->x_type == GGML_TYPE_F32 ? p->x == nullptr : p->x_q == nullptr) || p->ids == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "x and ids are required");
    }
    if (p->mode == MOESWARM_MODE_SUM && p->weights == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "mode sum needs the router weights");
    }
    if (out_len != moeswarm_run_output_len(slice, p->n_tokens, p->k, p->mode)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "output holds %zu floats, expected %zu", out_len,
                moeswarm_run_output_len(slice, p->n_tokens, p->k, p->mode));
    }
    if (p->weights != nullptr) {
        const size_t n = (size_t) p->n_tokens * p->k;
        for (size_t i = 0; i < n; ++i) {
            if (!std::isfinite(p->weights[i])) {
                return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "router weight %zu (token %zu, slot %zu) is not finite",
                        i, i / p->k, i % p->k);
            }
            if (slice->weight_before_ffn && p->weights[i] != 1.0f) {
                return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                        "router weight %zu is %g: %s weights the expert input, so each row comes weighted with weight 1",
                        i, (double) p->weights[i], slice->arch.c_str());
            }
        }
    }
    return true;
}

bool moeswarm_slice_run(struct moeswarm_slice * slice, const struct moeswarm_run_params * p_in, float * out, size_t out_len,
        struct moeswarm_error * err) {
    moeswarm_error_clear(err);
    const moeswarm_layer * L = nullptr;
    if (!moeswarm_check_run(slice, p_in, out_len, &L, err)) {
        return false;
    }
    // activations in the layer's wire type: ggml takes the rows as they are, or (repacked layer)
    // the run goes on over their f32 values
    moeswarm_run_params p_f32;
    const moeswarm_run_params * p = p_in;
    if (p_in->x_type != GGML_TYPE_F32) {
        bool use_f32 = false;
        if (!moeswarm_wire_prepare(slice, *L, p_in, slice->x_wire_f32, &use_f32, err)) {
            return false;
        }
        if (use_f32) {
            p_f32        = *p_in;
            p_f32.x      = slice->x_wire_f32.data();
            p_f32.x_type = GGML_TYPE_F32;
            p            = &p_f32;
        }
    }
    const bool x_f32 = p->x_type == GGML_TYPE_F32;
    const size_t x_row = ggml_row_size(p->x_type, slice->n_embd);
    const uint32_t n_tokens = p->n_tokens;
    const uint32_t k        = p->k;
    const size_t n_embd     = slice->n_embd;

    // every (token, slot) pair with an expert becomes one row of a k = 1 mul_mat_id: each expert
    // sees the same rows in the same order as in the monolithic graph, and ggml computes each
    // row on its own, so the results are the same bits; empty slots never reach ggml
    slice->pair_of_slot.resize((size_t) n_tokens * k);
    size_t n_pairs = 0;
    for (uint32_t i = 0; i < n_tokens; ++i) {
        for (uint32_t j = 0; j < k; ++j) {
            const int32_t gid = p->ids[(size_t) i * k + j];
            const int32_t lid = moeswarm_local_id(slice, gid);
            if (lid == -2 || gid < -1) {
                return moeswarm_error_set(
                        err, "MOESWARM_NATIVE_COMPUTE", "expert %d (token %u, slot %u) is not in this slice", gid, i, j);
            }
            slice->pair_of_slot[(size_t) i * k + j] = lid < 0 ? -1 : (int32_t) n_pairs;
            if (lid >= 0) {
                n_pairs++;
            }
        }
    }
    slice->pair_ids.resize(n_pairs);
    uint8_t * x_rows = nullptr;
    if (x_f32) {
        slice->x_rows.resize(n_pairs * n_embd);
        x_rows = (uint8_t *) slice->x_rows.data();
    } else {
        slice->xq_rows.resize(n_pairs * x_row);
        x_rows = slice->xq_rows.data();
    }
    const uint8_t * x_in = x_f32 ? (const uint8_t *) p->x : (const uint8_t *) p->x_q;
    for (uint32_t i = 0; i < n_tokens; ++i) {
        for (uint32_t j = 0; j < k; ++j) {
            const int32_t pi = slice->pair_of_slot[(size_t) i * k + j];
            if (pi >= 0) {
                slice->pair_ids[pi] = moeswarm_local_id(slice, p->ids[(size_t) i * k + j]);
                memcpy(x_rows + (size_t) pi * x_row, x_in + (size_t) i * x_row, x_row);
            }
        }
    }

    slice->y_rows.resize(n_pairs * n_embd);
    // at most max_rows rows per graph (the compute buffer was reserved for them at load): more are
    // computed in chunks, in turn; each row is computed on its own, so a chunk's rows need no others
    const size_t chunk = slice->max_rows > 0 ? slice->max_rows : std::max<size_t>(n_pairs, 1);
    for (size_t r0 = 0; r0 < n_pairs; r0 += chunk) {
        const size_t nr    = std::min(chunk, n_pairs - r0);
        moeswarm_graph * g = moeswarm_graph_get(slice, *L, 0, (uint32_t) nr, 1, p->x_type, err);
        if (g == nullptr) {
            return false;
        }
        if (!moeswarm_graph_alloc(slice, g, err)) {
            return false;
        }
        ggml_backend_tensor_set(g->x, x_rows + r0 * x_row, 0, ggml_nbytes(g->x));
        ggml_backend_tensor_set(g->ids, slice->pair_ids.data() + r0, 0, ggml_nbytes(g->ids));
        if (!moeswarm_graph_compute(slice, g, p->abort_flag, err)) {
            return false;
        }
        ggml_backend_tensor_get(g->out, slice->y_rows.data() + r0 * n_embd, 0, ggml_nbytes(g->out));
    }

    if (p->mode == MOESWARM_MODE_EACH) {
        moeswarm_scatter_each(slice->y_rows.data(), slice->pair_of_slot.data(), n_tokens, k, n_embd, out);
    } else {
        moeswarm_combine_sum(slice->y_rows.data(), slice->pair_of_slot.data(), p->weights, n_tokens, k, n_embd, out);
    }
    return true;
}

bool moeswarm_slice_run_reference(struct moeswarm_slice * slice, const struct moeswarm_run_params * p, float * out,
        size_t out_len, struct moeswarm_error * err) {
    moeswarm_error_clear(err);
    const moeswarm_layer * L = nullptr;
    if (!moeswarm_check_run(slice, p, out_len, &L, err)) {
        return false;
    }
    const size_t n = (size_t) p->n_tokens * p->k;
    std::vector<int32_t> local(n);
    for (size_t i = 0; i < n; ++i) {
        const int32_t lid = moeswarm_local_id(slice, p->ids[i]);
        if (lid < 0) {
            return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                    "the reference graph needs every slot filled with an expert of the file (slot %zu has %d)", i, p->ids[i]);
        }
        local[i] = lid;
    }
    const int32_t kind = p->mode == MOESWARM_MODE_SUM ? 2 : 1;
    if (p->x_type != GGML_TYPE_F32) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_WIRE_DTYPE", "the reference graph takes f32 activations only");
    }
    moeswarm_graph * g = moeswarm_graph_get(slice, *L, kind, p->n_tokens, p->k, GGML_TYPE_F32, err);
    if (g == nullptr) {
        return false;
    }
    if (!moeswarm_graph_alloc(slice, g, err)) {
        return false;
    }
    ggml_backend_tensor_set(g->x, p->x, 0, ggml_nbytes(g->x));
    ggml_backend_tensor_set(g->ids, local.data(), 0, ggml_nbytes(g->ids));
    if (g->w) {
        ggml_backend_tensor_set(g->w, p->weights, 0, ggml_nbytes(g->w));
    }
    if (!moeswarm_graph_compute(slice, g, p->abort_flag, err)) {
        return false;
    }
    if (ggml_nbytes(g->out) != out_len * sizeof(float)) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE", "reference output size mismatch");
    }
    ggml_backend_tensor_get(g->out, out, 0, ggml_nbytes(g->out));
    return true;
}
