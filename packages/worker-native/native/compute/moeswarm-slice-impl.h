#pragma once

// The compute core's own view of a slice, shared by its files (moeswarm-slice.cpp: lifetime and
// accessors, moeswarm-slice-load.cpp: reading the GGUF, moeswarm-slice-run.cpp: graphs and runs).
// Not part of the core's interface (moeswarm-slice.h).

#include "moeswarm-slice.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <string>
#include <vector>

// bounds of a request (the protocol's) and of a slice; anything beyond is refused before
// anything is allocated
#define MOESWARM_MAX_TOKENS  65536
#define MOESWARM_MAX_K       256
#define MOESWARM_MAX_EMBD    65536
#define MOESWARM_MAX_FF      (1 << 20)
#define MOESWARM_MAX_EXPERTS 65536
#define MOESWARM_MAX_LAYERS  4096
#define MOESWARM_GRAPH_NODES 64

//
// the slice
//

struct moeswarm_layer {
    uint32_t layer;
    uint32_t n_ff;
    ggml_tensor * gate;    // NULL without a gate or when merged
    ggml_tensor * up;      // NULL when merged
    ggml_tensor * gate_up; // merged gate and up, [n_embd, 2*n_ff, n_expert]
    ggml_tensor * down;
    ggml_tensor * gate_b;
    ggml_tensor * up_b;
    ggml_tensor * gate_up_b;
    ggml_tensor * down_b;
    ggml_tensor * gate_s;
    ggml_tensor * up_s;
    ggml_tensor * down_s;
    float swiglu_limit;
    bool repacked;
};

// a graph kept for reuse; the reference graphs carry their own shape in the key
struct moeswarm_graph {
    uint32_t layer;
    uint32_t n_rows; // pairs (run) or tokens (reference)
    uint32_t k;      // 1 (run) or slots (reference)
    int32_t kind;    // 0 run, 1 reference each, 2 reference sum
    enum ggml_type x_type; // the activations' type: f32, or the layer's wire type (run only)
    uint64_t last_use;
    ggml_context * ctx;
    ggml_cgraph * gf;
    ggml_tensor * x;
    ggml_tensor * ids;
    ggml_tensor * w;
    ggml_tensor * out;
    size_t need_bytes; // compute buffer it needs (measured when the slice has a reservation)
};

struct moeswarm_expert_map {
    uint32_t global;
    int32_t local;
};

struct moeswarm_slice {
    std::string arch;
    std::string device; // ggml device name
    bool on_cpu         = true;
    uint32_t n_embd     = 0;
    uint32_t n_expert   = 0;
    int32_t act         = MOESWARM_ACT_SILU;
    bool weight_before_ffn = false; // llama4: the router weights multiply the input (rows come weighted)
    int32_t n_threads   = 1;
    uint32_t n_graphs   = 16;
    size_t weight_bytes = 0;

    std::vector<uint32_t> experts;               // global ids in slice order
    std::vector<moeswarm_expert_map> expert_map; // sorted by global id
    std::vector<uint32_t> layers;                // ascending
    std::vector<moeswarm_layer> layer_data;      // same order as layers

    ggml_context * ctx_w             = nullptr;  // weights in plain CPU buffers
    ggml_context * ctx_w_repack      = nullptr;  // weights in CPU_REPACK buffers
    ggml_backend_buffer_t buf_plain  = nullptr;
    ggml_backend_buffer_t buf_repack = nullptr;
    ggml_backend_t backend           = nullptr;
    ggml_threadpool * threadpool     = nullptr;
    ggml_gallocr_t galloc            = nullptr;
    ggml_gallocr_t measure           = nullptr;  // plans graphs without allocating (moeswarm-slice-reserve.cpp)
    uint32_t max_rows                = 0;        // rows per graph, 0: no limit
    size_t compute_bytes             = 0;        // compute buffer reserved at load, 0: none (grows as needed)

    std::vector<moeswarm_graph> graphs;
    uint64_t clock = 0;

    // staging of one run, kept to avoid reallocations
    std::vector<float> x_rows;
    std::vector<uint8_t> xq_rows; // the rows of a run whose activations came in the wire type
    std::vector<float> x_wire_f32; // those dequantised, for a repacked layer
    std::vector<int32_t> pair_ids;
    std::vector<int32_t> pair_of_slot;
    std::vector<float> y_rows;

    volatile bool * abort_flag = nullptr;
};

struct moeswarm_tensor_src {
    ggml_tensor * t;
    size_t offset; // in the file
};

void moeswarm_graph_free(moeswarm_graph & g);

// builds one graph (not cached) for layer L (moeswarm-slice-run.cpp)
bool moeswarm_graph_build(moeswarm_slice * slice, const moeswarm_layer & L, int32_t kind, uint32_t n_rows, uint32_t k,
        enum ggml_type x_type, moeswarm_graph & g, moeswarm_error * err);

// the compute buffer's reservation (moeswarm-slice-reserve.cpp): at load, and the check of each new graph
bool moeswarm_reserve_compute(moeswarm_slice * slice, uint32_t max_rows, moeswarm_error * err);
bool moeswarm_graph_check_fits(moeswarm_slice * slice, moeswarm_graph & g, moeswarm_error * err);
bool moeswarm_check_not_grown(moeswarm_slice * slice, const moeswarm_graph & g, moeswarm_error * err);

// reading one layer's tensors (moeswarm-slice-layer.cpp)
bool moeswarm_load_layer(moeswarm_slice * slice, const gguf_context * gctx, uint32_t il, size_t file_size,
        std::vector<moeswarm_tensor_src> & srcs, moeswarm_error * err);
// activations that came in the layer's wire type (moeswarm-activations.cpp): checks their type and
// size; for a layer in CPU_REPACK buffers turns them into f32 rows (in f32, *use_f32 set), refusing
// rows that from_float would not give back byte for byte
bool moeswarm_wire_prepare(moeswarm_slice * slice, const moeswarm_layer & L, const moeswarm_run_params * p,
        std::vector<float> & f32, bool * use_f32, moeswarm_error * err);
bool moeswarm_resolve_act(moeswarm_slice * slice, const gguf_context * gctx, int32_t act_param, moeswarm_error * err);
