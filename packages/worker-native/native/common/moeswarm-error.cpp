#include "moeswarm-error.h"

#include <stdarg.h>
#include <stdio.h>

void moeswarm_error_clear(struct moeswarm_error * err) {
    if (err) {
        err->code[0] = '\0';
        err->msg[0]  = '\0';
    }
}

bool moeswarm_error_set(struct moeswarm_error * err, const char * code, const char * fmt, ...) {
    if (err) {
        snprintf(err->code, sizeof(err->code), "%s", code);
        va_list args;
        va_start(args, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, args);
        va_end(args);
    }
    return false;
}
