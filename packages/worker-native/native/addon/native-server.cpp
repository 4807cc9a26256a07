// The worker's native listener (docs/protocol.md section 10.9): backbone plugins dial it over TLS
// and send a layer's `dispatch` straight to this addon, with no JavaScript on the data path. An
// accept thread, one thread per connection; each connection computes its dispatches inline on its
// own thread under the slice's mutex (the same C API the thread pool's runs use), so a dispatch
// costs the compute and the codec. JavaScript keeps every decision: the ticket of a connection's
// hello is handed to it (onHello, through a thread-safe function; the connection thread waits for
// the verdict), and it sets which (model, layer) each slice serves (setRoutes).

#include "native-server.h"

#include "native-server-core.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>

namespace moeswarm_addon {

namespace {

using native::hello_fn;
using native::route;
using native::route_table;
using native::served_count;
using native::server_core;

class NativeServer : public Napi::ObjectWrap<NativeServer> {
public:
    static Napi::Function define(Napi::Env env) {
        return DefineClass(env, "NativeServer", {
            InstanceAccessor<&NativeServer::port>("port"),
            InstanceAccessor<&NativeServer::fingerprint>("fingerprint"),
            InstanceMethod<&NativeServer::set_routes>("setRoutes"),
            InstanceMethod<&NativeServer::take_served>("takeServed"),
            InstanceMethod<&NativeServer::close>("close"),
        });
    }

    // new NativeServer({ host, port, cert, key, maxFrame?, id?, helloMs?, idleMs?, onHello })
    NativeServer(const Napi::CallbackInfo & info) : Napi::ObjectWrap<NativeServer>(info) {
        Napi::Env env = info.Env();
        std::string err;
        if (!moeswarm_tls_available(err)) {
            throw_error(env, "MOESWARM_NATIVE_TLS_UNAVAILABLE", "the native listener needs OpenSSL 3: " + err);
        }
        if (info.Length() < 1 || !info[0].IsObject()) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "new NativeServer({ host, port, cert, key, maxFrame, id, onHello })");
        }
        Napi::Object o = info[0].As<Napi::Object>();
        const auto str = [&](const char * k, bool required) {
            Napi::Value v = o.Get(k);
            if (v.IsString()) {
                return v.As<Napi::String>().Utf8Value();
            }
            if (required || !v.IsUndefined()) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", std::string(k) + " must be a string");
            }
            return std::string();
        };
        const std::string host = str("host", false);
        const std::string cert = str("cert", true);
        const std::string key = str("key", true);
        const double port = o.Get("port").IsNumber() ? o.Get("port").As<Napi::Number>().DoubleValue() : 0;
        const double max_frame = o.Get("maxFrame").IsNumber() ? o.Get("maxFrame").As<Napi::Number>().DoubleValue()
                                                              : (double) MOESWARM_FRAME_MAX_DEFAULT;
        if (!(port >= 0 && port <= 65535 && port == (double) (uint32_t) port)) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "port must be an integer in 0..65535");
        }
        if (!(max_frame >= 1024 && max_frame <= 4294967295.0)) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "maxFrame must be 1024..2^32-1 bytes");
        }
        const auto ms = [&](const char * k, double def) {
            Napi::Value v = o.Get(k);
            const double x = v.IsNumber() ? v.As<Napi::Number>().DoubleValue() : def;
            if (!(x >= 1 && x <= 86400e3)) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", std::string(k) + " must be 1..86400000 ms");
            }
            return x * 1e3;
        };
        const double hello_us = ms("helloMs", native::k_hello_us / 1e3);
        const double idle_us = ms("idleMs", native::k_idle_us / 1e3);
        if (!o.Get("onHello").IsFunction()) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "onHello must be a function");
        }
        core_ = std::make_shared<server_core>();
        core_->id = str("id", false);
        core_->max_frame = (uint32_t) max_frame;
        core_->hello_us = hello_us;
        core_->idle_us = idle_us;
        core_->tls = moeswarm_tls_server_new(cert, key, err);
        if (core_->tls == nullptr) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "the TLS certificate or key cannot be used: " + err);
        }
        core_->listen_fd = native::listen_on(host, (uint16_t) port, &core_->port, err);
        if (core_->listen_fd < 0) {
            throw_error(env, "MOESWARM_NATIVE_LISTEN", err);
        }
        if (pipe2(core_->wake, O_CLOEXEC) != 0) {
            throw_error(env, "MOESWARM_NATIVE_LISTEN", std::string("pipe: ") + strerror(errno));
        }
        core_->on_hello = hello_fn::New(env, o.Get("onHello").As<Napi::Function>(), "moeswarm-native-hello", 0, 1, core_.get());
        // the listener alone does not keep the process alive (the worker's relay link does)
        core_->on_hello.Unref(env);
        core_->accept_thread = std::thread(native::accept_loop, core_.get());
        napi_add_env_cleanup_hook(env, cleanup, core_.get());
        hooked_ = true;
    }

    ~NativeServer() override {
        if (core_) {
            if (hooked_) {
                napi_remove_env_cleanup_hook(Env(), cleanup, core_.get());
            }
            native::stop(core_.get());
        }
    }

