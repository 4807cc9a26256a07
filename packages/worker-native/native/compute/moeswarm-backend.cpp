#include "moeswarm-backend.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <mutex>
#include <string>

#ifdef MOESWARM_LLAMA_SHARED
#include <dlfcn.h>
#else
#include "ggml-cpu.h"
#endif

#if defined(MOESWARM_LLAMA_SHARED) || defined(MOESWARM_DEVICE_REGISTRY)
static ggml_backend_dev_t moeswarm_find_in_registry(const char * name) {
    if (name == nullptr || name[0] == '\0' || strcasecmp(name, "cpu") == 0) {
        return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (strcasecmp(name, "gpu") == 0) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        return dev != nullptr ? dev : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_IGPU);
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (strcasecmp(ggml_backend_dev_name(dev), name) == 0) {
            return dev;
        }
    }
    return nullptr;
}

static const char * moeswarm_registry_devices(void) {
    static std::string names;
    static std::once_flag once;
    std::call_once(once, [] {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            names += (names.empty() ? "" : ",");
            names += ggml_backend_dev_name(ggml_backend_dev_get(i));
        }
    });
    return names.c_str();
}
#endif

#ifdef MOESWARM_LLAMA_SHARED

//
// llama-shared: everything through the registry of the host's libggml
//

// The directory of the backend libraries: MOESWARM_GGML_BACKEND_DIR, else the one the loaded
// libggml came from (node-llama-cpp's bins directory, which holds libggml-cpu-*.so too).
static std::string moeswarm_backend_dir(void) {
    const char * env = getenv("MOESWARM_GGML_BACKEND_DIR");
    if (env != nullptr && env[0] != '\0') {
        return env;
    }
    Dl_info info;
    if (dladdr((void *) &ggml_backend_load_all_from_path, &info) != 0 && info.dli_fname != nullptr) {
        std::string path = info.dli_fname;
        const size_t slash = path.rfind('/');
        if (slash != std::string::npos) {
            return path.substr(0, slash);
        }
    }
    return ".";
}

static ggml_backend_reg_t moeswarm_cpu_reg(void) {
    static std::once_flag once;
    std::call_once(once, [] {
        // a host that already loaded its backends (node-llama-cpp in this process) keeps them
        if (ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) == nullptr) {
            ggml_backend_load_all_from_path(moeswarm_backend_dir().c_str());
        }
    });
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return dev != nullptr ? ggml_backend_dev_backend_reg(dev) : nullptr;
}

template <typename T>
static T moeswarm_cpu_proc(const char * name) {
    ggml_backend_reg_t reg = moeswarm_cpu_reg();
    return reg != nullptr ? (T) ggml_backend_reg_get_proc_address(reg, name) : nullptr;
}

typedef struct ggml_threadpool * (*moeswarm_threadpool_new_t)(struct ggml_threadpool_params * params);
typedef void (*moeswarm_threadpool_free_t)(struct ggml_threadpool * pool);
typedef void (*moeswarm_set_threadpool_t)(ggml_backend_t backend, struct ggml_threadpool * pool);

ggml_backend_dev_t moeswarm_backend_find_device(const char * name) {
    if (moeswarm_cpu_reg() == nullptr) {
        return nullptr;
    }
    return moeswarm_find_in_registry(name);
}

const char * moeswarm_backend_devices(void) {
    moeswarm_cpu_reg();
    return moeswarm_registry_devices();
}

ggml_backend_buffer_type_t moeswarm_backend_cpu_buffer_type(ggml_backend_dev_t dev) {
    return ggml_backend_dev_buffer_type(dev);
}

bool moeswarm_backend_cpu_set_threads(ggml_backend_t backend, int32_t n_threads, struct ggml_threadpool ** pool) {
    auto tp_new  = moeswarm_cpu_proc<moeswarm_threadpool_new_t>("ggml_threadpool_new");
    auto set_tp  = moeswarm_cpu_proc<moeswarm_set_threadpool_t>("ggml_backend_cpu_set_threadpool");
    auto set_n   = moeswarm_cpu_proc<ggml_backend_set_n_threads_t>("ggml_backend_set_n_threads");
    if (tp_new == nullptr || set_tp == nullptr || set_n == nullptr) {
        return false;
    }
    ggml_threadpool_params tp = ggml_threadpool_params_default(n_threads);
    ggml_threadpool * p = tp_new(&tp);
    if (p == nullptr) {
        return false;
    }
    set_n(backend, n_threads);
    set_tp(backend, p);
    *pool = p;
    return true;
}

void moeswarm_backend_cpu_threadpool_free(struct ggml_threadpool * pool) {
    auto tp_free = moeswarm_cpu_proc<moeswarm_threadpool_free_t>("ggml_threadpool_free");
    if (pool != nullptr && tp_free != nullptr) {
        tp_free(pool);
    }
}

void moeswarm_backend_cpu_set_abort_callback(ggml_backend_t backend, ggml_abort_callback cb, void * data) {
    auto set_abort = moeswarm_cpu_proc<ggml_backend_set_abort_callback_t>("ggml_backend_set_abort_callback");
    if (set_abort != nullptr) {
        set_abort(backend, cb, data);
    }
}

