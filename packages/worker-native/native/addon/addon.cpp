// The N-API wrapper of the expert compute core. Loading and running happen on libuv's thread
// pool (Napi::AsyncWorker); runs of one slice are serialised by its mutex. Inputs are copied
// before the worker starts, so the caller may reuse its typed arrays at once; the output array is
// made on the JS thread before the worker starts and the compute writes into it directly.
// `runSync` computes on the calling thread instead, reading the caller's arrays in place: for small
// requests, where the thread-pool hop costs more than the arithmetic. Failures reject (or throw)
// with an Error carrying `code` (a MOESWARM_* code); src/native-binding.ts turns it into the
// typed error class.

#include "moeswarm-slice.h"
#include "native-server.h"
#include "slice-state.h"

#include <napi.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moeswarm_addon {

Napi::Error make_error(Napi::Env env, const char * code, const std::string & msg) {
    Napi::Error e = Napi::Error::New(env, msg);
    e.Set("code", Napi::String::New(env, code));
    return e;
}

[[noreturn]] void throw_error(Napi::Env env, const char * code, const std::string & msg) {
    throw make_error(env, code, msg);
}

} // namespace moeswarm_addon

namespace {

using moeswarm_addon::make_error;
using moeswarm_addon::slice_state;
using moeswarm_addon::throw_error;

Napi::Error make_error(Napi::Env env, const moeswarm_error & err) {
    return make_error(env, err.code[0] ? err.code : "MOESWARM_NATIVE_COMPUTE", err.msg);
}

uint32_t get_u32(Napi::Env env, const Napi::Value & v, const char * name, uint32_t lo, uint32_t hi) {
    if (!v.IsNumber()) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", std::string(name) + " must be a number");
    }
    const double d = v.As<Napi::Number>().DoubleValue();
    if (!(d >= lo && d <= hi) || d != (double) (uint64_t) d) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", std::string(name) + " must be an integer in " +
            std::to_string(lo) + ".." + std::to_string(hi));
    }
    return (uint32_t) d;
}

Napi::Object slice_info(Napi::Env env, const moeswarm_slice * s) {
    Napi::Object o = Napi::Object::New(env);
    const uint32_t n_layer = moeswarm_slice_n_layer(s);
    const uint32_t n_expert = moeswarm_slice_n_expert(s);
    Napi::Array layers = Napi::Array::New(env, n_layer);
    Napi::Array tensors = Napi::Array::New(env, n_layer);
    for (uint32_t i = 0; i < n_layer; ++i) {
        moeswarm_layer_desc d;
        moeswarm_slice_layer_desc(s, i, &d);
        layers.Set(i, Napi::Number::New(env, d.layer));
        Napi::Object t = Napi::Object::New(env);
        t.Set("layer", Napi::Number::New(env, d.layer));
        t.Set("nFf", Napi::Number::New(env, d.n_ff));
        t.Set("merged", Napi::Boolean::New(env, d.merged));
        t.Set("gate", d.type_gate == GGML_TYPE_COUNT ? env.Null() : Napi::String::New(env, ggml_type_name(d.type_gate)));
        t.Set("up", Napi::String::New(env, ggml_type_name(d.type_up)));
        t.Set("down", Napi::String::New(env, ggml_type_name(d.type_down)));
        t.Set("repacked", Napi::Boolean::New(env, d.repacked));
        t.Set("extras", Napi::Number::New(env, d.n_extra));
        t.Set("swigluLimit", Napi::Number::New(env, d.swiglu_limit));
        const enum ggml_type wire = moeswarm_slice_wire_type(s, d.layer);
        t.Set("wire", wire == GGML_TYPE_COUNT ? env.Null() : Napi::String::New(env, ggml_type_name(wire)));
        tensors.Set(i, t);
    }
    Napi::Array experts = Napi::Array::New(env, n_expert);
    for (uint32_t i = 0; i < n_expert; ++i) {
        experts.Set(i, Napi::Number::New(env, moeswarm_slice_experts(s)[i]));
    }
    o.Set("layers", layers);
    o.Set("experts", experts);
    o.Set("tensors", tensors);
    o.Set("nEmbd", Napi::Number::New(env, moeswarm_slice_n_embd(s)));
    o.Set("act", Napi::String::New(env, moeswarm_act_name(moeswarm_slice_act(s))));
    o.Set("arch", Napi::String::New(env, moeswarm_slice_arch(s)));
    o.Set("threads", Napi::Number::New(env, moeswarm_slice_n_threads(s)));
    o.Set("weightBytes", Napi::Number::New(env, (double) moeswarm_slice_weight_bytes(s)));
    o.Set("cpu", Napi::String::New(env, moeswarm_cpu_features()));
    o.Set("device", Napi::String::New(env, moeswarm_slice_device(s)));
    return o;
}

