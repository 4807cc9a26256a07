// A decoded dispatch as run parameters (moeswarm-dispatch.h).

#include "moeswarm-dispatch.h"

#include "ggml.h"

#include <stdint.h>
#include <string.h>

void moeswarm_dispatch_run_params(const moeswarm_frame * f, moeswarm_dispatch_scratch * s, moeswarm_run_params * rp) {
    const size_t n_x = (size_t) f->n * f->embd;
    const size_t n_slots = (size_t) f->n * f->k;
    // q8_0/q8_K rows go to the compute as they came (they stay in the frame's buffer during the run),
    // and so do f32 rows where they are float-aligned (always, for a sender that pads as protocol
    // section 8 says and a receiver holding the payload at an aligned address): no copy of x
    const bool wire_q8 = f->dtype == MOESWARM_DTYPE_Q8_0 || f->dtype == MOESWARM_DTYPE_Q8_K;
    const bool f32_in_place = f->dtype == MOESWARM_DTYPE_F32 && (uintptr_t) f->x.ptr % alignof(float) == 0;
    s->x.resize(wire_q8 || f32_in_place ? 0 : n_x);
    if (wire_q8 || f32_in_place) {
    } else if (f->dtype == MOESWARM_DTYPE_F32) {
        memcpy(s->x.data(), f->x.ptr, n_x * sizeof(float));
    } else {
        s->half.resize(n_x);
        memcpy(s->half.data(), f->x.ptr, n_x * sizeof(uint16_t));
        if (f->dtype == MOESWARM_DTYPE_F16) {
            ggml_fp16_to_fp32_row((const ggml_fp16_t *) s->half.data(), s->x.data(), (int64_t) n_x);
        } else {
            ggml_bf16_to_fp32_row((const ggml_bf16_t *) s->half.data(), s->x.data(), (int64_t) n_x);
        }
    }
    s->ids.resize(n_slots);
    memcpy(s->ids.data(), f->ids.ptr, n_slots * sizeof(int32_t));
    if (f->w.present) {
        s->w.resize(n_slots);
        memcpy(s->w.data(), f->w.ptr, n_slots * sizeof(float));
    }
    memset(rp, 0, sizeof(*rp));
    rp->layer = f->layer;
    rp->n_tokens = f->n;
    rp->k = f->k;
    rp->x = wire_q8 ? nullptr : f32_in_place ? (const float *) f->x.ptr : s->x.data();
    if (wire_q8) {
        rp->x_type = f->dtype == MOESWARM_DTYPE_Q8_0 ? GGML_TYPE_Q8_0 : GGML_TYPE_Q8_K;
        rp->x_q = f->x.ptr;
        rp->x_q_size = f->x.len;
    }
    rp->ids = s->ids.data();
    rp->weights = f->w.present ? s->w.data() : nullptr;
    rp->mode = f->mode;
}
