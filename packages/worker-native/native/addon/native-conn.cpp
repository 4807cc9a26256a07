// The native listener's connections (docs/protocol.md section 10.9): the accept loop, one thread
// per connection from the TLS handshake to its close, the hello handed to JavaScript, and each
// dispatch computed inline on the connection's thread under the slice's mutex (the same C API the
// thread pool's runs use) and answered by the C++ codec.

#include "moeswarm-dispatch.h"
#include "moeswarm-frame.h"
#include "moeswarm-msgpack.h"
#include "moeswarm-trace.h"
#include "native-server-core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

namespace moeswarm_addon {
namespace native {

// Runs on the JS thread: onHello(backbone, ticket, remote, done) where done(true) accepts and
// done(code, message) refuses. A throw refuses as an invalid ticket.
void js_hello(Napi::Env env, Napi::Function cb, server_core * core, hello_call * call) {
    std::unique_ptr<hello_call> owned(call);
    if (env == nullptr || core == nullptr || core->stopping) {
        return; // the function is being torn down: the connection's wait ends with stopping
    }
    std::shared_ptr<verdict> v = call->v;
    auto settle = [core, v](bool accepted, std::string code, std::string msg) {
        std::lock_guard<std::mutex> lock(core->mu);
        if (v->done) {
            return;
        }
        v->done = true;
        v->accepted = accepted;
        v->code = std::move(code);
        v->msg = std::move(msg);
        core->cv.notify_all();
    };
    // nothing may escape into the thread-safe function's caller: at the environment's teardown
    // (a call queued before close) any N-API call may fail and throw
    try {
        Napi::Function done = Napi::Function::New(env, [settle](const Napi::CallbackInfo & info) {
            if (info.Length() > 0 && info[0].IsBoolean() && info[0].As<Napi::Boolean>().Value()) {
                settle(true, "", "");
            } else {
                const std::string code = info.Length() > 0 && info[0].IsString()
                    ? info[0].As<Napi::String>().Utf8Value() : "MOESWARM_AUTH_TICKET_INVALID";
                const std::string msg = info.Length() > 1 && info[1].IsString()
                    ? info[1].As<Napi::String>().Utf8Value() : "direct-link ticket refused";
                settle(false, code, msg);
            }
            return info.Env().Undefined();
        }, "done");
        cb.Call({ Napi::String::New(env, call->backbone), Napi::String::New(env, call->ticket),
                  Napi::String::New(env, call->remote), done });
    } catch (const Napi::Error & e) {
        settle(false, "MOESWARM_AUTH_TICKET_INVALID", e.Message());
    } catch (...) {
        settle(false, "MOESWARM_AUTH_TICKET_INVALID", "the hello could not be checked");
    }
}

// the frames of one connection
struct conn_io {
    server_core *          core;
    moeswarm_tls_conn      c;
    std::vector<uint8_t>   frame;
    moeswarm_mp_writer     out;
    moeswarm_dispatch_scratch scratch;
    std::vector<float>     y;
};

// io.out holds the 4 bytes of the length prefix, then the frame (begin_out): one TLS record and
// one send for the whole frame
void begin_out(conn_io & io) {
    io.out.buf.assign(4, 0);
}

bool send_out(conn_io & io) {
    const size_t n = io.out.buf.size() - 4;
    for (int i = 0; i < 4; ++i) {
        io.out.buf[i] = (uint8_t) (n >> (8 * i));
    }
    std::string err;
    const double deadline = moeswarm_tls_now_us() + k_write_us;
    const bool ok = moeswarm_tls_send_all(io.c, io.out.buf.data(), io.out.buf.size(), deadline, err);
    io.out.buf.clear();
    return ok;
}

bool send_error(conn_io & io, const moeswarm_frame * req, const char * code, const std::string & msg) {
    begin_out(io);
    moeswarm_frame_write_error(&io.out, req, code, msg.c_str());
    return send_out(io);
}

bool str_is(const moeswarm_mp_value & v, const char * s) {
    return v.type == MOESWARM_MP_STR && v.n == strlen(s) && memcmp(v.ptr, s, v.n) == 0;
}

struct hello_fields {
    bool        is_hello = false;
    bool        backbone = false;
    std::string id;
    std::string token;
};

// The fields of a hello that matter here; anything else (another frame, malformed msgpack) is not
// a hello. Unknown keys are skipped as section 6 asks.
hello_fields parse_hello(const std::vector<uint8_t> & p) {
    hello_fields h;
    moeswarm_mp_reader r;
    moeswarm_mp_reader_init(&r, p.data(), p.size());
    moeswarm_mp_value m;
    if (!moeswarm_mp_read(&r, &m) || m.type != MOESWARM_MP_MAP) {
        return h;
    }
    bool t = false, v = false;
    for (uint32_t i = 0; i < m.n; ++i) {
        moeswarm_mp_value k;
        if (!moeswarm_mp_read(&r, &k) || k.type != MOESWARM_MP_STR) {
            return hello_fields();
        }
        const std::string key((const char *) k.ptr, k.n);
        if (key == "t" || key == "v" || key == "role" || key == "id" || key == "token") {
            moeswarm_mp_value x;
            if (!moeswarm_mp_read(&r, &x) || x.type == MOESWARM_MP_ARRAY || x.type == MOESWARM_MP_MAP) {
                return hello_fields();
            }
            if (key == "t") {
                t = str_is(x, "hello");
            } else if (key == "v") {
                v = x.type == MOESWARM_MP_UINT && x.u == MOESWARM_PROTOCOL_VERSION;
            } else if (key == "role") {
                h.backbone = str_is(x, "backbone");
            } else if (x.type == MOESWARM_MP_STR) {
                (key == "id" ? h.id : h.token).assign((const char *) x.ptr, x.n);
            }
        } else if (!moeswarm_mp_skip(&r, 8)) {
            return hello_fields();
        }
    }
    h.is_hello = t && v;
    return h;
}

// The acceptance (section 10.8): role "backbone", the id echoed, an empty token, caps.maxFrame.
void write_accept(moeswarm_mp_writer * w, const std::string & id, uint32_t max_frame) {
    moeswarm_mp_write_map(w, 6);
    moeswarm_mp_write_cstr(w, "t");
    moeswarm_mp_write_cstr(w, "hello");
    moeswarm_mp_write_cstr(w, "v");
    moeswarm_mp_write_uint(w, MOESWARM_PROTOCOL_VERSION);
    moeswarm_mp_write_cstr(w, "role");
    moeswarm_mp_write_cstr(w, "backbone");
    moeswarm_mp_write_cstr(w, "id");
    moeswarm_mp_write_str(w, id.data(), id.size());
    moeswarm_mp_write_cstr(w, "token");
    moeswarm_mp_write_cstr(w, "");
    moeswarm_mp_write_cstr(w, "caps");
    moeswarm_mp_write_map(w, 1);
    moeswarm_mp_write_cstr(w, "maxFrame");
    moeswarm_mp_write_uint(w, max_frame);
}

// Reads the hello, asks JavaScript, answers. The backbone's id when accepted, else empty.
std::string admit(conn_io & io, const std::string & remote) {
    server_core * core = io.core;
    const double deadline = moeswarm_tls_now_us() + core->hello_us;
    std::string err;
    bool timed_out = false;
    // a stranger's first frame: a hello with its ticket is small, so no stranger makes the worker
    // hold a large buffer (64 of them may wait at once)
    const size_t hello_max = std::min<size_t>(io.core->max_frame, k_hello_max_frame);
    if (!moeswarm_tls_recv_frame(io.c, io.frame, hello_max, deadline, err, &timed_out)) {
        if (err.rfind("MOESWARM_PROTOCOL_FRAME_TOO_LARGE", 0) == 0) {
            send_error(io, nullptr, "MOESWARM_AUTH_MISSING", "the first frame must be a backbone's hello (" + err + ")");
        } else if (timed_out) {
            send_error(io, nullptr, "MOESWARM_AUTH_MISSING",
                    "no hello within " + std::to_string((long long) (core->hello_us / 1e3)) + " ms");
        }
        return "";
    }
    const hello_fields h = parse_hello(io.frame);
    if (!h.is_hello || !h.backbone || h.id.empty()) {
        send_error(io, nullptr, "MOESWARM_AUTH_MISSING", "the first frame must be a backbone's hello");
        return "";
    }
    auto v = std::make_shared<verdict>();
    std::unique_ptr<hello_call> call(new hello_call{ h.id, h.token, remote, v });
    if (core->on_hello.NonBlockingCall(call.get()) != napi_ok) {
        send_error(io, nullptr, "MOESWARM_TRANSPORT_CLOSED", "the worker is closing");
        return "";
    }
    call.release(); // js_hello owns it now
    {
        std::unique_lock<std::mutex> lock(core->mu);
        const auto until = std::chrono::steady_clock::now() +
            std::chrono::microseconds((int64_t) std::max(0.0, deadline - moeswarm_tls_now_us()));
        core->cv.wait_until(lock, until, [&] { return v->done || core->stopping.load(); });
        if (!v->done) {
            v->done = true; // a late verdict is dropped
            v->accepted = false;
            v->code = core->stopping ? "MOESWARM_TRANSPORT_CLOSED" : "MOESWARM_AUTH_MISSING";
            v->msg = core->stopping ? "the worker is closing" : "the hello was not verified within 10 s";
        }
    }
    if (!v->accepted) {
        send_error(io, nullptr, v->code.c_str(), v->msg);
        return "";
    }
    begin_out(io);
    write_accept(&io.out, h.id, core->max_frame);
    return send_out(io) ? h.id : "";
}

// The route serving f, or an error code and message for the reply.
const route * find_route(const route_table & t, const moeswarm_frame * f, const char ** code, std::string & msg) {
    if (t.empty()) {
        *code = "MOESWARM_TRANSPORT_DRAINING";
        msg = "this worker serves nothing on its native link now (paused, draining or loading)";
        return nullptr;
    }
    const std::string model((const char *) f->model.ptr, f->model.len);
    const route * r = nullptr;
    for (const route & x : t) {
        if (x.layer == f->layer && x.model == model) {
            r = &x;
            break;
        }
    }
    *code = "MOESWARM_INVALID_ARGUMENT";
    if (r == nullptr) {
        msg = "layer " + std::to_string(f->layer) + " of " + model + " is not served on this worker's native link";
        return nullptr;
    }
    // the ids lie in the frame, not necessarily 4-byte aligned: read byte-wise
    const size_t n = (size_t) f->n * f->k;
    for (size_t i = 0; i < n; ++i) {
        int32_t id;
        memcpy(&id, f->ids.ptr + i * sizeof(int32_t), sizeof(id));
        if (id != -1 && !std::binary_search(r->experts.begin(), r->experts.end(), id)) {
            msg = "expert " + std::to_string(id) + " of layer " + std::to_string(f->layer) + " is not in this worker's slice";
            return nullptr;
        }
    }
    return r;
}

uint64_t filled_slots(const moeswarm_frame * f) {
    uint64_t filled = 0;
    const size_t n = (size_t) f->n * f->k;
    for (size_t i = 0; i < n; ++i) {
        int32_t id;
        memcpy(&id, f->ids.ptr + i * sizeof(int32_t), sizeof(id));
        filled += id != -1;
    }
    return filled;
}

// f on the slice, under its mutex, with the same C API as the thread pool's runs: into the result
// frame begun in io.out (in_place: moeswarm_frame_write_result_begin) or into io.y. ms: the run alone.
bool compute(conn_io & io, slice_state & slice, const moeswarm_frame * f, bool in_place, double & ms,
        moeswarm_error & err) {
    std::lock_guard<std::mutex> lock(slice.mu);
    moeswarm_slice * s = slice.slice;
    if (s == nullptr) {
        moeswarm_error_set(&err, "MOESWARM_NATIVE_CLOSED", "the expert compute was closed");
        return false;
    }
    if (f->embd != moeswarm_slice_n_embd(s)) {
        moeswarm_error_set(&err, "MOESWARM_INVALID_ARGUMENT", "embd does not match the slice's n_embd");
        return false;
    }
    const int32_t threads = slice.pending_threads.exchange(-1);
    if (threads >= 0) {
        moeswarm_slice_set_n_threads(s, threads);
    }
    moeswarm_run_params rp;
    moeswarm_dispatch_run_params(f, &io.scratch, &rp);
    const size_t n_out = moeswarm_run_output_len(s, f->n, f->k, f->mode);
    float * y = nullptr;
    if (in_place) {
        y = moeswarm_frame_write_result_begin(&io.out, f, n_out);
    } else {
        io.y.resize(n_out);
        y = io.y.data();
    }
    const double t0 = moeswarm_tls_now_us();
    const bool ok   = moeswarm_slice_run(s, &rp, y, n_out, &err);
    ms              = (moeswarm_tls_now_us() - t0) / 1e3;
    return ok;
}

bool handle_dispatch(conn_io & io, const moeswarm_frame * f, const std::string & backbone) {
    server_core * core = io.core;
    if (f->to.present && (f->to.len != core->id.size() || memcmp(f->to.ptr, core->id.data(), f->to.len) != 0)) {
        return send_error(io, f, "MOESWARM_TRANSPORT_UNKNOWN_PEER", "this link reaches worker " + core->id + " only");
    }
    std::shared_ptr<const route_table> table;
    {
        std::lock_guard<std::mutex> lock(core->routes_mu);
        table = core->routes;
    }
    const char * code = nullptr;
    std::string msg;
    const route * r = find_route(*table, f, &code, msg);
    if (r == nullptr) {
        return send_error(io, f, code, msg);
    }
    // a full answer is computed straight into its frame; a compact one (the filled rows only) into
    // io.y, from which the encoder picks the rows
    const bool in_place = !(f->compact && f->mode == MOESWARM_MODE_EACH);
    moeswarm_error err;
    moeswarm_error_clear(&err);
    double ms = 0;
    begin_out(io);
    if (!compute(io, *r->slice, f, in_place, ms, err)) {
        return send_error(io, f, err.code[0] ? err.code : "MOESWARM_NATIVE_COMPUTE", err.msg); // drops the half frame
    }
    {
        std::lock_guard<std::mutex> lock(core->served_mu);
        served_count & c = core->served[{ backbone, r->model }];
        c.expert_tokens += filled_slots(f);
        c.requests += 1;
    }
    if (in_place) {
        moeswarm_frame_write_result_end(&io.out, f, ms);
    } else {
        moeswarm_frame_write_result(&io.out, f, io.y.data(), io.y.size(), ms);
    }
    return send_out(io);
}

// One accepted connection, from the TLS handshake to its close.
void serve_conn(server_core * core, std::shared_ptr<conn_entry> entry, int fd, std::string remote, bool over_limit) {
    conn_io io;
    io.core = core;
    std::string err;
    bool ok = moeswarm_tls_accept(core->tls, fd, io.c, moeswarm_tls_now_us() + core->hello_us, err);
    {
        // a failed handshake closed fd: close() must not interrupt a number reused meanwhile
        std::lock_guard<std::mutex> lock(core->mu);
        entry->fd = ok ? io.c.fd : -1;
    }
    if (ok && over_limit) {
        send_error(io, nullptr, "MOESWARM_TRANSPORT_LIMIT", "too many connections wait for their hello: try later");
        ok = false;
    }
    std::string backbone = ok ? admit(io, remote) : "";
    if (!over_limit) {
        std::lock_guard<std::mutex> lock(core->mu);
        core->waiting_hello--;
    }
    while (!backbone.empty() && !core->stopping) {
        bool timed_out = false;
        if (!moeswarm_tls_recv_frame(io.c, io.frame, core->max_frame, moeswarm_tls_now_us() + core->idle_us, err, &timed_out)) {
            if (err.rfind("MOESWARM_PROTOCOL_FRAME_TOO_LARGE", 0) == 0) {
                send_error(io, nullptr, "MOESWARM_PROTOCOL_FRAME_TOO_LARGE", err);
            }
            break; // closed, broken, or idle for 10 minutes
        }
        moeswarm_frame f;
        moeswarm_error derr;
        if (!moeswarm_frame_decode(io.frame.data(), io.frame.size(), 0, &f, &derr)) {
            const bool version = strcmp(derr.code, "MOESWARM_PROTOCOL_VERSION") == 0;
            if (!send_error(io, version ? nullptr : &f, derr.code, derr.msg) || version) {
                break;
            }
            continue;
        }
        bool sent = true;
        if (f.type == MOESWARM_FRAME_DISPATCH) {
            moeswarm_trace_hop("native.in", (long long) f.id);
            sent = handle_dispatch(io, &f, backbone);
            moeswarm_trace_hop("native.out", (long long) f.id);
        } else if (f.type == MOESWARM_FRAME_PING) {
            begin_out(io);
            moeswarm_frame_write_pong(&io.out, f.seq, f.ts);
            sent = send_out(io);
        }
        if (!sent) {
            break;
        }
    }
    {
        std::lock_guard<std::mutex> lock(core->mu);
        entry->fd = -1;
    }
    moeswarm_tls_close(io.c);
    entry->finished = true;
}

// joins the connection threads that ended (accept thread)
void reap(server_core * core) {
    std::list<std::shared_ptr<conn_entry>> done;
    {
        std::lock_guard<std::mutex> lock(core->mu);
        for (auto it = core->conns.begin(); it != core->conns.end();) {
            if ((*it)->finished) {
                done.push_back(*it);
                it = core->conns.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (auto & e : done) {
        e->thread.join();
    }
}

std::string remote_of(const sockaddr_storage & ss) {
    char host[INET6_ADDRSTRLEN] = "";
    uint16_t port = 0;
    if (ss.ss_family == AF_INET) {
        const sockaddr_in * a = (const sockaddr_in *) &ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        port = ntohs(a->sin_port);
        return std::string(host) + ":" + std::to_string(port);
    }
    const sockaddr_in6 * a = (const sockaddr_in6 *) &ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
}

void accept_loop(server_core * core) {
    for (;;) {
        pollfd p[2] = { { core->listen_fd, POLLIN, 0 }, { core->wake[0], POLLIN, 0 } };
        const int rc = poll(p, 2, 1000);
        if (core->stopping) {
            return;
        }
        reap(core);
        if (rc <= 0 || !(p[0].revents & POLLIN)) {
            continue;
        }
        sockaddr_storage ss;
        socklen_t len = sizeof(ss);
        const int fd = accept4(core->listen_fd, (sockaddr *) &ss, &len, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE) {
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
            continue;
        }
        auto entry = std::make_shared<conn_entry>();
        entry->fd = fd;
        std::lock_guard<std::mutex> lock(core->mu);
        const bool over = core->waiting_hello >= k_max_waiting_hello;
        if (!over) {
            core->waiting_hello++;
        }
        entry->thread = std::thread(serve_conn, core, entry, fd, remote_of(ss), over);
        core->conns.push_back(entry);
    }
}

// binds host:port (port 0: any free one); the socket, or -1 with err
int listen_on(const std::string & host, uint16_t port, uint16_t * bound, std::string & err) {
    addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo * res = nullptr;
    const std::string service = std::to_string(port);
    const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
    if (gai != 0) {
        err = "cannot resolve " + host + ": " + gai_strerror(gai);
        return -1;
    }
    int fd = -1;
    for (addrinfo * a = res; a != nullptr && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            continue;
        }
        const int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
            err = std::string("cannot listen on ") + host + ":" + service + ": " + strerror(errno);
            ::close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        sockaddr_storage ss;
        socklen_t len = sizeof(ss);
        getsockname(fd, (sockaddr *) &ss, &len);
        *bound = ntohs(ss.ss_family == AF_INET ? ((sockaddr_in *) &ss)->sin_port : ((sockaddr_in6 *) &ss)->sin6_port);
    }
    return fd;
}

// Stops the listener and every connection, joins their threads. Idempotent; JS thread (or the
// environment's cleanup).
void stop(server_core * core) {
    if (core->closed) {
        return;
    }
    core->closed = true;
    {
        std::lock_guard<std::mutex> lock(core->mu);
        core->stopping = true;
        core->cv.notify_all();
        for (auto & e : core->conns) {
            if (e->fd >= 0) {
                moeswarm_tls_conn c;
                c.fd = e->fd;
                moeswarm_tls_interrupt(c);
            }
        }
    }
    if (core->wake[1] >= 0) {
        const char b = 1;
        ssize_t w = write(core->wake[1], &b, 1);
        (void) w;
    }
    if (core->accept_thread.joinable()) {
        core->accept_thread.join();
    }
    std::list<std::shared_ptr<conn_entry>> all;
    {
        std::lock_guard<std::mutex> lock(core->mu);
        all.swap(core->conns);
    }
    for (auto & e : all) {
        e->thread.join();
    }
    core->on_hello.Release();
}

} // namespace native
} // namespace moeswarm_addon