class SliceHandle;

class LoadWorker : public Napi::AsyncWorker {
public:
    LoadWorker(Napi::Env env, std::string path, moeswarm_slice_params params, std::string device)
        : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), path_(std::move(path)), params_(params),
          device_(std::move(device)) {
        moeswarm_error_clear(&err_);
    }
    ~LoadWorker() override { moeswarm_slice_free(slice_); }

    Napi::Promise promise() { return deferred_.Promise(); }

    void Execute() override {
        params_.device = device_.empty() ? nullptr : device_.c_str();
        slice_ = moeswarm_slice_init_from_file(path_.c_str(), params_, &err_);
    }

    void OnOK() override;

private:
    Napi::Promise::Deferred deferred_;
    std::string path_;
    moeswarm_slice_params params_;
    std::string device_;
    moeswarm_slice * slice_ = nullptr;
    moeswarm_error err_;
};

class RunWorker : public Napi::AsyncWorker {
public:
    RunWorker(Napi::Env env, std::shared_ptr<slice_state> state, moeswarm_run_params params, bool reference,
            std::vector<float> x, std::vector<uint8_t> xq, std::vector<int32_t> ids, std::vector<float> w,
            Napi::Float32Array y)
        : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), state_(std::move(state)),
          params_(params), reference_(reference), x_(std::move(x)), xq_(std::move(xq)), ids_(std::move(ids)),
          w_(std::move(w)), y_ref_(Napi::Persistent(y)), y_(y.Data()), n_out_(y.ElementLength()) {
        moeswarm_error_clear(&err_);
    }

    Napi::Promise promise() { return deferred_.Promise(); }

    void Execute() override {
        std::lock_guard<std::mutex> lock(state_->mu);
        if (state_->slice == nullptr) {
            moeswarm_error_set(&err_, "MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
            return;
        }
        state_->abort = false;
        const int32_t threads = state_->pending_threads.exchange(-1);
        if (threads >= 0) {
            moeswarm_slice_set_n_threads(state_->slice, threads);
        }
        params_.x = x_.data();
        params_.x_q = xq_.data();
        params_.x_q_size = xq_.size();
        params_.ids = ids_.data();
        params_.weights = w_.empty() ? nullptr : w_.data();
        params_.abort_flag = &state_->abort;
        // y_ is the data of a Float32Array that y_ref_ keeps alive: its memory never moves
        ok_ = reference_ ? moeswarm_slice_run_reference(state_->slice, &params_, y_, n_out_, &err_)
                         : moeswarm_slice_run(state_->slice, &params_, y_, n_out_, &err_);
        state_->abort = false;
    }

    void OnOK() override {
        Napi::Env env = Env();
        if (!ok_) {
            deferred_.Reject(make_error(env, err_).Value());
            return;
        }
        deferred_.Resolve(y_ref_.Value());
    }

private:
    Napi::Promise::Deferred deferred_;
    std::shared_ptr<slice_state> state_;
    moeswarm_run_params params_;
    bool reference_;
    std::vector<float> x_;
    std::vector<uint8_t> xq_;
    std::vector<int32_t> ids_;
    std::vector<float> w_;
    Napi::Reference<Napi::Float32Array> y_ref_;
    float * y_;
    size_t n_out_;
    bool ok_ = false;
    moeswarm_error err_;
};

