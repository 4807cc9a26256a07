#pragma once

// The backbone's side of opening a native link (docs/protocol.md section 10.9), one definition for
// the plugin and moeswarm-native-ping: TLS to the worker's native listener with its certificate
// pinned, our hello (the backbone's id and its hub ticket), the worker's hello back. Failures carry
// a stable MOESWARM_* code, as the plugin reports them to the bridge.

#include "moeswarm-frame.h"
#include "moeswarm-tls.h"

#include <string>
#include <vector>

struct moeswarm_native_err {
    std::string code; // stable MOESWARM_* code
    std::string msg;
    // the worker refused our frame as malformed or not its to serve (INVALID_ARGUMENT, PROTOCOL_*):
    // a replica would refuse it too, so no failover
    bool ours = false;
};

// a transport failure: the deadline's, or the link's
void moeswarm_native_transport_err(moeswarm_native_err & e, bool timed_out, const std::string & what);

// the worker's error frame f, answering `when` (our hello, a dispatch)
void moeswarm_native_error_frame(moeswarm_native_err & e, const moeswarm_frame & f, const char * when);

// TLS to addr (host:port), the certificate pinned to fp (AA:BB:...); c is closed on failure
bool moeswarm_native_dial(moeswarm_tls_conn & c, const std::string & addr, const std::string & fp, double deadline_us,
        moeswarm_native_err & e);

// our hello on a dialled link, and the worker's: rx holds its bytes after
bool moeswarm_native_hello(moeswarm_tls_conn & c, const std::string & backbone, const std::string & ticket,
        double deadline_us, std::vector<uint8_t> & rx, moeswarm_native_err & e);
