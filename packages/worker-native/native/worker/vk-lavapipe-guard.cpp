// The workaround for a heap corruption inside Mesa's lavapipe (issue #19), in the shared-ggml
// worker executable only.
//
// What happens: ggml-vulkan grows its preallocated buffers (prealloc_x / prealloc_y /
// prealloc_split_k, ggml-vulkan.cpp ggml_vk_preallocate_buffers) in the middle of a graph when a
// node needs more than the last one did: it submits the recorded work, waits for the fence
// (ggml_vk_synchronize), then destroys the old VkBuffer and creates a bigger one. That order is what
// the Vulkan spec asks for. On lavapipe (Debian 12's Mesa 22.3.6) the llvmpipe resource behind the
// destroyed buffer is nevertheless released twice by lavapipe's own queue thread on a later
// submission: valgrind shows the 496-byte block calloc'd by vkCreateBuffer (called from
// ggml_vk_create_buffer <- ggml_vk_preallocate_buffers <- ggml_vk_mul_mat_id_q_f16) freed by the
// queue thread, read again and freed a second time by the same thread ("Invalid free"), which is
// the "double free or corruption" / SIGSEGV of the chunk case. No shader writes out of bounds: with
// 64 KiB guard bytes after every VkDeviceMemory and freed memory kept and watched, nothing is
// written past an allocation or after its free, and the crash still happens; deferring
// vkDestroyBuffer alone makes it go away (test/vk-repro.ts numbers in the #19 notes).
//
// So on a lavapipe device the worker keeps the VkBuffer objects ggml-vulkan destroys (their memory
// is still freed) until the device itself is destroyed. What it keeps is small and bounded: a
// buffer is destroyed only when a preallocated buffer grows, and those only grow.
//
// How: ggml-vulkan resolves every Vulkan function through vkGetInstanceProcAddr /
// vkGetDeviceProcAddr (vulkan-hpp's dynamic dispatcher), which it imports from libvulkan.so.1. This
// executable exports both (CMake: --export-dynamic-symbol), so the loader binds libggml-vulkan.so's
// imports to the functions below, which hand out the real functions except vkCreateDevice,
// vkDestroyBuffer and vkDestroyDevice. MOESWARM_VK_KEEP_DESTROYED_BUFFERS=0 turns the workaround off
// (the reproducer's "before"), =1 applies it on any Vulkan device.
//
// Vulkan's headers are not needed: handles are pointers or 64-bit integers, and the one struct read
// (VkPhysicalDeviceProperties) is read through its fixed leading fields.

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

typedef void (*moeswarm_vk_void_fn)(void);
typedef int32_t moeswarm_vk_result;

// VkPhysicalDeviceProperties: apiVersion, driverVersion, vendorID, deviceID (uint32_t),
// deviceType (VkPhysicalDeviceType, int32), deviceName[256]; the rest (limits...) is not read
struct moeswarm_vk_props_head {
    uint32_t api_version;
    uint32_t driver_version;
    uint32_t vendor_id;
    uint32_t device_id;
    int32_t device_type;
    char device_name[256];
};
#define MOESWARM_VK_DEVICE_TYPE_CPU 4
#define MOESWARM_VK_PROPS_BYTES     4096 // larger than VkPhysicalDeviceProperties (824 bytes)

struct moeswarm_vk_kept {
    void * device;
    uint64_t buffer;
    const void * allocator;
};

typedef moeswarm_vk_void_fn (*moeswarm_vk_gipa_fn)(void *, const char *);
typedef moeswarm_vk_void_fn (*moeswarm_vk_gdpa_fn)(void *, const char *);
typedef moeswarm_vk_result (*moeswarm_vk_create_device_fn)(void *, const void *, const void *, void **);
typedef void (*moeswarm_vk_props_fn)(void *, void *);
typedef void (*moeswarm_vk_destroy_buffer_fn)(void *, uint64_t, const void *);
typedef void (*moeswarm_vk_destroy_device_fn)(void *, const void *);

static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static moeswarm_vk_gipa_fn g_gipa;
static moeswarm_vk_gdpa_fn g_gdpa;
static moeswarm_vk_create_device_fn g_create_device;
static moeswarm_vk_props_fn g_props;
static moeswarm_vk_destroy_buffer_fn g_destroy_buffer;
static moeswarm_vk_destroy_device_fn g_destroy_device;
static std::vector<void *> g_keep_devices; // VkDevice handles whose destroyed buffers are kept
static std::vector<moeswarm_vk_kept> g_kept;

static void * moeswarm_vk_loader(void) {
    static void * handle = nullptr;
    if (handle == nullptr) {
        handle = dlopen("libvulkan.so.1", RTLD_NOW | RTLD_LOCAL);
    }
    return handle;
}

static void moeswarm_vk_resolve(void) {
    if (g_gipa == nullptr && moeswarm_vk_loader() != nullptr) {
        g_gipa = (moeswarm_vk_gipa_fn) dlsym(moeswarm_vk_loader(), "vkGetInstanceProcAddr");
        g_gdpa = (moeswarm_vk_gdpa_fn) dlsym(moeswarm_vk_loader(), "vkGetDeviceProcAddr");
    }
}

// -1: never keep, 1: keep on every device, 0: keep on lavapipe only (the default)
static int moeswarm_vk_keep_mode(void) {
    const char * v = getenv("MOESWARM_VK_KEEP_DESTROYED_BUFFERS");
    if (v == nullptr || *v == '\0') {
        return 0;
    }
    return strcmp(v, "0") == 0 ? -1 : 1;
}