class CloseWorker : public Napi::AsyncWorker {
public:
    CloseWorker(Napi::Env env, std::shared_ptr<slice_state> state)
        : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), state_(std::move(state)) {}

    Napi::Promise promise() { return deferred_.Promise(); }

    void Execute() override {
        state_->abort = true;
        std::lock_guard<std::mutex> lock(state_->mu); // waits for a run in flight
        moeswarm_slice_free(state_->slice);
        state_->slice = nullptr;
    }

    void OnOK() override { deferred_.Resolve(Env().Undefined()); }

private:
    Napi::Promise::Deferred deferred_;
    std::shared_ptr<slice_state> state_;
};

class SliceHandle : public Napi::ObjectWrap<SliceHandle> {
public:
    static Napi::Function define(Napi::Env env) {
        return DefineClass(env, "SliceHandle", {
            InstanceMethod<&SliceHandle::run>("run"),
            InstanceMethod<&SliceHandle::run_sync>("runSync"),
            InstanceMethod<&SliceHandle::info>("info"),
            InstanceMethod<&SliceHandle::set_threads>("setThreads"),
            InstanceMethod<&SliceHandle::abort>("abort"),
            InstanceMethod<&SliceHandle::close>("close"),
        });
    }

    SliceHandle(const Napi::CallbackInfo & info) : Napi::ObjectWrap<SliceHandle>(info) {
        state_ = std::make_shared<slice_state>();
        if (info.Length() == 1 && info[0].IsExternal()) {
            state_->slice = info[0].As<Napi::External<moeswarm_slice>>().Data();
        }
    }

