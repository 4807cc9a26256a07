#pragma once

// A decoded `dispatch` frame as the compute's run parameters: shared by the executable worker
// (worker/worker-main.cpp) and the addon's native listener (addon/native-server.cpp), so that both
// hand the compute exactly the same inputs. ids and weights are copied out of the frame (its bytes
// need not be aligned), and so are f32 rows that are not float-aligned; f16/bf16 rows are widened
// with ggml's conversions; aligned f32 rows and q8_0/q8_K rows are used where they lie in the frame,
// which must outlive the run.

#include "moeswarm-frame.h"
#include "moeswarm-slice.h"

#include <stdint.h>

#include <vector>

struct moeswarm_dispatch_scratch {
    std::vector<float>    x;
    std::vector<int32_t>  ids;
    std::vector<float>    w;
    std::vector<uint16_t> half;
};

// rp is filled (layer, n_tokens, k, mode, inputs); abort_flag is left NULL
void moeswarm_dispatch_run_params(const struct moeswarm_frame * f, struct moeswarm_dispatch_scratch * s,
        struct moeswarm_run_params * rp);
