// Reference for route(): the routing half of llama.cpp's build_moe_ffn
// (src/llama-graph.cpp:1966-2094 of the pinned commit), built with the same ggml calls and run on
// ggml's CPU backend (node-llama-cpp's prebuilt libggml, best CPU variant for this machine).
//
//   stdin:  any number of records, each: int32 n_expert, n_tokens, k, gating (1..4), norm (0/1), n_groups, n_group_used,
//           has_sel_bias, has_logit_bias, select_on (0 probs, 1 logits, 2 sigmoid);
//           f32 scale; f32 logits[n_tokens * n_expert]; f32 sel_bias[n_expert] if has_sel_bias;
//           f32 logit_bias[n_expert] if has_logit_bias
//   stdout: per record: int32 ids[n_tokens * k], f32 weights[n_tokens * k]
//   argv[1]: directory holding the ggml backend libraries
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

static void read_exact(void * dst, size_t n) {
    if (n && fread(dst, 1, n, stdin) != n) { fprintf(stderr, "short stdin\n"); exit(2); }
}

static int route_one(ggml_backend_t backend, const int32_t * h);

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: ggml-route <libdir>\n"); return 2; }
    ggml_backend_load_all_from_path(argv[1]);
    ggml_backend_t backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
    if (!backend) { fprintf(stderr, "no CPU backend\n"); return 2; }
    // one thread: tiny graphs, and ggml's worker threads would spin against each other on small machines
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(backend));
    ggml_backend_set_n_threads_t set_n_threads =
        (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set_n_threads) set_n_threads(backend, 1);
    int32_t h[10];
    while (fread(h, 1, sizeof h, stdin) == sizeof h) {
        int rc = route_one(backend, h);
        if (rc) return rc;
    }
    ggml_backend_free(backend);
    return 0;
}