    std::shared_ptr<slice_state> state() const { return state_; }

private:
    void check_open(Napi::Env env) {
        if (state_->closed.load() || state_->slice == nullptr) {
            throw_error(env, "MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
        }
    }

    // The checked arguments of run and runSync; views of the caller's arrays.
    struct run_args {
        moeswarm_run_params p;
        bool reference;
        Napi::Float32Array x;   // f32 activations, or
        Napi::Uint8Array xq;    // the rows in the layer's wire type (p.x_type)
        Napi::Int32Array ids;
        Napi::Float32Array w; // empty when absent
        size_t n_out;
    };

    run_args parse_run(const Napi::CallbackInfo & info, const char * usage) {
        Napi::Env env = info.Env();
        check_open(env);
        if (info.Length() < 7) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", usage);
        }
        run_args a;
        moeswarm_run_params & p = a.p;
        memset(&p, 0, sizeof(p));
        p.layer = get_u32(env, info[0], "layer", 0, UINT32_MAX);
        p.k = get_u32(env, info[3], "k", 1, 256);
        p.mode = (int32_t) get_u32(env, info[5], "mode", 0, 1);
        a.reference = info[6].ToBoolean().Value();
        const bool wire = info[1].IsTypedArray() && info[1].As<Napi::TypedArray>().TypedArrayType() == napi_uint8_array;
        if (!wire && (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array)) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "x must be a Float32Array (or a Uint8Array of q8_0/q8_K rows)");
        }
        if (!info[2].IsTypedArray() || info[2].As<Napi::TypedArray>().TypedArrayType() != napi_int32_array) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "ids must be an Int32Array");
        }
        a.ids = info[2].As<Napi::Int32Array>();
        const uint32_t n_embd = moeswarm_slice_n_embd(state_->slice);
        const size_t n_ids = a.ids.ElementLength();
        if (n_ids == 0 || n_ids % p.k != 0 || n_ids / p.k > 65536) {
            throw_error(env, "MOESWARM_NATIVE_COMPUTE", "ids holds " + std::to_string(n_ids) +
                " values: expected n_tokens * k with 1 <= n_tokens <= 65536 and k = " + std::to_string(p.k));
        }
        p.n_tokens = (uint32_t) (n_ids / p.k);
        if (wire) {
            // runs in the wire type: the 8th argument names it; moeswarm_slice_run checks it against the layer
            p.x_type = info.Length() > 7 && info[7].IsString()
                ? moeswarm_type_from_name(info[7].As<Napi::String>().Utf8Value().c_str()) : GGML_TYPE_COUNT;
            if (p.x_type != GGML_TYPE_Q8_0 && p.x_type != GGML_TYPE_Q8_K) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", "a Uint8Array x needs xType \"q8_0\" or \"q8_K\"");
            }
            a.xq = info[1].As<Napi::Uint8Array>();
            const size_t want = moeswarm_row_bytes(p.x_type, p.n_tokens, n_embd);
            if (want == 0 || a.xq.ByteLength() != want) {
                throw_error(env, "MOESWARM_NATIVE_COMPUTE", "x holds " + std::to_string(a.xq.ByteLength()) +
                    " bytes, expected n_tokens rows of " + std::to_string(n_embd) + " values as " +
                    ggml_type_name(p.x_type) + " = " + std::to_string(want));
            }
        } else {
            a.x = info[1].As<Napi::Float32Array>();
        }
        if (!wire && a.x.ElementLength() != (size_t) p.n_tokens * n_embd) {
            throw_error(env, "MOESWARM_NATIVE_COMPUTE", "x holds " + std::to_string(a.x.ElementLength()) +
                " values, expected n_tokens * n_embd = " + std::to_string((size_t) p.n_tokens * n_embd));
        }
        if (!info[4].IsNull() && !info[4].IsUndefined()) {
            if (!info[4].IsTypedArray() || info[4].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", "weights must be a Float32Array");
            }
            a.w = info[4].As<Napi::Float32Array>();
            if (a.w.ElementLength() != n_ids) {
                throw_error(env, "MOESWARM_NATIVE_COMPUTE", "weights holds " + std::to_string(a.w.ElementLength()) +
                    " values, expected n_tokens * k = " + std::to_string(n_ids));
            }
        }
        if (p.mode == MOESWARM_MODE_SUM && a.w.IsEmpty()) {
            throw_error(env, "MOESWARM_NATIVE_COMPUTE", "mode sum needs the router weights");
        }
        a.n_out = moeswarm_run_output_len(state_->slice, p.n_tokens, p.k, p.mode);
        return a;
    }

    // The caller's output array for runSync: a Float32Array of exactly the output's length that
    // shares no byte with an input (the compute reads its inputs while it writes the output).
    static Napi::Float32Array checked_out(Napi::Env env, const Napi::Value & v, const run_args & a) {
        if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "out must be a Float32Array");
        }
        Napi::Float32Array y = v.As<Napi::Float32Array>();
        if (y.ElementLength() != a.n_out) {
            throw_error(env, "MOESWARM_NATIVE_OUTPUT", "out holds " + std::to_string(y.ElementLength()) +
                " values, the answer " + std::to_string(a.n_out));
        }
        const uint8_t * lo = (const uint8_t *) y.Data();
        const uint8_t * hi = lo + y.ByteLength();
        const auto overlaps = [&](const void * p, size_t n) {
            const uint8_t * b = (const uint8_t *) p;
            return n > 0 && b < hi && lo < b + n;
        };
        if (overlaps(a.x.IsEmpty() ? (const void *) a.xq.Data() : (const void *) a.x.Data(),
                     a.x.IsEmpty() ? a.xq.ByteLength() : a.x.ByteLength()) ||
            overlaps(a.ids.Data(), a.ids.ByteLength()) ||
            (!a.w.IsEmpty() && overlaps(a.w.Data(), a.w.ByteLength()))) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "out must not share memory with x, ids or weights");
        }
        return y;
    }

    // run(layer, x: Float32Array, ids: Int32Array, k, weights: Float32Array | null, mode: 0|1, reference: bool)
    Napi::Value run(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        run_args a = parse_run(info, "run(layer, x, ids, k, weights, mode, reference)");
        const size_t n_ids = a.ids.ElementLength();
        std::vector<float> w;
        if (!a.w.IsEmpty()) {
            w.assign(a.w.Data(), a.w.Data() + n_ids);
        }
        std::vector<float> xv;
        std::vector<uint8_t> xq;
        if (a.xq.IsEmpty()) {
            xv.assign(a.x.Data(), a.x.Data() + a.x.ElementLength());
        } else {
            xq.assign(a.xq.Data(), a.xq.Data() + a.xq.ByteLength());
        }
        std::vector<int32_t> iv(a.ids.Data(), a.ids.Data() + n_ids);
        Napi::Float32Array y = Napi::Float32Array::New(env, a.n_out);
        RunWorker * worker =
            new RunWorker(env, state_, a.p, a.reference, std::move(xv), std::move(xq), std::move(iv), std::move(w), y);
        Napi::Promise promise = worker->promise();
        worker->Queue();
        return promise;
    }

    // runSync(same arguments as run, out?) -> Float32Array, computed on the calling thread: the
    // arrays are read in place (nothing else runs on this thread meanwhile) and the output is
    // written straight into `out` when given (the outgoing result frame's memory: no array of its
    // own, no copy), else into a new array; the array written is returned. It waits for a run in
    // flight on the thread pool, if any: the TypeScript side calls it only when none is queued.
    Napi::Value run_sync(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        run_args a = parse_run(info, "runSync(layer, x, ids, k, weights, mode, reference, xType?, out?)");
        Napi::Float32Array y = info.Length() > 8 && !info[8].IsUndefined() && !info[8].IsNull()
            ? checked_out(env, info[8], a) : Napi::Float32Array::New(env, a.n_out);
        a.p.x = a.x.IsEmpty() ? nullptr : a.x.Data();
        a.p.x_q = a.xq.IsEmpty() ? nullptr : a.xq.Data();
        a.p.x_q_size = a.xq.IsEmpty() ? 0 : a.xq.ByteLength();
        a.p.ids = a.ids.Data();
        a.p.weights = a.w.IsEmpty() ? nullptr : a.w.Data();
        moeswarm_error err;
        moeswarm_error_clear(&err);
        bool ok;
        {
            std::lock_guard<std::mutex> lock(state_->mu);
            if (state_->slice == nullptr) {
                throw_error(env, "MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
            }
            const int32_t threads = state_->pending_threads.exchange(-1);
            if (threads >= 0) {
                moeswarm_slice_set_n_threads(state_->slice, threads);
            }
            // no abort flag: nothing on this thread can set it while the run blocks it
            a.p.abort_flag = nullptr;
            ok = a.reference ? moeswarm_slice_run_reference(state_->slice, &a.p, y.Data(), a.n_out, &err)
                             : moeswarm_slice_run(state_->slice, &a.p, y.Data(), a.n_out, &err);
        }
        if (!ok) {
            throw make_error(env, err);
        }
        return y;
    }

    // what the slice holds never changes after loading: no lock, so a run in flight never
    // blocks the JS thread here
    Napi::Value info(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        check_open(env);
        return slice_info(env, state_->slice);
    }

    // takes effect at the next run
    Napi::Value set_threads(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        check_open(env);
        state_->pending_threads = (int32_t) get_u32(env, info[0], "threads", 0, 512);
        return env.Undefined();
    }

    Napi::Value abort(const Napi::CallbackInfo & info) {
        state_->abort = true;
        return info.Env().Undefined();
    }

    Napi::Value close(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        if (state_->closed.exchange(true)) {
            Napi::Promise::Deferred d = Napi::Promise::Deferred::New(env);
            d.Resolve(env.Undefined());
            return d.Promise();
        }
        CloseWorker * worker = new CloseWorker(env, state_);
        Napi::Promise promise = worker->promise();
        worker->Queue();
        return promise;
    }

    std::shared_ptr<slice_state> state_;
};

