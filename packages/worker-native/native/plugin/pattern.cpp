// What the device computes: the structural supports_op (each remote MoE layer is exactly one
// split per ubatch) and, in a split the scheduler hands over, the tensors of that pattern.

#include "moeswarm-plugin.h"

#include <string.h>

#include <unordered_set>

bool moeswarm_expert_name(const char * name, int * layer, moeswarm_proj * proj) {
    if (strncmp(name, "blk.", 4) != 0) {
        return false;
    }
    const char * p = name + 4;
    int l = 0, digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 5) {
        l = l * 10 + (*p - '0');
        ++p;
        ++digits;
    }
    if (digits == 0 || *p != '.') {
        return false;
    }
    ++p;
    static const struct {
        const char * prefix;
        moeswarm_proj proj;
    } k_projs[] = {
        { "ffn_gate_up_exps.", MOESWARM_PROJ_GATE_UP },
        { "ffn_gate_exps.",    MOESWARM_PROJ_GATE    },
        { "ffn_up_exps.",      MOESWARM_PROJ_UP      },
        { "ffn_down_exps.",    MOESWARM_PROJ_DOWN    },
    };
    for (const auto & k : k_projs) {
        const size_t n = strlen(k.prefix);
        if (strncmp(p, k.prefix, n) == 0) {
            const char * suffix = p + n;
            if (strcmp(suffix, "weight") != 0 && strcmp(suffix, "bias") != 0 && strcmp(suffix, "scale") != 0) {
                return false;
            }
            if (layer) *layer = l;
            if (proj) *proj = k.proj;
            return true;
        }
    }
    return false;
}

// the part of the MoE FFN a tensor belongs to
enum moeswarm_role {
    MOESWARM_ROLE_NONE,   // not ours
    MOESWARM_ROLE_WEIGHT, // an expert tensor in a MOESWARM buffer, or a view/repeat/get_rows of one
    MOESWARM_ROLE_FFN,    // the expert FFN before the weighting (projections, activation, bias, scale)
    MOESWARM_ROLE_OUT,    // the weighted outputs and their sum
};

// an expert tensor in one of our buffers. In llama.cpp's load-time probe (weight_buft_supported:
// a zero-size buffer of ours, usage not yet WEIGHTS) only the configured layers are claimed.
static bool moeswarm_is_our_weight(const ggml_tensor * t) {
    const ggml_tensor * base  = t->view_src ? t->view_src : t;
    ggml_backend_buffer_t buf = base->buffer;
    if (buf == nullptr || ggml_backend_buffer_get_type(buf) != moeswarm_buft()) {
        return false;
    }
    int layer = -1;
    if (!moeswarm_expert_name(base->name, &layer, nullptr)) {
        return false;
    }
    const bool probe = ggml_backend_buffer_get_size(buf) == 0 && !moeswarm_buffer_is_weights(buf);
    if (!probe) {
        return moeswarm_buffer_is_weights(buf);
    }
    const std::shared_ptr<const moeswarm_config> cfg = moeswarm_config_current();
    return cfg->all_layers || (layer >= 0 && layer < MOESWARM_MAX_LAYERS && cfg->layers[layer]);
}

