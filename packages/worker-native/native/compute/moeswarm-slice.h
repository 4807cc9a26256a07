#pragma once

// The expert compute core: a slice GGUF (routed-expert tensors of some layers, some experts)
// loaded into ggml CPU buffers in its stored types, and the expert FFN of llama.cpp's
// build_moe_ffn (src/llama-graph.cpp) computed over it with ggml_mul_mat_id.
//
// Everything that reaches ggml is validated first: a bad file or a bad request gives a
// moeswarm_error, never a GGML_ASSERT.

#include "ggml.h"
#include "moeswarm-error.h"
#include "moeswarm-mode.h"

#include <stddef.h>
#include <stdint.h>

// the activation between the gate/up and the down projections (llm_ffn_op_type of llama.cpp)
enum moeswarm_act {
    MOESWARM_ACT_AUTO = -1, // from general.architecture, as llama.cpp's model code chooses it
    MOESWARM_ACT_SILU = 0,  // ggml_swiglu_split (ggml_silu without a gate)
    MOESWARM_ACT_GELU,      // ggml_geglu_split  (ggml_gelu without a gate)
    MOESWARM_ACT_RELU,      // ggml_reglu_split  (ggml_relu without a gate)
    MOESWARM_ACT_SWIGLU_OAI,// ggml_swiglu_oai, alpha 1.702, limit 7 (gpt-oss, minimax-m3)
    MOESWARM_ACT_RELU_SQR,  // ggml_relu then ggml_sqr, no gate (nemotron-h)
    MOESWARM_ACT_COUNT,
};

const char * moeswarm_act_name(int32_t act);
int32_t      moeswarm_act_from_name(const char * name); // -2 when unknown

struct moeswarm_slice_params {
    int32_t      n_threads;  // <= 0: all online CPUs (CPU device)
    bool         repack;     // CPU_REPACK buffers for the types llama.cpp repacks by default (its --repack)
    int32_t      act;        // enum moeswarm_act
    uint32_t     n_graphs;   // graphs kept for reuse (by layer and number of (token, slot) pairs)
    const char * device;     // NULL or "cpu": ggml's CPU backend; "gpu": the first GPU; else a ggml
                             // device name ("CUDA0", "ROCm0"...) of a build with that backend
    uint32_t     max_rows;   // most (token, expert) rows in one compute graph; a run with more is
                             // computed in chunks of at most this many. The compute buffer is reserved
                             // at load for it and never grows afterwards. 0: MOESWARM_GPU_MAX_ROWS on
                             // a GPU device, no limit (and a buffer that grows as needed) on the CPU
};

// the default max_rows on a device other than the CPU
#define MOESWARM_GPU_MAX_ROWS 512

struct moeswarm_slice_params moeswarm_slice_default_params(void);

struct moeswarm_slice;

struct moeswarm_slice * moeswarm_slice_init_from_file(
        const char * path, struct moeswarm_slice_params params, struct moeswarm_error * err);
void moeswarm_slice_free(struct moeswarm_slice * slice);

// what the slice holds
uint32_t         moeswarm_slice_n_embd  (const struct moeswarm_slice * slice);
uint32_t         moeswarm_slice_n_expert(const struct moeswarm_slice * slice);   // experts in the slice
uint32_t         moeswarm_slice_n_layer (const struct moeswarm_slice * slice);
const uint32_t * moeswarm_slice_experts (const struct moeswarm_slice * slice);   // global ids, slice order
const uint32_t * moeswarm_slice_layers  (const struct moeswarm_slice * slice);   // ascending
int32_t          moeswarm_slice_act     (const struct moeswarm_slice * slice);
const char *     moeswarm_slice_arch    (const struct moeswarm_slice * slice);   // "" when absent
int32_t          moeswarm_slice_n_threads(const struct moeswarm_slice * slice);
const char *     moeswarm_slice_device  (const struct moeswarm_slice * slice);   // ggml device name
size_t           moeswarm_slice_weight_bytes(const struct moeswarm_slice * slice);
uint32_t         moeswarm_slice_max_rows(const struct moeswarm_slice * slice);       // 0: no limit
size_t           moeswarm_slice_compute_bytes(const struct moeswarm_slice * slice);  // reserved at load, 0: none

struct moeswarm_layer_desc {
    uint32_t       layer;
    uint32_t       n_ff;
    bool           merged;      // ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    bool           has_gate;
    enum ggml_type type_gate;   // GGML_TYPE_COUNT when absent
    enum ggml_type type_up;     // the merged tensor's type when merged
    enum ggml_type type_down;
    bool           repacked;    // at least one tensor lives in a CPU_REPACK buffer
    uint32_t       n_extra;     // biases and scales present
    float          swiglu_limit;// 0: none
};

// i in [0, n_layer)
bool moeswarm_slice_layer_desc(const struct moeswarm_slice * slice, uint32_t i, struct moeswarm_layer_desc * desc);

void moeswarm_slice_set_n_threads(struct moeswarm_slice * slice, int32_t n_threads);

