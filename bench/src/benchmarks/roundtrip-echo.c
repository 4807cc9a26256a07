/* The C floor of the `roundtrip` benchmark: one process forks an echo server and times
 * length-prefixed round trips of `bytes` out and `back` bytes back over a Unix socket or loopback
 * TCP. Prints "p10 p50 p90" in microseconds. Compiled by the benchmark with cc into .cache. */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int full(int fd, void *buf, size_t n, int wr) {
    char *p = buf;
    while (n > 0) {
        ssize_t k = wr ? write(fd, p, n) : read(fd, p, n);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t) k;
    }
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    const int unix_ = strcmp(argv[1], "unix") == 0;
    const size_t bytes = (size_t) atol(argv[2]), back = (size_t) atol(argv[3]);
    const int iters = atoi(argv[4]);
    char path[108];
    snprintf(path, sizeof path, "/tmp/moeswarm-echo-%d.sock", (int) getpid());
    int ls = socket(unix_ ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
    struct sockaddr_un su = { .sun_family = AF_UNIX };
    struct sockaddr_in si = { .sin_family = AF_INET, .sin_port = 0 };
    si.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = unix_ ? sizeof su : sizeof si;
    if (unix_) { strncpy(su.sun_path, path, sizeof su.sun_path - 1); unlink(path); }
    if (bind(ls, unix_ ? (struct sockaddr *) &su : (struct sockaddr *) &si, len) || listen(ls, 1)) return 3;
    if (!unix_) getsockname(ls, (struct sockaddr *) &si, &len);
    char *buf = calloc(1, bytes > back ? bytes : back);
    pid_t child = fork();
    if (child == 0) {
        int c = accept(ls, NULL, NULL), one = 1;
        if (!unix_) setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        uint32_t n;
        while (full(c, &n, 4, 0) == 0 && full(c, buf, n, 0) == 0) {
            uint32_t m = (uint32_t) back;
            if (full(c, &m, 4, 1) || full(c, buf, back, 1)) break;
        }
        _exit(0);
    }
    int s = socket(unix_ ? AF_UNIX : AF_INET, SOCK_STREAM, 0), one = 1;
    if (connect(s, unix_ ? (struct sockaddr *) &su : (struct sockaddr *) &si, len)) return 4;
    if (!unix_) setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double *us = malloc(sizeof(double) * (size_t) iters);
    for (int i = -iters / 10; i < iters; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        uint32_t n = (uint32_t) bytes;
        if (full(s, &n, 4, 1) || full(s, buf, bytes, 1) || full(s, &n, 4, 0) || full(s, buf, n, 0)) return 5;
        clock_gettime(CLOCK_MONOTONIC, &b);
        if (i >= 0) us[i] = (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3;
    }
    close(s);
    waitpid(child, NULL, 0);
    if (unix_) unlink(path);
    qsort(us, (size_t) iters, sizeof(double), cmp);
    printf("%.2f %.2f %.2f\n", us[iters / 10], us[iters / 2], us[iters * 9 / 10]);
    return 0;
}
