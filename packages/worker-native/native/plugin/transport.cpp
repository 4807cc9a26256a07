// The socket to the dispatcher bridge: connect (unix:/path or tcp:host:port) and move whole
// buffers before a deadline.

#include "moeswarm-plugin.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>

void moeswarm_conn_close(moeswarm_conn & c) {
    if (c.fd >= 0) {
        close(c.fd);
        c.fd = -1;
    }
    c.in.clear();
    c.in_pos = 0;
    c.out_pending.clear();
}

bool moeswarm_conn_open(moeswarm_conn & c, const std::string & bridge, std::string & err) {
    if (bridge.rfind("unix:", 0) == 0) {
        const std::string path = bridge.substr(5);
        sockaddr_un addr;
        memset(&addr, 0, sizeof(addr));
        addr.sun_family = AF_UNIX;
        if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
            err = "the socket path of MOESWARM_BRIDGE is empty or longer than " + std::to_string(sizeof(addr.sun_path) - 1) +
                    " bytes";
            return false;
        }
        memcpy(addr.sun_path, path.c_str(), path.size());
        const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (sockaddr *) &addr, sizeof(addr)) != 0) {
            err = "cannot connect to the bridge at " + bridge + ": " + strerror(errno);
            if (fd >= 0) close(fd);
            return false;
        }
        c.fd = fd;
        return true;
    }
    if (bridge.rfind("tcp:", 0) == 0) {
        const std::string hp = bridge.substr(4);
        const size_t colon   = hp.rfind(':');
        if (colon == std::string::npos || colon == 0 || colon + 1 >= hp.size()) {
            err = "MOESWARM_BRIDGE tcp: needs host:port";
            return false;
        }
        std::string host = hp.substr(0, colon);
        if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
            host = host.substr(1, host.size() - 2);
        }
        const std::string port = hp.substr(colon + 1);
        addrinfo hints;
        memset(&hints, 0, sizeof(hints));
        hints.ai_socktype = SOCK_STREAM;
        addrinfo * res    = nullptr;
        const int rc      = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
        if (rc != 0) {
            err = "cannot resolve " + host + ": " + gai_strerror(rc);
            return false;
        }
        int fd           = -1;
        std::string last = "no address";
        for (addrinfo * ai = res; ai != nullptr; ai = ai->ai_next) {
            fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
            if (fd < 0) continue;
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
            last = strerror(errno);
            close(fd);
            fd = -1;
        }
        freeaddrinfo(res);
        if (fd < 0) {
            err = "cannot connect to the bridge at " + bridge + ": " + last;
            return false;
        }
        // one small frame per layer and token: latency, not throughput
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        c.fd = fd;
        return true;
    }
    err = bridge.empty() ? "MOESWARM_BRIDGE is not set (unix:/path or tcp:host:port)" :
                           "MOESWARM_BRIDGE must be unix:/path or tcp:host:port, got " + bridge;
    return false;
}

static bool moeswarm_wait_fd(int fd, short events, double deadline_us, std::string & err) {
    for (;;) {
        const double left_ms = (deadline_us - moeswarm_now_us()) / 1000.0;
        if (left_ms <= 0) {
            err = "no answer from the bridge within the timeout (MOESWARM_TIMEOUT_MS): is moeswarm-dispatcher stopped, "
                  "or are its workers unreachable?";
            return false;
        }
        pollfd p    = { fd, events, 0 };
        const int r = poll(&p, 1, (int) std::min(left_ms + 1, 2e9));
        if (r > 0) {
            if (p.revents & (POLLERR | POLLNVAL)) {
                err = "the bridge connection failed";
                return false;
            }
            return true;
        }
        if (r < 0 && errno != EINTR) {
            err = std::string("poll: ") + strerror(errno);
            return false;
        }
    }
}

static bool moeswarm_send_raw(moeswarm_conn & c, const uint8_t * data, size_t size, double deadline_us, std::string & err) {
    size_t done = 0;
    while (done < size) {
        const ssize_t n = send(c.fd, data + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t) n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!moeswarm_wait_fd(c.fd, POLLOUT, deadline_us, err)) return false;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        err = std::string("cannot write to the bridge: ") + (n < 0 ? strerror(errno) : "connection closed");
        return false;
    }
    return true;
}

bool moeswarm_send_all(moeswarm_conn & c, const uint8_t * data, size_t size, double deadline_us, std::string & err) {
    // the tail of an earlier frame first: frames never interleave
    if (!c.out_pending.empty()) {
        if (!moeswarm_send_raw(c, c.out_pending.data(), c.out_pending.size(), deadline_us, err)) {
            return false;
        }
        c.out_pending.clear();
    }
    return moeswarm_send_raw(c, data, size, deadline_us, err);
}

// what the socket takes now, without waiting: bytes written, or -1 when the connection failed
static ssize_t moeswarm_send_some(int fd, const uint8_t * data, size_t size) {
    size_t done = 0;
    while (done < size) {
        const ssize_t n = send(fd, data + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t) n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        } else {
            return -1;
        }
    }
    return (ssize_t) done;
}

bool moeswarm_send_nowait(moeswarm_conn & c, const uint8_t * data, size_t size) {
    if (c.fd < 0) {
        return false;
    }
    if (!c.out_pending.empty()) {
        const ssize_t n = moeswarm_send_some(c.fd, c.out_pending.data(), c.out_pending.size());
        if (n < 0) {
            return false; // the next round trip finds the connection dead and reopens it
        }
        c.out_pending.erase(c.out_pending.begin(), c.out_pending.begin() + n);
        if (!c.out_pending.empty()) {
            return false;
        }
    }
    const ssize_t n = moeswarm_send_some(c.fd, data, size);
    if (n <= 0) {
        return false;
    }
    c.out_pending.assign(data + n, data + size);
    return true;
}

bool moeswarm_conn_fill(moeswarm_conn & c, std::string & err) {
    if (c.in_pos == c.in.size()) {
        c.in.clear();
        c.in_pos = 0;
    }
    uint8_t buf[16384];
    for (;;) {
        const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) {
            c.in.insert(c.in.end(), buf, buf + n);
            continue;
        }
        if (n == 0) {
            err = "the bridge closed the connection";
            return false;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        err = std::string("cannot read from the bridge: ") + strerror(errno);
        return false;
    }
}

bool moeswarm_recv_all(moeswarm_conn & c, uint8_t * data, size_t size, double deadline_us, std::string & err) {
    size_t done = 0;
    // bytes a drain read ahead come first
    if (c.in_pos < c.in.size()) {
        done = std::min(size, c.in.size() - c.in_pos);
        memcpy(data, c.in.data() + c.in_pos, done);
        c.in_pos += done;
        if (c.in_pos == c.in.size()) {
            c.in.clear();
            c.in_pos = 0;
        }
    }
    while (done < size) {
        const ssize_t n = recv(c.fd, data + done, size - done, MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t) n;
            continue;
        }
        if (n == 0) {
            err = "the bridge closed the connection";
            return false;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (!moeswarm_wait_fd(c.fd, POLLIN, deadline_us, err)) return false;
            continue;
        }
        if (errno == EINTR) continue;
        err = std::string("cannot read from the bridge: ") + strerror(errno);
        return false;
    }
    return true;
}