const char * moeswarm_backend_cpu_features(void) {
    static std::string text;
    static std::once_flag once;
    std::call_once(once, [] {
        auto get_features = moeswarm_cpu_proc<ggml_backend_get_features_t>("ggml_backend_get_features");
        ggml_backend_reg_t reg = moeswarm_cpu_reg();
        if (get_features != nullptr && reg != nullptr) {
            for (ggml_backend_feature * f = get_features(reg); f != nullptr && f->name != nullptr; ++f) {
                // boolean features are "1"; others (the variant's name, e.g. CPU zen4) say what they are
                if (strcmp(f->value, "1") == 0) {
                    text += (text.empty() ? "" : " ");
                    text += f->name;
                }
            }
        }
        if (text.empty()) {
            text = "baseline";
        }
        for (char & c : text) {
            c = (char) tolower((unsigned char) c);
        }
    });
    return text.c_str();
}

bool moeswarm_backend_cpu_type_supported(enum ggml_type type) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) {
        return false;
    }
    ggml_backend_dev_t dev = moeswarm_backend_find_device("cpu");
    if (dev == nullptr) {
        return false;
    }
    // the question llama.cpp asks (weight_buft_supported): the CPU device's supports_op on a probe
    ggml_init_params ip = { ggml_tensor_overhead() * 4, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) {
        return false;
    }
    const int64_t ne0 = ggml_blck_size(type) * 8;
    ggml_tensor * w   = ggml_new_tensor_3d(ctx, type, ne0, 8, 2);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne0, 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 1);
    const bool ok = ggml_backend_dev_supports_op(dev, ggml_mul_mat_id(ctx, w, b, ids));
    ggml_free(ctx);
    return ok;
}

const char * moeswarm_backend_kind(void) {
    return "llama-shared";
}

#else

//
// static ggml
//

#ifdef MOESWARM_DEVICE_REGISTRY
// the registry brings std::filesystem and dlopen code with it, a megabyte in a static phone
// binary: CPU-only builds go to the CPU backend directly
ggml_backend_dev_t moeswarm_backend_find_device(const char * name) {
    return moeswarm_find_in_registry(name);
}

const char * moeswarm_backend_devices(void) {
    return moeswarm_registry_devices();
}
#else
ggml_backend_dev_t moeswarm_backend_find_device(const char * name) {
    if (name == nullptr || name[0] == '\0' || strcasecmp(name, "cpu") == 0) {
        return ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
    }
    return nullptr;
}

const char * moeswarm_backend_devices(void) {
    return "CPU";
}
#endif

ggml_backend_buffer_type_t moeswarm_backend_cpu_buffer_type(ggml_backend_dev_t dev) {
    (void) dev;
    return ggml_backend_cpu_buffer_type();
}

bool moeswarm_backend_cpu_set_threads(ggml_backend_t backend, int32_t n_threads, struct ggml_threadpool ** pool) {
    ggml_threadpool_params tp = ggml_threadpool_params_default(n_threads);
    ggml_threadpool * p = ggml_threadpool_new(&tp);
    if (p == nullptr) {
        return false;
    }
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    ggml_backend_cpu_set_threadpool(backend, p);
    *pool = p;
    return true;
}

void moeswarm_backend_cpu_threadpool_free(struct ggml_threadpool * pool) {
    if (pool != nullptr) {
        ggml_threadpool_free(pool);
    }
}

void moeswarm_backend_cpu_set_abort_callback(ggml_backend_t backend, ggml_abort_callback cb, void * data) {
    ggml_backend_cpu_set_abort_callback(backend, cb, data);
}

const char * moeswarm_backend_cpu_features(void) {
    static char buf[256];
    if (buf[0] != '\0') {
        return buf;
    }
    struct feature { const char * name; int on; };
    const feature features[] = {
        { "sse3", ggml_cpu_has_sse3() }, { "avx", ggml_cpu_has_avx() }, { "avx2", ggml_cpu_has_avx2() },
        { "fma", ggml_cpu_has_fma() }, { "f16c", ggml_cpu_has_f16c() }, { "avx512", ggml_cpu_has_avx512() },
        { "neon", ggml_cpu_has_neon() }, { "arm_fma", ggml_cpu_has_arm_fma() },
        { "fp16_va", ggml_cpu_has_fp16_va() }, { "dotprod", ggml_cpu_has_dotprod() },
        { "i8mm", ggml_cpu_has_matmul_int8() }, { "sve", ggml_cpu_has_sve() },
    };
    size_t used = 0;
    for (const feature & f : features) {
        if (f.on && used < sizeof(buf)) {
            used += snprintf(buf + used, sizeof(buf) - used, "%s%s", used ? " " : "", f.name);
        }
    }
    if (used == 0) {
        snprintf(buf, sizeof(buf), "baseline");
    }
    return buf;
}

bool moeswarm_backend_cpu_type_supported(enum ggml_type type) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) == 0) {
        return false;
    }
    const ggml_type_traits_cpu * tc = ggml_get_type_traits_cpu(type);
    if (tc == nullptr || tc->vec_dot == nullptr) {
        return false;
    }
    const ggml_type_traits_cpu * tv = ggml_get_type_traits_cpu(tc->vec_dot_type);
    return tv != nullptr && tv->from_float != nullptr;
}

const char * moeswarm_backend_kind(void) {
    return "static";
}

#endif
