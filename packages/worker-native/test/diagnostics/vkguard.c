// Diagnostic LD_PRELOAD shim of issue #19 (not built or run by CI): every VkDeviceMemory gets PAD
// (VKGUARD_PAD, default 65536) extra bytes filled with a pattern; after every fence wait, before
// every submit and at every free the pads are checked and the first overwritten one is reported
// (allocation size, how far the write went, the bytes written). VKGUARD_QUARANTINE=1 keeps freed
// memory, filled and watched, instead of freeing it (writes after vkFreeMemory); VKGUARD_KEEP_BUFFERS=1
// never destroys a VkBuffer (what native/worker/vk-lavapipe-guard.cpp does on lavapipe);
// VKGUARD_LOG=1 logs every allocation and free; VKGUARD_FILE=PATH writes to PATH.<pid>.
// Lavapipe only: its memory is host malloc, mapping is pmem + offset, unmapping is a no-op.
// It interposes vkGetInstanceProcAddr / vkGetDeviceProcAddr, which a worker executable built with
// vk-lavapipe-guard.cpp defines itself (and an executable's definitions come before a preloaded
// library's): use it with a worker built without that file (how the #19 numbers were taken).
//
//   gcc -O1 -g -shared -fPIC -o /tmp/vkguard.so test/diagnostics/vkguard.c -ldl -lpthread
//   npx tsx test/vk-repro.ts --runs 10 --case chunk --binary OLD_WORKER
//       --env LD_PRELOAD=/tmp/vkguard.so --env VKGUARD_FILE=/tmp/guard
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef void (*PFN_void)(void);
typedef int32_t VkResult;
typedef struct { int32_t sType; const void * pNext; uint64_t allocationSize; uint32_t memoryTypeIndex; } AllocInfo;

static size_t PAD = 65536;
#define PAT 0xA5
#define MAXA 4096
struct a { uint64_t mem; uint8_t * p; uint64_t size; int id; int reported; int freed; };
static struct a allocs[MAXA];
static int n_allocs, next_id;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long events;
static FILE * out_f;
static FILE * out(void) { if (!out_f) { const char * f = getenv("VKGUARD_FILE"); char b[512]; if (f) { snprintf(b, sizeof b, "%s.%d", f, (int) getpid()); out_f = fopen(b, "a"); if (out_f) setvbuf(out_f, NULL, _IONBF, 0); } if (!out_f) out_f = stderr; } return out_f; }

static PFN_void (*real_gdpa)(void *, const char *);
static PFN_void (*real_gipa)(void *, const char *);
static VkResult (*real_alloc)(void *, const AllocInfo *, const void *, uint64_t *);
static void (*real_free)(void *, uint64_t, const void *);
static VkResult (*real_map)(void *, uint64_t, uint64_t, uint64_t, uint32_t, void **);
static VkResult (*real_wait)(void *, uint32_t, const void *, uint32_t, uint64_t);
static void (*real_destroy_buffer)(void *, uint64_t, const void *);
static long kept;
static void w_destroy_buffer(void * dev, uint64_t b, const void * cb) { if (getenv("VKGUARD_KEEP_BUFFERS")) { kept++; return; } real_destroy_buffer(dev, b, cb); }
static VkResult (*real_submit)(void *, uint32_t, const void *, uint64_t);

static void check(const char * where) {
    pthread_mutex_lock(&mu);
    events++;
    for (int i = 0; i < n_allocs; i++) {
        struct a * A = &allocs[i];
        if (A->p == NULL || A->reported) continue;
        if (A->freed) {
            size_t first = ~(size_t) 0, last = 0, cnt = 0;
            for (size_t j = 0; j < A->size + PAD; j++) if (A->p[j] != 0x5A) { if (first == ~(size_t) 0) first = j; last = j; cnt++; }
            if (cnt) {
                A->reported = 1;
                fprintf(out(), "VKGUARD: %s (event %ld): FREED allocation #%d of %lu bytes written after vkFreeMemory: %zu bytes in [%zu, %zu]\n",
                        where, events, A->id, (unsigned long) A->size, cnt, first, last);
                fprintf(out(), "VKGUARD: as u32:");
                for (size_t k = first & ~(size_t) 3; k < (first & ~(size_t) 3) + 64 && k + 4 <= A->size + PAD; k += 4) fprintf(out(), " %08x", *(const uint32_t *) (A->p + k));
                fprintf(out(), "\n");
            }
            continue;
        }
        size_t first = PAD, last = 0;
        for (size_t j = 0; j < PAD; j++) {
            if (A->p[A->size + j] != PAT) {
                if (first == PAD) first = j;
                last = j;
            }
        }
        if (first != PAD) {
            A->reported = 1;
            fprintf(out(), "VKGUARD: %s (event %ld): allocation #%d of %lu bytes written past its end: bytes [+%zu, +%zu] of the pad\n",
                    where, events, A->id, (unsigned long) A->size, first, last);
            const uint8_t * q = A->p + A->size + first;
            fprintf(out(), "VKGUARD: first bytes as u32:");
            for (int k = 0; k < 16; k++) fprintf(out(), " %08x", ((const uint32_t *) (A->p + A->size + (first & ~3u)))[k]);
            fprintf(out(), "\nVKGUARD: as f32:");
            for (int k = 0; k < 16; k++) fprintf(out(), " %g", ((const float *) (A->p + A->size + (first & ~3u)))[k]);
            fprintf(out(), "\nVKGUARD: last 64 bytes in bounds as f32:");
            for (int k = 0; k < 16; k++) fprintf(out(), " %g", ((const float *) (A->p + A->size - 64))[k]);
            fprintf(out(), "\n");
            (void) q;
        }
    }
    pthread_mutex_unlock(&mu);
}