static int route_one(ggml_backend_t backend, const int32_t * h) {
    const int n_expert = h[0], n_tokens = h[1], k = h[2], gating = h[3], norm = h[4];
    const int n_groups = h[5], n_group_used = h[6], has_sel_bias = h[7], has_logit_bias = h[8], select_on = h[9];
    float scale;
    read_exact(&scale, sizeof scale);
    float * logits_data = malloc(sizeof(float) * n_expert * n_tokens);
    float * sel_bias_data = malloc(sizeof(float) * n_expert);
    float * logit_bias_data = malloc(sizeof(float) * n_expert);
    read_exact(logits_data, sizeof(float) * n_expert * n_tokens);
    if (has_sel_bias) read_exact(sel_bias_data, sizeof(float) * n_expert);
    if (has_logit_bias) read_exact(logit_bias_data, sizeof(float) * n_expert);

    struct ggml_init_params params = { ggml_tensor_overhead() * 512 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx0 = ggml_init(params);

    struct ggml_tensor * logits = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, n_expert, n_tokens);
    ggml_set_input(logits);
    struct ggml_tensor * exp_probs_b = NULL;
    struct ggml_tensor * gate_inp_b = NULL;
    if (has_sel_bias) { exp_probs_b = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, n_expert); ggml_set_input(exp_probs_b); }
    if (has_logit_bias) { gate_inp_b = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, n_expert); ggml_set_input(gate_inp_b); }
    struct ggml_tensor * raw_logits = logits;

    // ---- llama-graph.cpp:1979 onwards, with hparams/arch replaced by the header fields ----
    if (gate_inp_b) {
        logits = ggml_add(ctx0, logits, gate_inp_b);
    }
    struct ggml_tensor * probs = NULL;
    switch (gating) {
        case 1: probs = ggml_soft_max(ctx0, logits); break;
        case 2: probs = ggml_sigmoid(ctx0, logits); break;
        case 3: probs = logits; break;
        case 4: probs = ggml_sqrt(ctx0, ggml_softplus(ctx0, logits)); break;
        default: fprintf(stderr, "bad gating\n"); return 2;
    }
    struct ggml_tensor * selection_probs = probs;
    if (exp_probs_b != NULL) {
        selection_probs = ggml_add(ctx0, probs, exp_probs_b);
    }
    if (select_on == 1) selection_probs = logits;                      // LLM_ARCH_LLAMA4
    if (select_on == 2) selection_probs = ggml_sigmoid(ctx0, logits);  // LLM_ARCH_GROVEMOE

    if (n_groups > 1 && n_tokens > 0) {
        const int64_t n_exp_per_group = n_expert / n_groups;
        struct ggml_tensor * selection_groups = ggml_reshape_3d(ctx0, selection_probs, n_exp_per_group, n_groups, n_tokens);
        struct ggml_tensor * group_scores = ggml_argsort_top_k(ctx0, selection_groups, 2);
        group_scores = ggml_get_rows(ctx0, ggml_reshape_4d(ctx0, selection_groups, 1, selection_groups->ne[0], selection_groups->ne[1], selection_groups->ne[2]), group_scores);
        group_scores = ggml_sum_rows(ctx0, ggml_reshape_3d(ctx0, group_scores, group_scores->ne[1], group_scores->ne[2], group_scores->ne[3]));
        group_scores = ggml_reshape_2d(ctx0, group_scores, group_scores->ne[1], group_scores->ne[2]);
        struct ggml_tensor * expert_groups = ggml_argsort_top_k(ctx0, group_scores, n_group_used);
        selection_probs = ggml_get_rows(ctx0, selection_groups, expert_groups);
        selection_probs = ggml_set_rows(ctx0, ggml_fill(ctx0, selection_groups, -INFINITY), selection_probs, expert_groups);
        selection_probs = ggml_reshape_2d(ctx0, selection_probs, n_expert, n_tokens);
    }

    struct ggml_tensor * selected_experts = ggml_argsort_top_k(ctx0, selection_probs, k);
    probs = ggml_reshape_3d(ctx0, probs, 1, n_expert, n_tokens);
    struct ggml_tensor * weights = ggml_get_rows(ctx0, probs, selected_experts);
    if (gating == 3) {
        weights = ggml_reshape_2d(ctx0, weights, k, n_tokens);
        weights = ggml_soft_max(ctx0, weights);
        weights = ggml_reshape_3d(ctx0, weights, 1, k, n_tokens);
    }
    if (norm) {
        weights = ggml_reshape_2d(ctx0, weights, k, n_tokens);
        struct ggml_tensor * weights_sum = ggml_sum_rows(ctx0, weights);
        weights_sum = ggml_clamp(ctx0, weights_sum, 6.103515625e-5, INFINITY);
        weights = ggml_div(ctx0, weights, weights_sum);
        weights = ggml_reshape_3d(ctx0, weights, 1, k, n_tokens);
    }
    if (scale != 0.0f && scale != 1.0f) {
        weights = ggml_scale(ctx0, weights, scale);
    }
    // ---- end of the copied part ----
    (void) raw_logits;

    struct ggml_tensor * ids_out = ggml_cont(ctx0, selected_experts);
    struct ggml_tensor * w_out = ggml_cont(ctx0, weights);
    ggml_set_output(ids_out);
    ggml_set_output(w_out);
    struct ggml_cgraph * gf = ggml_new_graph(ctx0);
    ggml_build_forward_expand(gf, ids_out);
    ggml_build_forward_expand(gf, w_out);

    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf)) { fprintf(stderr, "alloc failed\n"); return 2; }
    ggml_backend_tensor_set(raw_logits, logits_data, 0, sizeof(float) * n_expert * n_tokens);
    // a bias the graph does not use (llama4/grovemoe selection) has no buffer
    if (exp_probs_b && exp_probs_b->buffer) ggml_backend_tensor_set(exp_probs_b, sel_bias_data, 0, sizeof(float) * n_expert);
    if (gate_inp_b) ggml_backend_tensor_set(gate_inp_b, logit_bias_data, 0, sizeof(float) * n_expert);
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); return 2; }

    int32_t * ids = malloc(sizeof(int32_t) * k * n_tokens);
    float * w = malloc(sizeof(float) * k * n_tokens);
    ggml_backend_tensor_get(ids_out, ids, 0, sizeof(int32_t) * k * n_tokens);
    ggml_backend_tensor_get(w_out, w, 0, sizeof(float) * k * n_tokens);
    fwrite(ids, sizeof(int32_t), (size_t) k * n_tokens, stdout);
    fwrite(w, sizeof(float), (size_t) k * n_tokens, stdout);
    fflush(stdout);
    ggml_gallocr_free(galloc);
    ggml_free(ctx0);
    free(ids);
    free(w);
    free(logits_data);
    free(sel_bias_data);
    free(logit_bias_data);
    return 0;
}
