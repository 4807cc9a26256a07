#pragma once

// TLS for the native data plane (docs/protocol.md section 10.9): the backbone plugin dials a
// worker's native listener, the worker's addon accepts. OpenSSL 3 is resolved at run time, never
// linked: first from the process itself (Node exports the OpenSSL it is built with, so the addon and
// a plugin loaded by node-llama-cpp use that one), else from libssl.so.3 opened with dlopen (a
// llama-server host). A host with neither still loads the plugin and the addon; only the native
// plane is then unavailable (moeswarm_tls_available says why), and everything takes the bridge.
//
// Sockets are non-blocking; every call that waits takes a deadline in microseconds of
// CLOCK_MONOTONIC (the plugin's moeswarm_now_us, moeswarm_tls_now_us here) and fails when it passes.
// A connection is used by one thread at a time.

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

// microseconds of CLOCK_MONOTONIC
double moeswarm_tls_now_us(void);

// Whether OpenSSL 3 was found (resolved once per process); err says why not.
bool moeswarm_tls_available(std::string & err);

struct moeswarm_tls_conn {
    int    fd  = -1;
    void * ssl = nullptr; // the TLS session (opaque: OpenSSL's SSL and its buffers)
};

// TCP to addr ("host:port" or "[v6]:port"), TCP_NODELAY, a TLS handshake (1.2 or later, no CA and
// no host name check), then the peer certificate pinned: the SHA-256 of its DER, as 32 uppercase hex
// pairs joined by ':' (moeswarm_tls_fingerprint's form), must equal pin, else the connection is
// closed before a byte of data is sent and err starts with "MOESWARM_TRANSPORT_PIN_MISMATCH".
bool moeswarm_tls_connect(moeswarm_tls_conn & c, const std::string & addr, const std::string & pin, double deadline_us,
        std::string & err);

// Whole buffers, or false with err (the peer closed or failed, or the deadline passed: then
// *timed_out, when given, is set). The connection is left open: the caller closes it.
bool moeswarm_tls_send_all(moeswarm_tls_conn & c, const uint8_t * data, size_t size, double deadline_us, std::string & err,
        bool * timed_out = nullptr);
bool moeswarm_tls_recv_all(moeswarm_tls_conn & c, uint8_t * data, size_t size, double deadline_us, std::string & err,
        bool * timed_out = nullptr);

// One frame of docs/protocol.md section 7 (u32 little-endian length, then the payload) into
// payload; a length above max_frame fails with err "MOESWARM_PROTOCOL_FRAME_TOO_LARGE ...".
bool moeswarm_tls_recv_frame(moeswarm_tls_conn & c, std::vector<uint8_t> & payload, size_t max_frame,
        double deadline_us, std::string & err, bool * timed_out = nullptr);

// Waits until one of conns has bytes to read (decrypted or not yet, buffered or on its socket) and
// returns its index, or -1 when the deadline passes (*timed_out set) or a wait fails (err). A closed
// connection (no session) is never ready. A reader then calls moeswarm_tls_recv_frame on it: its
// frame may still be arriving, so that call waits too, with its own deadline. (The plugin's hedged
// splits wait on two workers at once with this.)
int moeswarm_tls_wait_any(moeswarm_tls_conn * const * conns, size_t n, double deadline_us, std::string & err,
        bool * timed_out = nullptr);

// A close_notify when the session is healthy, then the socket closed. Safe on a closed connection.
void moeswarm_tls_close(moeswarm_tls_conn & c);

// Unblocks a thread waiting on c from another thread (shutdown(2) of the socket; c is closed later
// by its owner with moeswarm_tls_close).
void moeswarm_tls_interrupt(const moeswarm_tls_conn & c);

// The server side: a certificate and its private key (PEM) behind every accepted connection.
struct moeswarm_tls_server;

moeswarm_tls_server * moeswarm_tls_server_new(const std::string & cert_pem, const std::string & key_pem, std::string & err);
void moeswarm_tls_server_free(moeswarm_tls_server * s);
// the certificate's SHA-256 fingerprint, as backbones pin it
std::string moeswarm_tls_server_fingerprint(const moeswarm_tls_server * s);
// The TLS handshake on an accepted socket (made non-blocking and TCP_NODELAY here); c owns fd
// afterwards, whether it succeeds or not (on failure it is closed).
bool moeswarm_tls_accept(moeswarm_tls_server * s, int fd, moeswarm_tls_conn & c, double deadline_us, std::string & err);

// SHA-256 of a DER certificate as "AA:BB:...:FF" (32 pairs).
std::string moeswarm_tls_fingerprint(const uint8_t * der, size_t size);