void LoadWorker::OnOK() {
    Napi::Env env = Env();
    if (slice_ == nullptr) {
        deferred_.Reject(make_error(env, err_).Value());
        return;
    }
    // one constructor per environment (main thread and each worker thread)
    Napi::FunctionReference * ctor = env.GetInstanceData<Napi::FunctionReference>();
    Napi::Object handle = ctor->New({ Napi::External<moeswarm_slice>::New(env, slice_) });
    slice_ = nullptr; // owned by the handle now
    Napi::Object result = Napi::Object::New(env);
    result.Set("handle", handle);
    deferred_.Resolve(result);
}

// loadSlice(path, { threads, repack, act, device }) -> Promise<{ handle }>
Napi::Value load_slice(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    if (info.Length() < 1 || !info[0].IsString()) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "loadSlice(path, options)");
    }
    moeswarm_slice_params params = moeswarm_slice_default_params();
    if (info.Length() > 1 && info[1].IsObject()) {
        Napi::Object o = info[1].As<Napi::Object>();
        if (o.Has("threads") && !o.Get("threads").IsUndefined()) {
            params.n_threads = (int32_t) get_u32(env, o.Get("threads"), "threads", 0, 512);
        }
        if (o.Has("repack") && !o.Get("repack").IsUndefined()) {
            params.repack = o.Get("repack").ToBoolean().Value();
        }
        if (o.Has("act") && o.Get("act").IsString()) {
            const std::string act = o.Get("act").As<Napi::String>().Utf8Value();
            params.act = moeswarm_act_from_name(act.c_str());
            if (params.act < MOESWARM_ACT_AUTO) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", "unknown activation " + act);
            }
        }
    }
    std::string device;
    if (info.Length() > 1 && info[1].IsObject()) {
        Napi::Object o = info[1].As<Napi::Object>();
        if (o.Has("device") && o.Get("device").IsString()) {
            device = o.Get("device").As<Napi::String>().Utf8Value();
        }
    }
    LoadWorker * worker = new LoadWorker(env, info[0].As<Napi::String>().Utf8Value(), params, device);
    Napi::Promise promise = worker->promise();
    worker->Queue();
    return promise;
}