struct moeswarm_run_params {
    uint32_t        layer;     // global layer index, must be in the slice
    uint32_t        n_tokens;  // 1..65536
    uint32_t        k;         // slots per token, 1..256
    const float   * x;         // [n_tokens][n_embd] f32
    const int32_t * ids;       // [n_tokens][k] global expert ids, -1 = empty slot
    const float   * weights;   // [n_tokens][k] f32, required for MOESWARM_MODE_SUM, else may be NULL
    int32_t         mode;      // enum moeswarm_mode
    volatile bool * abort_flag;// optional: set to true to stop the compute early (result: MOESWARM_ABORTED)
    // Activations already in the layer's wire type (moeswarm_slice_wire_type): x_type GGML_TYPE_Q8_0
    // or GGML_TYPE_Q8_K, x_q holding n_tokens rows of ggml_row_size(x_type, n_embd) bytes (x unused).
    // GGML_TYPE_F32 (0, a zeroed struct): x is f32.
    enum ggml_type  x_type;
    const void    * x_q;
    size_t          x_q_size;
};

// number of floats the output of a run holds
size_t moeswarm_run_output_len(const struct moeswarm_slice * slice, uint32_t n_tokens, uint32_t k, int32_t mode);

// Computes the routed experts of one layer for the given tokens. out must hold
// moeswarm_run_output_len floats. Not thread-safe per slice: callers serialise runs.
bool moeswarm_slice_run(struct moeswarm_slice * slice, const struct moeswarm_run_params * params,
        float * out, size_t out_len, struct moeswarm_error * err);

// The reference: one graph exactly as llama.cpp's build_moe_ffn builds it over the whole
// tensors (ids are slice-local expert indices, all valid, no empty slots), ending with the
// weighting ggml_mul and the k-1 ggml_add of the expert views (MOESWARM_MODE_SUM) or at the
// down projection (MOESWARM_MODE_EACH). Used by tests and the benchmark as the monolithic
// baseline the sharded path must reproduce bit for bit.
bool moeswarm_slice_run_reference(struct moeswarm_slice * slice, const struct moeswarm_run_params * params,
        float * out, size_t out_len, struct moeswarm_error * err);

// ggml's own conversions, for test fixtures and oracles (quantize: ggml_quantize_chunk; dequantize:
// the type's to_float). Sizes are checked; false with err on a bad type or size.
bool moeswarm_quantize(enum ggml_type type, const float * src, int64_t n_rows, int64_t n_per_row,
        void * dst, size_t dst_size, struct moeswarm_error * err);
bool moeswarm_dequantize(enum ggml_type type, const void * src, size_t src_size, float * dst, int64_t n,
        struct moeswarm_error * err);
// bytes of n_rows rows of n_per_row values; 0 when n_per_row is not a multiple of the block size
size_t moeswarm_row_bytes(enum ggml_type type, int64_t n_rows, int64_t n_per_row);
// a ggml type by its name ("q4_K", "f32"...; case-insensitive); GGML_TYPE_COUNT when unknown
enum ggml_type moeswarm_type_from_name(const char * name);

// Activations on the wire (moeswarm-activations.cpp). ggml converts f32 activations to the weights'
// vec_dot_type before the expert matmul; a sender that converts them first, with the same ggml-cpu
// from_float, sends fewer bytes and the worker computes the same bits.
// the CPU backend's vec_dot_type of a weight type; GGML_TYPE_COUNT when unknown (or a llama-shared build)
enum ggml_type moeswarm_vec_dot_type(enum ggml_type weight_type);
// the type a weight type's activations may travel in (its vec_dot_type when that is q8_0 or q8_K and
// the CPU mul_mat_id reads the converted rows with vec_dot whatever their origin); GGML_TYPE_COUNT: f32
enum ggml_type moeswarm_wire_type_of_weight(enum ggml_type weight_type);
// the type a layer's activations may travel in (q8_0 or q8_K); GGML_TYPE_COUNT: f32 only (a GPU
// device, gate and up of different vec_dot types, llama4's weighted input, a type without this path)
enum ggml_type moeswarm_slice_wire_type(const struct moeswarm_slice * slice, uint32_t layer);
// n_rows rows of n_per_row f32 values to type (q8_0 or q8_K) with ggml-cpu's from_float, the
// conversion ggml's CPU mul_mat_id applies (not ggml_quantize_chunk's reference rounding)
bool moeswarm_quantize_activations(enum ggml_type type, const float * x, int64_t n_rows, int64_t n_per_row, void * dst,
        size_t dst_size, struct moeswarm_error * err);

// *same = 1 when every row of rows (n_per_row values as type, q8_0 or q8_K) has f32 values that
// from_float turns back into it byte for byte (what a layer in repacked buffers needs, see
// moeswarm-activations.cpp); false with err on a bad type or size
bool moeswarm_activations_round_trip(enum ggml_type type, const void * rows, size_t size, int64_t n_per_row, int32_t * same,
        struct moeswarm_error * err);

// short description of the compiled CPU features (for info and logs)
const char * moeswarm_cpu_features(void);
// the ggml devices of this build, "CPU" first, comma-separated (e.g. "CPU,CUDA0")
const char * moeswarm_devices(void);

// ggml's log goes to a per-thread buffer (the last error lines), echoed to stderr only when
// MOESWARM_GGML_LOG=1. Called once by both wrappers.
void moeswarm_log_init(void);
const char * moeswarm_log_last(void);
void moeswarm_log_reset(void);
