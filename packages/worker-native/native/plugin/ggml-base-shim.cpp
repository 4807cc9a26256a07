// The seven libggml-base functions the plugin calls, bound at run time to whichever libggml-base the
// host process already loaded: node-llama-cpp ships it as `libggml-base.so`, an upstream llama.cpp
// build as `libggml-base.so.0`. A DT_NEEDED entry names one file, and ggml_backend_load dlopens
// backends with RTLD_LOCAL (ggml-backend-dl.cpp), while node loads its addon RTLD_LOCAL too, so
// neither "leave the symbols undefined" nor "need one soname" works in both hosts. Instead the
// plugin links no ggml library and defines these symbols itself (hidden, so they never interpose
// on the host's), forwarding to the loaded libggml-base found by dl_iterate_phdr.
//
// ggml_abort and ggml_log_internal are variadic: the message is formatted here and handed on as
// "%s", which prints the same text.

#include "moeswarm-plugin.h"

#include <dlfcn.h>
#include <link.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <string>

namespace {

struct ggml_base_api {
    void (*abort)(const char *, int, const char *, ...)                       = nullptr;
    void (*log_internal)(enum ggml_log_level, const char *, ...)              = nullptr;
    const char * (*op_desc)(const struct ggml_tensor *)                       = nullptr;
    size_t (*buffer_get_size)(ggml_backend_buffer_t)                          = nullptr;
    ggml_backend_buffer_type_t (*buffer_get_type)(ggml_backend_buffer_t)      = nullptr;
    enum ggml_backend_buffer_usage (*buffer_get_usage)(ggml_backend_buffer_t) = nullptr;
    ggml_backend_buffer_t (*buffer_init)(ggml_backend_buffer_type_t, struct ggml_backend_buffer_i, void *,
                                         size_t)                             = nullptr;
};

// the basename of a loaded object that is libggml-base under any soname (libggml-base.so,
// libggml-base.so.0, libggml-base.so.0.9.4)
bool is_ggml_base(const char * path) {
    if (path == nullptr) return false;
    const char * slash = strrchr(path, '/');
    const char * base  = slash ? slash + 1 : path;
    return strncmp(base, "libggml-base.so", 15) == 0 && (base[15] == '\0' || base[15] == '.');
}

int find_ggml_base(struct dl_phdr_info * info, size_t, void * out) {
    if (!is_ggml_base(info->dlpi_name)) return 0;
    *static_cast<std::string *>(out) = info->dlpi_name;
    return 1;
}

template <typename F> void bind(void * handle, F & slot, const char * name) {
    slot = reinterpret_cast<F>(handle ? dlsym(handle, name) : nullptr);
    // a host that linked ggml-base statically into its executable: the global scope has it
    if (slot == nullptr) slot = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

const ggml_base_api & api() {
    static ggml_base_api a;
    static std::once_flag once;
    std::call_once(once, [] {
        std::string path;
        dl_iterate_phdr(find_ggml_base, &path);
        // RTLD_NOLOAD: only a reference to the library the host already holds, never a second copy
        void * handle = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
        bind(handle, a.abort, "ggml_abort");
        bind(handle, a.log_internal, "ggml_log_internal");
        bind(handle, a.op_desc, "ggml_op_desc");
        bind(handle, a.buffer_get_size, "ggml_backend_buffer_get_size");
        bind(handle, a.buffer_get_type, "ggml_backend_buffer_get_type");
        bind(handle, a.buffer_get_usage, "ggml_backend_buffer_get_usage");
        bind(handle, a.buffer_init, "ggml_backend_buffer_init");
        if (!a.abort || !a.log_internal || !a.op_desc || !a.buffer_get_size || !a.buffer_get_type ||
            !a.buffer_get_usage || !a.buffer_init) {
            fprintf(stderr,
                    "ggml-moeswarm: no libggml-base in this process (found '%s'); load libggml-moeswarm.so "
                    "only into llama.cpp (GGML_BACKEND_PATH)\n",
                    path.c_str());
            abort();
        }
    });
    return a;
}

}  // namespace

// The plugin's own definitions; hidden visibility keeps them out of the dynamic symbol table.
extern "C" {

bool moeswarm_ggml_base_available(void) {
    std::string path;
    dl_iterate_phdr(find_ggml_base, &path);
    return !path.empty() || dlsym(RTLD_DEFAULT, "ggml_backend_buffer_init") != nullptr;
}

void ggml_abort(const char * file, int line, const char * fmt, ...) {
    char msg[2048];
    va_list args;
    va_start(args, fmt);
    vsnprintf(msg, sizeof(msg), fmt, args);
    va_end(args);
    api().abort(file, line, "%s", msg);
    abort();  // ggml_abort never returns; keeps [[noreturn]] honest
}

void ggml_log_internal(enum ggml_log_level level, const char * fmt, ...) {
    char msg[4096];
    va_list args;
    va_start(args, fmt);
    vsnprintf(msg, sizeof(msg), fmt, args);
    va_end(args);
    api().log_internal(level, "%s", msg);
}

const char * ggml_op_desc(const struct ggml_tensor * t) {
    return api().op_desc(t);
}

size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer) {
    return api().buffer_get_size(buffer);
}

ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer) {
    return api().buffer_get_type(buffer);
}

enum ggml_backend_buffer_usage ggml_backend_buffer_get_usage(ggml_backend_buffer_t buffer) {
    return api().buffer_get_usage(buffer);
}

ggml_backend_buffer_t ggml_backend_buffer_init(ggml_backend_buffer_type_t buft, struct ggml_backend_buffer_i iface,
                                               void * context, size_t size) {
    return api().buffer_init(buft, iface, context, size);
}

}  // extern "C"
