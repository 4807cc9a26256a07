#pragma once

// A loaded slice as the addon's handles share it: the SliceHandle (addon.cpp) owns it, runs on the
// thread pool and the native listener's connection threads (native-server.cpp) hold it while they
// compute, and every run takes its mutex.

#include "moeswarm-slice.h"

#include <napi.h>

#include <atomic>
#include <memory>
#include <mutex>

namespace moeswarm_addon {

struct slice_state {
    std::mutex       mu;
    moeswarm_slice * slice = nullptr;
    std::atomic<bool> closed{false};
    std::atomic<int32_t> pending_threads{-1}; // applied by the next run, never blocking the JS thread
    volatile bool    abort = false;

    ~slice_state() {
        moeswarm_slice_free(slice);
    }
};

Napi::Error make_error(Napi::Env env, const char * code, const std::string & msg);
[[noreturn]] void throw_error(Napi::Env env, const char * code, const std::string & msg);

// The slice of a SliceHandle of this addon (of this environment), or a thrown MOESWARM_INVALID_ARGUMENT.
std::shared_ptr<slice_state> slice_state_of(Napi::Env env, const Napi::Value & v);

} // namespace moeswarm_addon
