#pragma once

// What the native listener's threads share (native-server.cpp: the N-API class; native-conn.cpp:
// the accept loop and the connections): the served table, the counts, the hello verdicts.

#include "moeswarm-frame.h"
#include "moeswarm-tls.h"
#include "slice-state.h"

#include <napi.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moeswarm_addon {
namespace native {

constexpr double k_hello_us = 10e6;        // default: a connection's hello, and its verdict, within 10 s
constexpr double k_idle_us = 600e6;        // default: a connection idle for 10 minutes is closed
constexpr double k_write_us = 10e6;        // an answer leaves within 10 s, or the connection is closed
constexpr int    k_max_waiting_hello = 64; // connections not past their hello at once
constexpr size_t k_hello_max_frame = 65536; // a hello (with its ticket) is far smaller

struct route {
    std::string                  model;
    uint32_t                     layer;
    std::shared_ptr<slice_state> slice;
    std::vector<int32_t>         experts; // sorted
};
using route_table = std::vector<route>;

struct served_count {
    uint64_t expert_tokens = 0;
    uint64_t requests = 0;
};

// One connection's thread and the socket close() interrupts. fd is -1 once the thread closed it
// (under server_core::mu, so an interrupt never hits a number reused by another socket).
struct conn_entry {
    std::thread       thread;
    int               fd = -1;
    std::atomic<bool> finished{false};
};

// A hello's verdict from JavaScript: accepted, or refused with a code and a message.
struct verdict {
    bool        done = false;
    bool        accepted = false;
    std::string code;
    std::string msg;
};

struct hello_call {
    std::string              backbone;
    std::string              ticket;
    std::string              remote;
    std::shared_ptr<verdict> v;
};

struct server_core;
// Runs on the JS thread: onHello(backbone, ticket, remote, done) (native-conn.cpp).
void js_hello(Napi::Env env, Napi::Function cb, server_core * core, hello_call * call);
using hello_fn = Napi::TypedThreadSafeFunction<server_core, hello_call, js_hello>;

struct server_core {
    std::string           id; // the worker's id: a dispatch's `to`, when present, must be it
    uint32_t              max_frame = MOESWARM_FRAME_MAX_DEFAULT;
    double                hello_us = k_hello_us; // serveNative's helloTimeoutMs
    double                idle_us = k_idle_us;   // serveNative's idleTimeoutMs
    moeswarm_tls_server * tls = nullptr;
    int                   listen_fd = -1;
    int                   wake[2] = { -1, -1 };
    uint16_t              port = 0;
    std::atomic<bool>     stopping{false};
    bool                  closed = false; // close() ran (JS thread only)
    hello_fn              on_hello;
    std::thread           accept_thread;

    std::mutex                              mu; // conns, waiting_hello, verdicts
    std::condition_variable                 cv; // a verdict arrived, or stopping
    std::list<std::shared_ptr<conn_entry>>  conns;
    int                                     waiting_hello = 0;

    std::mutex                          routes_mu;
    std::shared_ptr<const route_table>  routes = std::make_shared<route_table>();

    std::mutex                                                 served_mu;
    std::map<std::pair<std::string, std::string>, served_count> served;

    ~server_core() {
        if (listen_fd >= 0) {
            ::close(listen_fd);
        }
        for (int fd : wake) {
            if (fd >= 0) {
                ::close(fd);
            }
        }
        moeswarm_tls_server_free(tls);
    }
};

// The accept thread's loop (until stopping).
void accept_loop(server_core * core);
// Binds host:port (port 0: any free one): the socket, or -1 with err.
int listen_on(const std::string & host, uint16_t port, uint16_t * bound, std::string & err);
// Stops the listener and every connection, joins their threads. Idempotent; JS thread only.
void stop(server_core * core);

} // namespace native
} // namespace moeswarm_addon
