#pragma once

// The error record every layer of the native code reports through: a stable code and a message,
// filled in by the first failure. Needs nothing from ggml, so that code without the compute core
// (the backbone's ggml plugin, which links only the host's libggml-base) shares it.

#include <stdbool.h>

#define MOESWARM_ERROR_CODE_MAX 48
#define MOESWARM_ERROR_MSG_MAX  768

// code is a MOESWARM_* code of packages/core/src/error-codes.ts
struct moeswarm_error {
    char code[MOESWARM_ERROR_CODE_MAX];
    char msg[MOESWARM_ERROR_MSG_MAX];
};

void moeswarm_error_clear(struct moeswarm_error * err);
bool moeswarm_error_set(struct moeswarm_error * err, const char * code, const char * fmt, ...)
#ifdef __GNUC__
        __attribute__((format(printf, 3, 4)))
#endif
        ;