// The op decides first which sources are looked at: the walk follows only the ops of the pattern,
// so asking about any other node (the scheduler asks about every node, several times) is O(1).
static moeswarm_role moeswarm_tensor_role(const ggml_tensor * t, int depth) {
    if (t == nullptr || depth > MOESWARM_ROLE_MAX_DEPTH) {
        return MOESWARM_ROLE_NONE;
    }
    auto role = [&](int i) {
        return moeswarm_tensor_role(t->src[i], depth + 1);
    };
    switch (t->op) {
        case GGML_OP_NONE: return moeswarm_is_our_weight(t) ? MOESWARM_ROLE_WEIGHT : MOESWARM_ROLE_NONE;
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE: return role(0);
        case GGML_OP_MUL_MAT_ID: return role(0) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_GET_ROWS:
        case GGML_OP_REPEAT:
            // per-expert scales: reshape -> repeat -> get_rows by the ids (build_lora_mm_id)
            return role(0) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_WEIGHT : MOESWARM_ROLE_NONE;
        case GGML_OP_ADD_ID:
            return role(0) == MOESWARM_ROLE_FFN && role(1) == MOESWARM_ROLE_WEIGHT ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_GLU:
            if (role(0) != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            return t->src[1] == nullptr || role(1) == MOESWARM_ROLE_FFN ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_UNARY:
        case GGML_OP_CLAMP:
        case GGML_OP_SCALE:
        case GGML_OP_SQR: return role(0) == MOESWARM_ROLE_FFN ? MOESWARM_ROLE_FFN : MOESWARM_ROLE_NONE;
        case GGML_OP_MUL: {
            if (role(0) != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            const moeswarm_role b = role(1);
            if (b == MOESWARM_ROLE_WEIGHT || b == MOESWARM_ROLE_FFN) return MOESWARM_ROLE_FFN;
            // the router weights (ffn_moe_weighted): the last op that is not a sum
            return b == MOESWARM_ROLE_NONE ? MOESWARM_ROLE_OUT : MOESWARM_ROLE_NONE;
        }
        case GGML_OP_ADD: {
            // the sum of the k weighted views; the residual add (one side not ours) stays local
            const moeswarm_role a = role(0);
            if (a != MOESWARM_ROLE_OUT && a != MOESWARM_ROLE_FFN) return MOESWARM_ROLE_NONE;
            return role(1) == a ? a : MOESWARM_ROLE_NONE;
        }
        case GGML_OP_CONT: {
            const moeswarm_role a = role(0);
            return a == MOESWARM_ROLE_OUT || a == MOESWARM_ROLE_FFN ? a : MOESWARM_ROLE_NONE;
        }
        default: return MOESWARM_ROLE_NONE;
    }
}

bool moeswarm_supports_op(const ggml_tensor * op) {
    // llama.cpp's load-time probe (weight_buft_supported) puts the weight in a zero-size buffer of
    // ours and asks about one op built around it (MUL_MAT_ID for weights and scales, ADD_ID for
    // biases, whose other operand is not ours): answer for the tensor, by name and configuration
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        const ggml_tensor * s = op->src[i];
        if (s != nullptr && s->buffer != nullptr && ggml_backend_buffer_get_type(s->buffer) == moeswarm_buft() &&
                ggml_backend_buffer_get_size(s->buffer) == 0 && !moeswarm_buffer_is_weights(s->buffer)) {
            const bool expert_op = op->op == GGML_OP_MUL_MAT_ID || op->op == GGML_OP_ADD_ID || op->op == GGML_OP_MUL;
            return expert_op && moeswarm_is_our_weight(s);
        }
    }
    // leaves: our weights (the scheduler asks before it assigns them); ops: the MoE pattern on them
    return moeswarm_tensor_role(op, 0) != MOESWARM_ROLE_NONE;
}

bool moeswarm_find_pattern(const ggml_cgraph * cgraph, moeswarm_pattern & p, std::string & err) {
    std::unordered_set<const ggml_tensor *> nodes;
    for (int i = 0; i < cgraph->n_nodes; ++i) {
        nodes.insert(cgraph->nodes[i]);
    }
    int n_add = 0, n_mmid = 0, n_weighting = 0;
    for (int i = 0; i < cgraph->n_nodes; ++i) {
        ggml_tensor * node = cgraph->nodes[i];
        if (node->op == GGML_OP_MUL_MAT_ID) {
            int layer = -1;
            moeswarm_proj proj;
            if (!moeswarm_expert_name(node->src[0]->name, &layer, &proj)) {
                err = std::string("MUL_MAT_ID on ") + node->src[0]->name + ", not a routed-expert tensor";
                return false;
            }
            if (p.layer >= 0 && p.layer != layer) {
                err = "one split holds the experts of layers " + std::to_string(p.layer) + " and " + std::to_string(layer);
                return false;
            }
            p.layer = layer;
            ++n_mmid;
            if (proj != MOESWARM_PROJ_DOWN) {
                if (p.x != nullptr && (p.x != node->src[1] || p.ids != node->src[2])) {
                    err = "the gate and up projections read different inputs";
                    return false;
                }
                p.x   = node->src[1];
                p.ids = node->src[2];
            }
        } else if (node->op == GGML_OP_MUL && node->src[1] != nullptr && nodes.count(node->src[1]) == 0 &&
                !(node->src[1]->buffer && moeswarm_buffer_is_weights(node->src[1]->buffer)) &&
                (node->src[1]->view_src == nullptr || nodes.count(node->src[1]->view_src) == 0)) {
            // src[1] comes from outside the split and is not a weight: the router weights
            p.w = node->src[1];
            ++n_weighting;
        } else if (node->op == GGML_OP_ADD) {
            ++n_add;
        }
    }
    // no weighting inside the split: llama4's weight_before_ffn, whose input rows the backbone
    // already multiplied by the router weights (the node llama.cpp names ffn_moe_weighted-<layer>;
    // the scheduler's copy of a split input keeps the name inside its own)
    p.weighted_input = n_weighting == 0 && p.x != nullptr && strstr(p.x->name, "ffn_moe_weighted") != nullptr;
    if (cgraph->n_nodes == 0 || p.x == nullptr || n_mmid < 2 || (!p.weighted_input && (p.w == nullptr || n_weighting != 1))) {
        err = "not the routed-expert FFN of one layer (projections, weighting and sum)";
        return false;
    }
    p.out      = cgraph->nodes[cgraph->n_nodes - 1];
    p.n_embd   = p.x->ne[0];
    p.n_tokens = p.x->ne[2];
    p.k        = p.ids->ne[0];
    // one input row per token and the weights beside them, or (weighted input) one row per slot
    const bool w_ok = p.weighted_input ? p.x->ne[1] == p.k
                                       : p.x->ne[1] == 1 && p.w->type == GGML_TYPE_F32 && p.w->ne[0] == 1 &&
                                                 p.w->ne[1] == p.k && p.w->ne[2] == p.n_tokens;
    const bool ok = p.x->type == GGML_TYPE_F32 && w_ok && p.x->ne[3] == 1 && p.ids->type == GGML_TYPE_I32 &&
            p.ids->ne[1] == p.n_tokens && p.ids->ne[2] == 1 && p.out->type == GGML_TYPE_F32 && p.out->ne[0] == p.n_embd &&
            p.out->ne[1] == p.n_tokens && p.out->ne[2] == 1 && p.out->ne[3] == 1 &&
            (p.k == 1 ? p.out->op == GGML_OP_CONT : (p.out->op == GGML_OP_ADD && n_add == p.k - 1));
    if (!ok || p.k < 1 || p.k > 256 || p.n_tokens < 1 || p.n_tokens > 65536 || p.n_embd < 1 || p.n_embd > 65536) {
        err = "unexpected shapes in the MoE split of layer " + std::to_string(p.layer);
        return false;
    }
    return true;
}
