// The compute buffer of a slice on a GPU device: reserved once at load, never grown afterwards.
//
// Why (issue #19): on Vulkan (lavapipe, where device memory is the process heap), letting
// ggml-alloc grow the compute buffer again after the first runs (free the old buffer, allocate a
// bigger one, while the graph cache keeps other layers' graphs) corrupted the heap ("double free or
// corruption") in most runs of the mixed-types test; synchronising before every allocation or never
// evicting a graph did not help, while reserving the buffer once, large enough, passed 10 of 10. So
// the rule is the one llama.cpp follows for its worst case (ggml_backend_sched_reserve at context
// creation): at load, every layer's run graph at the largest batch the slice accepts (max_rows
// (token, expert) rows) is planned, and the compute buffer is reserved for the largest of them. A
// run with more rows is computed in chunks of at most max_rows rows, in turn, rather than refused:
// each row of mul_mat_id is computed on its own, so on the CPU a chunked run gives the same bits
// (test/llama-cpu.test.ts checks it), and the backbone's prefill batches (hundreds of tokens x k)
// are served without the operator sizing anything. Growing by replacing the whole allocator was
// the other option; it frees and reallocates device memory just the same, which is what the
// experiments point at, so it was not chosen. (The cause, found later: on lavapipe, destroying a
// VkBuffer it has bound makes its queue thread free that buffer's resource twice; the worker now
// keeps destroyed buffers alive there, native/worker/vk-lavapipe-guard.cpp. The reservation stays:
// a GPU worker's memory is known at load.)
//
// Every graph built after load is planned once with a second, non-allocating allocator (`measure`)
// and refused (MOESWARM_NATIVE_COMPUTE) if it would need more than the reservation, so ggml-alloc
// never reallocates the buffer; after each allocation the buffer's size is checked again.
// On the CPU nothing is reserved unless max_rows is given: host memory grows safely there. The
// reference graphs (--reference, a test's monolithic baseline in a process of its own, never served)
// are the one exception: they may grow the buffer.

#include "moeswarm-slice-impl.h"

#include <string.h>

#include <algorithm>

static size_t moeswarm_measure(moeswarm_slice * slice, ggml_cgraph * gf) {
    size_t sizes[1] = { 0 };
    ggml_gallocr_reserve_n_size(slice->measure, gf, nullptr, nullptr, sizes);
    return sizes[0];
}

bool moeswarm_reserve_compute(moeswarm_slice * slice, uint32_t max_rows, moeswarm_error * err) {
    if (max_rows == 0 && !slice->on_cpu) {
        max_rows = MOESWARM_GPU_MAX_ROWS;
    }
    if (max_rows == 0) {
        return true;
    }
    if (max_rows > MOESWARM_MAX_TOKENS) {
        return moeswarm_error_set(
                err, "MOESWARM_INVALID_ARGUMENT", "max rows %u is outside 1..%d", max_rows, MOESWARM_MAX_TOKENS);
    }
    slice->measure = ggml_gallocr_new(ggml_backend_get_default_buffer_type(slice->backend));
    if (slice->measure == nullptr) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD", "cannot create the graph allocator");
    }
    // plan every layer's graph (types and n_ff differ per layer), keep the largest
    moeswarm_graph best;
    memset(&best, 0, sizeof(best));
    for (const moeswarm_layer & L : slice->layer_data) {
        moeswarm_graph g;
        if (!moeswarm_graph_build(slice, L, 0, max_rows, 1, GGML_TYPE_F32, g, err)) {
            moeswarm_graph_free(best);
            return false;
        }
        g.need_bytes = moeswarm_measure(slice, g.gf);
        if (best.ctx == nullptr || g.need_bytes > best.need_bytes) {
            moeswarm_graph_free(best);
            best = g;
        } else {
            moeswarm_graph_free(g);
        }
    }
    if (best.ctx == nullptr) {
        return true; // no layers: nothing will run
    }
    // one allocation, for the largest graph; the tensors of that graph are not placed
    const bool ok = ggml_gallocr_reserve(slice->galloc, best.gf);
    const size_t need = best.need_bytes;
    moeswarm_graph_free(best);
    if (!ok) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_LOAD",
                "cannot reserve %zu bytes of %s memory for the compute buffer of %u rows (out of memory? "
                "load with fewer max batch rows)", need, slice->device.c_str(), max_rows);
    }
    slice->max_rows      = max_rows;
    slice->compute_bytes = ggml_gallocr_get_buffer_size(slice->galloc, 0);
    return true;
}

bool moeswarm_graph_check_fits(moeswarm_slice * slice, moeswarm_graph & g, moeswarm_error * err) {
    // the reference graphs (llama.cpp's monolithic shape, k slots per row) are the tests' baseline,
    // run by a worker started with --reference in a process of its own and never served to a
    // swarm (scripts/gpu-check.py sends them 128 tokens x top-8): they may grow the buffer
    if (slice->compute_bytes == 0 || g.kind != 0) {
        return true;
    }
    g.need_bytes = moeswarm_measure(slice, g.gf);
    if (g.need_bytes > slice->compute_bytes) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                "a graph of layer %u over %u rows needs %zu bytes of compute buffer, but %zu were reserved at load "
                "(for %u rows) and the buffer does not grow on %s", g.layer, g.n_rows * g.k, g.need_bytes,
                slice->compute_bytes, slice->max_rows, slice->device.c_str());
    }
    return true;
}

bool moeswarm_check_not_grown(moeswarm_slice * slice, const moeswarm_graph & g, moeswarm_error * err) {
    if (slice->compute_bytes == 0) {
        return true;
    }
    // the measure above is of the whole buffer: ggml-alloc compares chunk by chunk (several only past
    // the device's largest allocation), so a buffer that was reallocated anyway is reported here
    const size_t now = ggml_gallocr_get_buffer_size(slice->galloc, 0);
    if (g.kind != 0) {
        slice->compute_bytes = std::max(slice->compute_bytes, now); // a reference graph grew it
        return true;
    }
    if (now != slice->compute_bytes) {
        return moeswarm_error_set(err, "MOESWARM_NATIVE_COMPUTE",
                "the compute buffer was reallocated (%zu bytes, %zu reserved at load)", now, slice->compute_bytes);
    }
    return true;
}
