#pragma once

// Hop stamps for latency work, the native side of @moeswarm/core's traceHop: with MOESWARM_TRACE=<dir>
// in the environment, each call appends `<hop>\t<CLOCK_MONOTONIC ns>\t<tag>` to <dir>/trace-<pid>.tsv
// (one write(2) per line, O_APPEND: safe across threads). Node's hrtime reads the same clock, so
// native and JavaScript stamps of every process of one machine merge into one timeline.
// Unset, a call costs one branch.

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static inline int moeswarm_trace_fd(void) {
    static const int fd = [] {
        const char * dir = getenv("MOESWARM_TRACE");
        if (dir == nullptr || dir[0] == '\0') {
            return -1;
        }
        mkdir(dir, 0777);
        char path[4096];
        snprintf(path, sizeof(path), "%s/trace-%d.tsv", dir, (int) getpid());
        return open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    }();
    return fd;
}

static inline void moeswarm_trace_hop(const char * hop, long long tag) {
    const int fd = moeswarm_trace_fd();
    if (fd < 0) {
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    char line[160];
    const int n = snprintf(line, sizeof(line), "%s\t%lld\t%lld\n", hop,
        (long long) ts.tv_sec * 1000000000LL + ts.tv_nsec, tag);
    if (n > 0 && n < (int) sizeof(line)) {
        ssize_t w = write(fd, line, (size_t) n);
        (void) w;
    }
}