static bool moeswarm_vk_is_lavapipe(void * physical_device) {
    if (g_props == nullptr) {
        return false;
    }
    alignas(8) unsigned char raw[MOESWARM_VK_PROPS_BYTES];
    memset(raw, 0, sizeof(raw));
    g_props(physical_device, raw);
    moeswarm_vk_props_head head;
    memcpy(&head, raw, sizeof(head));
    head.device_name[sizeof(head.device_name) - 1] = '\0';
    return head.device_type == MOESWARM_VK_DEVICE_TYPE_CPU && strncmp(head.device_name, "llvmpipe", 8) == 0;
}

static moeswarm_vk_result moeswarm_vk_create_device(
        void * physical_device, const void * info, const void * allocator, void ** device) {
    const moeswarm_vk_result r = g_create_device(physical_device, info, allocator, device);
    const int mode = moeswarm_vk_keep_mode();
    if (r == 0 && mode >= 0 && (mode == 1 || moeswarm_vk_is_lavapipe(physical_device))) {
        pthread_mutex_lock(&g_mutex);
        g_keep_devices.push_back(*device);
        pthread_mutex_unlock(&g_mutex);
    }
    return r;
}

static void moeswarm_vk_destroy_buffer(void * device, uint64_t buffer, const void * allocator) {
    pthread_mutex_lock(&g_mutex);
    bool keep = false;
    for (void * d : g_keep_devices) {
        keep = keep || d == device;
    }
    if (keep && buffer != 0) {
        g_kept.push_back({ device, buffer, allocator });
    }
    pthread_mutex_unlock(&g_mutex);
    if (!keep) {
        g_destroy_buffer(device, buffer, allocator);
    }
}

// the device's queue is idle when the device is destroyed: the kept buffers can go first
static void moeswarm_vk_destroy_device(void * device, const void * allocator) {
    std::vector<moeswarm_vk_kept> mine;
    pthread_mutex_lock(&g_mutex);
    for (size_t i = 0; i < g_kept.size();) {
        if (g_kept[i].device == device) {
            mine.push_back(g_kept[i]);
            g_kept[i] = g_kept.back();
            g_kept.pop_back();
        } else {
            ++i;
        }
    }
    for (size_t i = 0; i < g_keep_devices.size(); ++i) {
        if (g_keep_devices[i] == device) {
            g_keep_devices[i] = g_keep_devices.back();
            g_keep_devices.pop_back();
            break;
        }
    }
    pthread_mutex_unlock(&g_mutex);
    for (const moeswarm_vk_kept & k : mine) {
        g_destroy_buffer(k.device, k.buffer, k.allocator);
    }
    g_destroy_device(device, allocator);
}

// the real function, or the wrapper taking its place (the real one kept for the wrapper)
static moeswarm_vk_void_fn moeswarm_vk_wrap(const char * name, moeswarm_vk_void_fn real) {
    if (real == nullptr || name == nullptr) {
        return real;
    }
    if (strcmp(name, "vkCreateDevice") == 0) {
        g_create_device = (moeswarm_vk_create_device_fn) real;
        return (moeswarm_vk_void_fn) moeswarm_vk_create_device;
    }
    if (strcmp(name, "vkGetPhysicalDeviceProperties") == 0) {
        g_props = (moeswarm_vk_props_fn) real;
        return real;
    }
    if (strcmp(name, "vkDestroyBuffer") == 0) {
        g_destroy_buffer = (moeswarm_vk_destroy_buffer_fn) real;
        return (moeswarm_vk_void_fn) moeswarm_vk_destroy_buffer;
    }
    if (strcmp(name, "vkDestroyDevice") == 0) {
        g_destroy_device = (moeswarm_vk_destroy_device_fn) real;
        return (moeswarm_vk_void_fn) moeswarm_vk_destroy_device;
    }
    return real;
}

extern "C" {

__attribute__((visibility("default"))) moeswarm_vk_void_fn vkGetDeviceProcAddr(void * device, const char * name);

__attribute__((visibility("default"))) moeswarm_vk_void_fn vkGetInstanceProcAddr(void * instance, const char * name) {
    moeswarm_vk_resolve();
    if (g_gipa == nullptr) {
        return nullptr;
    }
    if (name != nullptr && strcmp(name, "vkGetInstanceProcAddr") == 0) {
        return (moeswarm_vk_void_fn) vkGetInstanceProcAddr;
    }
    if (name != nullptr && strcmp(name, "vkGetDeviceProcAddr") == 0) {
        return (moeswarm_vk_void_fn) vkGetDeviceProcAddr;
    }
    moeswarm_vk_void_fn real = g_gipa(instance, name);
    if (instance != nullptr && name != nullptr && g_props == nullptr) {
        g_props = (moeswarm_vk_props_fn) g_gipa(instance, "vkGetPhysicalDeviceProperties");
    }
    return moeswarm_vk_wrap(name, real);
}

__attribute__((visibility("default"))) moeswarm_vk_void_fn vkGetDeviceProcAddr(void * device, const char * name) {
    moeswarm_vk_resolve();
    if (g_gdpa == nullptr) {
        return nullptr;
    }
    if (name != nullptr && strcmp(name, "vkGetDeviceProcAddr") == 0) {
        return (moeswarm_vk_void_fn) vkGetDeviceProcAddr;
    }
    return moeswarm_vk_wrap(name, g_gdpa(device, name));
}

} // extern "C"
