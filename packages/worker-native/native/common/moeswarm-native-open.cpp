// The backbone's side of opening a native link (moeswarm-native-open.h).

#include "moeswarm-native-open.h"

void moeswarm_native_transport_err(moeswarm_native_err & e, bool timed_out, const std::string & what) {
    e.code = timed_out ? "MOESWARM_TRANSPORT_TIMEOUT" : "MOESWARM_TRANSPORT_CLOSED";
    e.msg  = what;
    e.ours = false;
}

void moeswarm_native_error_frame(moeswarm_native_err & e, const moeswarm_frame & f, const char * when) {
    e.code = f.code.present ? std::string((const char *) f.code.ptr, f.code.len) : "MOESWARM_TRANSPORT_CLOSED";
    e.msg  = std::string("the worker refused ") + when + ": " + std::string((const char *) f.msg.ptr, f.msg.len);
    // the worker found our frame malformed or not its to serve: a replica would say the same
    e.ours = e.code == "MOESWARM_INVALID_ARGUMENT" || e.code.rfind("MOESWARM_PROTOCOL_", 0) == 0;
}

bool moeswarm_native_dial(moeswarm_tls_conn & c, const std::string & addr, const std::string & fp, double deadline_us,
        moeswarm_native_err & e) {
    std::string err;
    if (moeswarm_tls_connect(c, addr, fp, deadline_us, err)) {
        return true;
    }
    moeswarm_tls_close(c);
    const bool pin = err.rfind("MOESWARM_TRANSPORT_PIN_MISMATCH", 0) == 0;
    e.code         = pin ? "MOESWARM_TRANSPORT_PIN_MISMATCH" :
                     moeswarm_tls_now_us() >= deadline_us ? "MOESWARM_TRANSPORT_TIMEOUT" : "MOESWARM_TRANSPORT_CONNECT";
    e.msg  = "cannot open the native link to " + addr + ": " + err;
    e.ours = false;
    return false;
}

bool moeswarm_native_hello(moeswarm_tls_conn & c, const std::string & backbone, const std::string & ticket,
        double deadline_us, std::vector<uint8_t> & rx, moeswarm_native_err & e) {
    moeswarm_mp_writer w;
    w.buf.resize(4);
    moeswarm_frame_write_backbone_hello(&w, backbone.c_str(), ticket.c_str());
    moeswarm_frame_prefix(w.buf);
    std::string err;
    bool timed_out = false;
    if (!moeswarm_tls_send_all(c, w.buf.data(), w.buf.size(), deadline_us, err, &timed_out) ||
            !moeswarm_tls_recv_frame(c, rx, 1u << 20, deadline_us, err, &timed_out)) {
        moeswarm_native_transport_err(e, timed_out, "no hello from the worker: " + err);
        return false;
    }
    moeswarm_frame f;
    moeswarm_error fe;
    if (!moeswarm_frame_decode(rx.data(), rx.size(), 0, &f, &fe)) {
        e.code = fe.code;
        e.msg  = std::string("the worker's first frame: ") + fe.msg;
        e.ours = false;
        return false;
    }
    if (f.type == MOESWARM_FRAME_ERROR) {
        moeswarm_native_error_frame(e, f, "the hello");
        return false;
    }
    if (f.type != MOESWARM_FRAME_HELLO) {
        e.code = "MOESWARM_AUTH_MISSING";
        e.msg  = "the worker answered the hello with another frame";
        e.ours = false;
        return false;
    }
    return true;
}