enum ggml_type get_type(Napi::Env env, const Napi::Value & v) {
    if (!v.IsString()) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "type must be a ggml type name");
    }
    const std::string name = v.As<Napi::String>().Utf8Value();
    const enum ggml_type type = moeswarm_type_from_name(name.c_str());
    if (type == GGML_TYPE_COUNT) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "unknown ggml type " + name);
    }
    return type;
}

// quantize(type, values: Float32Array, nPerRow) -> Uint8Array (ggml_quantize_chunk)
Napi::Value quantize(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    const enum ggml_type type = get_type(env, info[0]);
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "values must be a Float32Array");
    }
    Napi::Float32Array src = info[1].As<Napi::Float32Array>();
    const uint32_t n_per_row = get_u32(env, info[2], "nPerRow", 1, 1u << 24);
    if (src.ElementLength() % n_per_row != 0) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "values do not hold whole rows");
    }
    const int64_t n_rows = (int64_t) (src.ElementLength() / n_per_row);
    const size_t size = moeswarm_row_bytes(type, n_rows, n_per_row);
    if (size == 0 && n_rows > 0) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "rows of " + std::to_string(n_per_row) + " values cannot be " + ggml_type_name(type));
    }
    std::vector<float> copy(src.Data(), src.Data() + src.ElementLength());
    Napi::Uint8Array dst = Napi::Uint8Array::New(env, size);
    moeswarm_error err;
    moeswarm_error_clear(&err);
    if (!moeswarm_quantize(type, copy.data(), n_rows, n_per_row, dst.Data(), size, &err)) {
        throw make_error(env, err);
    }
    return dst;
}

// quantizeActivations(type: "q8_0" | "q8_K", x: Float32Array, nPerRow) -> Uint8Array: ggml-cpu's
// from_float, the conversion the CPU mul_mat_id applies (not quantize's reference rounding)
Napi::Value quantize_activations(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    const enum ggml_type type = get_type(env, info[0]);
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_float32_array) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "x must be a Float32Array");
    }
    Napi::Float32Array src = info[1].As<Napi::Float32Array>();
    const uint32_t n_per_row = get_u32(env, info[2], "nPerRow", 1, 1u << 24);
    if (src.ElementLength() % n_per_row != 0) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "x does not hold whole rows");
    }
    const int64_t n_rows = (int64_t) (src.ElementLength() / n_per_row);
    const size_t size = moeswarm_row_bytes(type, n_rows, n_per_row);
    if (size == 0 && n_rows > 0) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "rows of " + std::to_string(n_per_row) + " values cannot be " + ggml_type_name(type));
    }
    Napi::Uint8Array dst = Napi::Uint8Array::New(env, size);
    moeswarm_error err;
    moeswarm_error_clear(&err);
    // read in place: nothing else runs on this thread meanwhile
    if (!moeswarm_quantize_activations(type, src.Data(), n_rows, n_per_row, dst.Data(), size, &err)) {
        throw make_error(env, err);
    }
    return dst;
}

