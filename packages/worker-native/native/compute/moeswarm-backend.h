#pragma once

// Where the compute core gets its ggml device, buffer types and CPU controls. Three builds:
//  - static, CPU only (default): ggml linked in, the CPU backend called directly;
//  - static with MOESWARM_DEVICE_REGISTRY (GPU builds): ggml's device registry, linked in;
//  - MOESWARM_LLAMA_SHARED ("llama-cpu"): the host's shared libggml-base and libggml (node-llama-cpp's).
//    The CPU backend is the libggml-cpu-<variant>.so that ggml_backend_load_all_from_path picks, as in
//    llama.cpp, so the kernels (and the sums' order) are the ones plain llama.cpp runs. Nothing of the
//    CPU backend is linked: its controls are the registry's proc addresses.

#include "ggml-backend.h"
#include "ggml.h"

// the device by name: NULL, "" or "cpu": the CPU; "gpu": the first GPU; else a ggml device name.
// NULL when there is none (or, llama-shared, when no CPU backend library could be loaded).
ggml_backend_dev_t moeswarm_backend_find_device(const char * name);

// the ggml devices of this build, "CPU" first, comma-separated
const char * moeswarm_backend_devices(void);

// the CPU backend's plain (non-repacked) weight buffer type
ggml_backend_buffer_type_t moeswarm_backend_cpu_buffer_type(ggml_backend_dev_t dev);

// gives backend a new thread pool of n_threads (returned in *pool); the caller frees the previous
// one after this returns (the backend lets go of it first). false when no pool could be made.
bool moeswarm_backend_cpu_set_threads(ggml_backend_t backend, int32_t n_threads, struct ggml_threadpool ** pool);
void moeswarm_backend_cpu_threadpool_free(struct ggml_threadpool * pool);

void moeswarm_backend_cpu_set_abort_callback(ggml_backend_t backend, ggml_abort_callback cb, void * data);

// can the CPU backend run MUL_MAT_ID with this weight type on f32 activations?
bool moeswarm_backend_cpu_type_supported(enum ggml_type type);

// short description of the CPU features the running CPU backend was compiled for
const char * moeswarm_backend_cpu_features(void);

// "static" or "llama-shared"
const char * moeswarm_backend_kind(void);