static VkResult w_alloc(void * dev, const AllocInfo * info, const void * cb, uint64_t * mem) {
    AllocInfo copy = *info;
    copy.allocationSize += PAD;
    VkResult r = real_alloc(dev, &copy, cb, mem);
    if (r != 0) return r;
    void * p = NULL;
    if (real_map(dev, *mem, 0, ~0ull, 0, &p) == 0 && p) {
        memset((uint8_t *) p + info->allocationSize, PAT, PAD);
        // lavapipe: unmap is a no-op, the pointer stays valid; ggml maps again itself
        void (*unmap)(void *, uint64_t) = (void (*)(void *, uint64_t)) real_gdpa(dev, "vkUnmapMemory");
        unmap(dev, *mem);
    }
    pthread_mutex_lock(&mu);
    int slot = n_allocs;
    for (int i = 0; i < n_allocs; i++) if (allocs[i].p == NULL && !allocs[i].freed) { slot = i; break; }
    if (slot == n_allocs && n_allocs < MAXA) n_allocs++;
    if (slot < MAXA) allocs[slot] = (struct a) { *mem, (uint8_t *) p, info->allocationSize, next_id++, 0, 0 };
    if (getenv("VKGUARD_LOG")) fprintf(out(), "VKGUARD: alloc #%d %lu bytes at %p (type %u)\n", next_id - 1, (unsigned long) info->allocationSize, p, info->memoryTypeIndex);
    pthread_mutex_unlock(&mu);
    return r;
}

static void w_free(void * dev, uint64_t mem, const void * cb) {
    check("vkFreeMemory");
    int quarantined = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_allocs; i++) if (allocs[i].mem == mem && allocs[i].p) {
        if (getenv("VKGUARD_LOG")) fprintf(out(), "VKGUARD: free #%d %lu bytes\n", allocs[i].id, (unsigned long) allocs[i].size);
        if (getenv("VKGUARD_QUARANTINE")) { memset(allocs[i].p, 0x5A, allocs[i].size + PAD); allocs[i].freed = 1; allocs[i].mem = 0; quarantined = 1; }
        else { allocs[i].p = NULL; allocs[i].mem = 0; }
    }
    pthread_mutex_unlock(&mu);
    if (!quarantined) real_free(dev, mem, cb);
}

static VkResult w_wait(void * dev, uint32_t n, const void * f, uint32_t all, uint64_t t) {
    VkResult r = real_wait(dev, n, f, all, t);
    check("after vkWaitForFences");
    return r;
}

static VkResult w_submit(void * q, uint32_t n, const void * s, uint64_t f) {
    check("before vkQueueSubmit");
    return real_submit(q, n, s, f);
}

static void * libvk(void) { static void * h; if (!h) h = dlopen("libvulkan.so.1", RTLD_NOW); return h; }

static PFN_void wrap(const char * name, PFN_void real) {
    if (!real) return real;
    if (!strcmp(name, "vkAllocateMemory")) { real_alloc = (void *) real; return (PFN_void) w_alloc; }
    if (!strcmp(name, "vkFreeMemory")) { real_free = (void *) real; return (PFN_void) w_free; }
    if (!strcmp(name, "vkMapMemory")) { real_map = (void *) real; return real; }
    if (!strcmp(name, "vkWaitForFences")) { real_wait = (void *) real; return (PFN_void) w_wait; }
    if (!strcmp(name, "vkDestroyBuffer")) { real_destroy_buffer = (void *) real; return (PFN_void) w_destroy_buffer; }
    if (!strcmp(name, "vkQueueSubmit")) { real_submit = (void *) real; return (PFN_void) w_submit; }
    return real;
}

PFN_void vkGetDeviceProcAddr(void * dev, const char * name) {
    if (!real_gdpa) real_gdpa = dlsym(libvk(), "vkGetDeviceProcAddr");
    if (getenv("VKGUARD_PAD")) PAD = strtoul(getenv("VKGUARD_PAD"), NULL, 10);
    if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_void) vkGetDeviceProcAddr;
    if (!real_map) real_map = (void *) real_gdpa(dev, "vkMapMemory");
    return wrap(name, real_gdpa(dev, name));
}

PFN_void vkGetInstanceProcAddr(void * inst, const char * name) {
    if (!real_gipa) real_gipa = dlsym(libvk(), "vkGetInstanceProcAddr");
    if (!real_gdpa) real_gdpa = dlsym(libvk(), "vkGetDeviceProcAddr");
    if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_void) vkGetDeviceProcAddr;
    if (!strcmp(name, "vkGetInstanceProcAddr")) return (PFN_void) vkGetInstanceProcAddr;
    PFN_void r = real_gipa(inst, name);
    // device-level functions fetched through the instance
    if (!strcmp(name, "vkMapMemory") && r) real_map = (void *) r;
    return wrap(name, r);
}