// wireActivationType(weightType) -> "q8_0" | "q8_K" | null: the type activations for weights of
// this type may travel in (moeswarm_wire_type_of_weight)
Napi::Value wire_activation_type(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    const enum ggml_type t = moeswarm_wire_type_of_weight(get_type(env, info[0]));
    return t == GGML_TYPE_COUNT ? env.Null() : Napi::String::New(env, ggml_type_name(t));
}

// activationsRoundTrip(type, rows: Uint8Array, nPerRow) -> bool: every row comes back byte for byte
// from to_float then from_float (what a worker with repacked weights checks before computing)
Napi::Value activations_round_trip(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    const enum ggml_type type = get_type(env, info[0]);
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "rows must be a Uint8Array");
    }
    Napi::Uint8Array rows = info[1].As<Napi::Uint8Array>();
    const uint32_t n_per_row = get_u32(env, info[2], "nPerRow", 1, 1u << 24);
    moeswarm_error err;
    moeswarm_error_clear(&err);
    int32_t same = 0;
    if (!moeswarm_activations_round_trip(type, rows.Data(), rows.ByteLength(), n_per_row, &same, &err)) {
        throw make_error(env, err);
    }
    return Napi::Boolean::New(env, same != 0);
}

// dequantize(type, bytes: Uint8Array, n) -> Float32Array (the type's to_float)
Napi::Value dequantize(const Napi::CallbackInfo & info) {
    Napi::Env env = info.Env();
    const enum ggml_type type = get_type(env, info[0]);
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "bytes must be a Uint8Array");
    }
    Napi::Uint8Array src = info[1].As<Napi::Uint8Array>();
    const uint32_t n = get_u32(env, info[2], "n", 0, UINT32_MAX);
    std::vector<uint8_t> copy(src.Data(), src.Data() + src.ByteLength());
    Napi::Float32Array dst = Napi::Float32Array::New(env, n);
    moeswarm_error err;
    moeswarm_error_clear(&err);
    if (!moeswarm_dequantize(type, copy.data(), copy.size(), dst.Data(), n, &err)) {
        throw make_error(env, err);
    }
    return dst;
}

Napi::Object init(Napi::Env env, Napi::Object exports) {
    moeswarm_log_init();
    Napi::Function cls = SliceHandle::define(env);
    env.SetInstanceData<Napi::FunctionReference>(new Napi::FunctionReference(Napi::Persistent(cls)));
    exports.Set("loadSlice", Napi::Function::New(env, load_slice));
    exports.Set("quantize", Napi::Function::New(env, quantize));
    exports.Set("dequantize", Napi::Function::New(env, dequantize));
    exports.Set("quantizeActivations", Napi::Function::New(env, quantize_activations));
    exports.Set("wireActivationType", Napi::Function::New(env, wire_activation_type));
    exports.Set("activationsRoundTrip", Napi::Function::New(env, activations_round_trip));
    exports.Set("cpuFeatures", Napi::String::New(env, moeswarm_cpu_features()));
    exports.Set("devices", Napi::String::New(env, moeswarm_devices()));
    exports.Set("abiVersion", Napi::Number::New(env, 1));
    moeswarm_addon::native_server_init(env, exports);
    return exports;
}

} // namespace

std::shared_ptr<moeswarm_addon::slice_state> moeswarm_addon::slice_state_of(Napi::Env env, const Napi::Value & v) {
    Napi::FunctionReference * ctor = env.GetInstanceData<Napi::FunctionReference>();
    if (!v.IsObject() || !v.As<Napi::Object>().InstanceOf(ctor->Value())) {
        throw_error(env, "MOESWARM_INVALID_ARGUMENT", "slice must be a SliceHandle of this addon (a loaded native compute's)");
    }
    return SliceHandle::Unwrap(v.As<Napi::Object>())->state();
}

NODE_API_MODULE(moeswarm_expert, init)