private:
    static void cleanup(void * arg) { native::stop((server_core *) arg); }

    Napi::Value port(const Napi::CallbackInfo & info) { return Napi::Number::New(info.Env(), core_->port); }

    Napi::Value fingerprint(const Napi::CallbackInfo & info) {
        return Napi::String::New(info.Env(), moeswarm_tls_server_fingerprint(core_->tls));
    }

    // setRoutes([{ model, layer, slice, experts }]): the table served from now on (replaced whole)
    Napi::Value set_routes(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        if (info.Length() < 1 || !info[0].IsArray()) {
            throw_error(env, "MOESWARM_INVALID_ARGUMENT", "setRoutes(routes: Array)");
        }
        Napi::Array a = info[0].As<Napi::Array>();
        auto table = std::make_shared<route_table>();
        for (uint32_t i = 0; i < a.Length(); ++i) {
            Napi::Value v = a.Get(i);
            if (!v.IsObject()) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", "a route must be an object");
            }
            Napi::Object r = v.As<Napi::Object>();
            route x;
            if (!r.Get("model").IsString() || !r.Get("layer").IsNumber()) {
                throw_error(env, "MOESWARM_INVALID_ARGUMENT", "a route needs model (string) and layer (number)");
            }
            x.model = r.Get("model").As<Napi::String>().Utf8Value();
            x.layer = r.Get("layer").As<Napi::Number>().Uint32Value();
            x.slice = slice_state_of(env, r.Get("slice"));
            {
                std::lock_guard<std::mutex> lock(x.slice->mu);
                if (x.slice->slice == nullptr) {
                    throw_error(env, "MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
                }
                const uint32_t * layers = moeswarm_slice_layers(x.slice->slice);
                const uint32_t n_layer = moeswarm_slice_n_layer(x.slice->slice);
                if (std::find(layers, layers + n_layer, x.layer) == layers + n_layer) {
                    throw_error(env, "MOESWARM_INVALID_ARGUMENT", "layer " + std::to_string(x.layer) + " is not in that slice");
                }
                const uint32_t * e = moeswarm_slice_experts(x.slice->slice);
                x.experts.assign(e, e + moeswarm_slice_n_expert(x.slice->slice));
            }
            std::sort(x.experts.begin(), x.experts.end());
            table->push_back(std::move(x));
        }
        std::lock_guard<std::mutex> lock(core_->routes_mu);
        core_->routes = table;
        return env.Undefined();
    }

    // takeServed() -> [{ backbone, model, expertTokens, requests }] since the last call
    Napi::Value take_served(const Napi::CallbackInfo & info) {
        Napi::Env env = info.Env();
        std::map<std::pair<std::string, std::string>, served_count> served;
        {
            std::lock_guard<std::mutex> lock(core_->served_mu);
            served.swap(core_->served);
        }
        Napi::Array out = Napi::Array::New(env, served.size());
        uint32_t i = 0;
        for (const auto & kv : served) {
            Napi::Object e = Napi::Object::New(env);
            e.Set("backbone", kv.first.first);
            e.Set("model", kv.first.second);
            e.Set("expertTokens", Napi::Number::New(env, (double) kv.second.expert_tokens));
            e.Set("requests", Napi::Number::New(env, (double) kv.second.requests));
            out.Set(i++, e);
        }
        return out;
    }

    Napi::Value close(const Napi::CallbackInfo & info) {
        native::stop(core_.get());
        return info.Env().Undefined();
    }

    std::shared_ptr<server_core> core_;
    bool hooked_ = false;
};

} // namespace

void native_server_init(Napi::Env env, Napi::Object exports) {
    exports.Set("NativeServer", NativeServer::define(env));
}

} // namespace moeswarm_addon
